"""Token shards: tokenizing pieces of text in parallel processes, writing fixed-size shard files
in order, and reading a split's shards back as one array.

A split (train or val) is a sequence of shard files of `shard_tokens` ids each (the last one
shorter): `train.bin`, `train-000001.bin`, `train-000002.bin`, ... so a corpus that fits one
shard has nanoGPT's layout. Chat data adds a flags file beside each (`train.flags.bin`: a uint8
per token, data/chat_data.py). Shards are written whole (temp file + rename), one after another;
after each, the caller records where the next one starts, which is all a resumed run needs.

This module imports no torch: worker processes start with numpy and tiktoken only.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from quillgpt.data.chat_data import ChatStats, encode_lines
from quillgpt.data.corpus import Piece
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.data.tokenizer_files import tokenizer_from_spec
from quillgpt.files import atomic_write

IN_FLIGHT = 3  # tasks per worker submitted ahead: slack for uneven tasks, ~12 MB of text each


def shard_name(split: str, index: int) -> str:
    return f"{split}.bin" if index == 0 else f"{split}-{index:06d}.bin"


def flags_name(shard: str) -> str:
    """The flags file beside a chat shard: train.bin → train.flags.bin."""
    return shard.removesuffix(".bin") + ".flags.bin"


@dataclass
class Task:
    """Consecutive pieces of one split, tokenized as a unit by one worker."""

    split: str
    cursor: dict[str, int]  # where the reader stood when the task began: a resume point
    pieces: list[str] = field(default_factory=list)
    starts: list[bool] = field(default_factory=list)  # the piece begins a document
    wheres: list[str] = field(default_factory=list)  # each piece's "path line N" (whole records only)
    chars: int = 0
    read_bytes: int = 0  # bytes of the corpus on disk read for this task (progress)

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece.text)
        self.starts.append(piece.starts_document)
        self.wheres.append(piece.where)
        self.chars += len(piece.text)


@dataclass
class Encoded:
    """A task's ids, and for chat data the flags beside them and what the lines held."""

    arrays: tuple[np.ndarray, ...]  # (ids,), or (ids, flags): the same length each
    chat: ChatStats | None = None


@dataclass(frozen=True)
class Encoding:
    """How tasks become ids: plain text (documents after the document-start id), or chat lines."""

    dtype: str
    chat: bool = False
    skip_bad_lines: bool = False
    chat_tokens: int | None = None  # chat: the flags of each conversation's first this many ids (None: all)

    def __call__(self, tok: Tokenizer, pieces: list[str], starts: list[bool], wheres: list[str], bulk: bool = True) -> Encoded:
        dtype = np.dtype(self.dtype)
        if self.chat:
            return Encoded(*encode_lines(tok, pieces, wheres, dtype, self.skip_bad_lines, self.chat_tokens))
        return Encoded((encode_task(tok, pieces, starts, dtype, bulk),))


def iter_tasks(pieces: Iterator[Piece], task_chars: int, read_before: int = 0) -> Iterator[Task]:
    """Group consecutive pieces of one split into tasks of at least `task_chars` characters. A
    task's boundaries depend only on the pieces from its first one on, so a resumed run that
    starts at a task's cursor forms the same tasks as the first run."""
    task, read = None, read_before
    for piece in pieces:
        if task is not None and (task.split != piece.split or task.chars >= task_chars):
            yield task
            task = None
        if task is None:
            task = Task(piece.split, piece.cursor)
        task.add(piece)
        task.read_bytes += piece.read_bytes - read
        read = piece.read_bytes
    if task is not None:
        yield task


