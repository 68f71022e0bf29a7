"""The native kernels (quillgpt/native) against the plain computation: x rounded to int16 per block
of 32 the way the kernel rounds it, times the dequantized weights, in float64. Each instruction-set
path (AVX-512BW, AVX2+FMA, the plain loop) is built and checked in a subprocess of its own, the
AVX-512 one emulated where the CPU has none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support import kernel_rounded
from torch import nn

from quillgpt import native
from quillgpt.quant import int8_kernels, plan
from quillgpt.quant.int8 import Int8Linear
from quillgpt.quant.plan import KernelPlan

ROOT = Path(__file__).resolve().parents[2]
needs_kernel = pytest.mark.skipif(not native.available(), reason=f"group_gemv did not build here: {native.why_not()}")


def case(n: int, k: int, group: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    q[0, :256] = torch.arange(-128, 128, dtype=torch.int8)[: min(256, k)]  # every byte value, both signs
    s, o = torch.rand(n, k // group, generator=g) / 50, torch.randn(n, k // group, generator=g) / 10
    s, o = s.half(), o.half()  # as Int8Linear keeps them for the kernel
    x = torch.randn(rows, k, generator=g)
    x[:, 5] *= 300.0  # an outlier channel, as real models have
    if k >= 64:
        x[0, 32:64] = 0.0  # a block of zeros: its step is 0
    return x, q, s, o


def reference(x, q, s, o, levels: int = 32767) -> torch.Tensor:
    """Σ q·s·x̃ + o·Σx per group in float64: x̃ rounded as the kernel rounds it (to ±levels steps per
    32), the offsets times x's own sums."""
    n, k = q.shape
    groups = s.shape[1]
    scaled = (q.double().view(n, groups, -1) * s.double()[:, :, None]).view(n, k)
    sums = x.double().view(x.shape[0], groups, -1).sum(-1)  # (rows, groups)
    return (kernel_rounded(x, levels) @ scaled.t() + sums @ o.double().t()).float()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize(("n", "k", "group"), [(48, 64, 32), (40, 256, 64), (33, 96, 96), (576, 1536, 32)])
def test_group_gemv_equals_the_dequantized_matmul_of_x_rounded_as_it_rounds(rows, n, k, group):
    x, q, s, o = case(n, k, group, rows)
    got = native.group_gemv(x, native.interleave(q), s, o)
    want = reference(x, q, s, o)
    assert got.shape == (rows, n) and got.dtype == torch.float32 and torch.isfinite(got).all()
    bound = (kernel_rounded(x).abs() @ (q.double().abs() * 0.02 + 1).t()).float()  # the float sums' scale
    torch.testing.assert_close(got, want, rtol=0, atol=float(1e-5 * bound.max()))  # float32 sums of int16 · int8 products
    # and the int16 rounding itself is far below bf16's: against x unrounded
    plain = F.linear(x.double(), (reference(torch.eye(k), q, s, o).t()).double()).float()
    assert ((got - plain).norm() / plain.norm()) < 1e-4


def case4(n: int, k: int, group: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """case()'s x, s and o with 4-bit codes (every value in row 0) instead of int8 weights."""
    x, _, s, o = case(n, k, group, rows, seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed + 1))
    q[0, :16] = torch.arange(16, dtype=torch.uint8)
    return x, q, s, o


def test_interleave_streams_four_rows_as_one_and_leaves_the_last_rows_as_they_are():
    """Unit u (32 bytes) of row r of each group of four at 32·(4u + r) of the group; the last
    N % 4 rows unchanged; deinterleave undoes it."""
    codes = torch.randint(-128, 128, (10, 96), dtype=torch.int8)
    laid = native.interleave(codes)
    assert laid.shape == codes.shape and torch.equal(native.deinterleave(laid), codes)
    for g in range(2):
        stream = laid[4 * g : 4 * g + 4].reshape(-1)
        for r in range(4):
            for u in range(3):
                assert torch.equal(stream[32 * (4 * u + r) : 32 * (4 * u + r + 1)], codes[4 * g + r, 32 * u : 32 * u + 32])
    assert torch.equal(laid[8:], codes[8:])


def test_pack4_keeps_every_code_and_pairs_blocks_in_nibbles():
    q = torch.randint(0, 16, (7, 128), dtype=torch.uint8)
    packed = native.pack4(q)
    assert packed.shape == (7, 64) and packed.dtype == torch.uint8 and torch.equal(native.unpack4(packed), q)
    rows = native.deinterleave(packed)  # two codes a byte, the rows one after another
    assert torch.equal(rows[:, :32] & 15, q[:, :32]) and torch.equal(rows[:, :32] >> 4, q[:, 32:64])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize(("n", "k", "group"), [(48, 64, 32), (40, 256, 64), (33, 128, 128), (576, 1536, 32)])
