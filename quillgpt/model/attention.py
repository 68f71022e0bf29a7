"""The shared attention math: RoPE, the position mask, softmax(QKᵀ/√d)V, and self-attention's
projections (MHA / GQA / MQA, QK-norm) that every attention variant composes.

The textbook form is one `Head` per head — key/query/value projections, a causal mask,
softmax(QK^T/√d_k)·V — concatenated and projected (tests/model/test_attention.py keeps that form
as the reference). Here all heads come out of one fused projection `c_attn` and run as one
batched matmul, which is the same computation, only faster.

Who may attend to whom is decided by *positions*, not by indices, in one rule shared by every
path (training, recompute, KV cache, left-padded batches):

    the query at position p sees the keys at positions (p - span, p] that are ≥ 0,
    span = min(window, block_size); a query at a negative position (left padding) sees only itself.

So a left-padded row gives its pad tokens negative positions and they never influence it, and a
ring-buffer cache that holds the last `span` keys is exact, however long generation runs.
Variants change the rule (a prefix attends both ways: variants/prefix.py) or replace the
cache (Infini-attention's memory: variants/infini.py); the pieces here stay the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quillgpt.config import ModelConfig
from quillgpt.model.fusion import stored
from quillgpt.model.kv_cache import Cache, KVCache, KVWrite


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: str | None = None,
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_context: int = 8192,
    device: torch.device | str | None = None,
) -> Tensor:
    """The (head_dim/2,) float32 RoPE frequencies θ^(-2i/d), optionally scaled for a longer context:
    "linear" divides them all by `factor` (= positions / factor); "llama3" (Llama 3.1) divides only
    the low frequencies (wavelength > original_context / low_freq_factor), keeps the high ones
    (wavelength < original_context / high_freq_factor) and blends linearly in between."""
    inv = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling == "linear":
        return inv / factor
    if scaling != "llama3":
        return inv
    wavelen = 2 * math.pi / inv
    low, high = original_context / low_freq_factor, original_context / high_freq_factor
    scaled = torch.where(wavelen > low, inv / factor, inv)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where((wavelen >= high) & (wavelen <= low), blended, scaled)


def rope_cos_sin(pos: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin of the RoPE angles pos·inv_freq for any (…) integer positions → (…, head_dim).

    One function for the precomputed table and for explicit positions, so both give the same bits.
    """
    angles = pos.to(torch.float32)[..., None] * inv_freq.to(pos.device)  # (..., hd/2)
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
    scale: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """softmax(QK^T/√d)·V for q (B, H, T, hd) and k, v (B, KV, S, hd), KV dividing H
    (scale: the scores' factor instead of 1/√d, model.attn_scale).

    `mask`: boolean (True = attend) or additive float (see mask_to_bias), broadcastable to
    (B, H, T, S); None means plain causal, the T queries being the last T keys (T == S, or one
    query that sees every key). Query head h reads K/V head h // (H/KV).
    `impl="math"` (or need_weights) spells it out and returns the (B, H, T, S) weights.
    """
    T, S = q.shape[2], k.shape[2]
    if impl == "sdpa" and not need_weights and T == 1 and dropout_p == 0 and q.device.type == "cpu" and torch.compiler.is_compiling():
        return attend_one(q, k, v, mask, scale), None  # one query per row, compiled on a CPU (the decode step)
    if impl == "sdpa" and not need_weights:
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            # torch's CPU attention kernels are far slower in bf16 than in fp32 (backward ~4.5×,
            # one-token decode ~9×), so bf16 models attend in fp32 (a small share of the FLOPs);
            # autocast is switched off around it, or it would cast the inputs straight back
            with torch.autocast("cpu", enabled=False):
                y, _ = attend(q.float(), k.float(), v.float(), mask, impl, dropout_p, scale=scale)
            return y.to(q.dtype), None
        if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)  # e.g. under autocast
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=mask is None and T > 1,
            enable_gqa=k.shape[1] != q.shape[1],
            scale=scale,
        )
        return y, None
    if k.shape[1] != q.shape[1]:  # GQA/MQA: each K/V head serves a group of query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)  # (B, H, T, S)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask.dtype == torch.bool:
        att = att.masked_fill(~mask, float("-inf"))
    else:
        att = att + mask
    att = att.softmax(dim=-1)
    y = F.dropout(att, dropout_p) if dropout_p > 0 else att
    return y @ v, att


