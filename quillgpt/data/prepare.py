"""A corpus → token shards, and batches of windows from them.

`prepare` reads `data.path` (a text file, a directory or a glob of .txt/.jsonl/.parquet files,
compressed or not: see data/corpus.py) or a URL downloaded once and checked, tokenizes it in parallel
processes and writes each split as token shards (flat uint16 or uint32 ids, as in nanoGPT:
`train.bin`, `train-000001.bin`, ...; one shard for a small corpus) plus `meta.json`, the
manifest: shards, token counts, tokenizer spec, and the sources with their sizes and mtimes,
so that running it again on the same inputs does nothing and a killed run resumes at its last
finished shard. Documents are separated by the tokenizer's end-of-text id (before each one),
so a model learns where a document starts. Training reads the shards through memmaps, so a
corpus larger than memory still trains.

`data.format: chat` reads jsonl conversations instead (data/chat_data.py): each is rendered with
the tokenizer's chat template (or quill's transcript) and stored whole, no separator, with a
flags shard beside each token shard that marks the assistant's tokens and each conversation's
start; val is the last val_fraction of the lines. The tokenizer must be given (the base model's):
a char or bpe vocabulary learned from the conversations would not be the base's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from quillgpt.config import DataConfig
from quillgpt.data.chat_data import FLAGS_DTYPE, ChatStats
from quillgpt.data.corpus import Piece, Source, count_chars, count_records, find_sources, iter_lines, iter_pieces
from quillgpt.data.download import download_path, sha256_file, source_path
from quillgpt.data.shards import Encoded, Encoding, ShardedTokens, Task, encode_tasks, iter_tasks, write_shards
from quillgpt.data.tokenizer import GPT4_SPLIT_PATTERN, TOKENIZER_NAMES, CharTokenizer, Tokenizer, dump_json
from quillgpt.data.tokenizer_files import build_tokenizer, tokenizer_from_spec
from quillgpt.errors import QuillError
from quillgpt.files import (
    DATASET_LOCK,
    DATASET_STATE,
    SHARD_FILE,
    atomic_write_bytes,
    check_output_dir,
    os_error,
    probe_writable,
    shown,
)

FORMAT = 2  # meta.json layout: 2 = shards with a manifest (1 = train.bin/val.bin, read still)
PIECE_CHARS = 1 << 20  # documents are cut into pieces of about this many characters...
TASK_CHARS = 1 << 22  # ...grouped into tasks of about this many, one per worker call
IN_PROCESS_BYTES = 1 << 24  # a corpus smaller than this is tokenized without worker processes
BPE_TRAIN_CHARS = 1 << 30  # `tokenizer: bpe` learns its merges from the corpus's first 1 G chars
DATASET_WRITES = {SHARD_FILE.pattern: None, r"meta\.json": "manifest", re.escape(DATASET_STATE): None}  # a foreign one is not replaced
TEMP_FILE = re.compile(r"\.(?:train|val|meta\.json|\.prepare-state\.json)[^/]*\.tmp")  # atomic_write names temps ".<name>.<random>.tmp"


# ---------------------------------------------------------------------------------------------
# reading and downloading text


# ---------------------------------------------------------------------------------------------
# prepare: a corpus → token shards of train and val, and meta.json (the manifest)


@dataclass(frozen=True)
class Manifest:
    """meta.json, typed: what the shards were made from (`inputs`: the keys compared to decide
    'up to date'), what they hold, and the tokenizer that reads them. `to_dict` is meta.json's
    on-disk form, key for key and in order."""

    inputs: dict[str, Any]  # format, sources, text_field, tokenizer_request, val_fraction, shard_tokens (+ chat's keys)
    source: str
    source_bytes: int
    documents: int  # lines of chat data
    val_documents: int  # 0 where val is the end of one document
    train_tokens: int
    val_tokens: int
    shards: dict[str, list[dict[str, Any]]]  # per split: each shard's file (and chat flags) and tokens
    vocab_size: int
    eot_id: int | None
    dtype: str  # the token files' numpy dtype: uint16 or uint32
    tokenizer_name: str
    tokenizer_fingerprint: str
    tokenizer: dict[str, Any]  # the tokenizer's spec (tokenizer_from_spec)
    chat: dict[str, dict[str, Any]] | None = None  # chat data, per split: ChatStats' fields

    @classmethod
    def from_dict(cls, meta: dict[str, Any]) -> Manifest:
        """meta.json's dict (complete: `_up_to_date` and `_build` vouch for it) as the record."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "inputs"]
        return cls({k: v for k, v in meta.items() if k not in names}, **{k: meta[k] for k in names if k in meta})

    def to_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "inputs"}
        return {**self.inputs, **{k: v for k, v in values.items() if k != "chat" or v is not None}}

    @property
    def shard_count(self) -> int:
        return sum(len(v) for v in self.shards.values())

    def made_from(self) -> str:
        """'N document(s)', or chat data's 'T + V conversation(s)'."""
        if self.chat is None:
            return f"{self.documents:,} document(s)"
        return f"{self.chat['train']['conversations']:,} + {self.chat['val']['conversations']:,} conversation(s)"

    def skipped(self) -> tuple[int, str | None]:
        """Chat data's bad lines left out (data.skip_bad_lines), and the first of them."""
        if self.chat is None:
            return 0, None
        splits = [self.chat[split] for split in ("train", "val")]
        return sum(c["skipped"] for c in splits), splits[0]["first_skipped"] or splits[1]["first_skipped"]


