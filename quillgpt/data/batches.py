"""Batches of windows from a split's tokens: x = block_size ids, y = the same window shifted by
one (the next tokens). Random windows for training from a seeded, checkpointed generator; fixed,
evenly spread windows for the trainer's evaluations."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from quillgpt.errors import QuillError


def _check_length(tokens: np.ndarray, block_size: int, split: str) -> None:
    if len(tokens) < block_size + 1:
        raise QuillError(
            f"the {split} split has {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}; "
            "use a smaller model.block_size, a larger data.val_fraction or more text"
        )


def batch_from_starts(
    tokens: np.ndarray, starts: np.ndarray, block_size: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 (B, T) windows starting at `starts`; y[:, t] = x[:, t + 1] continued."""
    idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(block_size + 1)  # (B, T+1)
    w = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))  # (B, T+1)
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (B, T) each
    device = torch.device(device)
    if device.type == "cuda":  # pinned host memory lets the copy overlap with compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def fixed_windows(tokens: np.ndarray, block_size: int, n: int, split: str = "val") -> np.ndarray:
    """(n,) start offsets spread evenly over the split: the same every call, so periodic
    evaluations compare like with like."""
    _check_length(tokens, block_size, split)
    return np.linspace(0, len(tokens) - block_size - 1, n).round().astype(np.int64)


class SeededSampler:
    """A sampler whose draws come from one seeded generator: its state is the generator's, saved in
    the checkpoint, so a resumed run draws what the uninterrupted run drew."""

    generator: torch.Generator

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


class BatchSampler(SeededSampler):
    """Random windows drawn with a seeded torch.Generator: the stream depends only on the seed
    and how many batches were drawn, and `state_dict` lets a resumed run continue it exactly."""

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        batch_size: int,
        seed: int,
        device: str | torch.device = "cpu",
        split: str = "train",
    ):
        _check_length(tokens, block_size, split)
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - self.block_size, (self.batch_size,), generator=self.generator)
        return batch_from_starts(self.tokens, starts.numpy(), self.block_size, self.device)
