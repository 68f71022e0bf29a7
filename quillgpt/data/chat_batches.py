"""Batches of conversations (chat data): one conversation per row, padded to the batch's longest,
the loss on the assistant's tokens only.

Row i holds conversation i from its first token, as the model reads a conversation when it
answers (position 0 at its start), cut to block_size + 1 tokens, with x = row[:-1] and
y = row[1:]; y is -1 (ignored by the loss) wherever the target is not the assistant's and past
the conversation's end, and x there is padding (id 0) that no real token attends to: causal
attention looks only back. So no row attends across two conversations, and the model's plain
causal path (no mask) trains it. A batch is as long as its longest row, not block_size (which
only caps a row): a step costs what its conversations cost. With a token budget
(train.batch_tokens) the sampler also puts conversations of similar length together
(`ChatSampler`), so little of a batch is padding (`padded_fill`).

Packing several conversations into a row would waste no compute either, but needs a per-row
document mask (and positions restarting in each conversation), which takes CPU attention off its
fast causal kernel; measured in scripts/finetune_recipe.py against padding on the recipe's data.

A conversation longer than block_size + 1 tokens is truncated (its tail is not trained) and
counted; one left with no assistant token inside the window (a long prompt) is not trained at
all and counted too (`ChatRows.truncated`, `ChatRows.untrained`); training prints both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from quillgpt.data.batches import SeededSampler
from quillgpt.data.chat_data import ASSISTANT, START
from quillgpt.data.prepare import flags_through, load_tokens
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
        through = flags_through(out_dir)
        if through is not None and through < block_size + 1:
            raise QuillError(
                f"{out_dir} was prepared for rows of {through} tokens (its conversations' assistant tokens are found that far), "
                f"shorter than model.block_size={block_size} + 1: prepare it again with this config (`quill prepare --config ...`)"
            )
        return cls(load_tokens(out_dir, split), load_tokens(out_dir, split, flags=True), block_size, split)

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def fill(self) -> float:
        """The share of a row's block_size + 1 tokens that are a conversation's (the rest: padding)."""
        return float(self.width.mean()) / (self.block_size + 1)

    @property
    def longest(self) -> int:
        """The longest row's length in tokens (x's length for it: its conversation's tokens − 1, ≤ block_size)."""
        return int(self.width.max()) - 1

    def real_tokens(self, rows: np.ndarray) -> int:
        """The conversations' tokens among the x of `rows` (the rest of the batch is padding)."""
        return int((self.width[rows] - 1).sum())

    def batch(self, rows: np.ndarray, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 (B, T) for the conversations `rows` (indices into this split), T the longest's length."""
        offsets = np.arange(int(self.width[rows].max()))
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


def token_budget_batches(width: np.ndarray, order: np.ndarray, batch_tokens: int, max_rows: int) -> list[np.ndarray]:
    """`order` (a shuffled epoch of row indices) cut into batches of similar length: sorted by
    length (stably, so equal lengths keep their random order), then filled while rows × the
    longest row's x length stays within batch_tokens (and rows ≤ max_rows); a row longer than
    the budget is a batch alone."""
    order = order[np.argsort(width[order], kind="stable")]
    lengths = width[order] - 1  # sorted ascending: a batch's last row is its longest
    batches, start = [], 0
    for i in range(1, len(order) + 1):
        if i == len(order) or (i + 1 - start) * lengths[i] > batch_tokens or i - start >= max_rows:
            batches.append(order[start:i])
            start = i
    return batches


class ChatSampler(SeededSampler):
    """Batches of conversations drawn with a seeded torch.Generator, as BatchSampler draws
    windows: the stream depends only on the seed and the batches drawn, and resumes from state_dict.

    Without a token budget: batch_size conversations drawn at random (with replacement). With
    batch_tokens: epochs, each a shuffle of every conversation cut into batches of similar length
    by the budget (token_budget_batches), the batches in random order.
    """

    def __init__(
        self, rows: ChatRows, batch_size: int, seed: int, device: str | torch.device = "cpu", batch_tokens: int | None = None
    ) -> None:
        self.rows, self.batch_size, self.device, self.batch_tokens = rows, batch_size, torch.device(device), batch_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.real = 0  # the conversations' tokens drawn so far (x tokens that are not padding)
        self.epoch, self.position, self.plan = 0, 0, self._epoch_plan() if batch_tokens else []

    def _epoch_plan(self) -> list[np.ndarray]:
        """This epoch's batches; the generator's state before it is kept to rebuild it on resume."""
        self.epoch_start = self.generator.get_state()
        order = torch.randperm(len(self.rows), generator=self.generator).numpy()
        batches = token_budget_batches(self.rows.width, order, self.batch_tokens, self.batch_size)
        shuffle = torch.randperm(len(batches), generator=self.generator).tolist()
        return [batches[i] for i in shuffle]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_tokens is None:
            picks = torch.randint(len(self.rows), (self.batch_size,), generator=self.generator).numpy()
        else:
            if self.position == len(self.plan):
                self.epoch, self.position, self.plan = self.epoch + 1, 0, self._epoch_plan()
            picks, self.position = self.plan[self.position], self.position + 1
        self.real += self.rows.real_tokens(picks)
        return self.rows.batch(picks, self.device)

    def batches_per_epoch(self) -> int:
        """Batches in an epoch (token budget), or conversations / batch_size rounded up."""
        return len(self.plan) if self.batch_tokens else -(-len(self.rows) // self.batch_size)

    def padded_per_epoch(self) -> int:
        """Tokens an epoch runs, padding included (without a token budget: as many rows as
        conversations, each as long as the longest)."""
        if self.batch_tokens is None:
            return len(self.rows) * self.rows.longest
        return sum(len(b) * (int(self.rows.width[b].max()) - 1) for b in self.plan)

    def largest_batch(self) -> tuple[int, int, int]:
        """(rows, T, scored) bounding a micro-batch's activations: rows × T tokens, the assistant's
        `scored` among them. Drawn at random: batch_size rows, each as long and as scored as the
        split's most; by a token budget: the largest of this epoch's batches."""
        if self.batch_tokens is None:
            return self.batch_size, self.rows.longest, self.batch_size * int(self.rows.targets.max())
        rows, T = max(((len(b), int(self.rows.width[b].max()) - 1) for b in self.plan), key=lambda s: s[0] * s[1])
        return rows, T, max(int(self.rows.targets[b].sum()) for b in self.plan)

    def state_dict(self) -> dict[str, Any]:
        if self.batch_tokens is None:
            return {"generator": self.generator.get_state()}
        return {"generator": self.epoch_start, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        if self.batch_tokens is not None:
            self.plan = self._epoch_plan()
            self.epoch, self.position = state["epoch"], state["position"]
