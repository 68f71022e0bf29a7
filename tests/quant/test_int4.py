"""Weight-only int4 (quant/int4.py): each layout equals its dequantized computation (group_gemv4
to the int16 rounding of x, int4pack_mm to bf16 rounding, the two-codes-a-byte path exactly);
codes round each weight to its group's nearest level; weights exactly representable in int4 give
the float model's tokens; quantize swaps the linears a group divides, gives the head 8 bits or
more and says which it kept float."""

import copy

import pytest
import torch
import torch.nn.functional as F
from kernel_reference import Int16Reference
from support import PROMPTS, kernel_rounded, random_model
from torch import nn

from quillgpt import native
from quillgpt.errors import QuillError
from quillgpt.inference.generate import generate_tokens
from quillgpt.quant import int4, quantize, weights_note
from quillgpt.quant.int4 import Int4Linear
from quillgpt.quant.int8 import Int8Linear

pytestmark = pytest.mark.usefixtures("one_thread")
needs_kernel = pytest.mark.skipif(not native.available(), reason=f"group_gemv did not build here: {native.why_not()}")


@pytest.fixture
def no_cpp(monkeypatch):
    """As on a machine where quill's C++ kernels do not build: torch's int4 kernel, a bf16 head."""
    monkeypatch.setattr(native.build, "_built", None)
    monkeypatch.setattr(native.build, "_error", "QUILL_NO_CPP_KERNELS is set")


@pytest.mark.parametrize(("out_features", "kernel"), [(48, "int4pack_mm"), (37, "dequantize")])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("shape", [(5,), (2, 7)], ids=["2d", "3d"])
def test_torch_layouts_equal_their_dequantized_computation_to_rounding(no_cpp, out_features, kernel, group, shape):
    torch.manual_seed(0)
    lin = nn.Linear(128, out_features)
    q = Int4Linear(lin, group)
    assert q.kernel == kernel
    x = torch.randn(*shape, 128)
    q_codes, sz = int4.int4_codes(lin.weight, group)
    w = int4.dequantize(q_codes, sz, group)
    # the kernel's layout read back (its bf16 output) = the codes' weights, to bf16 rounding there
    assert torch.equal(q.dequantized(), w.bfloat16().float() if kernel == "int4pack_mm" else w)
    got = q(x)
    assert got.shape == (*shape, out_features) and got.dtype == torch.float32
    if kernel == "int4pack_mm":  # bf16 activations, a bf16 product
        want = F.linear(x.bfloat16().float(), w) + lin.bias
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    else:
        torch.testing.assert_close(got, F.linear(x, w, lin.bias), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("out_features", [48, 37])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 5, int4.GEMV_ROWS + 6], ids=["1", "5", "past-gemv-rows"])
