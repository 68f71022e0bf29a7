"""Prefix-LM attention: the prompt (in training, a window's first P tokens) attends both ways.

Token i sees token j iff j ≤ i or both lie in the row's prefix, positions [0, P). The model is
trained to predict only what comes after the prefix: the target of position t (the token t+1)
counts iff t ≥ P − 1, so the first scored token is the one right after the prefix, predicted from
the prefix's last position, which has seen the whole prefix. Generation prefills the prompt as
the prefix and never crops it, so prompt + new tokens must fit block_size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quillgpt.config import ModelConfig
from quillgpt.model.attention import attention_mask
from quillgpt.model.variants.base import Variant


def prefix_mask(q_pos: Tensor, k_pos: Tensor, prefix_len: Tensor | int, span: int) -> Tensor:
    """attention_mask plus the prefix-LM rule: query i sees key j iff j ≤ i or both lie in the
    row's prefix, positions [0, prefix_len) — the prefix attends both ways. prefix_len: (B,) or int."""
    P = torch.as_tensor(prefix_len, device=q_pos.device).view(-1, 1, 1, 1)  # (B or 1, 1, 1, 1)
    q = q_pos[:, None, :, None]  # (B, 1, T, 1)
    k = k_pos[:, None, None, :]  # (B, 1, 1, S)
    both = (q >= 0) & (q < P) & (k >= 0) & (k < P)
    return attention_mask(q_pos, k_pos, span) | both


def eval_prefix_len(cfg: ModelConfig) -> int:
    """The prefix of the trainer's fixed evaluation windows: the middle of the training draw."""
    return cfg.train_prefix_max // 2


class Prefix(Variant):
    name = "prefix"
    bidirectional_prefix = True
    shares_prefix_keys = False  # a prefix token sees the tokens after it
    hf_exportable = False  # no transformers decoder reads its prompt both ways

    def mask(self, q_pos: Tensor, k_pos: Tensor, span: int, prefix_len: Tensor | None) -> Tensor:
        if prefix_len is None:  # no prefix given: plain causal (prefix 0)
            return attention_mask(q_pos, k_pos, span)
        return prefix_mask(q_pos, k_pos, prefix_len, span)

    def room(self, cfg: ModelConfig, prompt_len: int) -> tuple[int, str] | None:
        """The prompt is the prefix and is never cropped (cropping would drop part of it, or
        change which tokens it holds): prompt + new tokens must fit block_size."""
        return cfg.block_size - prompt_len, "a prefix-LM (model.attention=prefix) keeps its whole prompt as the prefix"
