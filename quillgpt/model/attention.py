"""Causal self-attention (MHA / GQA / MQA, sliding window, RoPE) and its KV cache.

The textbook form is one `Head` per head — key/query/value projections, a causal mask,
softmax(QK^T/√d_k)·V — concatenated and projected (tests/test_attention.py keeps that form as
the reference). Here all heads come out of one fused projection `c_attn` and run as one batched
matmul, which is the same computation, only faster.

Who may attend to whom is decided by *positions*, not by indices, in one rule shared by every
path (training, recompute, KV cache, left-padded batches):

    the query at position p sees the keys at positions (p - span, p] that are ≥ 0,
    span = min(window, block_size); a query at a negative position (left padding) sees only itself.

So a left-padded row gives its pad tokens negative positions and they never influence it, and a
ring-buffer cache that holds the last `span` keys is exact, however long generation runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quillgpt.config import ModelConfig

EMPTY_POS = -(2**62)  # position of a cache slot that holds no key yet: matches no query


def rope_cos_sin(pos: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin of the RoPE angles pos·θ^(-2i/d) for any (…) integer positions → (…, head_dim).

    One function for the precomputed table and for explicit positions, so both give the same bits.
    """
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    angles = pos.to(torch.float32)[..., None] * inv_freq  # (..., hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., hd): the two halves rotate as pairs
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[i], x[i + d/2]) of q or k (B, H, T, hd) by their position's angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).type_as(x)


def attention_mask(q_pos: Tensor, k_pos: Tensor, span: int) -> Tensor:
    """(B, T) query and (B, S) key positions → (B, 1, T, S) boolean mask, True = may attend.

    Causal, limited to the last `span` positions, blind to negative (padding / empty) keys; a
    padding query sees itself so that no softmax row is empty (an empty row would give NaN, and
    NaN·0 would leak into real rows through the values).
    """
    q = q_pos[:, None, :, None]  # (B, 1, T, 1)
    k = k_pos[:, None, None, :]  # (B, 1, 1, S)
    return ((k <= q) & (k > q - span) & (k >= 0)) | (k == q)


def prefix_mask(q_pos: Tensor, k_pos: Tensor, prefix_len: Tensor | int, span: int) -> Tensor:
    """attention_mask plus the prefix-LM rule: query i sees key j iff j ≤ i or both lie in the
    row's prefix, positions [0, prefix_len) — the prefix attends both ways. prefix_len: (B,) or int."""
    P = torch.as_tensor(prefix_len, device=q_pos.device).view(-1, 1, 1, 1)  # (B or 1, 1, 1, 1)
    q = q_pos[:, None, :, None]  # (B, 1, T, 1)
    k = k_pos[:, None, None, :]  # (B, 1, 1, S)
    both = (q >= 0) & (q < P) & (k >= 0) & (k < P)
    return attention_mask(q_pos, k_pos, span) | both


def mask_to_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean mask → additive bias (0 where allowed, -inf elsewhere). CPU sdpa is far faster
    with it: a boolean mask over a cache slice sends decode steps to a path ~50× slower."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    impl: str = "sdpa",
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """softmax(QK^T/√d)·V for q (B, H, T, hd) and k, v (B, KV, S, hd), KV dividing H.

    `mask`: boolean (True = attend) or additive float (see mask_to_bias), broadcastable to
    (B, H, T, S); None means plain causal with T == S. Query head h reads K/V head h // (H/KV).
    `impl="math"` (or need_weights) spells it out and returns the (B, H, T, S) weights.
    """
    T, S = q.shape[2], k.shape[2]
    if impl == "sdpa" and not need_weights:
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            # torch's CPU attention kernels are far slower in bf16 than in fp32 (backward ~4.5×,
            # one-token decode ~9×), so bf16 models attend in fp32 (a small share of the FLOPs);
            # autocast is switched off around it, or it would cast the inputs straight back
            with torch.autocast("cpu", enabled=False):
                y, _ = attend(q.float(), k.float(), v.float(), mask, impl, dropout_p)
            return y.to(q.dtype), None
        if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)  # e.g. under autocast
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p,
            is_causal=mask is None and T > 1, enable_gqa=k.shape[1] != q.shape[1],
        )
        return y, None
    if k.shape[1] != q.shape[1]:  # GQA/MQA: each K/V head serves a group of query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, T, S)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    if mask.dtype == torch.bool:
        att = att.masked_fill(~mask, float("-inf"))
    else:
        att = att + mask
    att = att.softmax(dim=-1)
    y = F.dropout(att, dropout_p) if dropout_p > 0 else att
    return y @ v, att