def test_group_gemv4_layout_equals_its_dequantized_computation(out_features, group, rows):
    """x rounded to int16 per 32 (group_gemv4: its few-rows kernel, or past GEMV_ROWS its GEMM): the
    dequantized weights, q·s + o with the fp16 s and o gemv4_codes made."""
    torch.manual_seed(0)
    lin = nn.Linear(128, out_features)
    q = Int4Linear(lin, group)
    assert q.kernel == "group_gemv4" and q.codes.shape == (out_features, 64) and q.scale.dtype == torch.float16
    codes, s, o = int4.gemv4_codes(lin.weight, group)
    w = (codes.float().view(out_features, -1, group) * s.float()[:, :, None] + o.float()[:, :, None]).view(out_features, 128)
    assert torch.equal(q.dequantized(), w)
    x = torch.randn(rows, 128)
    got, want = q(x), F.linear(x, w, lin.bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@needs_kernel
def test_a_layer_of_symmetric_groups_keeps_no_offsets_and_multiplies_the_same():
    """Every group in Q4_0's form (a Q4_0 import's, or gemv4_codes' choice for each): no offsets
    kept (the kernels imply -8·s), the same products and weights, and packed() writes them back;
    one group over its range keeps them all."""
    torch.manual_seed(0)
    q4_0 = torch.randint(0, 16, (40, 128)).float() * 0.01 - 0.08  # each group symmetric: w = (q - 8)·0.01
    q4_0[:, ::32] = -0.08  # each group's largest magnitude -8·s, so gemv4_codes finds that form
    lin = nn.Linear(128, 40)
    lin.weight.data.copy_(q4_0)
    sym = Int4Linear(lin, 32)
    assert sym.kernel == "group_gemv4" and sym.offset is None
    packed = sym.packed()
    assert torch.equal(packed["offset"], (-8 * sym.scale.float()).half())
    kept = Int4Linear.from_stored(int4.store(packed), lin.bias.detach())
    assert kept.offset is None and torch.equal(kept.dequantized(), sym.dequantized())
    explicit = Int4Linear.from_stored(int4.store(packed), lin.bias.detach())
    explicit.offset = packed["offset"]  # the same weights, offsets streamed
    for rows in (1, 5, int4.GEMV_ROWS + 6):
        x = torch.randn(rows, 128)
        assert torch.equal(sym(x), explicit(x))
    idx = torch.tensor([3, 0, 39])
    assert torch.equal(sym.rows(idx), sym.dequantized()[idx])
    lin.weight.data[5, :32] += 0.5  # one group now over its range: Q4_1's form
    assert Int4Linear(lin, 32).offset is not None


@needs_kernel
def test_a_prompts_rows_run_the_kernel_in_chunks_of_prefill_rows(monkeypatch):
    """Past GEMV_ROWS rows group_gemv4 still multiplies (its GEMM), PREFILL_ROWS rows a call, where
    the weight was dequantized for F.linear before: the chunks' rows equal one call's (to float
    sums' order), and the product x rounded to int16 per 32 times the dequantized weight."""
    torch.manual_seed(0)
    lin = nn.Linear(192, 40)
    q = Int4Linear(lin, 32)
    x = torch.randn(3, 100, 192)
    whole = q(x)
    calls = []
    gemv4 = native.group_gemv4
    monkeypatch.setattr(native, "group_gemv4", lambda x, *a: calls.append(x.shape[0]) or gemv4(x, *a))
    monkeypatch.setattr(int4, "PREFILL_ROWS", 128)
    got = q(x)
    assert calls == [128, 128, 44]
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item())  # 44 rows: the few-rows kernel's sum order
    want = (kernel_rounded(x.view(300, 192)) @ q.dequantized().double().t()).float().view(3, 100, 40) + lin.bias
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@needs_kernel
def test_int8_prefill_activations_are_asked_for_by_name(monkeypatch):
    """QUILL_PREFILL_ACTIVATIONS=int8: past GEMV_ROWS rows x is rounded to int8 per 32
    (group_gemv4_x8), up to them int16 as before; another value is one clear error."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 40, bias=False)
    q = Int4Linear(lin, 32)
    offsets = q.offset.double().repeat_interleave(32, 1).t()  # the offsets times x's own sums
    scaled = q.dequantized().double().t() - offsets
    few, many = torch.randn(int4.GEMV_ROWS, 128), torch.randn(int4.GEMV_ROWS + 36, 128)
    monkeypatch.setenv("QUILL_PREFILL_ACTIVATIONS", "int8")
    for x, levels in ((few, 32767), (many, 127)):
        want = (kernel_rounded(x, levels) @ scaled + x.double() @ offsets).float()
        torch.testing.assert_close(q(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert (q(many) - (kernel_rounded(many) @ scaled + many.double() @ offsets).float()).abs().max() > 1e-4  # not int16's
    monkeypatch.setenv("QUILL_PREFILL_ACTIVATIONS", "fp8")
    with pytest.raises(QuillError, match="QUILL_PREFILL_ACTIVATIONS must be one of int16, int8, got 'fp8'"):
        q(many)


def range_form(w, group=32):
    """Each group of w rebuilt over its range (Q4_1: s = (max - min) / 15, o = min, fp16), plainly."""
    wg = w.float().view(w.shape[0], -1, group)
    low, high = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s, o = ((high - low) / 15).half().float(), low.half().float()
    return (torch.round((wg - o) / torch.where(s > 0, s, 1.0)).clamp(0, 15) * s + o).view_as(w)


def test_gemv_codes_take_the_better_of_two_forms_and_round_each_weight_to_a_level():
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    w[2, :32] = 0.25  # a constant group: scale 0, every weight exact
    q, s, o = int4.gemv4_codes(w, 32)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and s.dtype == o.dtype == torch.float16
    wq = (q.float().view(16, 4, 32) * s.float()[:, :, None] + o.float()[:, :, None]).view(16, 128)
    err = (wq - w).square().view(16, 4, 32).sum(-1)
    assert bool((err <= (range_form(w) - w).square().view(16, 4, 32).sum(-1) + 1e-9).all())  # never worse than Q4_1
    assert torch.equal(wq[2, :32], torch.full((32,), 0.25))
    wg = w.view(16, 4, 32)
    ranged = s == ((wg.amax(-1) - wg.amin(-1)) / 15).half()  # the groups in Q4_1's form
    half = (wq - w).view(16, 4, 32).abs().amax(-1) <= s.float().abs() * 0.5 + (s.float().abs() + o.float().abs()) * 2**-10
    assert bool(half[ranged].all())  # half a level + fp16 rounding
    w[5, 7] = 1e6  # past fp16: no group_gemv4 layout
    assert int4.gemv4_codes(w, 32) is None
    if native.available():
        assert Int4Linear(nn.Linear(128, 48), 32).kernel == "group_gemv4"
        big = nn.Linear(128, 48)
        big.weight.data[0, 0] = 1e6
        assert Int4Linear(big, 32).kernel == "int4pack_mm"


def test_q4_0_and_q4_1_weights_come_back_exactly_in_the_gemv_layout():
    """Weights that were llama.cpp's Q4_0 ((q - 8)·d, fp16 d) or Q4_1 (q·d + m) are rebuilt exactly:
    each group takes the form that fits it (here no Q4_0 group uses code 15, so Q4_1's form alone
    would move them)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 15, (32, 128), generator=g).float()
    q[:, ::32] = 0  # the largest magnitude in each group, as Q4_0 makes it
    d = (torch.randn(32, 4, generator=g) * 0.01).half().float().repeat_interleave(32, dim=1)
    q4_0 = (q - 8) * d
    q[:, 1::32] = 15
    m = (torch.randn(32, 4, generator=g) * 0.05).half().float().repeat_interleave(32, dim=1)
    q4_1 = q * d.abs() + m
    for w in (q4_0, q4_1):
        codes, s, o = int4.gemv4_codes(w, 32)
        rebuilt = (codes.float().view(32, 4, 32) * s.float()[:, :, None] + o.float()[:, :, None]).view(32, 128)
        assert torch.equal(rebuilt, w)
    assert not torch.equal(range_form(q4_0), q4_0)


