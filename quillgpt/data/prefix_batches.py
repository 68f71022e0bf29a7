"""Prefix-LM training batches: which part of each window is the (bidirectional) prefix.

A prefix-LM (`model.attention: prefix`, model/variants/prefix.py) reads the first P tokens of a
window both ways and is trained to predict only what comes after them (mask_prefix_targets).

P is drawn per row, uniform in [0, prefix_max] (default block_size / 2), by a seeded generator
whose state goes into the checkpoint, so a resumed run draws what the uninterrupted run drew.
With `model.prefix_sep` (a string that is one token), a window that contains the separator has
its prefix end right after the first one (e.g. "question=answer" lines with prefix_sep "=");
windows without it get a drawn P.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from quillgpt.config import ModelConfig
from quillgpt.data.batches import SeededSampler
from quillgpt.errors import QuillError

Batch = tuple[Tensor, Tensor, Tensor]  # x, y (prefix targets masked), prefix_len


def mask_prefix_targets(y: Tensor, prefix_len: Tensor) -> Tensor:
    """y (B, T) with the targets inside each row's prefix set to -1 (ignored): t < prefix_len − 1."""
    t = torch.arange(y.shape[1], device=y.device)[None, :]  # (1, T)
    return y.masked_fill(t < prefix_len.to(y.device)[:, None] - 1, -1)


class PrefixLengths(SeededSampler):
    """Per-row prefix lengths for training windows, from a seeded, checkpointed generator."""

    def __init__(self, cfg: ModelConfig, seed: int, sep_id: int | None = None) -> None:
        self.high = cfg.train_prefix_max
        self.sep_id = sep_id
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self, x: Tensor) -> Tensor:
        """(B,) prefix lengths for the windows x (B, T), on x's device."""
        P = torch.randint(self.high + 1, (x.shape[0],), generator=self.generator).to(x.device)
        if self.sep_id is not None:
            is_sep = x == self.sep_id  # (B, T)
            first = is_sep.int().argmax(dim=1)  # first separator (0 when there is none)
            P = torch.where(is_sep.any(dim=1), first + 1, P)
        return P


def separator_id(cfg: ModelConfig, encode: Any) -> int | None:
    """model.prefix_sep as one token id (encode: the tokenizer's str → ids), or None."""
    if cfg.prefix_sep is None:
        return None
    ids = encode(cfg.prefix_sep)
    if len(ids) != 1:
        raise QuillError(f"model.prefix_sep {cfg.prefix_sep!r} is {len(ids)} tokens with this tokenizer; it must be exactly one")
    return ids[0]


class PrefixSampler:
    """A training batch sampler (next() → x, y) turned into one for a prefix-LM: next() → x, y with
    the prefix targets ignored, and each row's prefix length; its state holds both generators."""

    def __init__(self, sampler: Any, lengths: PrefixLengths) -> None:
        self.sampler, self.lengths = sampler, lengths

    def next(self) -> Batch:
        x, y = self.sampler.next()
        prefix_len = self.lengths.draw(x)
        return x, mask_prefix_targets(y, prefix_len), prefix_len

    def state_dict(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "prefix": self.lengths.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self.lengths.load_state_dict(state["prefix"])