class KVCache:
    """Static keys/values: per layer, k[layer] and v[layer] of (rows, kv_heads, capacity, head_dim).

    A token at position p of a row is written by index into slot p % capacity of that row, and
    `pos` (rows, capacity) keeps the position each slot holds, so the shared attention rule masks
    what a query may not see. With capacity ≥ the attention span (min(window, block_size), the
    default) a slot is only overwritten by a position `capacity` later, when no query can see the
    old key any more: a ring, exact however long generation runs, and the shapes never change
    (a one-token step attends over the whole buffer with a mask). Rows are independent: each has
    its own positions, and `reset(row)` forgets one row. A smaller capacity is allowed as long as
    it never has to drop a visible key (ValueError otherwise).
    """

    def __init__(
        self, n_layer: int, batch_size: int, kv_heads: int, head_dim: int,
        capacity: int, span: int, device: torch.device | str, dtype: torch.dtype,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"KV cache capacity must be at least 1, got {capacity}")
        # one tensor per layer, not views of one: a compiled decode step then writes them in place
        # (a write through a view of a graph input makes inductor copy the whole base back)
        shape = (batch_size, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.pos = torch.full((batch_size, capacity), EMPTY_POS, device=device, dtype=torch.long)
        self.capacity, self.span = capacity, span
        self.seen = 0  # tokens written by forwards with default positions (all rows together)
        self.empty = True  # nothing written since the last full reset: a forward needs no old keys
        self._slots: Tensor | None = None  # the current forward's write plan (see plan)
        self._first, self._fresh, self._inplace = 0, True, False

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values (the per-row positions add batch·capacity·8 more)."""
        return sum(t.nbytes for t in self.k + self.v)

    def reset(self, row: int | None = None) -> None:
        """Forget every token, or one row's (the buffers are reused, not reallocated)."""
        if row is None:
            self.pos.fill_(EMPTY_POS)
            self.seen, self.empty = 0, True
        else:
            self.pos[row].fill_(EMPTY_POS)

    def fresh_row(self, row: int) -> KVCache:
        """Forget one row and return a one-row view of it whose writes land in this cache (to
        prefill one row of many while the others keep their tokens)."""
        self.reset(row)
        view = KVCache.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.k, view.v = [k[row : row + 1] for k in self.k], [v[row : row + 1] for v in self.v]
        view.pos = self.pos[row : row + 1]
        view.seen, view.empty = 0, True
        return view

    def plan(self, pos: Tensor) -> Tensor:
        """Start a forward of T new tokens at positions (B, T): record them, return key positions.

        One token: written in place, the keys are the whole buffer. Several: they attend over
        [old keys, new keys] (only the new ones when the cache is empty), then the last
        min(T, capacity) of them are written to their slots (distinct: consecutive positions).
        Negative (padding) positions may only start a row, never follow its real tokens.
        """
        pos = pos.expand(self.pos.shape[0], -1)  # (B, T)
        T = pos.shape[1]
        if self.capacity < self.span and int(pos.max()) >= self.capacity:
            raise ValueError(
                f"KV cache of capacity {self.capacity} is full (position {int(pos.max())}) and would drop "
                f"keys still within the attention span ({self.span}); make it larger or reset it"
            )
        m = min(T, self.capacity)
        self._first, self._slots = T - m, pos[:, T - m :] % self.capacity  # (B, m)
        self._fresh, self._inplace = self.empty, T == 1 and not self.empty
        key_pos = pos if self._fresh or self._inplace else torch.cat([self.pos, pos], dim=1)  # (B, [cap +] T)
        self.pos.scatter_(1, self._slots, pos[:, T - m :])
        self.seen, self.empty = self.seen + T, False
        return self.pos if self._inplace else key_pos

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this layer's new k, v (B, KV, T, hd) as planned; return the keys/values to attend
        over, in the order of `plan`'s key positions."""
        ks, vs, slots, first = self.k[layer], self.v[layer], self._slots, self._first
        if self._inplace:
            return self.write(layer, k, v, (torch.arange(k.shape[0], device=k.device), slots[:, 0]))
        k_all = k if self._fresh else torch.cat([ks, k.to(ks.dtype)], dim=2)  # copies before the writes
        v_all = v if self._fresh else torch.cat([vs, v.to(vs.dtype)], dim=2)
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1) with slots (B, m)
        ks[rows, :, slots] = k[:, :, first:].transpose(1, 2).to(ks.dtype)  # (B, m, KV, hd)
        vs[rows, :, slots] = v[:, :, first:].transpose(1, 2).to(vs.dtype)
        return k_all, v_all

    def write(
        self, layer: int, k: Tensor, v: Tensor, at: tuple[Tensor, Tensor], n_keys: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """One new token per row, k, v (B, KV, 1, hd), at (rows, slots) (B,) each: the decode step's
        fixed-shape write. Returns the (B, KV, n_keys or capacity, hd) buffers to attend over."""
        ks, vs = self.k[layer], self.v[layer]
        rows, slots = at
        ks[rows, :, slots] = k[:, :, 0] if k.dtype == ks.dtype else k[:, :, 0].to(ks.dtype)  # (B, KV, hd)
        vs[rows, :, slots] = v[:, :, 0] if v.dtype == vs.dtype else v[:, :, 0].to(vs.dtype)
        return ks[:, :, :n_keys], vs[:, :, :n_keys]


class CausalSelfAttention(nn.Module):
    """All heads at once: fused q/k/v projection, (RoPE), attention, output projection.

    c_attn's output is [q heads | k heads | v heads], each head-major, as in HF GPT-2; with GQA or
    MQA there are fewer k/v heads (kv_heads), each shared by n_head / kv_heads query heads.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.impl, self.dropout = cfg.attn_impl, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, (self.n_head + 2 * self.kv_heads) * self.head_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # model.qk_norm: RMSNorm over each head's q and k (gains shared by the heads)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: Tensor,
        *,
        rope: tuple[Tensor, Tensor] | None = None,
        mask: Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, C) → (B, T, C) and the attention weights when need_weights.

        rope: cos/sin for these tokens; mask: (B, 1, T, S) from `attention_mask`, None = causal.
        """
        B, T, _ = x.shape
        H, KV, hd = self.n_head, self.kv_heads, self.head_dim
        q, k, v = self.c_attn(x).split([H * hd, KV * hd, KV * hd], dim=2)
        q = q.view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, KV, hd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(layer, k, v)
            if k.dtype != q.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
        dropout_p = self.dropout if self.training else 0.0
        y, weights = attend(q, k, v, mask, self.impl, dropout_p, need_weights)
        y = y.transpose(1, 2).reshape(B, T, H * hd)  # heads side by side again
        return self.resid_dropout(self.c_proj(y)), weights

    def decode(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None, mask: Tensor, cache: KVCache, layer: int,
        at: tuple[Tensor, Tensor], n_keys: int | None,
    ) -> Tensor:
        """The decode step's attention, x (R, C) one token per row → (R, C): forward's ops in eval
        mode, without nn.Module calls (their overhead is ~10% of a one-token step). The token's
        k, v go to cache slots at = (rows, slots); it attends over the first n_keys slots
        (None: all, the compiled step's fixed shape)."""
        R, H, KV, hd = x.shape[0], self.n_head, self.kv_heads, self.head_dim
        q, k, v = self.c_attn.forward(x).split([H * hd, KV * hd, KV * hd], dim=1)
        q, k, v = q.view(R, H, 1, hd), k.view(R, KV, 1, hd), v.view(R, KV, 1, hd)
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k, v = cache.write(layer, k, v, at, n_keys)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        y, _ = attend(q, k, v, mask, self.impl)  # (R, H, 1, hd)
        return self.c_proj.forward(y.reshape(R, H * hd))
