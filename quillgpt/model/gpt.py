"""A decoder-only GPT: token (+ learned position) embeddings, pre-norm blocks, a language head.

Parameter names mirror Hugging Face GPT-2 (transformer.wte / wpe / h.{i}.ln_1 / attn.c_attn /
attn.c_proj / ln_2 / mlp.c_fc / mlp.c_proj / ln_f, lm_head) so GPT-2 weights load by name.
Modern variants (RoPE, RMSNorm, SwiGLU, GQA/MQA, sliding window) are config switches.

Positions. `forward(idx, pos=...)` takes absolute positions per row; a negative position marks a
left-padding token that nothing attends to (see attention.py for the one masking rule). Beyond
block_size the two position schemes differ, and generate.py follows this:

* learned positions only exist for 0..block_size-1, so the context is cropped to the last
  block_size tokens and positions restart at 0 (nanoGPT); a KV cache must then be refilled.
* RoPE keeps absolute positions and every layer attends to at most the last
  span = min(window, block_size) positions — a banded mask over the whole stream, which a ring
  buffer of `span` keys reproduces exactly. `forward` accepts any length T under RoPE.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quillgpt.model.attention import CausalSelfAttention, KVCache, attention_mask, mask_to_bias, rope_cos_sin
from quillgpt.config import ModelConfig
from quillgpt.model.attention import prefix_mask
from quillgpt.model.variants.infini import InfiniAttention, InfiniCache, segment_positions


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


class MLP(nn.Module):
    """GELU (tanh approximation, = HF gelu_new), ReLU² (relu(x)²) or SwiGLU: c_fc gives
    [gate | up], silu(gate)·up."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind, self.swiglu = cfg.mlp, cfg.mlp == "swiglu"
        hidden = cfg.hidden_dim
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.swiglu else 1) * hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))

    def act(self, h: Tensor) -> Tensor:
        """c_fc's output → c_proj's input."""
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        if self.kind == "relu2":
            return ReLUSquared.apply(h)
        return F.gelu(h, approximate="tanh")


