"""The plain reference engine: every step, one forward over each active row's tokens.

`Recompute` has the engine's interface (add / step / release, the same finish rule and random
streams), so everything built on an engine runs on it too, and `use_cache=False` is the
reference the static cache is tested against. Each step left-pads the active rows into one
batch — pad tokens get negative positions, which nothing attends to — and feeds each row the
tokens that decide its next logits (model.context(): the last block_size under learned
positions, the receptive field n_layer·(span-1)+1 under RoPE — feeding only the last block_size
would not do, as earlier tokens of that crop would lose context the cache had when it stored
their keys —, and for Infini-attention every token, each row alone from its first).
"""

from __future__ import annotations

import torch
from torch import Tensor

from quillgpt.inference.engine import MEMORY_FIX, Rows, _Row
from quillgpt.model.gpt import GPT


class Recompute(Rows):
    """Rows of generation recomputed from their tokens at every step."""

    def __init__(
        self,
        model: GPT,
        max_rows: int = 1,
        *,
        dtype: torch.dtype | None = None,
        unit: str = "row",
        capacity: int | None = None,
        memory_fix: str = MEMORY_FIX,
    ) -> None:
        super().__init__(model, max_rows, dtype, unit, capacity, memory_fix)

    def _first_logits(self, rs: list[int], rows: list[_Row], ids: list[list[int]]) -> Tensor:
        return self._logits(rs)

    def _step_logits(self, active: list[int], width: int) -> Tensor:
        logits = torch.zeros(width, self.model.config.vocab_size, device=self.device)
        return logits.index_copy(0, torch.tensor(active, device=self.device), self._logits(active))

    def _logits(self, active: list[int]) -> Tensor:
        """(len(active), V) float next-token logits of these rows, from their tokens."""
        rows = [self._rows[r] for r in active]
        if self.context is None:  # infini: each row alone from its first token (no padding in the memory)
            return torch.cat([self.model(torch.tensor([list(row.tokens)], device=self.device))[0][:, -1] for row in rows]).float()
        W = max(len(row.tokens) for row in rows)
        idx = torch.zeros(len(rows), W, dtype=torch.long)
        pos = torch.zeros(len(rows), W, dtype=torch.long)
        for i, row in enumerate(rows):  # left padding: pad tokens get negative positions
            n = len(row.tokens)
            idx[i, W - n :] = torch.tensor(list(row.tokens))
            first = 0 if self.crops else row.length - n  # RoPE keeps absolute positions
            pos[i] = torch.arange(W) - (W - n) + first
        plain = bool((pos == torch.arange(W)).all())  # 0..W-1 everywhere: sdpa's causal fast path
        prefix = None
        if self.variant.bidirectional_prefix:  # the prompt is the prefix (never cropped: check_room)
            prefix = torch.tensor([row.length - row.new for row in rows], device=self.device)
        logits, _ = self.model(idx.to(self.device), pos=None if plain else pos.to(self.device), prefix_len=prefix)
        return logits[:, -1].float()