def test_group_gemv4_equals_the_dequantized_matmul_of_x_rounded_as_it_rounds(rows, n, k, group):
    """4-bit codes: the same sums over their unpacked weights (33 rows: a remainder past 4-row steps)."""
    x, q, s, o = case4(n, k, group, rows)
    got = native.group_gemv4(x, native.pack4(q), s, o)
    want = reference(x, q, s, o)
    assert got.shape == (rows, n) and got.dtype == torch.float32 and torch.isfinite(got).all()
    bound = (kernel_rounded(x).abs() @ (q.double() * 0.02 + 1).t()).float()
    torch.testing.assert_close(got, want, rtol=0, atol=float(1e-5 * bound.max()))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 70, 130])  # rows_dot, the batch kernel, the GEMM
@pytest.mark.parametrize(("n", "k", "group"), [(48, 64, 32), (37, 256, 64), (33, 128, 128)])
def test_without_offsets_the_kernels_take_the_formats_symmetric_form(rows, n, k, group):
    """o empty: 4-bit codes centred on 8 (o = -8·s, Q4_0) and int8 codes on 0 (o = 0, Q8_0), the
    very sums of those offsets given (-8 is a power of two: every rounding the same)."""
    x, q, s, _ = case4(n, k, group, rows)
    none = s.new_empty(0)
    got, want = native.group_gemv4(x, native.pack4(q), s, none), native.group_gemv4(x, native.pack4(q), s, (-8 * s.float()).half())
    assert torch.equal(got, want)
    torch.testing.assert_close(got, reference(x, q, s, (-8 * s.float()).half()), rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    x, q, s, _ = case(n, k, group, rows)
    laid = native.interleave(q)
    assert torch.equal(native.group_gemv(x, laid, s, none), native.group_gemv(x, laid, s, torch.zeros_like(s)))


def rounding_bound(x, q, s, o, levels: int = 32767) -> torch.Tensor:
    """How far the kernels may be from x·Wᵀ (W = q·s + o, float64) by their arithmetic, (rows, N):
    x is rounded per block of 32 to a step of max|x|/levels, each input by at most half a step, so
    |Δy| ≤ Σ|q·s|·step/2; and the sums run in float32 (int32 dot products per block, exact; their
    scaling and the blocks', groups' and Σx's float sums, at most K/32 + group + G + 4 roundings
    deep), each rounding at most 2⁻²⁴ of the sums of |terms|."""
    rows, k = x.shape
    n, groups = s.shape
    qs = (q.double().view(n, groups, -1) * s.double()[:, :, None]).view(n, k).abs()
    blocks = x.double().view(rows, k // 32, 32)
    step = (blocks.abs().amax(-1, keepdim=True) / levels).expand(-1, -1, 32).reshape(rows, k)
    absx = x.double().abs()
    terms = absx @ qs.t() + absx.view(rows, groups, -1).sum(-1) @ o.double().abs().t()
    depth = k // 32 + k // groups + groups + 4
    return (step / 2) @ qs.t() + depth * 2**-24 * terms


GEMM_ROWS = [1, 63, 64, 65, 127, 300, 600]  # around the few-rows kernel's limit and the GEMM's tiles and blocks


def many_rows_op(kind: str):
    """(the op, its codes' layout, its activations' levels) of each kernel a prompt's rows may run."""
    return {
        "int4": (native.group_gemv4, native.pack4, 32767),
        "int4-x8": (native.group_gemv4_x8, native.pack4, 127),
        "int8": (native.group_gemv, native.interleave, 32767),
    }[kind]


@needs_kernel
@pytest.mark.parametrize("rows", GEMM_ROWS)
@pytest.mark.parametrize(("n", "k", "group"), [(37, 192, 64), (130, 640, 128), (33, 320, 32)])
@pytest.mark.parametrize("kind", ["int4", "int4-x8", "int8"])
def test_many_rows_equal_the_dequantized_fp32_matmul_within_the_rounding_bound(kind, n, k, group, rows):
    """Past 64 rows the ops run their GEMM (gemm.cpp; group_gemv4_x8 with int8 activations): the
    same sums as the few-rows kernel, against the float matmul of the dequantized weights within
    rounding_bound; widths no multiple of the panel (16 weight rows) or the tile (12 activation
    rows), groups of 32, 64 and 128."""
    op, layout, levels = many_rows_op(kind)
    x, q, s, o = (case if kind == "int8" else case4)(n, k, group, rows)
    got = op(x, layout(q), s, o)
    w = (q.double().view(n, k // group, group) * s.double()[:, :, None] + o.double()[:, :, None]).view(n, k)
    want = x.double() @ w.t()
    assert got.shape == (rows, n) and torch.isfinite(got).all()
    assert ((got.double() - want).abs() <= rounding_bound(x, q, s, o, levels)).all()
    x_rounded = reference(x, q, s, o, levels)  # x rounded as it rounds: the float sums' order alone
    torch.testing.assert_close(got, x_rounded, rtol=0, atol=float(1e-5 * want.abs().max()))


@needs_kernel
def test_group_gemv_refuses_shapes_it_cannot_take():
    x, q, s, o = case(16, 64, 32, 1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.group_gemv(x[:, :48], q[:, :48].contiguous(), s[:, :1].contiguous(), o[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="group must be a multiple of 32"):
        native.group_gemv(x, q, torch.rand(16, 4).half(), torch.rand(16, 4).half())  # groups of 16
    with pytest.raises(RuntimeError, match="float16"):
        native.group_gemv(x, q, s.float(), o.float())
    x, q, s, o = case4(16, 96, 32, 1)  # 4-bit codes: K a multiple of 64
    with pytest.raises(RuntimeError, match="multiple of 64"):
        native.group_gemv4(x, torch.zeros(16, 48, dtype=torch.uint8), s, o)
    with pytest.raises(RuntimeError, match="uint8"):
        native.group_gemv4(x[:, :64], q[:, :32].to(torch.int8), s[:, :2].contiguous(), o[:, :2].contiguous())


@needs_kernel
def test_int8_linear_takes_group_gemv_where_its_group_is_whole_blocks():
    """Groups of 32 and per-channel rows a multiple of 32 wide (one group of the whole row, offsets
    0) run group_gemv; a group of 16 or a row of 48 cannot. Each equals its dequantized weights,
    through every kernel: group_gemv reads the codes in its layout, the others row after row."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 50)  # 50 rows: twelve groups of four and two rows of their own
    plan = KernelPlan((1,), ("group_gemv",))
    assert Int8Linear.from_linear(lin, plan, 32).runs["group_gemv"] == "group_gemv"
    assert Int8Linear.from_linear(lin, plan, 16).runs["group_gemv"] == "dequant/model"  # a group it cannot take
    assert Int8Linear.from_linear(lin, plan, 0).runs["group_gemv"] == "group_gemv"  # per channel, 64 wide
    assert Int8Linear.from_linear(nn.Linear(48, 16), plan, 0).runs["group_gemv"] == "dequant/model"
    x = torch.randn(2, 64)
    for group in (32, 0):
        q = Int8Linear.from_linear(lin, plan, group)
        assert torch.equal(q.scale_half.float().view(q.scale.shape), q.scale)  # the scales are fp16 values
        assert q.interleaved and torch.equal(q.weight, native.interleave(q.codes()))
        want = F.linear(x, q.dequantized(), lin.bias)
        for kernel in int8_kernels.KERNELS:
            torch.testing.assert_close(q.linear(x, kernel), want, rtol=1e-2, atol=1e-2)  # bf16 activations among them
        torch.testing.assert_close(q(x), want, rtol=1e-4, atol=1e-4)


def test_group_wise_scales_are_fp16_values_and_q_rounds_against_them():
    torch.manual_seed(0)
    lin = nn.Linear(256, 32)
    q = Int8Linear.from_linear(lin, KernelPlan((1,), ("dequant/model",)), 32)
    assert torch.equal(q.scale_half.float(), q.scale) and torch.equal(q.offset_half.float(), q.offset)
    # each weight within half a step of what is multiplied (the step and offset as stored)
    err = (q.dequantized() - lin.weight.detach()).view(32, 8, 32).abs().amax(-1)
    assert (err <= q.scale * 0.5 + 1e-7).all()
    lin.weight.data[3, 7] = 1e6  # an offset fp16 cannot hold (~5e5 + 128·s): that group is kept symmetric
    wide = Int8Linear.from_linear(lin, KernelPlan((1,), ("dequant/model",)), 32)
    assert wide.group == 32 and wide.offset[3, 0] == 0 and torch.isfinite(wide.dequantized()).all()
    lin.weight.data[3, 7] = 1e7  # neither form (1e7 / 127 > 65504), nor per row: fp32 scales, and no group_gemv
    wider = Int8Linear.from_linear(lin, KernelPlan((1,), ("dequant/model",)), 32)
    assert wider.scale_half is None and wider.runs["group_gemv"] == "dequant/model"
    assert wider.scale[3] == torch.tensor(1e7 / 127)


@needs_kernel
def test_group_gemv_compiled_equals_eager():
    """In a compiled step the kernel is one extern call: the same numbers as eager."""
    x, q, s, o = case(96, 128, 32, 2)
    fn = lambda x, q, s, o: int8_kernels.gemv_linear(torch.relu(x) + 1, q, s, o).sum(-1)
    want = fn(x, q, s, o)
    got = torch.compile(fn, fullgraph=True, dynamic=False)(x, q, s, o)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    torch._dynamo.reset()


def test_without_a_build_the_layers_fall_back(monkeypatch):
    monkeypatch.setattr(native.build, "_built", None)
    monkeypatch.setattr(native.build, "_error", None)
    monkeypatch.setenv("QUILL_NO_CPP_KERNELS", "1")
    assert not native.available() and "QUILL_NO_CPP_KERNELS" in native.why_not()
    q = Int8Linear.from_linear(nn.Linear(64, 48), KernelPlan((1,), ("group_gemv",)), 32)
    assert q.runs["group_gemv"] == "dequant/model"
    assert "group_gemv" not in plan._candidates(q)


WORKER = """
import json, sys, torch
for path in ({root!r}, {root!r} + '/tests', {tests!r}, {root!r} + '/tests/inference'):
    sys.path.insert(0, path)
from quillgpt import native
from test_kernels import case, case4, reference
assert native.available(), native.why_not()
errs = []
for n, k, group, rows in [(48, 64, 32, 1), (40, 256, 64, 3), (576, 1536, 32, 2), (33, 128, 128, 2), (37, 192, 64, 70), (21, 128, 32, 130)]:
    x, q, s, o = case(n, k, group, rows)
    got, want = native.group_gemv(x, native.interleave(q), s, o), reference(x, q, s, o)
    errs.append(float((got - want).abs().max() / want.abs().max()))
    x, q, s, o = case4(n, k, group, rows)  # and 4-bit codes
    got, want = native.group_gemv4(x, native.pack4(q), s, o), reference(x, q, s, o)
    errs.append(float((got - want).abs().max() / want.abs().max()))
    got, want = native.group_gemv4_x8(x, native.pack4(q), s, o), reference(x, q, s, o, 127)  # int8 activations
    errs.append(float((got - want).abs().max() / want.abs().max()))
    o = (-8 * s.float()).half()  # no offsets kept: Q4_0's symmetric form, the same sums
    implied, given = (native.group_gemv4(x, native.pack4(q), s, offsets) for offsets in (s.new_empty(0), o))
    errs.append(float((implied - given).abs().max()))
import pytest
import test_native_decoder as nb  # the native decoder built the same way: its steps = op by op
for shape, scheme in [("llama-hd64", "int8"), ("gpt2-hd128", "int4"), ("window", "int4")]:  # attention widths 64, 128, 32; both kernels
    for cache_dtype in (torch.float32, torch.float16):
        with pytest.MonkeyPatch.context() as mp:
            nb.test_native_step_equals_the_op_by_op_step(shape, scheme, cache_dtype, mp)
print(json.dumps(errs))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64", reason="x86-64 paths")
@pytest.mark.parametrize("isa", ["avx2", "plain", "avx512-emulated"])
def test_each_instruction_set_path_equals_the_reference(isa, tmp_path):
    """The AVX2, plain-loop and AVX-512 paths, int8 and int4 (and int4 with int8 activations, and
    without offsets), the
    kernels (70 and 130 rows: the GEMM's) and the native decode block, built here with
    -march=haswell / x86-64 (a build each, cached); the AVX-512 one through scalar stand-ins of its
    intrinsics (quillgpt/native/csrc/avx512_emulated.h), so it is checked on any AVX2 machine."""
    if not native.available():
        pytest.skip(f"group_gemv did not build here: {native.why_not()}")
    if isa != "plain" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2 to run a -march=haswell build")
    code = WORKER.format(root=str(ROOT), tests=str(Path(__file__).parent))
    env = {**os.environ, "QUILL_GEMV_ISA": isa}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert max(json.loads(out.stdout.strip().splitlines()[-1])) < 1e-5


def test_the_stats_note_says_why_the_kernel_did_not_build(monkeypatch):
    from support import random_model

    from quillgpt.quant import quantize, weights_note

    monkeypatch.setattr(native.build, "_built", None)
    monkeypatch.setattr(native.build, "_error", "CalledProcessError: g++ not found")
    model = quantize(random_model(), "int8", kernel="dequant/model")
    assert weights_note(model).endswith("(group_gemv did not build: CalledProcessError: g++ not found)")
    assert "did not build" not in weights_note(quantize(random_model(), "int8-channel", kernel="dequant/model"))
