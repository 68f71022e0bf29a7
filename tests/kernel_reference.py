"""The plain computation the int16-activation kernels (group_gemv, group_gemv4) are checked
against, in float64: a layer that rounds its input as they do (support.kernel_rounded)."""

import torch
import torch.nn.functional as F
from support import kernel_rounded
from torch import nn


class Int16Reference(nn.Module):
    """A group_gemv4 layer, or an int8 layer through group_gemv, computed in float64 from its
    dequantized weights: Σ q·s·x̃ + o·Σx, with x̃ x rounded to int16 per block of 32 as the kernels
    round it at every row count, the offsets times x's float sums."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        w = layer.dequantized().double()
        offset = getattr(layer, "offset", None)  # (out, in / group), or None (per channel: 0)
        o = torch.zeros_like(w) if offset is None else offset.double().repeat_interleave(w.shape[1] // offset.shape[1], 1)
        self.scaled, self.offsets, self.bias = w - o, o, layer.bias
        self.rows = layer.rows  # a tied head's embedding lookup reads the layer's own rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = F.linear(kernel_rounded(x2), self.scaled) + F.linear(x2.double(), self.offsets)
        y = y.float() if self.bias is None else (y + self.bias.double()).float()
        return y.view(*x.shape[:-1], -1)


def with_references(model: nn.Module, layers: dict[str, nn.Module]) -> nn.Module:
    """`model` with each named layer replaced by its Int16Reference (in place; returned)."""
    for name, layer in layers.items():
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, Int16Reference(layer))
    return model
