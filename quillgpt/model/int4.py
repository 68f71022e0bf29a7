"""Weight-only int4: each group of G weights along a row keeps 16 levels between its own minimum
and maximum, W ≈ (q - 8)·s + z with one bf16 scale s and zero z per group (gpt-fast's and torch's
"tinygemm" layout), so a decode step streams about a seventh of fp32's weight bytes.

On the CPU the matmul is torch's `_weight_int4pack_mm_for_cpu` (bf16 activations, the weight
repacked once by `_convert_weight_to_int4pack_for_cpu`); it takes out_features a multiple of 16
and G in 32/64/128/256 dividing in_features, and it measured the fastest weight-only kernel on
an AVX2 EPYC (scripts/bench_real.py). Elsewhere, or for a shape it cannot take, the layer keeps
its 4-bit codes two to a byte and dequantizes them before F.linear (slow, exact to the same
rounding). A layer whose width no group divides is not quantized (quant.quantize keeps it float).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUPS = (32, 64, 128, 256)  # what the kernel takes


def group_for(in_features: int, group: int) -> int:
    """The largest kernel group ≤ `group` that divides in_features (0: none does)."""
    return next((g for g in sorted(GROUPS, reverse=True) if g <= group and in_features % g == 0), 0)


def kernel_fits(out_features: int, in_features: int, group: int) -> bool:
    """Whether `_weight_int4pack_mm_for_cpu` takes the shape (it raises otherwise: checked first)."""
    return out_features % 16 == 0 and group in GROUPS and in_features % group == 0


def int4_codes(w: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """(q (out, in) int32 in [0, 15], scales_zeros (in / group, out, 2) bf16) with
    w ≈ (q - 8)·s + z per group: s = (max - min) / 15 and z = min + 8·s over each group's weights,
    both rounded to bf16 first so q rounds against the values the kernel multiplies by."""
    out, inp = w.shape
    wg = w.detach().float().view(out, inp // group, group)
    low, high = wg.amin(dim=2), wg.amax(dim=2)
    scale = ((high - low) / 15).to(torch.bfloat16).float()
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((wg - zero[:, :, None]) / safe[:, :, None] + 8).clamp_(0, 15)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return q.view(out, inp).to(torch.int32), scales_zeros


def dequantize(q: Tensor, scales_zeros: Tensor, group: int) -> Tensor:
    """(out, in) float32 (q - 8)·s + z: the weight an int4 layer multiplies by."""
    out, inp = q.shape
    s, z = scales_zeros.float().unbind(-1)  # (in / group, out) each
    return ((q.float().view(out, inp // group, group) - 8) * s.t()[:, :, None] + z.t()[:, :, None]).view(out, inp)


class Int4Linear(nn.Module):
    """y = x·Wᵀ + b with W from 4-bit codes and a bf16 scale and zero per `group` inputs of a row.
    The same call as nn.Linear: (…, in) → (…, out) in x's dtype."""

    def __init__(self, linear: nn.Linear, group: int) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.group = group
        q, scales_zeros = int4_codes(linear.weight, group)
        self.kernel = linear.weight.device.type == "cpu" and kernel_fits(self.out_features, self.in_features, group)
        if self.kernel:
            codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)  # the kernel's own layout
        else:
            codes = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)  # two codes a byte, low nibble first
        self.register_buffer("codes", codes)
        self.register_buffer("scales_zeros", scales_zeros)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def _scales_zeros(self) -> Tensor:
        sz = self.scales_zeros  # a model cast to another dtype casts this buffer too; the kernel takes bf16
        return sz if sz.dtype == torch.bfloat16 else sz.to(torch.bfloat16)

    def dequantized(self) -> Tensor:
        """(out, in) float32: the weight this layer multiplies by (read back through the kernel
        on the identity where the codes are in its layout: exact, bf16 values)."""
        if self.kernel:
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.codes.device)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.codes, self.group, self._scales_zeros()).float().t()
        low, high = self.codes & 15, self.codes >> 4
        q = torch.stack([low, high], dim=-1).view(self.out_features, self.in_features)
        return dequantize(q, self.scales_zeros, self.group)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.kernel:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), self.codes, self.group, self._scales_zeros())
        else:
            y = F.linear(x2.float(), self.dequantized().to(x2.device))
        y = y.to(x.dtype) if self.bias is None else self.bias + y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        how = "int4pack_mm" if self.kernel else "dequantize"
        shape = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        return f"{shape}, int4, {self.group} per scale, {how}"


class Bf16Linear(nn.Module):
    """nn.Linear with its weight kept in bf16 (a copy: a tied head leaves its embedding as it
    was), x cast to bf16 for the matmul and the product back to x's dtype: half fp32's bytes."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16, copy=True))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> Tensor:
        return self.weight.float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, bf16"
