"""Every scheme of the registry (quillgpt.quant.SCHEMES) against its reference, with no test of its
own needed: its storage rebuilds a weight within its bits' rounding, each of its kernels equals the
reference (the unpacked weight through F.linear) to the rounding of its activations on odd shapes,
and a model converted with it equals the same model over its dequantized weights."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quillgpt import quant
from quillgpt.config import ModelConfig
from quillgpt.model.gpt import GPT
from quillgpt.quant.scheme import QuantLinear, reference
from tests.support import rel_err

SCHEMES = list(quant.SCHEMES.values())
KERNELS = [(s, k) for s in SCHEMES for k in s.kernels]


def width(scheme) -> int:
    """An input width every kernel group of the scheme divides, and a second group of 64."""
    return 2 * max(64, scheme.group)


def rounding_bound(w: torch.Tensor, scheme, group: int) -> torch.Tensor:
    """(out, in): how far a stored weight may be from w, two of its levels over each group's range
    (one step rounds half a level; a symmetric form spends one level of its range on the sign)."""
    out, k = w.shape
    wg = w.view(out, -1, group or k)
    span = (wg.amax(-1) - wg.amin(-1))[:, :, None]
    return (2 * span / (2**scheme.bits - 1)).expand_as(wg).reshape(out, k) + 1e-6


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("out", [37, 48])
def test_pack_keeps_the_bits_and_unpack_rebuilds_the_weight_within_their_rounding(scheme, out):
    check_storage(scheme, out)


def check_storage(scheme, out: int) -> None:
    torch.manual_seed(out)
    w = torch.randn(out, width(scheme)) * torch.linspace(0.1, 3, out)[:, None] + 0.2
    packed = scheme.pack(w, scheme.group)
    assert packed["codes"].shape == w.shape and packed["codes"].unique().numel() <= 2**scheme.bits
    back = scheme.unpack(packed)
    assert back.dtype == torch.float32 and back.shape == w.shape
    assert ((back - w).abs() <= rounding_bound(w, scheme, scheme.group)).all()
    assert torch.equal(scheme.unpack(scheme.pack(back, scheme.group)), back)  # stored weights are stored as they are


@pytest.mark.parametrize(("scheme", "kernel"), KERNELS, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("bias", [False, True])
def test_each_kernel_equals_the_reference_to_its_activations_rounding(scheme, kernel, bias):
    check_kernel(scheme, kernel, bias)


def check_kernel(scheme, kernel: str, bias: bool) -> None:
    torch.manual_seed(1)
    lin = nn.Linear(width(scheme), 37, bias=bias)
    layer = scheme.linear(lin, scheme.group, kernel)
    assert isinstance(layer, scheme.layer) and isinstance(layer, QuantLinear)
    assert ((layer.dequantized() - lin.weight).abs() <= rounding_bound(lin.weight.detach(), scheme, scheme.group)).all()
    for rows in (1, 5):
        x = torch.randn(rows, lin.in_features)
        got = layer(x)
        assert got.shape == (rows, 37) and got.dtype == x.dtype
        assert rel_err(got, reference(x, layer)) <= scheme.kernels[kernel], (rows, kernel)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_a_converted_model_is_its_dequantized_model_and_names_its_scheme(scheme):
    torch.manual_seed(2)
    cfg = ModelConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=64, norm="rmsnorm", mlp="swiglu", pos="rope")
    model = GPT(cfg).eval()
    assert quant.parse_quantize(scheme.name) == scheme.name and f"{scheme.name}: {scheme.help}" in quant.help_text()
    quant.quantize(model, scheme.name)
    assert any(isinstance(m, scheme.layer) for m in model.transformer.h.modules())
    assert quant.weights_note(model).startswith(f", int{scheme.bits} weights")
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        got, _ = model(idx, all_logits=True)
        want, _ = quant.dequantize(copy.deepcopy(model))(idx, all_logits=True)
    assert rel_err(got, want) <= max(scheme.kernels.values())
    with pytest.raises(ValueError, match="already quantized"):
        quant.quantize(model, scheme.name)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_a_layer_in_the_stored_form_multiplies_by_the_unpacked_weight(scheme):
    """The layer's default layout keeps what pack stores where that form holds (int8; int4 where
    quill's C++ kernel runs it), so its reference is the scheme's unpack of pack."""
    torch.manual_seed(3)
    lin = nn.Linear(width(scheme), 48, bias=True)
    layer = scheme.linear(lin, scheme.group, next(iter(scheme.kernels)))
    if getattr(layer, "kernel", "group_gemv4") == "group_gemv4":  # int8, or int4's stored form
        assert torch.equal(layer.dequantized(), scheme.unpack(scheme.pack(lin.weight, scheme.group)))
    x = torch.randn(2, lin.in_features)
    torch.testing.assert_close(reference(x, layer), F.linear(x, layer.dequantized(), lin.bias))


def test_the_checks_fail_a_scheme_whose_storage_or_kernel_is_wrong():
    """A test-only scheme (a record over int8's Linear) with an unpack that drops the offsets, and
    one whose kernel is looser than it claims: the registry's checks catch each."""
    import dataclasses

    int8 = quant.SCHEMES["int8"]
    no_offsets = dataclasses.replace(int8, name="int8-test", unpack=lambda p: int8.unpack({"codes": p["codes"], "scale": p["scale"]}))
    with pytest.raises(AssertionError):
        check_storage(no_offsets, 48)
    claims_exact = dataclasses.replace(int8, name="int8-test", kernels={"dequant/bf16": 1e-7})
    with pytest.raises(AssertionError):
        check_kernel(claims_exact, "dequant/bf16", True)
