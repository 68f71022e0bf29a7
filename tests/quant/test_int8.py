"""Weight-only int8 (quant/int8.py): each kernel equals the dequantized fp32 computation to its
rounding; weights exactly representable in int8 give the float model's tokens; quantize swaps
every linear (a tied head keeps its embedding); the plan takes the fastest kernel per input size
and says so where even that is slower than the float linears."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from support import BLOCK, PROMPTS, V, random_model, rel_err
from torch import nn

from quillgpt import native, quant
from quillgpt.errors import QuillError
from quillgpt.inference.generate import generate_tokens
from quillgpt.quant import int8, int8_kernels, plan_of, quantize
from quillgpt.quant import plan as planning
from quillgpt.quant.int8 import Int8Linear
from quillgpt.quant.int8_kernels import FUSED_ROWS, KERNELS, grouped_sum
from quillgpt.quant.plan import KernelPlan

kernels = pytest.mark.parametrize("kernel", list(KERNELS))
pytestmark = pytest.mark.usefixtures("one_thread")


def fixed(kernel: str) -> KernelPlan:
    return KernelPlan((1,), (kernel,))


@kernels
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5,), (2, 7)], ids=["2d", "3d"])
@pytest.mark.parametrize("group", [0, 16, 32])
def test_int8_linear_equals_its_dequantized_fp32_computation_to_rounding(kernel, bias, shape, group):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=bias)
    q = Int8Linear.from_linear(lin, fixed(kernel), group)
    assert q.group == group and q.scale.shape == ((48, 64 // group) if group else (48,))
    x = torch.randn(*shape, 64)
    bf16 = KERNELS[kernel].bf16
    x_in = x.bfloat16().float() if bf16 else x  # what the kernel multiplies: x rounded to its activations
    want = F.linear(x_in, q.dequantized(), lin.bias)
    got = q(x)
    assert got.shape == (*shape, 48) and got.dtype == torch.float32
    step = KERNELS[kernel].rounding  # bf16 kernels round their output to 8 bits; group_gemv x to int16 per 32
    scale = want.abs().max().item()
    if group and step > 1e-6:  # each group's (block's) partial sum is rounded: bounded by the sum of |x|·|w|
        scale = F.linear(x_in.abs(), q.dequantized().abs()).max().item()
    torch.testing.assert_close(got, want, rtol=step, atol=step * scale)


@pytest.mark.parametrize("packed", [False, True], ids=["int8-lanes", "packed-words"])
@pytest.mark.parametrize("rows", [1, 3, FUSED_ROWS])
def test_grouped_sum_equals_the_dequantized_fp32_computation(rows, packed, monkeypatch):
    """Both forms (int8 lanes; four int8 to a word, byte order and sign extension included)."""
    monkeypatch.setattr(int8_kernels, "PACKED_LOADS", packed)
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    q = Int8Linear.from_linear(lin, fixed("dequant/model"), 16)
    assert q.weight.min() == -128 or q.weight.max() == 127  # the extreme bytes are exercised
    x = torch.randn(rows, 64)
    got = grouped_sum(x, q.weight, q.scale, q.offset)
    torch.testing.assert_close(got, F.linear(x, q.dequantized()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["int8-lanes", "packed-words"])
def test_grouped_sum_compiled_equals_eager(packed, monkeypatch):
    """The form inductor fuses gives the eager sum's result (every byte value, both signs)."""
    monkeypatch.setattr(int8_kernels, "PACKED_LOADS", packed)
    torch.manual_seed(0)
    weight = torch.arange(-128, 128, dtype=torch.int8).repeat(24, 1)[:, torch.randperm(256)].contiguous()  # (24, 256)
    scale, offset = torch.rand(24, 8), torch.randn(24, 8)
    x = torch.randn(2, 256)
    want = grouped_sum(x, weight, scale, offset)
    got = torch.compile(grouped_sum, fullgraph=True, dynamic=False)(x, weight, scale, offset)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch._dynamo.reset()


