"""--quantize: the schemes, each one record (quant/scheme.py), and the converter that applies one
to a model from outside it (torchtitan's converters: the model stays pure).

    SCHEMES          name → Scheme: int8 and int8-channel (quant/int8.py), int5 (quant/int5.py), int4, int4-g64 and
                     int4-g128 (quant/int4.py); --quantize's help, its parsing, the stats line
                     and tests/quant/test_schemes.py read it
    quantize()       every linear of a model swapped for its scheme's Linear, in place
    weights_note()   the stats line's words for a quantized model
    dequantize()     the float model a quantized one computes: each quantized linear an nn.Linear

A new scheme is a module with its record, its Linear and its pack/unpack (the reference), and one
line below.
"""

from __future__ import annotations

import torch
from torch import nn

from quillgpt.errors import QuillError
from quillgpt.quant.embedding import QuantEmbedding
from quillgpt.quant.int4 import INT4, INT4_G64, INT4_G128
from quillgpt.quant.int5 import INT5
from quillgpt.quant.int8 import INT8, INT8_CHANNEL, plan_of
from quillgpt.quant.scheme import ConvertOptions, QuantLinear, Scheme

SCHEMES: dict[str, Scheme] = {s.name: s for s in (INT8, INT8_CHANNEL, INT5, INT4, INT4_G64, INT4_G128)}

__all__ = [
    "SCHEMES",
    "ConvertOptions",
    "QuantLinear",
    "Scheme",
    "dequantize",
    "help_text",
    "parse_quantize",
    "plan_of",
    "quantize",
    "weights_note",
]


def parse_quantize(name: str | None, setting: str = "--quantize") -> str | None:
    """A scheme a user names (a SCHEMES key), or none / None for the float weights."""
    if name is None or name == "none":
        return None
    if name not in SCHEMES:
        raise QuillError(f"{setting} must be {', '.join(SCHEMES)} or none, got {str(name)[:60]!r}")
    return name


def help_text() -> str:
    """--quantize's help: each scheme's phrase, then none."""
    return "; ".join(f"{s.name}: {s.help}" for s in SCHEMES.values()) + "; none: the float weights."


def quantize(
    model: nn.Module, scheme: str | None, rows: int = 1, kernel: str | None = None, cache: bool = False, group: int | None = None
) -> nn.Module:
    """Swap the linears of `model` (a GPT) for `scheme`'s, in place, and return it; scheme None
    returns the model unchanged. `rows`: the decode batch (one token per row) int8's kernels are
    measured at (quant/plan.py); `kernel` fixes one int8 kernel for every input instead (tests,
    reproducing a run). `cache`: take the plan measured before on this machine for this shape,
    and keep a new one. `group`: weights per scale instead of the scheme's (0: per output
    channel; measuring schemes)."""
    name = parse_quantize(scheme, "scheme")
    if name is None:
        return model
    if any(isinstance(m, _LAYERS) for m in model.modules()):
        raise ValueError("the model is already quantized")
    s = SCHEMES[name]
    s.convert(model, s.group if group is None else group, ConvertOptions(rows, kernel, cache, group))
    return model


_LAYERS = tuple({s.layer for s in SCHEMES.values()})


def weights_note(model: nn.Module, sep: str = ", ", compiled: bool = False) -> str:
    """`sep` + the few words of a quantized model's start-up or stats line ("" for float weights):
    the note of the scheme whose Linear its blocks hold, each one's where they hold several (a GGUF
    file's mix, kept). `compiled`: the decode step ran compiled."""
    for modules in (list(model.transformer.h.modules()), list(model.modules())):  # the blocks decide; else the head
        kinds = [layer for layer in dict.fromkeys(s.layer for s in SCHEMES.values()) if any(isinstance(m, layer) for m in modules)]
        notes = [next(s for s in SCHEMES.values() if s.layer is layer).note(model, "", compiled) for layer in kinds]
        if notes:
            return sep + "; ".join(notes)
    return ""


def dequantize(model: nn.Module) -> nn.Module:
    """Every quantized linear of `model` replaced by an nn.Linear of its dequantized weight and its
    bias, in place, and the model returned: the float model the quantized one computes (what its
    kernels are checked against, and what a scheme's quality is measured from). An embedding table
    kept quantized becomes an nn.Embedding (tied to the head again where it was the head's)."""
    wte, tied = model.transformer.wte, model.lm_head
    if isinstance(wte, QuantEmbedding):
        model.transformer.wte = nn.Embedding.from_pretrained(wte.table.dequantized().to(wte.dtype), freeze=False)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():
                    plain.weight.copy_(child.dequantized())
                    if child.bias is not None:
                        plain.bias.copy_(child.bias)
                setattr(parent, name, plain)
    if isinstance(wte, QuantEmbedding) and wte.table is tied:
        model.transformer.wte.weight = model.lm_head.weight
    return model
