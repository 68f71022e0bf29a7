"""LoRA (Hu et al. 2021): a frozen linear W plus a trainable low-rank update on some of its rows,

    y = W x + b + (alpha / rank) · B (A x)        A (rank, in), B (rows, rank), B = 0 at init,

so a model with fresh adapters computes exactly what its base computes, and training changes
only A and B: rank·(in + rows) numbers per adapter instead of rows·in.

`lora.targets` names the linears by what they do. The blocks' q, k and v come out of one fused
projection, attn.c_attn, whose output rows are [q heads | k heads | v heads]: target "q" puts an
adapter on the q rows only (the k and v rows stay the base's), "q" and "v" one adapter on each.
"o" is attn.c_proj, "mlp" both of the MLP's linears (c_fc, c_proj). A wrapped linear keeps the
base's parameter names (…c_attn.weight) and adds …c_attn.lora_A.q / lora_B.q, and the blocks call
it as they call any linear. For use, the adapters are merged into W (`merge_adapters`): the
model is a plain GPT again, as fast as its base.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quillgpt.config import LoraConfig, ModelConfig

Slots = dict[str, tuple[int, int]]  # adapter name → the output rows [lo, hi) it updates


def lora_slots(cfg: ModelConfig, targets: list[str]) -> dict[str, Slots]:
    """Each targeted linear of a block (its path inside the block) → its adapters' rows."""
    q, kv = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
    fused = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}  # c_attn: [q | k | v]
    fc_rows = (2 if cfg.gated_mlp else 1) * cfg.hidden_dim
    slots: dict[str, Slots] = {}
    if attn := {name: rows for name, rows in fused.items() if name in targets}:
        slots["attn.c_attn"] = attn
    if "o" in targets:
        slots["attn.c_proj"] = {"o": (0, cfg.n_embd)}
    if "mlp" in targets:
        slots["mlp.c_fc"] = {"mlp": (0, fc_rows)}
        slots["mlp.c_proj"] = {"mlp": (0, cfg.n_embd)}
    return slots


def is_adapter(name: str) -> bool:
    """A LoRA parameter's state-dict name (…lora_A.q, …lora_B.mlp)."""
    return ".lora_A." in name or ".lora_B." in name


class LoRALinear(nn.Module):
    """A base linear's weight and bias (frozen, same names) plus one adapter per slot of rows."""

    def __init__(self, base: nn.Linear, slots: Slots, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.slots, self.scale, self.out_features = dict(sorted(slots.items(), key=lambda s: s[1])), alpha / rank, base.out_features
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.ParameterDict({n: nn.Parameter(torch.empty(rank, base.in_features, **like)) for n in self.slots})
        self.lora_B = nn.ParameterDict({n: nn.Parameter(torch.zeros(hi - lo, rank, **like)) for n, (lo, hi) in self.slots.items()})
        for a in self.lora_A.values():  # as nn.Linear initialises a weight; B = 0 makes the update 0
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        """x (…, in) → W x + b + scale · B(A x) added onto each slot's rows (…, out), in place: no
        zero blocks, concatenation or scaled copy of the whole output (the base's linear needs
        its input and weight for backward, not its output)."""
        y = F.linear(x, self.weight, self.bias)
        h = self.lora_dropout(x)
        for name, (lo, hi) in self.slots.items():
            y[..., lo:hi].add_(F.linear(F.linear(h, self.lora_A[name]), self.lora_B[name]), alpha=self.scale)
        return y


def add_lora(model: nn.Module, lora: LoraConfig) -> None:
    """Wrap the targeted linears of every block (model.transformer.h) and freeze everything but
    the adapters, in place. A's are drawn from torch's current random stream."""
    for block in model.transformer.h:
        for path, slots in lora_slots(model.config, lora.targets).items():
            parent_path, name = path.rsplit(".", 1)
            parent = block.get_submodule(parent_path)
            setattr(parent, name, LoRALinear(getattr(parent, name), slots, lora.rank, lora.alpha, lora.dropout))
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))


def adapter_shapes(cfg: ModelConfig, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """The state-dict name and shape of every adapter tensor a model of `cfg` gets."""
    shapes = {}
    inputs = {"attn.c_attn": cfg.n_embd, "attn.c_proj": cfg.n_head * cfg.head_size, "mlp.c_fc": cfg.n_embd, "mlp.c_proj": cfg.hidden_dim}
    for i in range(cfg.n_layer):
        for path, slots in lora_slots(cfg, lora.targets).items():
            for name, (lo, hi) in slots.items():
                shapes[f"transformer.h.{i}.{path}.lora_A.{name}"] = (lora.rank, inputs[path])
                shapes[f"transformer.h.{i}.{path}.lora_B.{name}"] = (hi - lo, lora.rank)
    return shapes


def adapter_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter tensors of a LoRA model's state dict (what a LoRA run saves)."""
    return {n: t for n, t in state.items() if is_adapter(n)}


@torch.no_grad()
def merge_adapters(
    weights: dict[str, Tensor], adapters: dict[str, Tensor], cfg: ModelConfig, lora: LoraConfig, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """A base's state dict with each adapter folded into its weight, W[rows] += scale · B A
    (computed in fp32, stored in `dtype`, else the weight's own): the weights of a plain GPT that
    computes what base + adapters compute. `weights` is updated in place and returned."""
    scale = lora.alpha / lora.rank
    for i in range(cfg.n_layer):
        for path, slots in lora_slots(cfg, lora.targets).items():
            prefix = f"transformer.h.{i}.{path}"
            w = weights[f"{prefix}.weight"].float()  # a copy when the base is not fp32
            w = w.clone() if w is weights[f"{prefix}.weight"] else w
            for name, (lo, hi) in slots.items():
                a, b = adapters[f"{prefix}.lora_A.{name}"].float(), adapters[f"{prefix}.lora_B.{name}"].float()
                w[lo:hi] += scale * (b @ a)
            weights[f"{prefix}.weight"] = w.to(dtype or weights[f"{prefix}.weight"].dtype)
    return weights