@dataclass
class PreparedData:
    """What `prepare` did: the data's directory and manifest, whether it rebuilt them, how long it took."""

    out_dir: Path
    manifest: Manifest
    rebuilt: bool  # False when meta.json showed the files were already up to date
    seconds: float = 0.0  # wall time of the prepare call

    @property
    def meta(self) -> dict[str, Any]:
        """meta.json as written (its keys, for code that reads them by name)."""
        return self.manifest.to_dict()

    def report(self) -> str:
        """`quill prepare`'s lines: what was written (or that it was up to date), and bad lines skipped."""
        m, out_dir = self.manifest, self.out_dir
        tokens = f"{m.train_tokens:,} train + {m.val_tokens:,} val tokens"
        if not self.rebuilt:
            return f"up to date: {out_dir} ({tokens}; --force rebuilds)"
        mb = m.source_bytes / 1e6
        speed = f"{mb:.2f} MB in {self.seconds:.2f}s ({mb / max(self.seconds, 1e-9):.1f} MB/s)"
        lines = [
            f"prepared {out_dir}: {tokens} in {m.shard_count} shard(s) from {m.made_from()}, "
            f"{m.tokenizer_name} vocab {m.vocab_size:,} ({m.dtype}), {speed}"
        ]
        skipped, first = m.skipped()
        if skipped:
            lines.append(f"skipped {skipped:,} bad line(s) (data.skip_bad_lines); the first: {first}")
        return "\n".join(lines)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id (nanoGPT's uint16 for GPT-2's 50257)."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise QuillError(f"a vocabulary of {vocab_size} ids does not fit uint32 token files (at most 2^32)")


def _tokenizer_request(cfg: DataConfig) -> dict[str, Any]:
    """What fixes the tokenizer besides the text: the cheap key that decides 'up to date'."""
    if cfg.tokenizer == "bpe":
        return {"name": "bpe", "vocab_size": cfg.bpe_vocab_size, "pattern": GPT4_SPLIT_PATTERN}
    if cfg.tokenizer in TOKENIZER_NAMES:
        return {"name": cfg.tokenizer}
    return {"name": "file", "fingerprint": build_tokenizer(cfg.tokenizer).fingerprint()}


def _want(cfg: DataConfig, sources: list[Source], chat_tokens: int | None = None) -> dict[str, Any]:
    """Everything the shards are made from: same inputs → nothing to do (sizes and mtimes stand
    for the files' content, so a corpus of many gigabytes is not hashed on every run)."""
    want = {
        "format": FORMAT,
        "sources": [s.manifest() for s in sources],
        "text_field": cfg.text_field,
        "tokenizer_request": _tokenizer_request(cfg),
        "val_fraction": cfg.val_fraction,
        "shard_tokens": cfg.shard_tokens,
    }
    if cfg.format == "chat":  # (text data's manifest stays as it was: no spurious rebuilds)
        want.update(data_format="chat", skip_bad_lines=cfg.skip_bad_lines)
        if chat_tokens is not None:  # (absent: every conversation's flags whole, as data prepared before the key)
            want["chat_tokens"] = chat_tokens
    return want