def test_codes_round_each_weight_to_its_groups_nearest_level():
    torch.manual_seed(0)
    w = torch.randn(32, 96)
    w[3, :32] = 0.5  # a constant group: scale 0, every weight exact
    q, sz = int4.int4_codes(w, 32)
    s = sz[..., 0].float().t().repeat_interleave(32, 1)  # (out, in)
    spread = q.view(32, 3, 32).amax(2) - q.view(32, 3, 32).amin(2)
    assert q.min() >= 0 and q.max() <= 15 and int(spread[3, 0]) == 0
    assert int(torch.cat([spread[:3].flatten(), spread[3, 1:], spread[4:].flatten()]).min()) >= 14  # each group spans the levels
    err = (int4.dequantize(q, sz, 32) - w).abs()
    assert bool((err <= s / 2 + 2e-2 * s + 1e-6).all())  # half a level, plus the bf16 rounding of s and z
    assert torch.equal(int4.dequantize(q, sz, 32)[3, :32], torch.full((32,), 0.5))


def test_the_group_is_the_largest_kernel_group_that_divides_the_width():
    assert int4.group_for(576, 128) == 64 and int4.group_for(1536, 128) == 128 and int4.group_for(576, 32) == 32
    assert int4.group_for(40, 32) == 0 and int4.group_for(96, 256) == 32
    assert int4.kernel_fits(1536, 576, 32) and not int4.kernel_fits(37, 64, 32) and not int4.kernel_fits(48, 64, 16)


