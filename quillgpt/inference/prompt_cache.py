"""The prompt cache: the keys and values of recent token sequences, kept across requests so a
prompt that starts with one of them prefills only the rest (turn N+1 of a chat starts with turn
N's prompt and reply; users of one server share a system prompt).

An entry is one sequence of token ids and its KV, one compact tensor (n_layer, 2, kv_heads, n,
head_dim) in the KV cache's dtype: the slices of a row of the engine's static cache, copied out,
never the whole cache. `lookup` finds the entry sharing the longest prefix with a prompt, token
ids compared exactly (a prompt never reads an entry past the first id where they differ), and
marks it recently used; `insert` adds an entry, dropping those it covers (a sequence that is a
prefix of the new one: every lookup it served, the new one serves), and evicts the least recently
used until the entries fit the byte budget (and MAX_ENTRIES, which bounds a lookup's scan).
The engine (inference/engine.py) decides what may be stored and where the KV goes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

MAX_ENTRIES = 256  # a lookup compares the prompt with every entry
DEFAULT_TOKENS = 65_536  # the default budget's tokens (e.g. 16 conversations of 4,096), memory permitting
DEFAULT_SHARE = 4  # ... and at most this fraction (1/4) of the memory free when the server starts
ID_BYTES = 8  # an entry's ids (int64), counted in its bytes


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids a and b share (one vectorized compare: a prompt of thousands of ids
    against a few hundred entries)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def as_ids(ids: Sequence[int]) -> np.ndarray:
    """Token ids as the cache keeps and compares them: int64."""
    return np.asarray(ids, dtype=np.int64)


def default_budget(kv_bytes_per_token: int, free_bytes: int | None) -> int:
    """The budget when none is given: DEFAULT_TOKENS tokens of KV, at most 1/DEFAULT_SHARE of the
    memory free (None: unknown, then the tokens alone)."""
    want = DEFAULT_TOKENS * (kv_bytes_per_token + ID_BYTES)
    return want if free_bytes is None else max(0, min(want, free_bytes // DEFAULT_SHARE))


@dataclass
class Entry:
    """A cached sequence: its ids and their KV (n_layer, 2, kv_heads, len(ids), head_dim)."""

    ids: np.ndarray  # int64
    kv: Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + ID_BYTES * len(self.ids)


@dataclass
class Stats:
    """What the cache did: prompts looked up, those that reused a prefix, the prompt tokens seen
    and those read from the cache, entries stored and evicted."""

    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    inserts: int = 0
    evictions: int = 0


class PromptCache:
    """Entries in least-recently-used order within `budget` bytes; see the module docstring.
    Not thread-safe (the engine's owner)."""

    def __init__(self, budget: int, max_entries: int = MAX_ENTRIES) -> None:
        self.budget, self.max_entries = budget, max_entries
        self.stats = Stats()
        self.nbytes = 0  # held by the entries
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # oldest first
        self._next = 0  # the next entry's key

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int], most: int | None = None) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `ids` and that prefix's length, at most `most`
        (None, 0 where no entry shares a first id); the entry becomes the most recently used."""
        ids, most = as_ids(ids), len(ids) if most is None else most
        best, found = self._best(ids)
        found = min(found, most)
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(ids)
        if best is None or found < 1:
            return None, 0
        self._entries.move_to_end(best)
        self.stats.hits += 1
        self.stats.cached_tokens += found
        return self._entries[best], found

    def shared(self, ids: Sequence[int], most: int | None = None) -> int:
        """The prefix `lookup` would give `ids` now, without counting a lookup or touching the order
        (the engine asks it while it decides which rows of a burst wait for the others)."""
        found = self._best(as_ids(ids))[1]
        return found if most is None else min(found, most)

    def _best(self, ids: np.ndarray) -> tuple[int | None, int]:
        """The key of the entry sharing the longest prefix with ids, and its length (None, 0: none)."""
        best, found = None, 0
        for key, entry in self._entries.items():
            n = common_prefix(entry.ids, ids)
            if n > found:
                best, found = key, n
        return best, found

    def covers(self, ids: Sequence[int]) -> bool:
        """Whether an entry holds `ids` whole (then storing them again adds nothing)."""
        ids = as_ids(ids)
        return any(common_prefix(e.ids, ids) == len(ids) for e in self._entries.values())

    def insert(self, ids: Sequence[int], kv: Tensor) -> bool:
        """Store `ids` with their KV (kv.shape[3] == len(ids)); False where it alone exceeds the
        budget. Entries whose ids are a prefix of these go; then the least recently used, until
        everything fits."""
        entry = Entry(as_ids(ids), kv)
        if kv.shape[3] != len(entry.ids):
            raise ValueError(f"the KV holds {kv.shape[3]} positions for {len(entry.ids)} ids")
        if entry.nbytes > self.budget or len(entry.ids) == 0:
            return False
        for key in [k for k, e in self._entries.items() if common_prefix(e.ids, entry.ids) == len(e.ids)]:
            self._drop(key)
        while self._entries and (self.nbytes + entry.nbytes > self.budget or len(self._entries) >= self.max_entries):
            self.evict()
        self._entries[self._next] = entry
        self._next += 1
        self.nbytes += entry.nbytes
        self.stats.inserts += 1
        return True

    def evict(self) -> None:
        """Drop the least recently used entry."""
        self._drop(next(iter(self._entries)))
        self.stats.evictions += 1

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

    def summary(self) -> dict[str, int]:
        """/health's figures: entries, bytes held and allowed, and the stats."""
        return {"entries": len(self), "bytes": self.nbytes, "budget_bytes": self.budget, **vars(self.stats)}