@pytest.mark.parametrize("few", ["group_gemv", "grouped_sum", "group_gemv, the plan's"])
def test_a_compiled_group_wise_layer_takes_its_few_rows_kernel_and_keeps_its_result(few, monkeypatch):
    """Inside torch.compile a group-wise Int8Linear of ≤ FUSED_ROWS rows runs group_gemv (one C++
    kernel) where it builds, else grouped_sum (fused by inductor), where its plan's kernel would
    multiply K/G times the rows; more rows run group_gemv where the plan measured it fastest, else
    the dequantized weight; the result is the eager layer's to their rounding, the bias included."""
    torch.manual_seed(0)
    plans = fixed("group_gemv") if few.endswith("plan's") else fixed("int8pack_mm/model")
    few = few.split(",")[0]
    q = Int8Linear.from_linear(nn.Linear(64, 48), plans, 32)
    if few == "grouped_sum":
        q.runs["group_gemv"] = "dequant/model"  # as where the C++ kernel does not build
    elif q.runs["group_gemv"] != "group_gemv":
        pytest.skip(f"group_gemv did not build here: {native.why_not()}")
    taken = []
    real = int8_kernels.KERNELS["group_gemv"].matmul if few == "group_gemv" else grouped_sum
    spy = lambda *a: taken.append(a[0].shape[0]) or real(*a)  # noqa: E731
    if few == "group_gemv":  # reached through its KERNELS entry
        monkeypatch.setitem(int8_kernels.KERNELS, "group_gemv", dataclasses.replace(int8_kernels.KERNELS["group_gemv"], matmul=spy))
    else:
        monkeypatch.setattr(int8, "grouped_sum", spy)  # as Int8Linear.forward calls it
    compiled = torch.compile(q, fullgraph=True, dynamic=False)
    for rows in (1, FUSED_ROWS + 1):
        x = torch.randn(rows, 64)
        want = F.linear(x, q.dequantized(), q.bias)
        torch.testing.assert_close(compiled(x), want, rtol=1e-4, atol=1e-4 if rows == 1 else 2**-8 * want.abs().max().item())
    assert taken == ([1, FUSED_ROWS + 1] if plans.kernels == ("group_gemv",) else [1])  # each traced once
    torch._dynamo.reset()


def test_quantization_rounds_each_weight_to_its_nearest_step():
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    with torch.no_grad():
        lin.weight[3] = 0.0  # an all-zero row has scale 0, not NaN
    q = Int8Linear.from_linear(lin, fixed("dequant/model"))
    step = q.scale[:, None]
    assert q.weight.dtype == torch.int8 and int(q.weight.abs().max()) == 127
    assert bool(((q.dequantized() - lin.weight).abs() <= step / 2 + 1e-7).all())
    assert torch.equal(q.dequantized()[3], torch.zeros(96))


@pytest.mark.parametrize("group", [16, 32])
def test_group_wise_scales_round_each_weight_to_its_groups_nearest_step(group):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    with torch.no_grad():
        lin.weight[:, :group] *= 100  # an outlier group: the other groups keep their finer steps
    q = Int8Linear.from_linear(lin, fixed("dequant/model"), group)
    step = q.scale.repeat_interleave(group, dim=1)
    assert bool(((q.dequantized() - lin.weight).abs() <= step / 2 + 1e-7).all())
    qg, ranged = q.codes().view(40, -1, group), q.offset != 0
    spans = (qg.amin(-1) == -128) & (qg.amax(-1) == 127)  # a group over its range spans all 256 codes
    assert bool(spans[ranged].all()) and bool((qg.abs().amax(-1)[~ranged] == 127).all())  # a symmetric one reaches ±127
    per_row = Int8Linear.from_linear(lin, fixed("dequant/model"))
    tail = slice(group, None)
    assert (q.dequantized() - lin.weight)[:, tail].abs().max() * 50 < (per_row.dequantized() - lin.weight)[:, tail].abs().max()
    assert Int8Linear.from_linear(nn.Linear(40, 8), fixed("dequant/model"), 64).group == 0  # 64 does not divide 40: per row


def both_forms(w, group=32):
    """Each group of w (out, in) rebuilt in int8's two forms, as the plain computation: over its
    range (s = (max - min) / 255, o = min + 128·s) and symmetric (s = max|w| / 127), fp16 s and o."""
    wg = w.detach().float().view(w.shape[0], -1, group)
    low, high = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s = ((high - low) / 255).half().float()
    o = (low + 128 * s).half().float()
    ranged = (torch.round((wg - o) / s).clamp(-128, 127) * s + o).view_as(w)
    s = (wg.abs().amax(-1, keepdim=True) / 127).half().float()
    return ranged, (torch.round(wg / s) * s).view_as(w)


