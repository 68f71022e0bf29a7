"""What a quantization scheme is: one record (`Scheme`) and the layer every scheme's Linear is
(`QuantLinear`). The registry of records is quant/__init__.py's SCHEMES; `--quantize`'s help,
its parsing, the stats line and tests/quant/test_schemes.py all read it, so a scheme is added
as one record, its Linear and its reference, and is tested without writing a test.

A scheme stores each weight as codes with a scale (and an offset) per group of `group` inputs
of a row: `pack` turns a float weight into those tensors (named as a run would store them),
`unpack` rebuilds the float weight from them. Its reference is `reference()`: a layer's weight
dequantized, through F.linear. Each of its kernels must equal that reference to the rounding of its
activations (`kernels`: name → that relative error).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quillgpt.native import Format

Packed = dict[str, Tensor]  # a weight's stored tensors: "codes", "scale" and (group-wise) "offset"


@runtime_checkable
class QuantLinear(Protocol):
    """A quantized linear layer, called as nn.Linear is: (…, in) → (…, out) in x's dtype."""

    in_features: int
    out_features: int
    bias: Tensor | None

    def __call__(self, x: Tensor) -> Tensor: ...

    def dequantized(self) -> Tensor:
        """(out, in) float32: the weight this layer multiplies by (to its kernels' rounding)."""
        ...

    def runs_native(self) -> bool:
        """Whether the native kernels may run this layer: its layout is theirs and its kernel plan
        may choose them (which batch sizes do is native_weights'). Never a timing: the KV cache's
        dtype follows from it (inference/native_decoder.py)."""
        ...

    def native_weights(self, rows: int) -> tuple[Tensor, Tensor, Tensor, Format] | None:
        """(codes, fp16 scales, fp16 offsets, their Format) in the native kernels' layout where this layer runs
        them at `rows` input rows (the native decoder then takes the layer); None elsewhere."""
        ...

    def rows(self, idx: Tensor) -> Tensor:
        """(len(idx), in) float32: rows `idx` of the dequantized weight (an embedding lookup in it)."""
        ...

    def packed(self) -> Packed:
        """The layer's codes, scales and offsets in its scheme's `pack` form (a run stores their `store`)."""
        ...


@dataclass(frozen=True)
class ConvertOptions:
    """How a model is converted: the decode batch its kernels are chosen for (`rows`), a kernel
    fixed for every input (None: chosen per size), a kernel plan kept across runs (`cache`), and a
    group size other than the scheme's (None: the scheme's; measuring schemes)."""

    rows: int = 1
    kernel: str | None = None
    cache: bool = False
    group: int | None = None


@dataclass(frozen=True)
class Scheme:
    """One --quantize scheme: its name and help, its storage (bits, weights per scale, pack and
    unpack), its Linear (`layer`, made by `linear`), how a whole model converts (`convert`: which
    layers, and the head), its kernels with the error each may have against `reference`, and the
    stats line's words (`note`)."""

    name: str
    help: str  # what `--quantize NAME` does, in a phrase
    bits: int
    group: int  # weights per scale; 0: one scale per output channel
    layer: type[nn.Module]
    linear: Callable[[nn.Linear, int, str | None], nn.Module]  # (float layer, group, kernel or None: its own choice)
    convert: Callable[[nn.Module, int, ConvertOptions], None]  # (model, group, options): every linear swapped, in place
    note: Callable[[nn.Module, str, bool], str]  # (model, sep, compiled) → the stats line's words
    pack: Callable[[Tensor, int], Packed]  # (weight (out, in), group) → its codes, scales and offsets
    unpack: Callable[[Packed], Tensor]  # packed tensors → the (out, in) float32 weight
    kernels: Mapping[str, float]  # kernel → its relative error against reference (the rounding of its activations)
    # a quantized run's file (runs.py): pack's tensors as stored (the kernels' layout, so loading is
    # one read a tensor), their dtypes and shapes for (out, in, group) known before any is made, and
    # the layer made from them (with its float bias, scales in the model's dtype)
    store: Callable[[Packed], Packed]
    stored_shapes: Callable[[int, int, int], dict[str, tuple[torch.dtype, tuple[int, ...]]]]
    load: Callable[[Packed, Tensor | None, torch.dtype], nn.Module]

    def stores(self, out_features: int, in_features: int) -> bool:
        """Whether a run's file can hold a layer of this shape in this scheme (int4's layout needs
        in_features a multiple of 64; the group must divide it)."""
        fits = self.group == 0 or in_features % self.group == 0
        return fits and (self.bits != 4 or in_features % 64 == 0)


def reference(x: Tensor, layer: QuantLinear) -> Tensor:
    """The plain computation every kernel of a scheme is checked against: the layer's weight
    dequantized (its scheme's unpack of what it stores), then F.linear in float32."""
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.dequantized(), bias)
