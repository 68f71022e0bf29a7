"""What an attention variant is: everything that differs between causal attention, a prefix-LM
and Infini-attention, asked for by name instead of compared as a string.

The model builds each block's attention from it and asks it for the mask; the engine asks it
whether rows decode in the static KV cache and how far back a token can matter; generation asks
it what a prompt may be; evaluation and training ask whether the prompt (a window's context) is
a bidirectional prefix; `quill attention` asks it what else it can show; export asks whether
Hugging Face can express it. A new variant is a subclass in its own module plus one line in
the registry (variants/__init__.py) and its name in config validation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from quillgpt.config import ModelConfig
from quillgpt.model.attention import CausalSelfAttention, attention_mask, mask_to_bias
from quillgpt.model.kv_cache import Cache, KVCache


class Variant:
    """Causal attention: the defaults every other variant starts from."""

    name = "causal"
    static_cache = True  # rows decode in the engine's static KVCache (one fixed-shape step for all)
    bidirectional_prefix = False  # the prompt / a window's context attends both ways
    hf_exportable = True  # a transformers architecture computes exactly this
    shares_prefix_keys = True  # a token's keys depend only on the tokens up to it (training may share a prefix's)

    def attention(self, cfg: ModelConfig) -> nn.Module:
        """One block's attention module (its parameter names are what checkpoints store)."""
        return CausalSelfAttention(cfg)

    def span(self, cfg: ModelConfig) -> int:
        """The most positions a query sees back (itself included) in the dot-product part: with
        global layers among windowed ones (model.global_every) theirs, block_size."""
        return min(cfg.window, cfg.block_size) if cfg.window and cfg.global_every is None else cfg.block_size

    def mask(self, q_pos: Tensor, k_pos: Tensor, span: int, prefix_len: Tensor | None) -> Tensor:
        """(B, T) query and (B, S) key positions → (B, 1, T, S) boolean mask, True = may attend."""
        return attention_mask(q_pos, k_pos, span)

    def plan(
        self, pos: Tensor | None, cache: Cache | None, rows: Tensor | None, span: int, prefix_len: Tensor | None, dtype: torch.dtype
    ) -> tuple[Tensor | None, object]:
        """One forward's (mask as an additive bias, cache write plan) for tokens at positions pos
        (B or 1, T); pos None is the plain causal case (no mask: sdpa's is_causal fast path)."""
        if pos is None:
            return None, None
        plan = cache.plan(pos, rows) if cache is not None else None
        key_pos = pos if plan is None else plan.key_pos
        return mask_to_bias(self.mask(pos, key_pos, span, prefix_len), dtype), plan

    def embed_positions(self, cfg: ModelConfig, pos: Tensor) -> Tensor:
        """The positions the position embedding (learned or RoPE) sees for absolute positions."""
        return pos

    def crops(self, cfg: ModelConfig) -> bool:
        """Past block_size the context is cropped to its last block_size tokens and positions
        restart at 0 (learned positions exist only up to block_size); a cache must be refilled."""
        return cfg.pos == "learned"

    def context(self, cfg: ModelConfig, span: int) -> int | None:
        """How many trailing tokens decide the next logits: the crop window (learned positions),
        or the receptive field of the last token through n_layer banded layers, n_layer·(span-1)+1
        (RoPE: feeding exactly these gives the cache's logits); None: every token ever seen."""
        return cfg.block_size if self.crops(cfg) else cfg.n_layer * (span - 1) + 1

    def room(self, cfg: ModelConfig, prompt_len: int) -> tuple[int, str] | None:
        """(the most new tokens a prompt of `prompt_len` tokens may get within block_size — ≤ 0: the
        prompt itself is too long —, why), or None for no limit. Callers word the fix in their
        own terms (a flag, an HTTP field)."""
        return None

    def make_cache(self, cfg: ModelConfig, rows: int, capacity: int, span: int, device: torch.device | str, dtype: torch.dtype) -> Cache:
        """An empty generation cache for `rows` rows."""
        return KVCache(cfg.n_layer, rows, cfg.kv_heads, cfg.head_size, capacity, span, device, dtype)

    def shows(self, model: nn.Module) -> dict[str, Any]:
        """What `quill attention` can show beyond the weights (e.g. Infini-attention's gates)."""
        return {}

    def __repr__(self) -> str:
        return f"<attention variant {self.name}>"
