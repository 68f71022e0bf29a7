"""A decoder-only GPT: token (+ learned position) embeddings, pre-norm blocks, a language head.

Parameter names mirror Hugging Face GPT-2 (transformer.wte / wpe / h.{i}.ln_1 / attn.c_attn /
attn.c_proj / ln_2 / mlp.c_fc / mlp.c_proj / ln_f, lm_head) so GPT-2 weights load by name.
Modern variants (RoPE, RMSNorm, SwiGLU/GeGLU, GQA/MQA, sliding window, Gemma's sandwich norms and
scaled embedding) are config switches.

Positions. `forward(idx, pos=...)` takes absolute positions per row; a negative position marks a
left-padding token that nothing attends to (see model/attention.py for the one masking rule).
Beyond block_size the two position schemes differ, and both inference engines follow this:

* learned positions only exist for 0..block_size-1, so the context is cropped to the last
  block_size tokens and positions restart at 0 (nanoGPT); a KV cache must then be refilled.
* RoPE keeps absolute positions and every layer attends to at most the last
  span = min(window, block_size) positions — a banded mask over the whole stream, which a ring
  buffer of `span` keys reproduces exactly. `forward` accepts any length T under RoPE.

Per-layer windows (model.global_every, Gemma 3): the global layers make the span block_size and
the cache holds it; the windowed layers ("local") take their own band mask of min(window,
block_size) and their own RoPE angles (model.local_rope_theta, unscaled) in every path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quillgpt.config import ModelConfig
from quillgpt.model.attention import LayerInputs, attention_mask, mask_to_bias, rope_cos_sin, rope_inv_freq
from quillgpt.model.fusion import stored
from quillgpt.model.kv_cache import Cache, KVCache, PrefixKV, SlotIndex, prefix_worth_sharing
from quillgpt.model.variants import Variant, variant_of

# a decode step's inputs to every block: embeddings (R, C), RoPE cos/sin or None, additive mask or None, new keys' slots
DecodeInputs = tuple[Tensor, tuple[Tensor, Tensor] | None, Tensor | None, SlotIndex]


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and no autograd for a pass, then the model's own mode back: what
    evaluation and the attention view run under, whether or not the model is training."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():  # not inference_mode: what it returns may meet autograd later
            yield
    finally:
        model.train(was_training)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


class MLP(nn.Module):
    """GELU (tanh approximation, = HF gelu_new), ReLU² (relu(x)²), or gated: c_fc gives
    [gate | up], silu(gate)·up (SwiGLU) or gelu_tanh(gate)·up (GeGLU, Gemma)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind, self.gated = cfg.mlp, cfg.gated_mlp
        hidden = cfg.hidden_dim
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.gated else 1) * hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))

    def act(self, h: Tensor) -> Tensor:
        """c_fc's output → c_proj's input."""
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return (F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate="tanh")) * up
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
    """Pre-norm residual block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); with model.sandwich_norm
    each branch is normed on its way out as well (ln_attn_out, ln_mlp_out: Gemma's
    post_attention_layernorm and post_feedforward_layernorm), in the residual stream's dtype: under
    training's bf16 autocast a branch leaves its linear in bf16 while the norm's gain is fp32."""

    def __init__(self, cfg: ModelConfig, variant: Variant) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = variant.attention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        if cfg.sandwich_norm:
            self.ln_attn_out, self.ln_mlp_out = make_norm(cfg), make_norm(cfg)
        self.sandwich = cfg.sandwich_norm

    def forward(self, x: Tensor, inputs: LayerInputs, layer: int = 0) -> tuple[Tensor, Tensor | None]:
        a, weights = self.attn(self.ln_1(x), inputs, layer)
        x = x + (self.ln_attn_out(a.to(x.dtype)) if self.sandwich else a)
        m = self.mlp(self.ln_2(x))
        return x + (self.ln_mlp_out(m.to(x.dtype)) if self.sandwich else m), weights

    def decode(self, x: Tensor, **attn_kwargs: Any) -> Tensor:
        """forward for the decode step, x (R, C) in eval mode: the same ops without nn.Module calls
        or the (identity) dropouts, whose overhead is ~10% of a one-token step."""
        a = self.attn.decode(self.ln_1.forward(x), **attn_kwargs)
        x = x + (self.ln_attn_out.forward(a) if self.sandwich else a)
        mlp = self.mlp
        m = mlp.c_proj.forward(mlp.act(mlp.c_fc.forward(self.ln_2.forward(x))))
        return x + (self.ln_mlp_out.forward(m) if self.sandwich else m)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be set (it comes from the tokenizer)")
        cfg.validate()
        self.config = cfg
        self.variant = variant_of(cfg)
        self.span = self.variant.span(cfg)  # every query sees at most this many positions back (itself included)
        # model.global_every: the windowed layers, which see at most local_span positions back
        self.local_layers = frozenset(i for i in range(cfg.n_layer) if cfg.global_every and cfg.windowed(i))
        self.local_span = min(cfg.window or cfg.block_size, cfg.block_size)
        modules = dict(wte=nn.Embedding(cfg.vocab_size, cfg.n_embd))
        if cfg.pos == "learned":
            modules["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        modules.update(
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg, self.variant) for _ in range(cfg.n_layer)),
            ln_f=make_norm(cfg),
        )
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        self._inv_freq: dict[tuple[torch.device, bool], Tensor] = {}  # RoPE frequencies per device (and local), fp32
        if cfg.pos == "rope":  # table for positions 0..block_size-1; other positions computed on the fly
            self.register_buffer("rope_cos", torch.empty(0), persistent=False)  # (block_size, hd)
            self.register_buffer("rope_sin", torch.empty(0), persistent=False)
            if not self.lm_head.weight.is_meta:  # built on the meta device: materialize() makes it
                self._rope_table()
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections so the residual stream's variance stays ~constant
        # (model.zero_init_proj: start them at zero instead, so every block starts as the identity)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") and cfg.zero_init_proj:
                nn.init.zeros_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _rope_table(self) -> None:
        """cos/sin of positions 0..block_size-1, on the CPU (model.to moves them; explicit device: also
        under a meta-device context)."""
        cpu = torch.device("cpu")
        cos, sin = rope_cos_sin(torch.arange(self.config.block_size, device=cpu), self.inv_freq(cpu))
        self.rope_cos, self.rope_sin = cos.to(self.dtype), sin.to(self.dtype)

    def materialize(self) -> None:
        """After load_state_dict(assign=True) into a model built on the meta device: the buffers no
        checkpoint holds (the RoPE table), and the tie of the head to the embedding."""
        if self.config.pos == "rope":
            self._rope_table()
        if self.config.tie_embeddings and isinstance(self.lm_head, nn.Linear) and isinstance(self.transformer.wte, nn.Embedding):
            self.transformer.wte.weight = self.lm_head.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def device(self) -> torch.device:
        return self.transformer.ln_f.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype of the activations and the KV cache: the final norm's (quantization,
        which swaps the linears and may swap the embedding, never touches a norm)."""
        return self.transformer.ln_f.weight.dtype

    # --- forward ------------------------------------------------------------------------------

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        pos: Tensor | None = None,
        cache: Cache | None = None,
        rows: Tensor | None = None,
        all_logits: bool = False,
        prefix_len: Tensor | None = None,
        scored_only: bool = False,
        share_prefix: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) → logits (B, T, V) with targets or all_logits, else (B, 1, V); loss or None.

        pos: absolute positions (B, T) or (T,) (negative = left padding); default 0..T-1. cache:
        from make_cache, extended by these T tokens at `pos` (required with a cache) in its `rows`
        (B,) (default: all). The loss is the mean cross-entropy over targets != -1.
        prefix_len (B,): a prefix-LM's prefixes (positions < prefix_len attend both ways,
        variants/prefix.py); None = no prefix (causal). scored_only (with targets): the head runs on
        the positions whose target counts only, and the logits are those (N, V): the same loss,
        without the head's matmul and the (B, T, V) logits where chat data scores nothing.
        share_prefix (with scored_only, training): the leading tokens all rows hold alike (a chat
        template's system prompt) run once, as one row (_after_shared_prefix): the same loss
        and gradients to rounding at a fraction of the prefix's cost.
        """
        if targets is not None and scored_only:
            P = self._shareable_prefix(idx, targets, pos, cache, prefix_len) if share_prefix else 0
            x = self._after_shared_prefix(idx, P) if P else self._hidden(idx, pos, cache, rows, prefix_len)[0]
            scored = targets[:, P:] != -1  # (B, T - P)
            logits = self.head(x[scored])  # (N, V)
            return logits, F.cross_entropy(logits, targets[:, P:][scored])
        x, _ = self._hidden(idx, pos, cache, rows, prefix_len, need_weights=False)
        if targets is not None:
            logits = self.head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
            return logits, loss
        # only the last position's logits when sampling: skips most of the big head matmul
        return self.head(x if all_logits else x[:, -1:, :]), None

    def _shareable_prefix(self, idx: Tensor, targets: Tensor, *plain: object) -> int:
        """The shared prefix's length, or 0 where sharing does not apply: one row, a variant whose
        tokens depend on more than the tokens before them, dropout (one mask for every row), explicit
        positions/cache/prefix, or a prefix too short to pay for the second pass."""
        if not self.variant.shares_prefix_keys or any(p is not None for p in plain):
            return 0
        if self.training and self.config.dropout > 0:
            return 0
        return prefix_worth_sharing(idx, targets)

    def _after_shared_prefix(self, idx: Tensor, P: int) -> Tensor:
        """Final hidden states (B, T - P, C) of positions P.. of rows whose first P tokens are
        equal: the prefix runs as one row into a PrefixKV, and every row's later tokens attend
        over its keys and their own. The prefix's gradient is then the sum of every row's."""
        T, dev = idx.shape[1], idx.device
        keys = PrefixKV()
        self._hidden(idx[:1, :P], torch.arange(P, device=dev), keys)
        return self._hidden(idx[:, P:], torch.arange(P, T, device=dev), keys)[0]

    def head(self, x: Tensor) -> Tensor:
        """Final hidden states (…, C) → logits (…, V); model.logit_softcap=c bounds them as c·tanh(z/c)."""
        logits = self.lm_head(x)
        c = self.config.logit_softcap
        return logits if c is None else c * torch.tanh(logits / c)

    def decode(self, idx: Tensor, pos: Tensor, cache: KVCache, n_keys: int | None = None, masked: bool = True) -> Tensor:
        """One new token per row: idx, pos (R,) → next-token logits (R, V), for the cache's first R
        rows; each row's keys and values go to its slot pos % capacity and it attends over them with the shared
        mask rule. Fixed shapes, no host syncs, no checks (what the engine runs, and compiles): the
        caller keeps positions valid (learned: < block_size). n_keys: attend over the first n_keys
        slots only (they must hold every visible key; None = all, the compiled step's shape).
        masked=False: the caller knows every row may see all of those slots (each row holds the
        same n_keys ≤ span latest positions), so no mask is built or applied (~10% of attention).
        The op-by-op step: inference/native_decoder.py runs the same step natively where it can."""
        x, rope, mask, at = self.decode_inputs(idx, pos, cache, n_keys, masked)
        local = self.decode_local(pos, cache, n_keys) if self.local_layers else None
        for i, block in enumerate(self.transformer.h):
            r, m = local if local and i in self.local_layers else (rope, mask)
            x = block.decode(x, rope=r, mask=m, cache=cache, layer=i, at=at, n_keys=n_keys)
        return self.head(self.transformer.ln_f(x))  # (R, V)

    def decode_local(self, pos: Tensor, cache: KVCache, n_keys: int | None) -> tuple[tuple[Tensor, Tensor] | None, Tensor]:
        """The windowed layers' RoPE cos/sin (R, 1, 1, hd) or None and additive band mask (R, 1, 1, S)
        for a decode step (model.global_every), after decode_inputs recorded the new positions.
        Always masked: the slots may hold more than the window even where every row sees them all."""
        mask = attention_mask(pos[:, None], cache.pos[: len(pos), :n_keys], self.local_span)
        rope = self._rope(pos[:, None], T=1, local=True)
        return rope and (stored(rope[0]), stored(rope[1])), stored(mask_to_bias(mask, self.dtype))

    def decode_inputs(self, idx: Tensor, pos: Tensor, cache: KVCache, n_keys: int | None, masked: bool) -> DecodeInputs:
        """What every block of a decode step takes (see decode): the embeddings (R, C), RoPE's
        cos/sin (R, 1, 1, hd) or None, the additive mask (R, 1, 1, S) or None, and each new key's
        (row, slot), whose positions it records in cache.pos."""
        at = cache.decode_slots(pos)  # (row, slot) of each new key
        mask = None
        if masked:
            mask = attention_mask(pos[:, None], cache.pos[: len(pos), :n_keys], self.span)  # (R, 1, 1, S)
            mask = stored(mask_to_bias(mask, self.dtype))  # once, not in each layer's attention
        x = self._scale_embedding(self.transformer.wte(idx))  # (R, C)
        if self.config.pos == "learned":
            x = x + self.transformer.wpe(pos)
        rope = self._rope(pos[:, None], T=1)  # (R, 1, 1, hd): over heads
        rope = rope and (stored(rope[0]), stored(rope[1]))  # cos/sin once, not in each layer
        return x, rope, mask, at

    @torch.no_grad()
    def attention_maps(self, idx: Tensor, prefix_len: Tensor | None = None) -> list[Tensor]:
        """Per layer, the (B, n_head, T, T) softmax weights of the explicit math path."""
        _, maps = self._hidden(idx, None, None, None, prefix_len, need_weights=True)
        return maps

    def _hidden(
        self,
        idx: Tensor,
        pos: Tensor | None = None,
        cache: Cache | None = None,
        rows: Tensor | None = None,
        prefix_len: Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor]]:
        """Positions → the variant's mask and cache plan → embeddings → blocks → ln_f: the (B, T, C)
        final hidden states (and each layer's attention weights)."""
        T = idx.shape[1]
        pos = self._positions(idx, pos, cache, prefix_len)  # None: plain causal 0..T-1
        mask, plan = self.variant.plan(pos, cache, rows, self.span, prefix_len, self.dtype)
        x = self.transformer.drop(self._embed(idx, pos))  # (B, T, C)
        inputs = LayerInputs(self._rope(pos, T), mask, cache, plan, need_weights)
        local = self._local_inputs(inputs, idx, pos, prefix_len) if self.local_layers else inputs
        maps = []
        for i, block in enumerate(self.transformer.h):
            x, w = block(x, local if i in self.local_layers else inputs, i)
            if need_weights:
                maps.append(w)
        return self.transformer.ln_f(x), maps

    def _local_inputs(self, inputs: LayerInputs, idx: Tensor, pos: Tensor | None, prefix_len: Tensor | None) -> LayerInputs:
        """The windowed layers' LayerInputs (model.global_every): the global layers' cache and write
        plan, their own RoPE angles, and the variant's mask at local_span over the same keys (None:
        plain causal, where no token is a window away from another)."""
        T = idx.shape[1]
        if pos is None and T <= self.local_span:
            return dataclasses.replace(inputs, rope=self._rope(torch.arange(T, device=idx.device)[None], T, local=True))
        q_pos = torch.arange(T, device=idx.device)[None] if pos is None else pos
        key_pos = q_pos if inputs.plan is None else inputs.plan.key_pos
        mask = mask_to_bias(self.variant.mask(q_pos, key_pos, self.local_span, prefix_len), self.dtype)
        return dataclasses.replace(inputs, rope=self._rope(q_pos, T, local=True), mask=mask)

    def _positions(self, idx: Tensor, pos: Tensor | None, cache: Cache | None, prefix_len: Tensor | None) -> Tensor | None:
        """The tokens' absolute positions (B or 1, T), checked; None for the plain causal case
        0..T-1 that needs no mask (sdpa's is_causal fast path)."""
        cfg, T = self.config, idx.shape[1]
        crops = self.variant.crops(cfg)
        if crops and T > cfg.block_size:
            raise ValueError(f"cannot forward {T} tokens: block_size is {cfg.block_size} (learned positions)")
        if pos is None:
            if cache is not None:
                raise ValueError("a forward through a cache needs pos=: the positions of the tokens in their rows")
            if prefix_len is None and T <= self.span:
                return None
            pos = torch.arange(T, device=idx.device)  # the prefix rule / a band past span needs positions
        pos = pos.view(-1, T)  # (B, T), or (1, T) shared by all rows
        if crops and int(pos.max()) >= cfg.block_size:
            raise ValueError(
                f"position {int(pos.max())} is past block_size {cfg.block_size}: learned positions stop at "
                f"{cfg.block_size - 1}; crop the context to its last {cfg.block_size} tokens and refill the "
                "cache from them (the engine and generate_tokens do)"
            )
        return pos

    def inv_freq(self, device: torch.device, local: bool = False) -> Tensor:
        """The RoPE frequencies (head_size/2,) in float32 on `device`, scaled as model.rope_scaling
        says; kept out of the buffers so that model.to(bfloat16) cannot round them. local: the
        windowed layers' of model.global_every (model.local_rope_theta, never scaled)."""
        key, c = (device, local), self.config
        if key not in self._inv_freq and local:
            self._inv_freq[key] = rope_inv_freq(c.head_size, c.local_rope_theta or c.rope_theta, device=device)
        elif key not in self._inv_freq:
            self._inv_freq[key] = rope_inv_freq(
                c.head_size,
                c.rope_theta,
                c.rope_scaling,
                c.rope_factor,
                c.rope_low_freq_factor,
                c.rope_high_freq_factor,
                c.rope_original_context,
                device,
            )
        return self._inv_freq[key]

    def _scale_embedding(self, x: Tensor) -> Tensor:
        """model.embed_scale: token embeddings × √n_embd, the factor rounded to their dtype (as HF Gemma)."""
        if not self.config.embed_scale:
            return x
        return x * torch.tensor(math.sqrt(self.config.n_embd), dtype=torch.float32).to(x.dtype)

    def _embed(self, idx: Tensor, pos: Tensor | None) -> Tensor:
        """Token embeddings (scaled: model.embed_scale), plus learned position embeddings (padding
        positions clamped to 0)."""
        x = self._scale_embedding(self.transformer.wte(idx))
        if self.config.pos != "learned":
            return x
        p = torch.arange(idx.shape[1], device=idx.device) if pos is None else pos.clamp(min=0)
        return x + self.transformer.wpe(self.variant.embed_positions(self.config, p))

    def _rope(self, pos: Tensor | None, T: int, local: bool = False) -> tuple[Tensor, Tensor] | None:
        """cos/sin for these tokens: the table's first T rows (T, hd), or from explicit positions
        (B, 1, T, hd), rounded to the table's dtype (bf16 after model.to(bfloat16)); None when learned.
        local: the windowed layers' angles (see inv_freq), from explicit positions only."""
        cfg = self.config
        if cfg.pos != "rope":
            return None
        if pos is None:
            return self.rope_cos[:T], self.rope_sin[:T]  # (T, hd)
        cos, sin = rope_cos_sin(self.variant.embed_positions(cfg, pos), self.inv_freq(pos.device, local))  # (B, T, hd)
        dt = self.rope_cos.dtype
        return cos[:, None].to(dt), sin[:, None].to(dt)  # broadcast over heads

    # --- cache and accounting -----------------------------------------------------------------

    def make_cache(
        self,
        rows: int,
        capacity: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> Any:
        """An empty generation cache of the variant's kind for `rows` rows; a KVCache's default
        capacity is the attention span min(window, block_size), its default dtype the model's."""
        capacity = self.span if capacity is None else capacity
        return self.variant.make_cache(self.config, rows, capacity, self.span, device or self.device, dtype or self.dtype)

    def context(self) -> int | None:
        """How many trailing tokens decide the next logits (None: all of them); see Variant.context."""
        return self.variant.context(self.config, self.span)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; tied weights count once. non_embedding drops pure lookup tables:
        wpe, and wte when untied (tied, it also does the head's matmul, so it stays; nanoGPT)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.config.pos == "learned":
                n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= sum(t.numel() for t in self.transformer.wte.parameters())
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token, 6N + 12·L·H·Q·T (PaLM appendix B, as nanoGPT's MFU).

        T is the number of keys a query sees at most, min(window, block_size).
        """
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_head * cfg.head_size * self.span