def test_each_group_takes_the_form_with_less_error_and_q8_0_weights_come_back_exactly():
    """A group quantized symmetrically (o = 0) or over its range, whichever reconstructs it better:
    weights that are Q8_0's (fp16 d times integers up to ±127, as SmolLM2's published embedding)
    come back exactly, where the range form alone would move them; neither form is ever better."""
    g = torch.Generator().manual_seed(0)
    q8 = torch.randint(-127, 128, (64, 128), generator=g).float()
    q8[:, ::32] = 127.0 * torch.where(torch.rand(64, 4, generator=g) < 0.5, -1.0, 1.0)  # each group reaches ±127
    d = (torch.rand(64, 4, generator=g) * 0.01 + 1e-3).half().float().repeat_interleave(32, dim=1)
    lin = nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(q8 * d)
    q = Int8Linear.from_linear(lin, fixed("dequant/model"), 32)
    assert torch.equal(q.dequantized(), lin.weight) and bool((q.offset == 0).all())
    assert not torch.equal(both_forms(lin.weight)[0], lin.weight)  # the range form alone would not keep them
    torch.manual_seed(1)
    lin = nn.Linear(128, 64)
    with torch.no_grad():
        lin.weight[:32] += 0.05  # shifted groups: the range form is the better one there
    q = Int8Linear.from_linear(lin, fixed("dequant/model"), 32)
    err = [(w - lin.weight).square().view(64, 4, 32).sum(-1) for w in (q.dequantized(), *both_forms(lin.weight))]
    assert bool((err[0] <= torch.minimum(err[1], err[2]) + 1e-12).all())
    assert bool((q.offset[:32] != 0).any()) and bool((q.offset[32:] == 0).any())  # both forms taken


@pytest.mark.skipif(not native.available(), reason="quill's C++ kernels did not build here")
def test_a_layer_of_symmetric_groups_streams_no_offsets_and_multiplies_the_same():
    """Every group's offset 0 (Q8_0's form): group_gemv's fp16 offsets are kept empty (the kernel
    implies 0), the products the same as with the zeros streamed; one group off 0 keeps them."""
    g = torch.Generator().manual_seed(0)
    q8 = torch.randint(-127, 128, (40, 128), generator=g).float()
    q8[:, ::32] = 127.0
    lin = nn.Linear(128, 40)
    with torch.no_grad():
        lin.weight.copy_(q8 * 0.01)
    q = Int8Linear.from_linear(lin, fixed("group_gemv"), 32)
    assert q.runs["group_gemv"] == "group_gemv" and q.offset_half.numel() == 0
    x = torch.randn(5, 128)
    want = native.group_gemv(x, q.weight, q.scale_half, torch.zeros_like(q.scale_half))
    assert torch.equal(q.linear(x, "group_gemv"), want + lin.bias)
    with torch.no_grad():
        lin.weight[3, :32] += 0.5
    assert Int8Linear.from_linear(lin, fixed("group_gemv"), 32).offset_half.shape == (40, 4)


def test_quantize_swaps_every_linear_and_a_tied_head_keeps_its_embedding():
    model = random_model("mha-learned")  # tied head
    wte = model.transformer.wte.weight.detach().clone()
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert quantize(model, None) is model and plan_of(model) is None
    quantize(model, "int8-channel", kernel="int8pack_mm/bf16")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == n_linear
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.transformer.wte.weight, nn.Parameter)
    assert torch.equal(model.transformer.wte.weight, wte) and model.dtype == torch.float32
    torch.testing.assert_close(model.lm_head.dequantized(), wte, atol=wte.abs().max().item() / 254, rtol=0)
    with pytest.raises(ValueError, match="already quantized"):
        quantize(model, "int8")


def exactly_representable(model, scheme="int8-channel"):
    """Every linear's weights made exactly what int8 stores: per row (a width the scheme's group
    does not divide), integers up to ±127 with a ±127 times a power of two; per group, integers
    -128…127 with both ends in each group times a power of two (the offset 0)."""
    g, group = torch.Generator().manual_seed(1), quant.SCHEMES[scheme].group
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                out, inp = m.weight.shape
                if group and inp % group == 0 and group < inp:
                    q = torch.randint(-128, 128, (out, inp), generator=g).float()
                    q[:, ::group], q[:, 1::group] = -128.0, 127.0
                else:
                    q = torch.randint(-127, 128, (out, inp), generator=g).float()
                    q[:, 0] = 127  # each row's max |q| is 127, so its scale is exactly s
                m.weight.copy_(q * 2.0 ** -torch.randint(8, 10, (out, 1), generator=g))  # std ~0.3, as random_model
    return model