def encode_task(tok: Tokenizer, pieces: list[str], starts: list[bool], dtype: np.dtype, bulk: bool = True) -> np.ndarray:
    """(n,) ids of the pieces in order, with the document-start id (BOS, else end-of-text) before
    each piece that starts a document (none for a tokenizer without either, as char). `bulk` uses the tokenizer's batch
    encoder (tiktoken's threads); a worker process encodes one piece at a time."""
    encoded = tok.encode_arrays(pieces) if bulk else [np.asarray(tok.encode(p), dtype=np.int64) for p in pieces]
    parts = []
    for ids, start in zip(encoded, starts):
        if start and tok.document_start is not None:
            parts.append(np.array([tok.document_start], dtype=dtype))
        parts.append(ids.astype(dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


# --- worker processes --------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}  # a worker process's tokenizer and encoding, set once by _init_worker


def _init_worker(spec: dict[str, Any], encoding: Encoding) -> None:
    _WORKER["tok"], _WORKER["encoding"] = tokenizer_from_spec(spec), encoding


def _encode_in_worker(pieces: list[str], starts: list[bool], wheres: list[str]) -> Encoded:
    return _WORKER["encoding"](_WORKER["tok"], pieces, starts, wheres, bulk=False)


def encode_tasks(tasks: Iterator[Task], tok: Tokenizer, encoding: Encoding, workers: int) -> Iterator[tuple[Task, Encoded]]:
    """(task, its encoding) in task order. With workers > 1, that many processes tokenize while
    this one reads; at most IN_FLIGHT tasks per worker are in flight, so memory stays bounded."""
    if workers <= 1:
        for task in tasks:
            yield task, encoding(tok, task.pieces, task.starts, task.wheres)
        return
    pool = cf.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker, initargs=(tok.spec(), encoding)
    )
    window: deque[tuple[Task, cf.Future]] = deque()
    try:
        for task in tasks:
            window.append((task, pool.submit(_encode_in_worker, task.pieces, task.starts, task.wheres)))
            if len(window) >= IN_FLIGHT * workers:
                done, future = window.popleft()
                yield done, future.result()
        while window:
            done, future = window.popleft()
            yield done, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --- writing -----------------------------------------------------------------------------------


class _TokenStream:
    """The encoded tasks as one stream of ids (and flags) that shards take from, tracking the
    resume point."""

    def __init__(self, results: Iterator[tuple[Task, Encoded]], skip: int, on_task_done: Callable[[Task, Encoded], None]):
        self.results, self.on_task_done = results, on_task_done
        self.head: tuple[Task, Encoded] | None = None
        self.offset = skip  # ids of the head task already written (by an earlier, killed run)

    def peek(self) -> Task | None:
        while self.head is None:
            item = next(self.results, None)
            if item is None:
                return None
            self.head = item
            if self.offset >= len(item[1].arrays[0]):  # nothing left of it to write
                self._finish()
        return self.head[0]

    def take(self, n: int) -> tuple[np.ndarray, ...]:
        arrays = self.head[1].arrays
        parts = tuple(a[self.offset : self.offset + n] for a in arrays)
        self.offset += len(parts[0])
        if self.offset >= len(arrays[0]):
            self._finish()
        return parts

    def _finish(self) -> None:
        self.on_task_done(*self.head)
        self.head, self.offset = None, 0

    def cursor(self) -> dict[str, Any] | None:
        """Where the next shard starts: the task to re-tokenize and how many of its ids to skip."""
        task = self.peek()
        return None if task is None else {**task.cursor, "split": task.split, "skip_tokens": self.offset}


def write_shards(
    results: Iterator[tuple[Task, Encoded]],
    out_dir: Path,
    shard_tokens: int,
    shards: dict[str, list[dict[str, Any]]],
    skip_tokens: int,
    on_shard: Callable[[dict[str, list[dict[str, Any]]], dict[str, Any] | None], None],
    on_task_done: Callable[[Task, Encoded], None],
) -> dict[str, list[dict[str, Any]]]:
    """Write the ids of `results` as shards of `shard_tokens` ids (a split's last one shorter),
    and chat data's flags beside them, appending to `shards` ({split: [{"file", "tokens"(,
    "flags")}]}); `on_shard(shards, cursor)` after each."""
    stream = _TokenStream(results, skip_tokens, on_task_done)
    while (task := stream.peek()) is not None:
        split, count = task.split, 0

        def write(*files: Any, split: str = split) -> None:  # called at once, for this shard
            nonlocal count
            while count < shard_tokens and (head := stream.peek()) is not None and head.split == split:
                parts = stream.take(shard_tokens - count)
                for part, f in zip(parts, files):  # not tofile: its OSError has no errno (a full disk read as "OSError")
                    f.write(memoryview(np.ascontiguousarray(part)))
                count += len(parts[0])

        name = shard_name(split, len(shards.setdefault(split, [])))
        flags = flags_name(name) if len(stream.head[1].arrays) > 1 else None  # chat: ids and flags side by side
        if flags is None:
            atomic_write(out_dir / name, write)
        else:
            atomic_write(out_dir / flags, lambda f, ids_file=out_dir / name: atomic_write(ids_file, lambda ids: write(ids, f)))
        shards[split].append({"file": name, "tokens": count, **({"flags": flags} if flags else {})})
        on_shard(shards, stream.cursor())
    return shards


# --- reading -----------------------------------------------------------------------------------


class ShardedTokens:
    """A split's shards as one read-only (N,) array of ids: len(), integer, slice and integer-array
    indexing (windows may cross shard boundaries), np.asarray. Each shard is a memmap."""

    def __init__(self, parts: list[np.memmap]):
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts])  # (S+1,) start of each shard
        self.dtype = parts[0].dtype
        self.shape = (int(self.offsets[-1]),)
        self.ndim = 1

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return self._range(start, max(start, stop))
            return self._gather(np.arange(start, stop, step, dtype=np.int64))
        if isinstance(index, (int, np.integer)):
            return self._gather(np.asarray([index % len(self) if index < 0 else index]))[0]
        return self._gather(np.asarray(index))

    def _range(self, start: int, stop: int) -> np.ndarray:
        parts = [
            p[max(start - o, 0) : min(stop - o, len(p))] for p, o in zip(self.parts, self.offsets[:-1]) if o < stop and o + len(p) > start
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def _gather(self, idx: np.ndarray) -> np.ndarray:
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"index out of range for {len(self)} tokens")
        flat = idx.ravel()
        shard = np.searchsorted(self.offsets, flat, side="right") - 1  # (n,) which shard holds each
        out = np.empty(flat.shape, dtype=self.dtype)
        for s in np.unique(shard):
            sel = shard == s
            out[sel] = self.parts[s][flat[sel] - self.offsets[s]]
        return out.reshape(idx.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = np.concatenate(self.parts)
        return whole if dtype is None else whole.astype(dtype)
