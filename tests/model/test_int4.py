"""Weight-only int4 (model/int4.py): the kernel equals the dequantized computation to bf16
rounding; the two-codes-a-byte path equals it exactly; codes round each weight to its group's
nearest level; weights exactly representable in int4 give the float model's tokens; quantize
swaps the linears a group divides and says which it kept float."""

import copy

import pytest
import torch
import torch.nn.functional as F
from support import PROMPTS, random_model
from torch import nn

from quillgpt.inference.generate import generate_tokens
from quillgpt.model import int4
from quillgpt.model.int4 import Int4Linear
from quillgpt.model.quant import quantize, weights_note

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("out_features", [48, 37], ids=["kernel", "two-a-byte"])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("shape", [(5,), (2, 7)], ids=["2d", "3d"])
def test_int4_linear_equals_its_dequantized_computation_to_rounding(out_features, group, shape):
    torch.manual_seed(0)
    lin = nn.Linear(128, out_features)
    q = Int4Linear(lin, group)
    assert q.kernel == (out_features % 16 == 0)
    x = torch.randn(*shape, 128)
    q_codes, sz = int4.int4_codes(lin.weight, group)
    w = int4.dequantize(q_codes, sz, group)
    # the kernel's layout read back (its bf16 output) = the codes' weights, to bf16 rounding there
    assert torch.equal(q.dequantized(), w.bfloat16().float() if q.kernel else w)
    got = q(x)
    assert got.shape == (*shape, out_features) and got.dtype == torch.float32
    if q.kernel:  # bf16 activations, a bf16 product
        want = F.linear(x.bfloat16().float(), w) + lin.bias
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    else:
        torch.testing.assert_close(got, F.linear(x, w, lin.bias), rtol=1e-5, atol=1e-5)


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
    """The float linear rounding its input and product to bf16, as the int4 kernel does."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias

    def forward(self, x):
        y = F.linear(x.bfloat16().float(), self.weight).bfloat16().float()
        return y if self.bias is None else y + self.bias


@pytest.mark.parametrize("variant", ["mha-learned", "rmsnorm-swiglu"])
def test_weights_exactly_representable_in_int4_give_the_same_tokens(variant):
    model = exactly_representable(random_model(variant))
    ref = copy.deepcopy(model)
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and int4.kernel_fits(child.out_features, child.in_features, 32):
                setattr(parent, name, Bf16Reference(child))
    ref.lm_head = Bf16Reference(ref.lm_head)  # the head runs in bf16 (its weights exact there)
    weights = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    want = torch.stack(list(generate_tokens(ref, PROMPTS, 30)), 1)
    quantize(model, "int4")
    fours = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert fours and all(torch.equal(m.dequantized(), weights[n]) for n, m in fours.items())  # nothing lost
    got = torch.stack(list(generate_tokens(model, PROMPTS, 30)), 1)
    assert torch.equal(got, want)
    assert len(set(want.flatten().tolist())) > 5


def test_quantize_int4_swaps_the_blocks_linears_keeps_the_head_in_bf16_and_says_what_stayed_float():
    model = random_model("mha-learned")  # n_embd 32: every width a multiple of 32; a tied head
    wte = model.transformer.wte.weight.detach().clone()
    n_block = sum(isinstance(m, nn.Linear) for m in model.transformer.h.modules())
    quantize(model, "int4-g64")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == n_block
    groups = {m.in_features: m.group for m in model.modules() if isinstance(m, Int4Linear)}
    assert groups == {32: 32, 128: 64}  # the largest kernel group up to 64 that divides each width
    assert isinstance(model.lm_head, int4.Bf16Linear) and torch.equal(model.lm_head.weight, wte.bfloat16())
    assert torch.equal(model.transformer.wte.weight, wte)  # the lookup keeps the float embedding
    note = weights_note(model)
    assert "int4 weights (64 per scale)" in note and "head in bf16" in note and "kept float" not in note
    with pytest.raises(ValueError, match="already quantized"):
        quantize(model, "int4")
    odd = random_model("mha-learned")
    odd.transformer.h[0].mlp.c_fc = nn.Linear(40, 128)  # a 40-wide input: no group divides it (not run)
    quantize(odd, "int4")
    assert isinstance(odd.transformer.h[0].mlp.c_fc, nn.Linear)
    assert "1 linears kept float" in weights_note(odd)