class Bf16Activations(nn.Module):
    """A float linear that rounds its input and its product to bf16 as the "/bf16" kernels do
    (the grouped int8pack_mm: each group's partial product, summed in fp32 and rounded): the
    reference that differs from them only in how the weights are stored."""

    def __init__(self, lin: nn.Linear, groups: int) -> None:
        super().__init__()
        self.weight, self.bias, self.groups = lin.weight, lin.bias, groups

    def forward(self, x):
        x = x.bfloat16().float()
        if self.groups == 1:
            y = F.linear(x, self.weight).bfloat16().float()
        else:
            xs, ws = x.chunk(self.groups, -1), self.weight.chunk(self.groups, -1)
            y = sum(F.linear(xg, wg).bfloat16().float() for xg, wg in zip(xs, ws)).bfloat16().float()
        return y if self.bias is None else y + self.bias


def float_reference(model, kernel, scheme):
    ref = copy.deepcopy(model)
    group = quant.SCHEMES[scheme].group
    if KERNELS[kernel].bf16:
        for parent in list(ref.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    inp = child.in_features
                    packed_groups = inp // group if group and kernel.startswith("int8pack") and inp % group == 0 and group < inp else 1
                    setattr(parent, name, Bf16Activations(child, packed_groups))
    return ref


@kernels
@pytest.mark.parametrize("variant", ["mha-learned", "rmsnorm-swiglu"])
@pytest.mark.parametrize("scheme", ["int8-channel", "int8"])
def test_weights_exactly_representable_in_int8_give_the_same_tokens(kernel, variant, scheme):
    """The float model's greedy tokens (with the kernel's activation rounding), past block_size,
    from the quantized model's engine."""
    model = exactly_representable(random_model(variant), scheme)
    weights = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    want = torch.stack(list(generate_tokens(float_reference(model, kernel, scheme), PROMPTS, 30)), 1)
    quantize(model, scheme, kernel=kernel)
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear):
            assert torch.equal(m.dequantized(), weights[name]), name  # nothing lost
    got = torch.stack(list(generate_tokens(model, PROMPTS, 30)), 1)
    assert torch.equal(got, want)
    assert len(set(want.flatten().tolist())) > 5


def test_plan_picks_the_kernel_of_the_smallest_measured_size_at_or_above():
    plan = KernelPlan((1, 8, 64), ("int8pack_mm/bf16", "dequant/model", "dequant/bf16"), rows=8)
    assert [plan.pick(m) for m in (1, 2, 8, 9, 64, 5000)] == [
        "int8pack_mm/bf16",
        "dequant/model",
        "dequant/model",
        "dequant/bf16",
        "dequant/bf16",
        "dequant/bf16",
    ]


def scripted(table):
    """A stand-in for planning._timings: {m: {kernel: ms}} (kernels missing at m cannot run)."""
    calls = []

    def timings(pairs, kernels, m, **budget):
        calls.append((m, len(pairs), list(kernels)))
        return {"float": table[m]["float"], **{k: v for k, v in table[m].items() if k in kernels}}

    return timings, calls


def test_plan_takes_the_fastest_kernel_per_size_and_drops_hopeless_ones(monkeypatch):
    a, b, c = "int8pack_mm/bf16", "dequant/bf16", "int8pack_mm/model"
    table = {
        m: {"float": 1.0, a: 0.2 if m <= 16 else 1.5, b: 2.0 if m <= 16 else 0.5, c: 0.9 if m == 1 else 25.0}
        for m in (1, 2, 4, 8, 16, 32, 64, 128, 256)
    }
    timings, calls = scripted(table)
    monkeypatch.setattr(planning, "_timings", timings)
    model = quantize(random_model("mha-learned"), "int8", rows=1)
    plan = plan_of(model)
    assert plan.sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert plan.kernels == (a,) * 5 + (b,) * 4
    every = sum(isinstance(m, Int8Linear) for m in model.modules())
    assert [n for m, n, _ in calls] == [1, every] + [4] * 8  # a probe on one layer, the decode size on every layer, the rest on block 0
    assert c in calls[2][2] and c not in calls[3][2]  # 25× float at 2 rows: not timed again
    assert "int8pack_mm/bf16" in plan.describe() and "0.20 ms vs 1.00 ms float" in plan.describe()


