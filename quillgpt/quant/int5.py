"""int5: int8's layer and kernels over 32 levels instead of 256. Each group of 32 weights of a row
keeps codes in [-16, 15] with an fp16 scale and offset (symmetric or over its range, as int8's),
so llama.cpp's Q5_0 and Q5_K blocks are int5 exactly (up to Q5_K's fp16 rounding). In memory the
codes are int8's (the int8 kernels run them unchanged); a run stores them in 5 bits, a nibble and
a bit plane, 24 bytes per 32 weights with the scale and offset (int8: 36), so an imported Q5 file
stays about its size (interop/gguf_import.py).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from quillgpt.quant import int8
from quillgpt.quant.int8 import TOLERANCES, Int8Linear
from quillgpt.quant.plan import KernelPlan
from quillgpt.quant.scheme import Packed, Scheme

BITS = 5
LOW = -(2 ** (BITS - 1))  # the smallest code; stored as code - LOW in [0, 31]


def pack(w: Tensor, group: int) -> Packed:
    return int8.pack(w, group, BITS)


def linear(lin: nn.Linear, group: int, kernel: str | None = None) -> Int8Linear:
    return Int8Linear.from_linear(lin, KernelPlan((1,), (kernel or "dequant/model",)), group, BITS)


def store(packed: Packed) -> Packed:
    """int8's stored form with the codes in 5 bits: "codes" the low nibbles of code + 16, two a byte
    (low nibble first), "high" their fifth bits, eight a byte (the first weight in bit 0). A few
    rows at a time: an embedding's temporaries stay small."""
    codes = packed["codes"]
    if codes.min() < LOW or codes.max() > -LOW - 1:
        raise ValueError(f"int5 codes must lie in [{LOW}, {-LOW - 1}]")
    n, k = codes.shape
    low, high = torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, k // 8, dtype=torch.uint8)
    shifts, step = torch.arange(8, dtype=torch.uint8), max(1, (1 << 20) // max(k, 1))
    for r in range(0, n, step):
        u = (codes[r : r + step] - LOW).view(torch.uint8)  # [0, 31]: no int8 overflow
        low[r : r + step] = u[:, 0::2] & 15 | (u[:, 1::2] & 15) << 4
        high[r : r + step] = ((u >> 4).view(-1, k // 8, 8) << shifts).sum(-1, dtype=torch.uint8)
    return {**int8.store(packed), "codes": low, "high": high}


def codes_of(stored: Packed) -> Tensor:
    """store's 5-bit codes → int8 codes (out, in) in [-16, 15], a few rows at a time (an embedding's
    temporaries stay small)."""
    low, high = stored["codes"], stored["high"]
    n, half = low.shape
    out = torch.empty(n, 2 * half, dtype=torch.int8)
    shifts, step = torch.arange(8, dtype=torch.uint8), max(1, (1 << 20) // max(2 * half, 1))
    for r in range(0, n, step):
        lo, hi = low[r : r + step], high[r : r + step]
        u = torch.stack([lo & 15, lo >> 4], dim=-1).view(len(lo), 2 * half)
        fifth = ((hi[:, :, None] >> shifts) & 1).view(len(lo), 2 * half)
        out[r : r + step] = (u | fifth << 4).view(torch.int8) + LOW
    return out


def stored_shapes(out_features: int, in_features: int, group: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    shapes = int8.stored_shapes(out_features, in_features, group)
    shapes["codes"] = (torch.uint8, (out_features, in_features // 2))
    return {**shapes, "high": (torch.uint8, (out_features, in_features // 8))}


def load(stored: Packed, bias: Tensor | None, dtype: torch.dtype) -> Int8Linear:
    rest = {k: v for k, v in stored.items() if k != "high"}
    return int8.load({**rest, "codes": codes_of(stored)}, bias, dtype, BITS)


INT5 = Scheme(
    "int5",
    "int8's kernels over 32 levels a group (a scale and an offset per 32 weights; stored in 5 bits), llama.cpp's Q5 blocks exactly",
    BITS,
    32,
    Int8Linear,
    linear,
    functools.partial(int8.convert, bits=BITS),
    int8.note,
    pack,
    int8.unpack,
    TOLERANCES,
    store,
    stored_shapes,
    load,
)
