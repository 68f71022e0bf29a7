"""Infini-attention (Munkhdalai et al. 2024, "Leave No Context Behind"): bounded memory, any length.

The input is cut into segments of L = segment_size tokens. Inside a segment, ordinary causal
dot-product attention (A_dot). Across segments, each K/V head keeps a compressive memory
M (hd × hd) and a normaliser z (hd), written once per finished segment and read by every query:

    σ(x)   = ELU(x) + 1                                  (positive, so σ(Q)z > 0 once z ≠ 0)
    A_mem  = σ(Q) M_{s-1} / (σ(Q) z_{s-1})               retrieval: from the memory *before* s
    linear: M_s = M_{s-1} + σ(K)ᵀ V
    delta:  M_s = M_{s-1} + σ(K)ᵀ (V − σ(K) M_{s-1} / (σ(K) z_{s-1}))
            z_s = z_{s-1} + Σ_t σ(K_t)
    A      = sigmoid(β) ⊙ A_mem + (1 − sigmoid(β)) ⊙ A_dot      one learned β per query head

The division guard: M and z start at zero, so the first segment's retrieval is 0/0. Since σ > 0,
σ(Q)z is 0 exactly when nothing was written yet (z = 0), and then σ(Q)M = 0 too; we define that
retrieval as 0 (A_mem = 0: the first segment reads only local attention), by dividing by 1 where
the denominator is 0 — exact, and NaN-free in the backward pass. Every later denominator is a sum
of positive terms and is used as is. The memory is kept and computed in float32 whatever the
model's dtype, autocast switched off around it (its sums grow with the text; bf16 would round
them away).

One code path serves training, recompute and the cache: `infini_attend` walks the new tokens in
chunks that end at segment boundaries, starting from a `SegmentState` (fresh for a forward
without cache, the cache's for generation). A forward over k segments is therefore the same
computation as feeding the segments one by one, and generation keeps only M, z and the current
segment's keys/values: memory bounded by the segment, not by the text.

As a variant (`Infini`): the projections, QK-norm and RoPE are self-attention's own
(attention.SelfAttention), positions restart in each segment, segments decide who sees whom (no
mask), and rows keep their own InfiniCache instead of the engine's static KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quillgpt.config import ModelConfig
from quillgpt.model.attention import LayerInputs, SelfAttention, attend, mask_to_bias
from quillgpt.model.kv_cache import Cache
from quillgpt.model.variants.base import Variant

GATE_LR_MULT = 10.0  # β's learning rate = this × the schedule's: at the base lr the gate barely moves


def sigma(x: Tensor) -> Tensor:
    """The feature map ELU(x) + 1 (> 0 everywhere), in float32."""
    return F.elu(x.float()) + 1.0


def retrieve(sq: Tensor, mem: Tensor, norm: Tensor) -> Tensor:
    """σ(Q) M / (σ(Q) z) for sq (B, H, T, hd), mem (B, KV, hd, hd), norm (B, KV, hd) → (B, H, T, hd).

    Query head h reads memory h // (H / KV) (grouped like GQA); 0 where the memory is empty.
    """
    B, H, T, d = sq.shape
    KV = mem.shape[1]
    sq = sq.reshape(B, KV, H // KV * T, d)  # heads of one group side by side (head-major)
    num = sq @ mem  # (B, KV, G·T, hd)
    den = sq @ norm[..., None]  # (B, KV, G·T, 1)
    den = torch.where(den > 0, den, torch.ones_like(den))  # empty memory: 0 / 1 = 0 (see module doc)
    return (num / den).reshape(B, H, T, -1)


def write(mem: Tensor, norm: Tensor, k: Tensor, v: Tensor, update: str) -> tuple[Tensor, Tensor]:
    """The memory after a finished segment with keys/values k, v (B, KV, L, hd): (M_s, z_s)."""
    sk, v = sigma(k), v.float()
    if update == "delta":  # write only what the memory does not already return for these keys
        v = v - retrieve(sk, mem, norm)
    return mem + sk.transpose(-2, -1) @ v, norm + sk.sum(dim=2)


@dataclass
class SegmentState:
    """One layer's state between chunks: memory, normaliser, and the current segment so far."""

    mem: Tensor  # (B, KV, hd, hd) float32
    norm: Tensor  # (B, KV, hd) float32
    k: Tensor  # (B, KV, n, hd): keys of the n tokens of the unfinished segment
    v: Tensor

    @classmethod
    def empty(cls, B: int, KV: int, hd: int, like: Tensor) -> SegmentState:
        zeros = torch.zeros(B, KV, hd, hd, device=like.device, dtype=torch.float32)
        kv = like.new_zeros(B, KV, 0, hd)
        return cls(zeros, zeros[..., 0].clone(), kv, kv)