def test_a_plan_measures_seconds_not_minutes(monkeypatch):
    """A kernel hopeless on one layer is never timed on every layer; past the measurement's seconds
    the sizes take the rule: the decode batch's kernel up to 64 rows, the dequantized weight past them."""
    a, slow = "dequant/model", "int8pack_mm/model"
    table = {2**i: {"float": 1.0, a: 0.5, slow: 30.0} for i in range(9)}
    timings, calls = scripted(table)
    monkeypatch.setattr(planning, "_timings", timings)
    monkeypatch.setattr(planning, "PLAN_SECONDS", 0.0)
    plan = plan_of(quantize(random_model("mha-learned"), "int8", rows=1))
    assert len(calls) == 2 and slow in calls[0][2] and slow not in calls[1][2]  # the probe, then every layer at 1 row
    assert plan.pick(1) == plan.pick(64) == a and plan.pick(128) == planning.RULE_LARGE


def test_a_burst_of_load_at_one_size_leaves_the_plan_a_kernel_for_every_size(monkeypatch):
    """Every kernel 20x slower than F.linear at 4 rows (another process's burst): the fastest is
    still chosen and timed on; a size where no kernel runs takes the decode size's kernel."""
    a, b = "int8pack_mm/bf16", "dequant/bf16"
    table = {2**i: {"float": 1.0, a: 0.5, b: 0.8} for i in range(9)}
    table[4] = {"float": 0.01, a: 0.5, b: 0.8}
    table[64] = {"float": 1.0}  # nothing runs at 64 rows
    timings, calls = scripted(table)
    monkeypatch.setattr(planning, "_timings", timings)
    plan = plan_of(quantize(random_model("mha-learned"), "int8", rows=1))
    assert None not in plan.kernels and plan.pick(4) == a and plan.pick(64) == a and plan.pick(256) == a
    assert calls[4][2] == [a]  # at 8 rows: only the fastest of 4 rows is timed again


def test_where_no_int8_kernel_beats_the_float_linears_the_fastest_runs_and_says_so(monkeypatch):
    table = {2**i: {"float": 0.1, **dict.fromkeys(KERNELS, 0.3)} for i in range(9)}
    table[8]["dequant/model"] = 0.2
    timings, _ = scripted(table)
    monkeypatch.setattr(planning, "_timings", timings)
    plan = plan_of(quantize(random_model("mha-learned"), "int8", rows=8))
    assert plan.pick(8) == "dequant/model"  # asked for int8: it runs, with the fastest int8 kernel
    assert plan.describe().startswith(
        "int8 weights, dequant/model: a step's linears 0.20 ms vs 0.10 ms float (slower here: "
        "a model this small, or a busy machine while it was measured); measured in "
    )
    table[8]["dequant/model"] = 0.05
    assert "slower" not in plan_of(quantize(random_model("mha-learned"), "int8", rows=8)).describe()


def test_the_real_timings_cover_every_kernel_that_runs_here():
    lin = nn.Linear(64, 96)
    pair = (lin, Int8Linear.from_linear(lin, fixed("dequant/model")))
    ms = planning._timings([pair], list(KERNELS), 4)
    assert set(ms) == {"float", *KERNELS}  # all four run on a CPU
    assert all(0 < v < 1e4 for v in ms.values())


