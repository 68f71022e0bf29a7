"""Batches of conversations (chat data): one conversation per row, padded, the loss on the
assistant's tokens only.

Row i holds conversation i from its first token, as the model reads a conversation when it
answers (position 0 at its start), cut to block_size + 1 tokens, with x = row[:-1] and
y = row[1:]; y is -1 (ignored by the loss) wherever the target is not the assistant's and past
the conversation's end, and x there is padding (id 0) that no real token attends to: causal
attention looks only back. So no row attends across two conversations, and the model's plain
causal path (no mask) trains it; the price is the padding, reported by `fill`.

Packing several conversations into a row would waste no compute, but needs a per-row document
mask (and positions restarting in each conversation), which takes CPU attention off its fast
causal kernel; measured in scripts/finetune_recipe.py against padding on the recipe's data.

A conversation longer than block_size + 1 tokens is truncated (its tail is not trained) and
counted; one left with no assistant token inside the window (a long prompt) is not trained at
all and counted too (`ChatRows.truncated`, `ChatRows.untrained`); training prints both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from quillgpt.data.batches import SeededSampler
from quillgpt.data.chat_data import ASSISTANT, START
from quillgpt.data.prepare import load_tokens
from quillgpt.errors import QuillError


class ChatRows:
    """A split's conversations (token ids and flags, as prepared) as rows of block_size tokens."""

    def __init__(self, tokens: np.ndarray, flags: np.ndarray, block_size: int, split: str = "train") -> None:
        self.tokens, self.flags, self.block_size, self.split = tokens, flags, block_size, split
        starts = np.flatnonzero(np.asarray(flags) & START)  # (C,) each conversation's first token
        lengths = np.diff(starts, append=len(tokens))
        self.width = np.minimum(lengths, block_size + 1)  # (C,) tokens of each that a row holds
        mine = np.concatenate([[0], np.cumsum(np.asarray(flags) & ASSISTANT, dtype=np.int64)])  # prefix counts
        targets = mine[starts + self.width] - mine[starts + 1]  # the assistant's tokens among targets 1..width-1
        self.truncated = int(np.count_nonzero(lengths > block_size + 1))
        self.untrained = int(np.count_nonzero(targets == 0))
        self.starts, self.targets = starts[targets > 0], targets[targets > 0]
        self.width = self.width[targets > 0]
        if not len(self.starts):
            raise QuillError(
                f"the {split} split has no conversation with an assistant token within model.block_size="
                f"{block_size}: raise model.block_size or shorten the prompts"
            )

    @classmethod
    def prepared(cls, out_dir: str | Path, split: str, block_size: int) -> ChatRows:
        """The rows of a chat dataset's prepared split (its token and flag shards)."""
        return cls(load_tokens(out_dir, split), load_tokens(out_dir, split, flags=True), block_size, split)

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def fill(self) -> float:
        """The share of a row's block_size + 1 tokens that are a conversation's (the rest: padding)."""
        return float(self.width.mean()) / (self.block_size + 1)

    def batch(self, rows: np.ndarray, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 (B, block_size) for the conversations `rows` (indices into this split)."""
        offsets = np.arange(self.block_size + 1)
        inside = offsets < self.width[rows, None]  # (B, T+1)
        at = np.where(inside, self.starts[rows, None] + offsets, self.starts[rows, None])  # padding reads the start
        ids = np.asarray(self.tokens[at], dtype=np.int64)
        trained = inside & (np.asarray(self.flags[at]) & ASSISTANT).astype(bool)
        x = torch.from_numpy(np.where(inside, ids, 0)[:, :-1].copy())
        y = torch.from_numpy(np.where(trained, ids, -1)[:, 1:].copy())
        return x.to(device), y.to(device)

    def fixed(self, n: int) -> np.ndarray:
        """(≤ n,) conversations spread evenly over the split, the same every call (evaluation)."""
        return np.unique(np.linspace(0, len(self) - 1, n).round().astype(np.int64))

    def describe(self) -> str | None:
        """A note on what a row cannot hold, or None when every conversation fits."""
        if not self.truncated and not self.untrained:
            return None
        return (
            f"note: {self.truncated} {self.split} conversation(s) are longer than model.block_size + 1 = "
            f"{self.block_size + 1} tokens and are truncated; {self.untrained} have no assistant token left "
            "in the window and are not trained"
        )


class ChatSampler(SeededSampler):
    """Random conversations drawn with a seeded torch.Generator, as BatchSampler draws windows:
    the stream depends only on the seed and the batches drawn, and resumes from state_dict."""

    def __init__(self, rows: ChatRows, batch_size: int, seed: int, device: str | torch.device = "cpu") -> None:
        self.rows, self.batch_size, self.device = rows, batch_size, torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        picks = torch.randint(len(self.rows), (self.batch_size,), generator=self.generator)
        return self.rows.batch(picks.numpy(), self.device)