def infini_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: SegmentState,
    beta: Tensor,
    segment: int,
    update: str,
    impl: str = "sdpa",
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, SegmentState, list[Tensor]]:
    """q (B, H, T, hd), k, v (B, KV, T, hd) continuing `state` → output (B, H, T, hd), new state,
    and with need_weights per chunk the (B, H, m, n+m) dot-attention weights."""
    T, gate = q.shape[2], torch.sigmoid(beta.float()).view(1, -1, 1, 1)  # (1, H, 1, 1)
    outs, weights, t = [], [], 0
    while t < T:
        n = state.k.shape[2]
        m = min(segment - n, T - t)  # up to the end of the current segment
        qc = q[:, :, t : t + m]
        ks = torch.cat([state.k.to(k.dtype), k[:, :, t : t + m]], dim=2)  # (B, KV, n+m, hd)
        vs = torch.cat([state.v.to(v.dtype), v[:, :, t : t + m]], dim=2)
        mask = None  # n == 0: plain causal over the chunk
        if n > 0:  # query i of the chunk sits at n+i in the segment
            allowed = torch.arange(n + m, device=q.device)[None, :] <= n + torch.arange(m, device=q.device)[:, None]
            mask = mask_to_bias(allowed, q.dtype)
        a_dot, w = attend(qc, ks, vs, mask, impl, dropout_p, need_weights)
        with torch.autocast(q.device.type, enabled=False):  # the memory's sums stay in fp32
            a_mem = retrieve(sigma(qc), state.mem, state.norm)
        outs.append((gate * a_mem + (1 - gate) * a_dot.float()).to(q.dtype))
        if need_weights:
            weights.append(w)
        if n + m == segment:  # segment finished: write it, start the next one empty
            with torch.autocast(q.device.type, enabled=False):
                mem, norm = write(state.mem, state.norm, ks, vs, update)
            state = SegmentState(mem, norm, ks[:, :, :0], vs[:, :, :0])
        else:
            state = SegmentState(state.mem, state.norm, ks, vs)
        t += m
    return torch.cat(outs, dim=2), state, weights