def _flags_cover(meta: dict[str, Any], chat_tokens: int | None) -> bool:
    """Chat data whose flags were found for rows of meta's chat_tokens serve rows that long or
    shorter (a fine-tune sized from its data asks for shorter ones); none recorded: every token's."""
    have = meta.get("chat_tokens")
    return have is None or (chat_tokens is not None and have >= chat_tokens)


def flags_through(out_dir: str | Path) -> int | None:
    """How many of each prepared conversation's first ids have their ASSISTANT flags found (None: all)."""
    value = _read_meta(Path(out_dir)).get("chat_tokens")
    return value if isinstance(value, int) else None


def _read_meta(out_dir: Path) -> dict[str, Any]:
    path = out_dir / "meta.json"
    if not path.is_file():
        raise QuillError(f"no prepared data in {out_dir}: meta.json is missing (run `quill prepare --config ...`)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise QuillError(f"{path} is corrupt; rebuild it with `quill prepare --force`") from None
    if not isinstance(meta, dict):
        raise QuillError(f"{path} is corrupt; rebuild it with `quill prepare --force`")
    return meta


def _shard_list(meta: dict[str, Any], split: str) -> list[dict[str, Any]]:
    """A split's shards; a meta.json from before shards describes one file, {split}.bin."""
    if "shards" in meta:
        return meta["shards"][split]
    return [{"file": f"{split}.bin", "tokens": meta[f"{split}_tokens"]}]


def _shards_complete(out_dir: Path, shards: dict[str, list[dict[str, Any]]], itemsize: int) -> bool:
    """Every shard (and chat data's flags beside it) holds the ids the manifest says."""
    try:
        return all(
            (out_dir / s["file"]).stat().st_size == s["tokens"] * itemsize
            and ("flags" not in s or (out_dir / s["flags"]).stat().st_size == s["tokens"] * FLAGS_DTYPE.itemsize)
            for split in shards.values()
            for s in split
        )
    except (OSError, KeyError, TypeError):
        return False


def _up_to_date(out_dir: Path, want: dict[str, Any]) -> Manifest | None:
    """meta.json when it was made from exactly `want` and every shard is complete, else None."""
    try:
        meta = _read_meta(out_dir)
        if any(meta.get(k) != v for k, v in want.items() if k != "chat_tokens") or not _flags_cover(meta, want.get("chat_tokens")):
            return None
        if _shards_complete(out_dir, meta["shards"], np.dtype(meta["dtype"]).itemsize):
            return Manifest.from_dict(meta)
    except (QuillError, KeyError, TypeError):
        pass
    return None


@contextlib.contextmanager
def _prepare_lock(out_dir: Path) -> Iterator[None]:
    """One prepare per data.out_dir at a time; a second waits. Held, it also proves every temp
    file of ours in the directory belongs to a writer that is gone."""
    path = out_dir / DATASET_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise os_error(e, path, "write", "data.out_dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove_stale_temps(out_dir: Path) -> None:
    """Temp files a killed prepare left (e.g. .train.bin.x1y2.tmp): only ours, only under the lock."""
    for path in out_dir.iterdir():
        if TEMP_FILE.fullmatch(path.name):
            path.unlink(missing_ok=True)


def _plan(cfg: DataConfig, sources: list[Source], progress: bool) -> dict[str, Any]:
    """Where val begins. Several documents: the last val_fraction of them (at least one, and at
    least one left for train). One document (one text file): its last val_fraction of characters,
    moved to the next place where the cut leaves the tokens unchanged."""
    if cfg.format == "chat":
        _check_chat_sources(sources)
    with tqdm(sources, desc="count documents", unit="file", disable=not progress, delay=1.0, leave=False) as bar:
        records = [count_records(s) for s in bar]
    total, where = sum(records), sources[0].path if len(sources) == 1 else cfg.path
    if cfg.format == "chat" and total < 2:
        raise QuillError(f"{shown(where)} has {total} line(s); chat data needs at least 2 conversations (one for val)")
    if total >= 2:
        n_val = min(total - 1, max(1, round(total * cfg.val_fraction)))
        return {"records": records, "val_from": total - n_val, "split_at": None}
    chars = count_chars(sources[records.index(1)], cfg.text_field) if total else 0
    if chars == 0:
        raise QuillError(f"{shown(where)} is empty: it needs some text to train on")
    val_chars = max(1, round(chars * cfg.val_fraction))
    if chars - val_chars < 1:
        raise QuillError(f"{shown(where)} has only {chars} character(s): too short to split into train and val")
    return {"records": records, "val_from": None, "split_at": chars - val_chars}


def _check_chat_sources(sources: list[Source]) -> None:
    for source in sources:
        if source.kind != "jsonl":
            raise QuillError(
                f"data.format=chat reads .jsonl files, one conversation a line; {shown(source.path)} is "
                f"{source.kind} (convert it, or use data.format=text)"
            )


def _check_chat_tokenizer(cfg: DataConfig) -> None:
    """Chat data is rendered with a given tokenizer (the base model's): not one learned from it."""
    if cfg.format == "chat" and cfg.tokenizer in ("char", "bpe"):
        raise QuillError(
            f"data.format=chat needs the model's own tokenizer, not one learned from the conversations "
            f"(data.tokenizer={cfg.tokenizer}): set train.init_from to the base run and leave data.tokenizer unset "
            "(its tokenizer.json is used), or set data.tokenizer to that tokenizer.json or a tiktoken name such as gpt2"
        )


def _pieces(
    cfg: DataConfig, sources: list[Source], plan: dict[str, Any], anywhere: bool, start: dict | None = None, size: int = PIECE_CHARS
) -> Iterator[Piece]:
    return iter_pieces(sources, cfg.text_field, plan["records"], plan["val_from"], plan["split_at"], size, anywhere, start)


def _learn_tokenizer(cfg: DataConfig, sources: list[Source], plan: dict[str, Any], progress: bool) -> Tokenizer:
    """The tokenizer: by name, from a file, or learned from the corpus (char: its characters;
    bpe: merges from its first BPE_TRAIN_CHARS characters). A saved char vocabulary must cover
    every character of the corpus."""
    if cfg.tokenizer not in ("char", "bpe"):
        tok = build_tokenizer(cfg.tokenizer)
        if isinstance(tok, CharTokenizer) and cfg.format == "text":  # (chat data: each line's own error)
            unknown: collections.Counter[str] = collections.Counter()
            for piece in _pieces(cfg, sources, plan, anywhere=True):
                unknown.update(tok.unknown_chars(piece.text))
            if unknown:
                shown_chars = ", ".join(f"{c!r} ×{k}" for c, k in list(unknown.items())[:5])
                raise QuillError(
                    f"{shown(cfg.path or sources[0].path)} has {len(unknown)} distinct character(s) the tokenizer "
                    f"{cfg.tokenizer} cannot encode ({shown_chars}); use data.tokenizer=char to build a vocabulary from this text"
                )
        return tok
    bar = tqdm(desc=f"learn {cfg.tokenizer} tokenizer", unit="char", unit_scale=True, disable=not progress, delay=1.0, leave=False)
    with bar:
        if cfg.tokenizer == "char":
            seen = np.zeros(0x110000, dtype=bool)  # every code point that occurs
            for piece in _pieces(cfg, sources, plan, anywhere=True):
                seen[np.frombuffer(piece.text.encode("utf-32-le", "surrogatepass"), dtype="<u4")] = True
                bar.update(len(piece.text))
            if not seen.any():
                raise QuillError(f"{shown(cfg.path or sources[0].path)} holds no text (every document is empty)")
            return CharTokenizer("".join(map(chr, np.flatnonzero(seen))))
        texts, n = [], 0
        for piece in _pieces(cfg, sources, plan, anywhere=False):
            texts.append(piece.text[: BPE_TRAIN_CHARS - n])
            n += len(texts[-1])
            bar.update(len(texts[-1]))
            if n >= BPE_TRAIN_CHARS:
                break
    return build_tokenizer("bpe", "".join(texts), cfg.bpe_vocab_size)


def _workers(cfg: DataConfig, sources: list[Source]) -> int:
    """data.workers (at most one per core: more would only add memory), else every core the
    process may use; a small corpus stays in-process."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cfg.workers is not None:
        return min(cfg.workers, cores)
    return 1 if sum(s.size for s in sources) < IN_PROCESS_BYTES else cores


def _resumable(out_dir: Path, want: dict[str, Any]) -> dict[str, Any] | None:
    """The state a killed prepare of the same inputs left, when its finished shards are intact."""
    try:
        state = json.loads((out_dir / DATASET_STATE).read_text(encoding="utf-8"))
        itemsize = token_dtype(tokenizer_from_spec(state["tokenizer"]).vocab_size).itemsize
        if state["want"] == want and _shards_complete(out_dir, state["shards"], itemsize):
            return state
    except (OSError, ValueError, KeyError, TypeError, RecursionError, QuillError):
        pass
    return None


def _save_state(out_dir: Path, state: dict[str, Any]) -> None:
    atomic_write_bytes(out_dir / DATASET_STATE, json.dumps(state).encode("utf-8"))


def _tokenize(cfg: DataConfig, sources: list[Source], state: dict[str, Any], tok: Tokenizer, out_dir: Path, progress: bool) -> None:
    """Write the shards from state["cursor"] on, saving the state after each finished shard."""
    start = state["cursor"]
    encoding = Encoding(token_dtype(tok.vocab_size).name, cfg.format == "chat", cfg.skip_bad_lines, state["want"].get("chat_tokens"))
    done = sum(s.size for s in sources[: start["source"]])
    if encoding.chat:  # whole conversations, one a line
        pieces = iter_lines(sources, state["plan"]["records"], state["plan"]["val_from"], start)
    else:
        size = PIECE_CHARS if tok.cuts_pieces else 2**62  # whole documents (cut only where val begins)
        pieces = _pieces(cfg, sources, state["plan"], isinstance(tok, CharTokenizer), start, size)
    results = encode_tasks(iter_tasks(pieces, TASK_CHARS, done), tok, encoding, _workers(cfg, sources))
    total = sum(s.size for s in sources)
    with tqdm(total=total, initial=done, desc="tokenize", unit="B", unit_scale=True, disable=not progress, delay=0.5) as bar:

        def on_task_done(task: Task, encoded: Encoded) -> None:
            bar.update(task.read_bytes)
            if encoded.chat is not None:  # counted once the task is written whole: a resume does not count it twice
                stats = ChatStats(**state["chat"][task.split])
                stats.add(encoded.chat)
                state["chat"][task.split] = vars(stats)

        def on_shard(shards: dict[str, list], cursor: dict[str, Any] | None) -> None:
            state["shards"], state["cursor"] = shards, cursor
            if cursor is not None:  # after the last shard, meta.json comes next
                _save_state(out_dir, state)

        write_shards(results, out_dir, cfg.shard_tokens, state["shards"], start["skip_tokens"], on_shard, on_task_done)


def _build(cfg: DataConfig, sources: list[Source], want: dict[str, Any], out_dir: Path, force: bool, progress: bool) -> Manifest:
    """Tokenize the corpus into shards, resuming a killed run of the same inputs; the manifest."""
    state = None if force else _resumable(out_dir, want)
    if state is None:  # an empty or too short text is refused here, before any output changes
        plan = _plan(cfg, sources, progress)
        tok = _learn_tokenizer(cfg, sources, plan, progress)
        if not force:  # after the input's own defects (empty, not text, characters the tokenizer lacks) are named
            _check_same_data(cfg, out_dir, want)
        cursor = {"source": 0, "record": 0, "piece": 0, "skip_tokens": 0}
        state = {
            "want": want,
            "plan": plan,
            "tokenizer": tok.spec(),
            "shards": {},
            "cursor": cursor,
            "chat": {split: vars(ChatStats()) for split in ("train", "val")},
        }
        (out_dir / DATASET_STATE).unlink(missing_ok=True)  # first saved when the first shard is done
    else:
        tok = tokenizer_from_spec(state["tokenizer"])
    (out_dir / "meta.json").unlink(missing_ok=True)  # a crash from here on must not look up to date
    if state["cursor"] is not None:
        try:
            _tokenize(cfg, sources, state, tok, out_dir, progress)
        except OSError as e:  # the disk filled up, the directory went away...: finished shards stay
            raise os_error(e, out_dir, "write token shards to", "data.out_dir") from None
    shards = {split: state["shards"].get(split, []) for split in ("train", "val")}
    tokens = {split: sum(s["tokens"] for s in shards[split]) for split in shards}
    if not tokens["train"] or not tokens["val"]:
        empty = "train" if not tokens["train"] else "val"
        more = "more valid conversations" if cfg.format == "chat" else "more text, or more documents with text"
        raise QuillError(
            f"{shown(cfg.path or sources[0].path)} gives an empty {empty} split (data.val_fraction={cfg.val_fraction}): it needs {more}"
        )
    plan = state["plan"]
    manifest = Manifest(
        inputs=want,
        source=str(cfg.path or sources[0].path),
        source_bytes=sum(s.size for s in sources),
        documents=sum(plan["records"]),
        val_documents=0 if plan["val_from"] is None else sum(plan["records"]) - plan["val_from"],
        train_tokens=tokens["train"],
        val_tokens=tokens["val"],
        shards=shards,
        vocab_size=tok.vocab_size,
        eot_id=tok.eot_id,
        dtype=token_dtype(tok.vocab_size).name,
        tokenizer_name=tok.name,
        tokenizer_fingerprint=tok.fingerprint(),
        tokenizer=tok.spec(),
        chat=state["chat"] if cfg.format == "chat" else None,  # per split: conversations kept, lines skipped, the first skipped one
    )
    atomic_write_bytes(out_dir / "meta.json", dump_json(manifest.to_dict()).encode("utf-8"))
    (out_dir / DATASET_STATE).unlink(missing_ok=True)
    keep = {s[key] for split in shards.values() for s in split for key in ("file", "flags") if key in s}
    for path in out_dir.iterdir():  # shards of an earlier, longer prepare
        if SHARD_FILE.fullmatch(path.name) and path.name not in keep:
            path.unlink()
    return manifest


def prepare(cfg: DataConfig, force: bool = False, progress: bool = True, chat_tokens: int | None = None) -> PreparedData:
    """Tokenize the configured corpus into token shards under cfg.out_dir, unless meta.json shows
    they are up to date; a killed prepare of the same inputs resumes at its last finished shard.
    chat_tokens (chat data; the model's block_size + 1, a row's length): each conversation's flags
    are found for its first chat_tokens ids only, in time linear in its length (None: all of them)."""
    t0 = time.perf_counter()
    if cfg.tokenizer is None:  # a DataConfig built in code: the default a config file gets
        cfg = dataclasses.replace(cfg, tokenizer="char")
    if cfg.tokenizer == "bpe":
        token_dtype(cfg.bpe_vocab_size)  # fail before reading or training anything
    _check_chat_tokenizer(cfg)
    out_dir = probe_writable(cfg.out_dir, "data.out_dir")
    check_output_dir(out_dir, "data.out_dir", "dataset", DATASET_WRITES, force, how="run `quill prepare --force`")
    if not force and (kept := _downloaded_and_prepared(cfg, out_dir, chat_tokens)) is not None:
        return PreparedData(out_dir, kept, rebuilt=False, seconds=time.perf_counter() - t0)
    sources = find_sources(cfg.path if cfg.path is not None else source_path(cfg, progress))
    want = _want(cfg, sources, chat_tokens)
    with _prepare_lock(out_dir):
        _remove_stale_temps(out_dir)
        want = _same_tokenizer_as_prepared(cfg, out_dir, want)
        kept = None if force else _up_to_date(out_dir, want)
        manifest = kept or _build(cfg, sources, want, out_dir, force, progress)
    return PreparedData(out_dir, manifest, rebuilt=kept is None, seconds=time.perf_counter() - t0)


# What makes prepared data *other* data: a run trained on it reads it again (quill eval, --resume),
# and its ids mean nothing under another tokenizer, its val loss nothing under another split.
# A changed size or mtime of the same source file is the same data, edited: it is rebuilt.
IDENTITY = ("text_field", "val_fraction")


def _describe_data(sources: list[dict[str, Any]], tokenizer: Any, val_fraction: Any) -> str:
    files = ", ".join(str(s.get("path")) for s in sources[:2]) + (f" and {len(sources) - 2} more" if len(sources) > 2 else "")
    name = tokenizer.get("name") if isinstance(tokenizer, dict) else None
    if name == "file":
        name += f" {str(tokenizer.get('fingerprint'))[:8]}"
    return f"{files} (tokenizer {name or '?'}, val_fraction {val_fraction})"


def _same_sources(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> bool:
    """The same files, or files of the same bytes elsewhere (a copy of the text: checked by sha256)."""
    if len(old) != len(new):
        return False
    paths = [(Path(str(a.get("path"))), Path(str(b["path"]))) for a, b in zip(old, new)]
    if all(a == b or a.resolve() == b.resolve() for a, b in paths):
        return True
    if any(a.get("bytes") != b["bytes"] for a, b in zip(old, new)) or sum(b["bytes"] for b in new) > 1 << 28:
        return False
    try:
        return all(sha256_file(a) == sha256_file(b) for a, b in paths)
    except OSError:
        return False


def _check_same_data(cfg: DataConfig, out_dir: Path, want: dict[str, Any]) -> None:
    """Refuse to prepare other data (other files, tokenizer, split) over data already prepared in
    out_dir: runs trained on it read it again, so it is replaced only with --force."""
    try:
        meta = _read_meta(out_dir)
        old_sources = meta["sources"]
    except (QuillError, KeyError):
        return  # nothing prepared there (or an old, unreadable manifest): nothing to keep
    differs = [k for k in IDENTITY if k in meta and meta.get(k) != want.get(k)]
    differs += ["data_format"] if meta.get("data_format", "text") != want.get("data_format", "text") else []
    differs += [] if _same_tokenizer(cfg, meta, want) else ["tokenizer"]
    if not differs and _same_sources(old_sources, want["sources"]):
        return
    suggestion = Path(cfg.out_dir).parent / _dataset_name(cfg, want)
    old = _describe_data(old_sources, meta.get("tokenizer_request"), meta.get("val_fraction"))
    new = _describe_data(want["sources"], want["tokenizer_request"], want["val_fraction"])
    raise QuillError(
        f"{shown(out_dir)} holds data prepared from {old}, which runs trained on it read again (quill eval, --resume); "
        f"this config's {new} would replace it: give it a "
        f"directory of its own with data.out_dir={suggestion}, or replace it on purpose with `quill prepare --config ... --force`"
    )


def _same_tokenizer(cfg: DataConfig, meta: dict[str, Any], want: dict[str, Any]) -> bool:
    """The same request, or one that gives the tokenizer the data were made with: a fine-tune's
    base tokenizer.json over data its base prepared with `char`, or `char` again over the same
    unchanged files (its vocabulary is theirs). A bpe one learned anew is not known until learned."""
    if "tokenizer_request" not in meta or meta["tokenizer_request"] == want["tokenizer_request"]:
        return True
    if cfg.tokenizer == "char":
        return meta.get("tokenizer", {}).get("type") == "char" and meta.get("sources") == want["sources"]
    if cfg.tokenizer == "bpe":
        return False
    return build_tokenizer(cfg.tokenizer).fingerprint() == meta.get("tokenizer_fingerprint")


def _same_tokenizer_as_prepared(cfg: DataConfig, out_dir: Path, want: dict[str, Any]) -> dict[str, Any]:
    """`want` with the prepared data's own tokenizer request when the one asked for gives the same
    tokenizer: those data are up to date, not rebuilt (nor refused) for a name."""
    try:
        meta = _read_meta(out_dir)
        if "tokenizer_request" in meta and meta["tokenizer_request"] != want["tokenizer_request"] and _same_tokenizer(cfg, meta, want):
            return {**want, "tokenizer_request": meta["tokenizer_request"]}
    except (QuillError, AttributeError, TypeError):
        pass
    return want


def _dataset_name(cfg: DataConfig, want: dict[str, Any]) -> str:
    """data/<source>_<tokenizer>: the directory a source's data would get by default."""
    stem = Path(str(want["sources"][0]["path"])).stem if len(want["sources"]) == 1 else Path(str(cfg.path)).name
    tokenizer = want["tokenizer_request"]["name"] if want["tokenizer_request"]["name"] != "file" else Path(str(cfg.tokenizer)).stem
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{stem}_{tokenizer}") or "mydata"


def _downloaded_and_prepared(cfg: DataConfig, out_dir: Path, chat_tokens: int | None) -> Manifest | None:
    """Data from data.url whose download is gone but whose shards are complete in out_dir: the
    manifest, so a resume or a second run never needs the network for data it already has."""
    if cfg.path is not None or cfg.url is None:
        return None
    dest = download_path(cfg)
    if dest.is_file():
        return None  # the usual check, against the file itself
    try:
        meta = _read_meta(out_dir)
        ok = [s["path"] for s in meta["sources"]] == [str(dest)] and meta["tokenizer_request"] == _tokenizer_request(cfg)
        ok = ok and all(meta.get(k) == v for k, v in (("val_fraction", cfg.val_fraction), ("text_field", cfg.text_field)))
        ok = ok and meta.get("data_format", "text") == cfg.format and meta.get("format") == FORMAT and _flags_cover(meta, chat_tokens)
        if ok and _shards_complete(out_dir, meta["shards"], np.dtype(meta["dtype"]).itemsize):
            return Manifest.from_dict(meta)
    except (QuillError, KeyError, TypeError):
        pass
    return None


def load_prepared(out_dir: str | Path) -> tuple[dict[str, Any], Tokenizer]:
    """meta.json and the tokenizer rebuilt from its spec."""
    meta = _read_meta(Path(out_dir))
    try:
        return meta, tokenizer_from_spec(meta["tokenizer"])
    except KeyError:
        raise QuillError(f"{Path(out_dir) / 'meta.json'} has no tokenizer; rebuild it with `quill prepare --force`") from None


def load_tokens(out_dir: str | Path, split: str, flags: bool = False) -> np.memmap | ShardedTokens:
    """(N,) token ids of one split, memory-mapped read-only: a memmap for one shard, else a
    ShardedTokens over all of them (the same indexing). flags: chat data's (N,) uint8 flags
    beside them instead (data/chat_data.py)."""
    if split not in ("train", "val"):
        raise QuillError(f"split must be 'train' or 'val', got {split!r}")
    out_dir = Path(out_dir)
    meta = _read_meta(out_dir)
    rebuild = "rebuild it with `quill prepare --force`"
    key = "flags" if flags else "file"
    try:
        dtype, vocab_size = np.dtype(meta["dtype"]), int(meta["vocab_size"])
        shards = [(out_dir / Path(s[key]).name, int(s["tokens"])) for s in _shard_list(meta, split)]
    except (KeyError, TypeError, ValueError):
        what = "has no chat flags (prepared with data.format=text?)" if flags else "is incomplete"
        raise QuillError(f"{out_dir / 'meta.json'} {what}; {rebuild}") from None
    if vocab_size > np.iinfo(dtype).max + 1:
        raise QuillError(f"{out_dir / 'meta.json'} says dtype {dtype.name}, too small for vocab_size {vocab_size}; {rebuild}")
    dtype = FLAGS_DTYPE if flags else dtype
    for path, n in shards:
        if not path.is_file() or path.stat().st_size != n * dtype.itemsize:
            raise QuillError(f"{path} is missing or not the {n} {'flags' if flags else 'tokens'} meta.json expects; {rebuild}")
    if not shards:
        raise QuillError(f"{out_dir / 'meta.json'} lists no {split} shards; {rebuild}")
    parts = [np.memmap(path, dtype=dtype, mode="r") for path, _ in shards]
    return parts[0] if len(parts) == 1 else ShardedTokens(parts)


# ---------------------------------------------------------------------------------------------
# batches: x = a window of block_size ids, y = the same window shifted by one (the next tokens)