def test_unknown_schemes_and_kernels_are_refused():
    with pytest.raises(QuillError, match="--quantize must be int8, int8-channel, int5, int4, int4-g64, int4-g128 or none, got 'int3'"):
        quant.parse_quantize("int3")
    assert quant.parse_quantize("none") is None and quant.parse_quantize("int8") == "int8" and quant.parse_quantize("int4") == "int4"
    with pytest.raises(ValueError, match="kernel must be one of"):
        quantize(random_model(), "int8", kernel="fast")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_int8_equals_its_dequantized_model_and_the_engine_equals_recompute(dtype):
    """On CUDA (gpt-fast's dequantize form): the measured plan runs, the int8 model's logits are
    the float model's on the dequantized weights, and (fp32) its cached tokens are its recompute tokens."""
    model = random_model("rope-window-gqa").to("cuda", dtype)
    quantize(model, "int8")  # the fastest int8 kernels here, whether or not they beat the float ones
    assert plan_of(model).pick(1) in KERNELS
    ref = copy.deepcopy(model)
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int8Linear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None).to("cuda", dtype)
                with torch.no_grad():
                    lin.weight.copy_(child.dequantized())
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                setattr(parent, name, lin)
    ids = torch.randint(0, V, (2, BLOCK), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        got, want = model(ids, all_logits=True)[0], ref(ids, all_logits=True)[0]
    assert rel_err(got, want) < (1e-3 if dtype == torch.float32 else 2e-2)
    if dtype == torch.bfloat16:  # bf16 tokens may part at a near-tie (the logits are proven above)
        return
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cached = torch.stack(list(generate_tokens(model, prompts, 40)), 1)
    assert torch.equal(cached, torch.stack(list(generate_tokens(model, prompts, 40, use_cache=False)), 1))


def test_the_kernel_plan_is_measured_once_per_machine_and_shape_and_kept_in_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("QUILL_CACHE_DIR", str(tmp_path / "cache"))
    table = {2**i: {"float": 1.0, "int8pack_mm/bf16": 0.3, "dequant/bf16": 0.5} for i in range(9)}
    timings, calls = scripted(table)
    monkeypatch.setattr(planning, "_timings", timings)
    first = plan_of(quantize(random_model("mha-learned"), "int8", cache=True))
    assert (
        first.source.startswith("measured in ") and first.source.endswith(", cached for the next load") and len(calls) == 10
    )  # a probe, then 9 sizes
    assert (tmp_path / "cache" / "kernel_plans.json").is_file()
    again = plan_of(quantize(random_model("mha-learned", seed=1), "int8", cache=True))  # other weights, the same shapes
    assert len(calls) == 10 and again.source == "cached"
    assert (again.sizes, again.kernels, again.ms) == (first.sizes, first.kernels, first.ms)
    plan_of(quantize(random_model("gqa"), "int8", cache=True))  # other shapes: measured
    plan_of(quantize(random_model("mha-learned"), "int8-channel", cache=True))  # other scales: measured
    plan_of(quantize(random_model("mha-learned"), "int8", rows=4, cache=True))  # another decode batch: measured
    assert len(calls) == 40  # each measurement a probe and 9 sizes
    plan_of(quantize(random_model("mha-learned"), "int8"))  # no cache asked: measured, nothing read
    assert len(calls) == 50
    monkeypatch.setattr(native, "build_name", lambda: "quill_group_gemv_another_build")
    replan = plan_of(quantize(random_model("mha-learned"), "int8", cache=True))  # the C++ kernel changed: measured
    assert replan.source.startswith("measured in ") if native.available() else replan.source == "cached"
    (tmp_path / "cache" / "kernel_plans.json").write_text("not json")
    assert plan_of(quantize(random_model("mha-learned"), "int8", cache=True)).source.startswith("measured in ")  # a bad file: ignored


def test_the_stats_note_says_what_a_compiled_group_wise_step_runs():
    grouped = quantize(random_model(), "int8", kernel="dequant/model")
    per_row = quantize(random_model(), "int8-channel", kernel="dequant/model")
    gemv = native.available()
    assert ("group_gemv" if gemv else "grouped_sum") in quant.weights_note(grouped, compiled=True)
    for m in grouped.modules():
        if isinstance(m, Int8Linear):
            m.runs["group_gemv"] = "dequant/model"  # as where the C++ kernel does not build
    assert "grouped_sum" in quant.weights_note(grouped, compiled=True)
    assert "grouped_sum" not in quant.weights_note(grouped) and "grouped_sum" not in quant.weights_note(per_row, compiled=True)
    assert "group_gemv" not in quant.weights_note(per_row, compiled=True)


@pytest.mark.parametrize("kernel", ["int8pack_mm/model", "int8pack_mm/bf16"])
def test_the_group_wise_int8pack_form_takes_an_input_that_is_not_contiguous(kernel):
    """x.to(its own dtype) keeps x's strides: a transposed input's spread could not be viewed
    (SmolLM2's prefill failed so with int8pack_mm/model)."""
    torch.manual_seed(0)
    q = Int8Linear.from_linear(nn.Linear(64, 48), fixed(kernel), 32)
    x = torch.randn(64, 5).t()  # (5, 64), not contiguous
    want = F.linear(x.bfloat16().float() if KERNELS[kernel].bf16 else x, q.dequantized(), q.bias)
    torch.testing.assert_close(q(x), want, rtol=2**-7, atol=2**-7 * F.linear(x.abs(), q.dequantized().abs()).max().item())
