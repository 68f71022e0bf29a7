"""The static KV cache, written at explicit positions (the gpt-fast design).

Per layer, keys and values of (rows, kv_heads, capacity, head_dim), allocated once. A token at
position p of a row goes to slot p % capacity of that row, and `pos` (rows, capacity) keeps the
position each slot holds, so the shared attention rule (attention.attention_mask) masks what a
query may not see. With capacity ≥ the attention span (min(window, block_size), the default) a
slot is only overwritten by a position `capacity` later, when no query can see the old key any
more: a ring, exact however long generation runs, and the shapes never change (a one-token step
attends over the whole buffer with a mask). Rows are independent: each has its own positions,
and `reset(row)` forgets one row.

Nothing is remembered between calls but the keys, values and positions themselves: a forward
asks `plan(pos, rows)` where its tokens go (a KVWrite, which it hands to every layer's `update`),
and the decode step asks `decode_slots(pos)`. Every caller says where its tokens are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from quillgpt import huge_pages

EMPTY_POS = -(2**62)  # position of a cache slot that holds no key yet: matches no query
SlotIndex = tuple[Tensor, Tensor]  # (rows, slots), each (R,): where a decode step's keys go


class Cache(Protocol):
    """What every generation cache offers (KVCache here; a variant's own, e.g. InfiniCache): its
    size, forgetting rows, and a forward's write plan for tokens at positions pos (B or 1, T),
    which the variant's attention layers then consume (a KVWrite for a KVCache)."""

    @property
    def nbytes(self) -> int: ...

    def reset(self, row: int | None = None) -> None: ...

    def plan(self, pos: Tensor, rows: Tensor | None = None) -> object: ...


@dataclass(frozen=True)
class KVWrite:
    """Where one forward's T tokens go and what they attend over, from their positions."""

    rows: Tensor  # (B,) cache rows of the batch's rows
    slots: Tensor  # (B, m) slots of the last m = min(T, capacity) tokens (earlier ones would be overwritten)
    first: int  # T - m: tokens before the stored ones
    key_pos: Tensor  # (B, S): positions of the keys the tokens attend over, [cached | new]
    cached: int  # how many of the rows' slots the keys include (S = cached + T): up to the last in use, 0: none


class KVCache:
    """Static keys/values of `rows` independent rows; see the module docstring."""

    def __init__(
        self,
        n_layer: int,
        rows: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        span: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"KV cache capacity must be at least 1, got {capacity}")
        # one tensor per layer, not views of one: a compiled decode step then writes them in place
        # (a write through a view of a graph input makes inductor copy the whole base back)
        # (on the CPU in huge pages where they span them: a decode step at depth streams them)
        shape = (rows, kv_heads, capacity, head_dim)
        cpu = torch.device(device).type == "cpu"

        def zeros() -> Tensor:
            return huge_pages.zeros(shape, dtype) if cpu else torch.zeros(shape, device=device, dtype=dtype)

        self.k = [zeros() for _ in range(n_layer)]
        self.v = [zeros() for _ in range(n_layer)]
        self.pos = torch.full((rows, capacity), EMPTY_POS, device=device, dtype=torch.long)
        self.capacity, self.span = capacity, span

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values (the per-row positions add rows·capacity·8 more)."""
        return sum(t.nbytes for t in self.k + self.v)

    def reset(self, row: int | None = None) -> None:
        """Forget every row's tokens, or one row's (the buffers are reused, not reallocated)."""
        if row is None:
            self.pos.fill_(EMPTY_POS)
        else:
            self.pos[row].fill_(EMPTY_POS)

    def plan(self, pos: Tensor, rows: Tensor | None = None) -> KVWrite:
        """T new tokens at positions pos (B, T) (or (1, T) for every row) of cache `rows` (B,)
        (None: all rows, B = the cache's rows): record their positions and say where they go.

        They attend over [the rows' cached keys, their own] (only their own when those rows hold
        nothing), then the last min(T, capacity) are stored (distinct slots: consecutive positions).
        The cached keys are the slots up to the last any of the rows uses, not the whole capacity:
        a prompt after a cached prefix, or a long prompt's later pieces, costs what the cache holds.
        Negative (padding) positions may only start a row, never follow its real tokens.
        """
        if rows is None:
            rows = torch.arange(self.pos.shape[0], device=pos.device)
        pos = pos.expand(len(rows), -1)  # (B, T)
        T = pos.shape[1]
        if self.capacity < self.span and int(pos.max()) >= self.capacity:
            raise ValueError(
                f"KV cache of capacity {self.capacity} is full (position {int(pos.max())}) and would drop "
                f"keys still within the attention span ({self.span}); make it larger or reset it"
            )
        m = min(T, self.capacity)
        slots = pos[:, T - m :] % self.capacity  # (B, m)
        old = self.pos[rows]  # (B, capacity): a copy, taken before the write
        used = (old != EMPTY_POS).any(dim=0).nonzero()
        cached = int(used[-1]) + 1 if len(used) else 0
        self.pos[rows[:, None], slots] = pos[:, T - m :]
        key_pos = torch.cat([old[:, :cached], pos], dim=1) if cached else pos
        return KVWrite(rows, slots, T - m, key_pos, cached)

    def update(self, layer: int, k: Tensor, v: Tensor, plan: KVWrite) -> tuple[Tensor, Tensor]:
        """Store this layer's new k, v (B, KV, T, hd) as planned; return the keys/values to attend
        over, in the order of plan.key_pos."""
        ks, vs = self.k[layer], self.v[layer]
        n = plan.cached  # copies of the slots in use, before the writes
        k_all = torch.cat([ks[:, :, :n][plan.rows], k.to(ks.dtype)], dim=2) if n else k
        v_all = torch.cat([vs[:, :, :n][plan.rows], v.to(vs.dtype)], dim=2) if n else v
        rows = plan.rows[:, None]  # (B, 1) with slots (B, m)
        ks[rows, :, plan.slots] = k[:, :, plan.first :].transpose(1, 2).to(ks.dtype)  # (B, m, KV, hd)
        vs[rows, :, plan.slots] = v[:, :, plan.first :].transpose(1, 2).to(vs.dtype)
        return k_all, v_all

    def decode_slots(self, pos: Tensor) -> SlotIndex:
        """One new token for every row at positions pos (R,): record them; their (rows, slots)."""
        at = (torch.arange(pos.shape[0], device=pos.device), pos % self.capacity)
        self.pos[at] = pos
        return at

    def write_one(self, layer: int, k: Tensor, v: Tensor, at: SlotIndex, n_keys: int | None = None) -> tuple[Tensor, Tensor]:
        """One new token per row, k, v (R, KV, 1, hd), at `at` (the cache's first R rows): the decode
        step's fixed-shape write. Returns those rows' (R, KV, n_keys or capacity, hd) buffers to attend over."""
        ks, vs = self.k[layer], self.v[layer]
        rows, slots = at
        ks[rows, :, slots] = k[:, :, 0] if k.dtype == ks.dtype else k[:, :, 0].to(ks.dtype)  # (R, KV, hd)
        vs[rows, :, slots] = v[:, :, 0] if v.dtype == vs.dtype else v[:, :, 0].to(vs.dtype)
        R = k.shape[0]
        return ks[:R, :, :n_keys], vs[:R, :, :n_keys]


@dataclass(frozen=True)
class PrefixWrite:
    """A forward through a PrefixKV: store its keys (the shared prefix), or attend over them."""

    key_pos: Tensor  # (1, S): positions of the keys the tokens attend over, [prefix | new]
    store: bool


class PrefixKV:
    """The keys and values of one prefix that every row of a training batch shares, kept in the
    autograd graph: the prefix runs once, as one row, and each row's later tokens attend over
    its keys, so their gradient is the sum over the rows, as if each row had run it (GPT.forward's
    share_prefix). The first forward stores; every later one attends over [prefix | its own]."""

    def __init__(self) -> None:
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        self.pos: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in [*self.k.values(), *self.v.values()])

    def reset(self, row: int | None = None) -> None:
        self.k, self.v, self.pos = {}, {}, None

    def plan(self, pos: Tensor, rows: Tensor | None = None) -> PrefixWrite:
        if self.pos is None:
            self.pos = pos
            return PrefixWrite(pos, store=True)
        return PrefixWrite(torch.cat([self.pos, pos], dim=1), store=False)

    def update(self, layer: int, k: Tensor, v: Tensor, plan: PrefixWrite) -> tuple[Tensor, Tensor]:
        if plan.store:
            self.k[layer], self.v[layer] = k, v
            return k, v
        B = k.shape[0]
        pk, pv = self.k[layer].expand(B, -1, -1, -1), self.v[layer].expand(B, -1, -1, -1)
        return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)


MIN_SHARED_PREFIX = 8  # a shared prefix shorter than this runs in every row (not worth a second pass)


def prefix_worth_sharing(idx: Tensor, targets: Tensor) -> int:
    """shared_prefix_len where sharing pays (2 or more rows, at least MIN_SHARED_PREFIX tokens), else 0."""
    P = shared_prefix_len(idx, targets) if idx.shape[0] > 1 else 0
    return P if P >= MIN_SHARED_PREFIX else 0


def shared_prefix_len(idx: Tensor, targets: Tensor) -> int:
    """How many leading tokens every row of idx (B, T) holds alike with no target scored
    (targets != -1) among them, at most T - 1: the prefix PrefixKV can share (a system prompt)."""
    same = (idx == idx[:1]).all(dim=0) & (targets == -1).all(dim=0)  # (T,)
    differs = (~same).nonzero()
    P = int(differs[0]) if len(differs) else idx.shape[1]
    return min(P, idx.shape[1] - 1)
