"""int8's kernels: (x (M, K), weight int8 (N, K), scale (N,) or (N, K/G), offset None or (N, K/G))
→ (M, N), x cast to the scale's dtype; W = q·s per output channel, or q·s + o per group of G
inputs. Each comes with the shapes it takes (`Kernel.fits`) and what runs where it cannot; which
one runs an input of m rows is the layer's plan (quant/plan.py).

On CUDA the dequantize form is gpt-fast's; it pays there once the decode step is compiled
(inductor fuses the dequantization into the matmul), which the engine's compile=True does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from quillgpt import native
from quillgpt.model.fusion import stored

Offset = Tensor | None
# group-wise layers of a compiled step with this many rows or fewer: group_gemv where it builds, else
# grouped_sum (past it inductor chose a far slower loop order: docs/kernels.md)
FUSED_ROWS = 8


def int8pack_mm(x: Tensor, weight: Tensor, scale: Tensor, offset: Offset = None) -> Tensor:
    """torch's int8 × bf16/fp16/fp32 matmul with one scale per output channel. Group-wise scales
    (N, K/G): the kernel multiplies x spread over K/G rows, row g keeping only group g's inputs,
    by the weight with unit scales (one pass over the weight, K/G times the multiply-adds); each
    group's partial sums are scaled and added, and each group's offset times its inputs' sum."""
    x = x.to(scale.dtype).contiguous()  # .to keeps x's strides: a transposed x's spread would not view
    if scale.dim() == 1:
        return _int8pack(x, weight, scale)
    (m, k), groups = x.shape, scale.shape[1]
    xg = x.view(m, 1, groups, k // groups)
    spread = (xg * torch.eye(groups, dtype=x.dtype, device=x.device)[:, :, None]).view(m * groups, k)
    parts = _int8pack(spread, weight, torch.ones_like(scale[:, 0])).view(m, groups, -1)
    y = torch.einsum("mgn,ng->mn", parts.float(), scale.float())
    if offset is not None:
        y = y + xg[:, 0].float().sum(-1) @ offset.float().t()
    return y.to(scale.dtype)


def _int8pack(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    x = x.contiguous()
    # its bf16/fp16 SIMD loads are aligned: a view into a larger tensor gets a fresh copy (compiled: no
    # address to test while tracing, so always; a decode step's x is one row per sequence)
    if torch.compiler.is_compiling() or x.data_ptr() % 64:
        x = x.clone()
    return torch._weight_int8pack_mm(x, weight, scale)


def dequant_linear(x: Tensor, weight: Tensor, scale: Tensor, offset: Offset = None) -> Tensor:
    if scale.dim() == 1:
        return F.linear(x.to(scale.dtype), weight.to(scale.dtype)) * scale
    n, k = weight.shape
    w = weight.view(n, scale.shape[1], -1).to(scale.dtype) * scale[:, :, None]
    if offset is not None:
        w = w + offset[:, :, None]
    return F.linear(x.to(scale.dtype), w.view(n, k))


def gemv_linear(x: Tensor, weight: Tensor, scale: Tensor, offset: Offset = None) -> Tensor:
    """quillgpt/native's C++ kernel: weights in groups of a multiple of 32 (per channel: one
    group a row, offsets 0) with fp16 scales and offsets (Int8Linear's scale_half, offset_half: empty
    where every offset is 0), x
    rounded to int16 per 32 inputs and multiplied in integer pairs; float32 out."""
    assert offset is not None and scale.dtype == torch.float16, "group_gemv takes (out, groups) fp16 scales and offsets"
    return native.group_gemv(x.float(), weight, scale, offset)


def grouped_sum(x: Tensor, weight: Tensor, scale: Tensor, offset: Offset = None) -> Tensor:
    """Σ_k x·(q·s + o) written as elementwise products and a sum over each output's inputs: no
    kernel of its own, but inside a compiled step inductor fuses it into one loop that reads each
    int8 weight once and dequantizes it in registers (eager, it would build an (M, N, K) product:
    never taken there). Two forms of one sum: on AVX-512 int8 lanes load directly; elsewhere
    the int8 weights are read four to a 32-bit word (_packed_sum)."""
    x = x.float()
    x = stored(x)  # else inductor recomputes x's producer (an RMSNorm) for every weight: 2-3x slower
    if PACKED_LOADS and (weight.shape[1] // scale.shape[1]) % 4 == 0:  # whole words per group
        return _packed_sum(x, weight, scale.float(), offset)
    n, k = weight.shape
    groups = scale.shape[1]
    w = weight.view(n, groups, k // groups).float() * scale.float()[:, :, None]
    if offset is not None:
        w = w + offset.float()[:, :, None]
    return (w * x.view(-1, 1, groups, k // groups)).sum((-1, -2))


# Whether grouped_sum reads int8 weights four to a 32-bit word. Inductor loads a vector of int8
# weights (8 of a 32-lane register on AVX2) as a partial load, which AVX-512 masks but AVX2's at::vec
# copies through the stack, several times slower than the packed form (docs/kernels.md).
PACKED_LOADS = sys.byteorder == "little" and torch.backends.cpu.get_cpu_capability() != "AVX512"


def _packed_sum(x: Tensor, weight: Tensor, scale: Tensor, offset: Offset) -> Tensor:
    """grouped_sum with weight (N, K) int8 read as (N, K/4) words: loaded as float bits (a full
    vector load; int32's partial load is AVX2's slow path), cast to int32 in registers, and byte j
    of word i (weight[4i + j], little-endian) sign-extended by two shifts. x is regrouped to match:
    xt[j, g, i] = x[g·G + 4i + j]; the offset term Σ_i o·Σ_j xt rides in the same sum."""
    n, k = weight.shape
    groups = scale.shape[1]
    per = k // groups // 4  # words per group
    words = weight.view(torch.float32).view(n, groups, per).view(torch.int32)
    xt = x.view(-1, groups, per, 4).permute(0, 3, 1, 2).contiguous()  # (M, 4, groups, per)
    xt = stored(xt)
    part = sum(((words << (24 - 8 * j)) >> 24).float() * xt[:, j, None] for j in range(4))  # (M, N, groups, per)
    part = part * scale[:, :, None]
    if offset is not None:
        part = part + offset.float()[:, :, None] * xt.sum(1)[:, None]
    return part.sum((-1, -2))


def int8pack_fits(out_features: int, in_features: int, group: int = 0) -> bool:
    """Whether torch._weight_int8pack_mm can take the shape: its bf16/fp16 path reads each row of
    x and of the weight in aligned SIMD blocks of 8 (AVX2, NEON) or 16 (AVX-512) values with no
    tail loop, so in_features must be a multiple of 16, else it reads past the row or faults on a
    misaligned load (a segfault). Its fp32 path is a plain loop, but a model converted to bf16
    after quantizing would take the other, so the rule holds for both."""
    return in_features % 16 == 0


def any_shape(out_features: int, in_features: int, group: int = 0) -> bool:
    return True


def gemv_fits(out_features: int, in_features: int, group: int = 0) -> bool:
    """group_gemv takes layers whose group (per channel: the whole row) is a multiple of 32, where
    its C++ kernel builds on this machine (the first call builds it: tens of seconds, then cached by torch)."""
    width = group or in_features
    return width % native.BLOCK == 0 and in_features % width == 0 and native.available()


@dataclass(frozen=True)
class Kernel:
    """A matmul, whether it takes bf16 activations (the bf16 scales; else the model's dtype), and
    which (out_features, in_features) it can take: a layer it cannot take runs `fallback` instead,
    decided when the layer is made, before any call (a kernel given a bad shape can crash the process)."""

    matmul: Callable[[Tensor, Tensor, Tensor, Offset], Tensor]
    bf16: bool
    fits: Callable[[int, int, int], bool]  # (out_features, in_features, group: 0 per channel)
    fallback: str
    rounding: float = 1e-6  # the relative error of its activations' rounding (bf16: 2**-8)
    half: bool = False  # group_gemv: the fp16 copies of the scales and offsets (scale_half, offset_half),
    # and the codes as Int8Linear keeps them for it (native.interleave's layout); the others take codes()


# name → Kernel; "/bf16": bf16 activations, "/model": the model's dtype
KERNELS: dict[str, Kernel] = {
    "int8pack_mm/bf16": Kernel(int8pack_mm, True, int8pack_fits, "dequant/bf16", 2**-8),
    "int8pack_mm/model": Kernel(int8pack_mm, False, int8pack_fits, "dequant/model"),
    "dequant/bf16": Kernel(dequant_linear, True, any_shape, "dequant/bf16", 2**-8),
    "dequant/model": Kernel(dequant_linear, False, any_shape, "dequant/model"),
    "group_gemv": Kernel(gemv_linear, False, gemv_fits, "dequant/model", 1e-4, half=True),  # x to int16 per 32: ~2e-5
}