def exactly_representable(model, group=32):
    """Every linear a group divides made exactly what int4 stores: codes 0…15 with both ends in
    each group, a power-of-two scale s per row and w = (q - 7.5)·s (zero-mean; z = s/2, exact)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) and int4.group_for(m.in_features, group):
                out, inp = m.weight.shape
                gr = int4.group_for(inp, group)
                q = torch.randint(0, 16, (out, inp), generator=g).float()
                ends = torch.rand(out, inp // gr, gr, generator=g).argsort(-1)[..., :2]  # two places per group
                q = q.view(out, inp // gr, gr).scatter(-1, ends, torch.tensor([0.0, 15.0]).expand_as(ends).contiguous()).view(out, inp)
                m.weight.copy_((q - 7.5) * 2.0 ** -torch.randint(4, 6, (out, 1), generator=g))  # std ~0.2, as random_model
    return model


class Bf16Reference(nn.Module):
    """The float linear rounding its input and product to bf16, as the int4pack kernel does."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias

    def forward(self, x):
        y = F.linear(x.bfloat16().float(), self.weight).bfloat16().float()
        return y if self.bias is None else y + self.bias


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
@pytest.mark.parametrize("variant", ["mha-learned", "rmsnorm-swiglu"])
def test_weights_exactly_representable_in_int4_give_the_same_tokens(request, variant, kernels):
    """cpp: group_gemv4 blocks and an int8 head through group_gemv; torch (no C++ kernels):
    int4pack_mm blocks and a bf16 head. The reference rounds as each of them rounds."""
    if kernels == "torch":
        request.getfixturevalue("no_cpp")
    elif not native.available():
        pytest.skip(f"group_gemv did not build here: {native.why_not()}")
    model = exactly_representable(random_model(variant))
    ref = copy.deepcopy(model)
    weights = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantize(model, "int4")
    fours = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert fours and all(torch.equal(m.dequantized(), weights[n]) for n, m in fours.items())  # nothing lost
    assert ("group_gemv4" in {m.kernel for m in fours.values()}) == (kernels == "cpp")
    for name, layer in [*fours.items(), ("lm_head", model.lm_head)]:
        parent, _, leaf = name.rpartition(".")
        float_layer = getattr(ref.get_submodule(parent), leaf)
        gemv = isinstance(layer, Int8Linear) or getattr(layer, "kernel", "") == "group_gemv4"
        setattr(ref.get_submodule(parent), leaf, Int16Reference(layer) if gemv else Bf16Reference(float_layer))
    assert isinstance(model.lm_head, Int8Linear) == (kernels == "cpp")
    want = torch.stack(list(generate_tokens(ref, PROMPTS, 30)), 1)
    got = torch.stack(list(generate_tokens(model, PROMPTS, 30)), 1)
    assert torch.equal(got, want)
    assert len(set(want.flatten().tolist())) > 5


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
def test_quantize_int4_swaps_the_blocks_linears_gives_the_head_8_bits_or_more_and_says_what_stayed_float(request, kernels):
    if kernels == "torch":
        request.getfixturevalue("no_cpp")
    elif not native.available():
        pytest.skip(f"group_gemv did not build here: {native.why_not()}")
    model = random_model("mha-learned")  # n_embd 32: every width a multiple of 32; a tied head
    wte = model.transformer.wte.weight.detach().clone()
    n_block = sum(isinstance(m, nn.Linear) for m in model.transformer.h.modules())
    quantize(model, "int4-g64")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == n_block
    groups = {m.in_features: m.group for m in model.modules() if isinstance(m, Int4Linear)}
    assert groups == {32: 32, 128: 64}  # the largest kernel group up to 64 that divides each width
    note = weights_note(model)
    if kernels == "cpp":  # an int8 head, a scale and an offset per 32 weights
        assert isinstance(model.lm_head, Int8Linear) and model.lm_head.group == 0  # a 32-wide row: one group
        torch.testing.assert_close(model.lm_head.dequantized(), wte, rtol=0, atol=float(wte.abs().max()) / 200)
        assert "group_gemv4 (GEMM-blocked past 64 rows) + int4pack_mm" in note and "head int8 (per-channel scales, group_gemv)" in note
    else:
        assert isinstance(model.lm_head, int4.Bf16Linear) and torch.equal(model.lm_head.weight, wte.bfloat16())
        assert "int4pack_mm" in note and "head in bf16" in note
    assert torch.equal(model.transformer.wte.weight, wte)  # the lookup keeps the float embedding
    assert "int4 weights (64 per scale)" in note and "kept float" not in note
    with pytest.raises(ValueError, match="already quantized"):
        quantize(model, "int4")
    odd = random_model("mha-learned")
    odd.transformer.h[0].mlp.c_fc = nn.Linear(40, 128)  # a 40-wide input: no group divides it (not run)
    quantize(odd, "int4")
    assert isinstance(odd.transformer.h[0].mlp.c_fc, nn.Linear)
    assert "1 linears kept float" in weights_note(odd)