class ReLUSquared(torch.autograd.Function):
    """relu(h)² with a two-op backward, 2·relu(h)·grad (zero wherever h ≤ 0), where autograd's
    backward of relu(h).square() runs four ops over the MLP's widest tensor."""

    @staticmethod
    def forward(ctx: Any, h: Tensor) -> Tensor:
        r = F.relu(h)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (r,) = ctx.saved_tensors
        return (r + r) * grad


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = InfiniAttention(cfg) if cfg.attention == "infini" else CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, **attn_kwargs) -> tuple[Tensor, Tensor | None]:
        a, weights = self.attn(self.ln_1(x), **attn_kwargs)
        x = x + a
        return x + self.mlp(self.ln_2(x)), weights

    def decode(self, x: Tensor, **attn_kwargs) -> Tensor:
        """forward for the decode step, x (R, C) in eval mode: the same ops without nn.Module
        calls or the (identity) dropouts, whose overhead is ~10% of a one-token step."""
        x = x + self.attn.decode(self.ln_1.forward(x), **attn_kwargs)
        mlp = self.mlp
        return x + mlp.c_proj.forward(mlp.act(mlp.c_fc.forward(self.ln_2.forward(x))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be set (it comes from the tokenizer)")
        cfg.validate()
        self.config = cfg
        # every query sees at most this many positions back (itself included)
        self.span = min(cfg.window, cfg.block_size) if cfg.window else cfg.block_size
        if cfg.attention == "infini":  # the dot-product part; the memory sees everything before
            self.span = cfg.segment_size
        modules = dict(wte=nn.Embedding(cfg.vocab_size, cfg.n_embd))
        if cfg.pos == "learned":
            modules["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        modules.update(
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=make_norm(cfg),
        )
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        if cfg.pos == "rope":  # table for positions 0..block_size-1; other positions computed on the fly
            cos, sin = rope_cos_sin(torch.arange(cfg.block_size), cfg.head_dim, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)  # (block_size, hd)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections so the residual stream's variance stays ~constant
        # (model.zero_init_proj: start them at zero instead, so every block starts as the identity)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") and cfg.zero_init_proj:
                nn.init.zeros_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # --- forward ------------------------------------------------------------------------------

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        pos: Tensor | None = None,
        all_logits: bool = False,
        prefix_len: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) → logits (B, T, V) with targets or all_logits, else (B, 1, V); loss or None.

        pos: absolute positions (B, T) or (T,) (negative = left padding); default 0..T-1, or following
        the cache's tokens. cache: a KVCache from make_cache, extended by these T tokens.
        The loss is the mean cross-entropy over targets != -1.
        prefix_len (B,): model.attention=prefix only — each row's prefix (positions < prefix_len)
        attends both ways (attention.prefix_mask); None = no prefix (causal).
        """
        x, _ = self._hidden(idx, pos, cache, need_weights=False, prefix_len=prefix_len)
        if targets is not None:
            logits = self.head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
            return logits, loss
        # only the last position's logits when sampling: skips most of the big head matmul
        return self.head(x if all_logits else x[:, -1:, :]), None

    def head(self, x: Tensor) -> Tensor:
        """Final hidden states (…, C) → logits (…, V); model.logit_softcap=c bounds them as c·tanh(z/c)."""
        logits = self.lm_head(x)
        c = self.config.logit_softcap
        return logits if c is None else c * torch.tanh(logits / c)

    def decode(self, idx: Tensor, pos: Tensor, cache: KVCache, n_keys: int | None = None) -> Tensor:
        """One new token per row: idx, pos (R,) → next-token logits (R, V); each row's keys and
        values go to its cache slot pos % capacity and it attends over the cache with the shared
        mask rule. Fixed shapes, no host syncs, no checks (what the engine runs, and compiles): the
        caller keeps positions valid (learned: < block_size). n_keys: attend over the first n_keys
        slots only (they must hold every visible key; None = all, the compiled step's shape)."""
        cfg, R = self.config, idx.shape[0]
        at = (torch.arange(R, device=idx.device), pos % cache.capacity)  # (row, slot) of each new key
        cache.pos[at] = pos
        mask = attention_mask(pos[:, None], cache.pos[:, :n_keys], self.span)  # (R, 1, 1, S)
        mask = mask_to_bias(mask, self.lm_head.weight.dtype)
        x = self.transformer.wte(idx)  # (R, C)
        rope = None
        if cfg.pos == "learned":
            x = x + self.transformer.wpe(pos)
        else:
            cos, sin = rope_cos_sin(pos[:, None], cfg.head_dim, cfg.rope_theta)  # (R, 1, hd)
            dt = self.rope_cos.dtype
            rope = (cos[:, None].to(dt), sin[:, None].to(dt))  # (R, 1, 1, hd): over heads
        for i, block in enumerate(self.transformer.h):
            x = block.decode(x, rope=rope, mask=mask, cache=cache, layer=i, at=at, n_keys=n_keys)
        return self.head(self.transformer.ln_f(x))  # (R, V)

    @torch.no_grad()
    def attention_maps(self, idx: Tensor, prefix_len: Tensor | None = None) -> list[Tensor]:
        """Per layer, the (B, n_head, T, T) softmax weights of the explicit math path."""
        _, maps = self._hidden(idx, None, None, need_weights=True, prefix_len=prefix_len)
        return maps

    def _hidden(
        self, idx: Tensor, pos: Tensor | None, cache: KVCache | None, need_weights: bool,
        prefix_len: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """Embeddings → blocks → ln_f: the (B, T, C) final hidden states (and attention maps)."""
        cfg = self.config
        B, T = idx.shape
        infini = cfg.attention == "infini"  # positions restart in each segment; no mask (infini.py)
        if infini:
            pos = cache.plan(T, idx.device) if cache is not None else segment_positions(0, T, self.span, idx.device)
        elif prefix_len is not None and pos is None:  # the prefix rule needs positions
            start = cache.seen if cache is not None else 0
            pos = torch.arange(start, start + T, device=idx.device)[None]
        if cfg.pos == "learned" and T > cfg.block_size and not infini:
            raise ValueError(f"cannot forward {T} tokens: block_size is {cfg.block_size} (learned positions)")
        if pos is not None:
            pos = pos.view(-1, T)  # (B, T), or (1, T) shared by all rows
        elif cache is not None or T > self.span:
            start = cache.seen if cache is not None else 0
            pos = torch.arange(start, start + T, device=idx.device)[None]  # (1, T): one mask row for all
        if cfg.pos == "learned" and pos is not None and not infini and int(pos.max()) >= cfg.block_size:
            raise ValueError(
                f"position {int(pos.max())} is past block_size {cfg.block_size}: learned positions stop at "
                f"{cfg.block_size - 1}; crop the context to its last {cfg.block_size} tokens and refill the "
                "cache from them (the engine and generate_tokens do)"
            )
        # pos None now means the plain causal case: sdpa's is_causal fast path, no mask tensor
        mask = None
        if pos is not None and not infini:
            key_pos = cache.plan(pos) if cache is not None else pos
            if prefix_len is None:
                mask = attention_mask(pos, key_pos, self.span)  # (B, 1, T, S), shared by all layers
            else:
                mask = prefix_mask(pos, key_pos, prefix_len, self.span)
            mask = mask_to_bias(mask, self.lm_head.weight.dtype)

        x = self.transformer.wte(idx)  # (B, T, C)
        rope = None
        if cfg.pos == "learned":
            p = torch.arange(T, device=idx.device) if pos is None else pos.clamp(min=0)
            x = x + self.transformer.wpe(p)
        elif pos is None:
            rope = (self.rope_cos[:T], self.rope_sin[:T])  # (T, hd)
        else:
            cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)  # (B, T, hd)
            dt = self.rope_cos.dtype  # round like the table does (bf16 after model.to(bfloat16))
            rope = (cos[:, None].to(dt), sin[:, None].to(dt))  # broadcast over heads
        x = self.transformer.drop(x)
        maps = []
        for i, block in enumerate(self.transformer.h):
            x, w = block(x, rope=rope, mask=mask, cache=cache, layer=i, need_weights=need_weights)
            if need_weights:
                maps.append(w)
        return self.transformer.ln_f(x), maps

    # --- cache and accounting -----------------------------------------------------------------

    def make_cache(
        self,
        batch_size: int,
        capacity: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """An empty KV cache; default capacity = the attention span min(window, block_size).
        Infini-attention: an InfiniCache (memory + one segment's keys/values), capacity unused."""
        cfg, p = self.config, self.lm_head.weight
        if cfg.attention == "infini":
            return InfiniCache(cfg.n_layer, batch_size, cfg.kv_heads, cfg.head_dim, cfg.segment_size, device or p.device, dtype or p.dtype)
        return KVCache(
            cfg.n_layer, batch_size, cfg.kv_heads, cfg.head_dim, self.span if capacity is None else capacity, self.span,
            device or p.device, dtype or p.dtype,
        )

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; tied weights count once. non_embedding drops pure lookup tables:
        wpe, and wte when untied (tied, it also does the head's matmul, so it stays; nanoGPT)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.config.pos == "learned":
                n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.transformer.wte.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token, 6N + 12·L·H·Q·T (PaLM appendix B, as nanoGPT's MFU).

        T is the number of keys a query sees at most, min(window, block_size).
        """
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * self.span