def attend_one(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None = None) -> Tensor:
    """attend for one query per row, q (R, H, 1, hd), k, v (R, KV, S, hd), as products and sums in
    fp32, query heads grouped over their K/V head: inside a compiled CPU step inductor fuses it into
    a few loops, where SDPA's CPU kernel cost more per call than the attention itself
    (docs/performance.md). mask: as attend's (None: every key is visible)."""
    R, H, _, hd = q.shape
    KV, S = k.shape[1], k.shape[2]
    qg = stored(q.reshape(R, KV, H // KV, 1, hd).float())  # else its RoPE is recomputed for every key
    scores = (qg * k.view(R, KV, 1, S, hd).float()).sum(-1) * (1.0 / math.sqrt(hd) if scale is None else scale)  # (R, KV, H/KV, S)
    if mask is not None:  # broadcast over (R, H, 1, S), as attend's
        per_head = scores.view(R, H, 1, S)
        per_head = per_head.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else per_head + mask.float()
        scores = per_head.view(R, KV, H // KV, S)
    p = scores.softmax(-1)
    y = (p[..., None] * v.view(R, KV, 1, S, hd).float()).sum(-2)  # (R, KV, H/KV, hd)
    return y.reshape(R, H, 1, hd).to(q.dtype)


@dataclass
class LayerInputs:
    """What every layer's attention needs for one forward, decided once by GPT (positions → mask):
    the RoPE angles of these tokens, the mask (None: plain causal), the cache with this forward's
    write plan (KVWrite for a KVCache; the variant's own for its cache), and whether to return
    the attention weights."""

    rope: tuple[Tensor, Tensor] | None = None
    mask: Tensor | None = None
    cache: Cache | None = None
    plan: object = None  # the cache's write plan for this forward (Cache.plan)
    need_weights: bool = False


class HeadNorm(nn.RMSNorm):
    """model.qk_norm: RMSNorm over each head's q or k (one gain vector shared by the heads). Under
    autocast q and k come out of c_attn in bf16 while the gain is fp32: the gain is cast to them,
    so the fused kernel runs (mixed dtypes fall back to a composite path, with a warning)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class SelfAttention(nn.Module):
    """The projections every variant shares: fused q/k/v (`c_attn`), QK-norm, RoPE, and the output
    projection (`c_proj`). c_attn's output is [q heads | k heads | v heads], each head-major, as in
    HF GPT-2; with GQA or MQA there are fewer k/v heads (kv_heads), each shared by n_head / kv_heads
    query heads. Subclasses decide what q, k, v attend over."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_size
        self.impl, self.dropout, self.scale = cfg.attn_impl, cfg.dropout, cfg.attn_scale
        qkv = (self.n_head + 2 * self.kv_heads) * self.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, qkv, bias=cfg.bias or cfg.qkv_bias)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.q_norm = HeadNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = HeadNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def qkv(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, C) → q (B, H, T, hd), k, v (B, KV, T, hd), normed and rotated."""
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
        return q, k, v

    def out(self, y: Tensor) -> Tensor:
        """Heads (B, H, T, hd) side by side again → the output projection (B, T, C)."""
        B, H, T, hd = y.shape
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, H * hd)))

    @property
    def dropout_p(self) -> float:
        return self.dropout if self.training else 0.0


class CausalSelfAttention(SelfAttention):
    """softmax(QKᵀ/√d)V over the keys the mask allows: these tokens', and with a KVCache the row's
    cached ones (written at the tokens' positions). Causal and prefix-LM attention both use it:
    they differ only in the mask."""

    def forward(self, x: Tensor, inputs: LayerInputs | None = None, layer: int = 0) -> tuple[Tensor, Tensor | None]:
        """x (B, T, C) → (B, T, C) and the (B, H, T, S) weights when inputs.need_weights
        (no inputs: plain causal attention over x, no RoPE)."""
        inputs = inputs or LayerInputs()
        q, k, v = self.qkv(x, inputs.rope)
        if inputs.cache is not None:
            k, v = inputs.cache.update(layer, k, v, inputs.plan)
            if k.dtype != q.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
        y, weights = attend(q, k, v, inputs.mask, self.impl, self.dropout_p, inputs.need_weights, self.scale)
        return self.out(y), weights

    def decode(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        mask: Tensor,
        cache: KVCache,
        layer: int,
        at: KVWrite,
        n_keys: int | None,
    ) -> Tensor:
        """The decode step's attention, x (R, C) one token per row → (R, C): forward's ops in eval
        mode, without nn.Module calls (their overhead is ~10% of a one-token step). The token's
        k, v go to the cache slots of `at`; it attends over the first n_keys slots (None: all,
        the compiled step's fixed shape)."""
        R, H, KV, hd = x.shape[0], self.n_head, self.kv_heads, self.head_dim
        q, k, v = self.c_attn.forward(x).split([H * hd, KV * hd, KV * hd], dim=1)
        q, k, v = q.view(R, H, 1, hd), k.view(R, KV, 1, hd), v.view(R, KV, 1, hd)
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k, v = cache.write_one(layer, k, v, at, n_keys)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        y, _ = attend(q, k, v, mask, self.impl, scale=self.scale)  # (R, H, 1, hd)
        return self.c_proj.forward(y.reshape(R, H * hd))
