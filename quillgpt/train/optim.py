"""Optimizers: AdamW (decay on matrices only), or Muon for the hidden matrices with AdamW for the rest.

Muon (`torch.optim.Muon`: Nesterov momentum, then a Newton–Schulz orthogonalisation of the update)
takes 2-D parameters only and is meant for the matrices inside the blocks; the embeddings, the head,
norm gains and biases stay with AdamW, as in Keller Jordan's modded-nanogpt speedruns.
`train.optimizer=muon` turns it on; its lr is `train.muon_lr`, scaled by the same schedule.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from quillgpt.config import TrainConfig
from quillgpt.device import cpu_has_bf16
from quillgpt.errors import QuillError
from quillgpt.model.variants.infini import GATE_LR_MULT, is_gate


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """The parameters Muon takes: 2-D weights inside the blocks (attention and MLP projections)."""
    return p.dim() == 2 and name.startswith("transformer.h.") and not is_gate(name)


def adamw_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not norms, biases or gains). Infini-attention's gates β get
    their own group: no decay, lr × infini.GATE_LR_MULT (the loop applies lr_mult)."""
    params = [p for n, p in named if not is_gate(n)]
    gates = [p for n, p in named if is_gate(n)]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return groups + ([{"params": gates, "weight_decay": 0.0, "lr_mult": GATE_LR_MULT}] if gates else [])


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """≈ the orthogonal factor UVᵀ of each matrix g = USVᵀ ((m, n), or a batch (k, m, n)) by a
    quintic Newton–Schulz iteration in `dtype`: torch.optim.Muon's iteration, step for step (for
    one 2-D matrix bit-identical in bfloat16, its fixed choice)."""
    a, b, c = coefficients
    mm = torch.addmm if g.dim() == 2 else torch.baddbmm
    wide = g.size(-2) <= g.size(-1)
    x = g.to(dtype) if wide else g.to(dtype).mT  # iterate on the smaller Gram matrix
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm ≤ 1
    for _ in range(steps):
        gram = x @ x.mT
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.mT


class Muon(torch.optim.Muon):
    """torch.optim.Muon (default "original" lr adjustment) with the Newton–Schulz iteration in
    `ns_dtype`, batched over matrices of one shape. torch runs it in bfloat16, which CPUs without
    bf16 units emulate, many times slower than fp32. One batched iteration per shape (a model has
    four shapes, n_layer matrices each) instead of one per matrix saves a step's small calls
    (scripts/bench.py's recipe group times both; docs/performance.md has the figures)."""

    def __init__(self, params: Any, ns_dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad)) for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
            updates = torch._foreach_lerp(grads, bufs, group["momentum"]) if group["nesterov"] else bufs
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            for same in _by_shape(params).values():
                g = torch.stack([updates[i] for i in same])
                ortho = newton_schulz(g, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                rows, cols = g.shape[-2:]
                scale = -group["lr"] * math.sqrt(max(1, rows / cols))
                torch._foreach_add_([params[i] for i in same], list(ortho.to(g.dtype).unbind(0)), alpha=scale)


def _by_shape(params: list[torch.Tensor]) -> dict[torch.Size, list[int]]:
    """Indices of `params` grouped by shape, in first-seen order."""
    groups: dict[torch.Size, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p.shape, []).append(i)
    return groups


class MuonAdamW:
    """Muon for the hidden matrices and AdamW for everything else, stepped as one optimizer: the
    loop sets each group's lr (× its lr_mult), GradScaler steps it, checkpoints save its state."""

    def __init__(self, adamw: torch.optim.AdamW, muon: Muon) -> None:
        self.adamw, self.muon = adamw, muon

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.adamw.param_groups + self.muon.param_groups

    def step(self, closure: None = None) -> None:
        self.adamw.step()
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"adamw", "muon"}:
            raise QuillError("the checkpoint's optimizer state is not train.optimizer=muon's; resume with the run's own config.yaml")
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW | MuonAdamW:
    """train.optimizer: adamw, or muon (hidden matrices) + adamw (the rest). Muon orthogonalises
    in bf16 where the device multiplies it in hardware (as torch does), else in fp32."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fused = device.type in ("cuda", "cpu")
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(adamw_groups(named, cfg.weight_decay), lr=cfg.learning_rate, betas=betas, fused=fused)
    rest = [(n, p) for n, p in named if not is_hidden_matrix(n, p)]
    adamw = torch.optim.AdamW(adamw_groups(rest, cfg.weight_decay), lr=cfg.learning_rate, betas=betas, fused=fused)
    matrices = [p for n, p in named if is_hidden_matrix(n, p)]
    group = {"params": matrices, "lr_mult": cfg.muon_lr / cfg.learning_rate}  # follows the schedule
    # decoupled decay shrinks by lr·λ per step: scaled so a matrix shrinks by what AdamW's would
    decay = cfg.weight_decay * cfg.learning_rate / cfg.muon_lr
    ns_dtype = torch.bfloat16 if device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16()) else torch.float32
    muon = Muon([group], ns_dtype, lr=cfg.muon_lr, weight_decay=decay, momentum=cfg.muon_momentum)
    return MuonAdamW(adamw, muon)