class InfiniCache:
    """Generation state of every layer: memory + normaliser + the current segment's keys/values.

    Its size depends on the segment, never on how many tokens went through it. Rows move in
    lockstep (the engine gives each row its own cache); `seen` counts the tokens written, and a
    forward's positions must continue from it.
    """

    def __init__(
        self,
        n_layer: int,
        rows: int,
        kv_heads: int,
        head_dim: int,
        segment: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        self.mem = torch.zeros(n_layer, rows, kv_heads, head_dim, head_dim, device=device)
        self.norm = torch.zeros(n_layer, rows, kv_heads, head_dim, device=device)
        self.k = torch.zeros(n_layer, rows, kv_heads, segment, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.segment = segment
        self.seen = 0  # tokens written since the last reset

    @property
    def kv_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def memory_bytes(self) -> int:
        return self.mem.nbytes + self.norm.nbytes

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + self.memory_bytes

    @property
    def n(self) -> int:
        """Tokens of the unfinished segment held in k/v."""
        return self.seen % self.segment

    def reset(self, row: int | None = None) -> None:
        if row is not None and self.mem.shape[1] != 1:
            raise ValueError("an InfiniCache resets all its rows together (rows move in lockstep)")
        self.mem.zero_()
        self.norm.zero_()
        self.seen = 0

    def plan(self, pos: Tensor, rows: Tensor | None = None) -> int:
        """T new tokens at absolute positions pos (B or 1, T), continuing the cache: returns how
        many tokens of the unfinished segment every layer's state holds before them."""
        if rows is not None and len(rows) != self.mem.shape[1]:
            raise ValueError("an InfiniCache takes all its rows at once (rows move in lockstep)")
        start = int(pos[0, 0])
        if start != self.seen:
            raise ValueError(
                f"positions must continue the Infini-attention cache: it holds {self.seen} tokens, the new ones start at {start}"
            )
        n = self.seen % self.segment
        self.seen += pos.shape[1]
        return n

    def layer_state(self, layer: int, n: int) -> SegmentState:
        return SegmentState(self.mem[layer], self.norm[layer], self.k[layer, :, :, :n], self.v[layer, :, :, :n])

    def store(self, layer: int, state: SegmentState) -> None:
        n = state.k.shape[2]
        self.mem[layer].copy_(state.mem)
        self.norm[layer].copy_(state.norm)
        self.k[layer, :, :, :n] = state.k
        self.v[layer, :, :, :n] = state.v


class InfiniAttention(SelfAttention):
    """Self-attention's projections (same names, so weights are interchangeable with causal
    attention's) with a compressive memory across segments and one gate β per query head
    (initially 0: half/half)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.segment, self.update = cfg.segment_size, cfg.memory_update
        self.beta = nn.Parameter(torch.zeros(cfg.n_head))

    def forward(self, x: Tensor, inputs: LayerInputs | None = None, layer: int = 0) -> tuple[Tensor, Tensor | None]:
        """x (B, T, C) → (B, T, C); with need_weights (no cache) also the (B, H, T, T) dot-attention
        weights, block-diagonal by segment. The mask is unused: segments decide who sees whom."""
        inputs = inputs or LayerInputs()
        q, k, v = self.qkv(x, inputs.rope)
        cache = inputs.cache
        state = SegmentState.empty(x.shape[0], self.kv_heads, self.head_dim, k) if cache is None else cache.layer_state(layer, inputs.plan)
        need_weights = inputs.need_weights and cache is None  # the maps of one forward from an empty state
        y, state, chunks = infini_attend(q, k, v, state, self.beta, self.segment, self.update, self.impl, self.dropout_p, need_weights)
        if cache is not None:
            cache.store(layer, state)
        return self.out(y), _block_diagonal(chunks, x.shape[1]) if need_weights else None


def _block_diagonal(chunks: list[Tensor], T: int) -> Tensor:
    """Per-segment weights (B, H, m, m) of a forward from an empty state → one (B, H, T, T)."""
    B, H = chunks[0].shape[:2]
    out = chunks[0].new_zeros(B, H, T, T)
    t = 0
    for w in chunks:
        m = w.shape[2]
        out[:, :, t : t + m, t : t + m] = w
        t += m
    return out


def gate_values(model: nn.Module) -> list[Tensor]:
    """Per layer, sigmoid(β) of each head: the share of its output read from memory."""
    return [torch.sigmoid(m.beta.detach().float()).cpu() for m in model.modules() if isinstance(m, InfiniAttention)]


def is_gate(name: str) -> bool:
    """True for the parameter names of the memory gates β (their own lr, no weight decay)."""
    return name.endswith("attn.beta")


class Infini(Variant):
    name = "infini"
    static_cache = False  # each row keeps its own memory
    shares_prefix_keys = False  # a segment's memory is per row
    hf_exportable = False

    def attention(self, cfg: ModelConfig) -> nn.Module:
        return InfiniAttention(cfg)

    def span(self, cfg: ModelConfig) -> int:
        return cfg.segment_size  # the dot-product part; the memory sees everything before

    def plan(
        self, pos: Tensor | None, cache: Cache | None, rows: Tensor | None, span: int, prefix_len: Tensor | None, dtype: torch.dtype
    ) -> tuple[Tensor | None, object]:
        return None, (cache.plan(pos, rows) if cache is not None else None)  # no mask: segments decide

    def embed_positions(self, cfg: ModelConfig, pos: Tensor) -> Tensor:
        """Positions restart in every segment: memory carries no positions, so a text of any
        length needs only `segment_size` of them."""
        return pos % cfg.segment_size

    def crops(self, cfg: ModelConfig) -> bool:
        return False  # positions restart in each segment: nothing is ever cropped

    def context(self, cfg: ModelConfig, span: int) -> int | None:
        return None  # the memory holds every earlier token

    def make_cache(
        self, cfg: ModelConfig, rows: int, capacity: int, span: int, device: torch.device | str, dtype: torch.dtype
    ) -> InfiniCache:
        return InfiniCache(cfg.n_layer, rows, cfg.kv_heads, cfg.head_size, cfg.segment_size, device, dtype)

    def shows(self, model: nn.Module) -> dict[str, Any]:
        return {"gates": gate_values(model)}
