"""Text → token files, and batches of windows from them.

`prepare` turns one UTF-8 text (a local file, or a URL downloaded once and checked) into
`train.bin` / `val.bin` (flat uint16 or uint32 ids, as in nanoGPT) and `meta.json`, which
records the tokenizer's spec and what the files were made from, so that running it again on
the same inputs does nothing. Training reads the bins through a memmap, so a corpus larger
than memory still trains.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from tqdm import tqdm

from quillgpt.config import DataConfig
from quillgpt.errors import QuillError
from quillgpt.files import atomic_write, atomic_write_bytes
from quillgpt.tokenizer import (
    GPT4_SPLIT_PATTERN,
    TOKENIZER_NAMES,
    Tokenizer,
    build_tokenizer,
    dump_json,
    text_chunks,
    tokenizer_from_spec,
)

DOWNLOAD_DIR = Path("data") / "downloads"  # relative to where `quill` runs; git-ignored
CHUNK_CHARS = 1 << 18  # text is tokenized in pieces of about this many characters, in parallel


# ---------------------------------------------------------------------------------------------
# reading and downloading text


def _read_bytes(path: Path) -> bytes:
    if not path.exists():
        raise QuillError(f"data file not found: {path} (set data.path to a UTF-8 text file)")
    if not path.is_file():
        raise QuillError(f"{path} is not a file (set data.path to a UTF-8 text file)")
    raw = path.read_bytes()
    if not raw:
        raise QuillError(f"{path} is empty: it needs some text to train on")
    return raw


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QuillError(
            f"{path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at byte offset {e.start} is "
            f"invalid ({e.reason}); convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from None


def read_text(path: str | Path) -> str:
    """The whole file as text; a clear QuillError when it is missing, empty or not UTF-8."""
    path = Path(path)
    return _decode(_read_bytes(path), path)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def download(url: str, sha256: str | None, dest: str | Path, progress: bool = True) -> Path:
    """Fetch `url` to `dest` once (temp file, checksum, rename); later calls reuse the file."""
    dest = Path(dest)
    by_hand = f"download it yourself and place it at {dest.resolve()}"
    expected = sha256.lower() if sha256 else None
    if dest.is_file():
        actual = _sha256_file(dest)
        if expected is None or actual == expected:
            return dest
        raise QuillError(
            f"{dest} has sha256 {actual}, expected {expected} (data.sha256); "
            f"delete it to download {url} again, or fix data.sha256"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
            size = int(r.headers.get("Content-Length") or 0) or None
            with tqdm(total=size, unit="B", unit_scale=True, desc=f"download {dest.name}", disable=not progress) as bar:
                while block := r.read(1 << 16):
                    f.write(block)
                    h.update(block)
                    bar.update(len(block))
    except (OSError, ValueError, http.client.HTTPException) as e:  # URLError is an OSError
        tmp.unlink(missing_ok=True)
        reason = getattr(e, "reason", None) or e
        raise QuillError(f"could not download {url} ({reason}); {by_hand}") from None
    actual = h.hexdigest()
    if expected is not None and actual != expected:
        tmp.unlink(missing_ok=True)
        raise QuillError(
            f"checksum mismatch for {url}: expected sha256 {expected}, got {actual}; "
            f"{by_hand}, or fix data.sha256"
        )
    os.replace(tmp, dest)
    return dest


def source_path(cfg: DataConfig, progress: bool = True) -> Path:
    """The local text file for `cfg`: data.path, else data.url downloaded into data/downloads/."""
    if cfg.path is not None:
        return Path(cfg.path)
    name = Path(urllib.parse.urlparse(cfg.url).path).name or "download.txt"
    return download(cfg.url, cfg.sha256, DOWNLOAD_DIR / name, progress)


# ---------------------------------------------------------------------------------------------
# prepare: text → train.bin, val.bin, meta.json


@dataclass
class PreparedData:
    out_dir: Path
    meta: dict[str, Any]
    rebuilt: bool  # False when meta.json showed the files were already up to date
    seconds: float = 0.0  # wall time of the prepare call


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


def _read_meta(out_dir: Path) -> dict[str, Any]:
    path = out_dir / "meta.json"
    if not path.is_file():
        raise QuillError(f"no prepared data in {out_dir}: meta.json is missing (run `quill prepare --config ...`)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise QuillError(f"{path} is corrupt; rebuild it with `quill prepare --force`") from None
    if not isinstance(meta, dict):
        raise QuillError(f"{path} is corrupt; rebuild it with `quill prepare --force`")
    return meta


def _up_to_date(out_dir: Path, want: dict[str, Any]) -> dict[str, Any] | None:
    """meta.json when it was made from exactly `want` and both bins are complete, else None."""
    try:
        meta = _read_meta(out_dir)
        if any(meta.get(k) != v for k, v in want.items()):
            return None
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split in ("train", "val"):
            if (out_dir / f"{split}.bin").stat().st_size != meta[f"{split}_tokens"] * itemsize:
                return None
    except (QuillError, OSError, KeyError, TypeError):
        return None
    return meta


def _write_tokens(tok: Tokenizer, text: str, path: Path, dtype: np.dtype, bar: tqdm) -> int:
    """Encode `text` piece by piece straight into `path` (temp + rename); returns the token
    count. Pieces are cut at safe points and encoded in parallel; memory stays at one group."""
    chunks = text_chunks(text, CHUNK_CHARS, tok.safe_cut)
    step = 2 * (os.cpu_count() or 1)
    n = 0

    def write(f: BinaryIO) -> None:
        nonlocal n
        for i in range(0, len(chunks), step):
            group = chunks[i : i + step]
            for ids in tok.encode_arrays(group):
                ids.astype(dtype).tofile(f)
                n += len(ids)
            bar.update(sum(map(len, group)))

    atomic_write(path, write)
    return n


def prepare(cfg: DataConfig, force: bool = False, progress: bool = True) -> PreparedData:
    """Tokenize the configured text into cfg.out_dir, unless meta.json shows it is up to date."""
    t0 = time.perf_counter()
    if cfg.tokenizer == "bpe":
        token_dtype(cfg.bpe_vocab_size)  # fail before reading or training anything
    source = source_path(cfg, progress)
    raw = _read_bytes(source)
    out_dir = Path(cfg.out_dir)
    want = {
        "source_sha256": hashlib.sha256(raw).hexdigest(),
        "tokenizer_request": _tokenizer_request(cfg),
        "val_fraction": cfg.val_fraction,
    }
    if not force and (meta := _up_to_date(out_dir, want)) is not None:
        return PreparedData(out_dir, meta, rebuilt=False, seconds=time.perf_counter() - t0)

    text = _decode(raw, source)
    tok = build_tokenizer(cfg.tokenizer, text, cfg.bpe_vocab_size)
    if cfg.tokenizer not in TOKENIZER_NAMES and (unknown := tok.unknown_chars(text)):  # a saved char vocabulary
        shown = ", ".join(f"{c!r} ×{k}" for c, k in list(unknown.items())[:5])
        raise QuillError(
            f"{source} has {len(unknown)} distinct character(s) the tokenizer {cfg.tokenizer} cannot "
            f"encode ({shown}); use data.tokenizer=char to build a vocabulary from this text"
        )
    dtype = token_dtype(tok.vocab_size)
    # Validation is the last val_fraction of the text; a tiktoken/BPE split moves to a nearby
    # newline so the two halves tokenize exactly as the whole text would.
    val_chars = max(1, round(len(text) * cfg.val_fraction))
    if len(text) - val_chars < 1:
        raise QuillError(f"{source} has only {len(text)} character(s): too short to split into train and val")
    cut = tok.safe_cut(text, len(text) - val_chars, window=max(1, min(10_000, val_chars // 10)))

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").unlink(missing_ok=True)  # a crash from here on must not look up to date
    with tqdm(total=len(text), unit="char", unit_scale=True, desc="tokenize", disable=not progress, delay=0.5) as bar:
        n_train = _write_tokens(tok, text[:cut], out_dir / "train.bin", dtype, bar)
        n_val = _write_tokens(tok, text[cut:], out_dir / "val.bin", dtype, bar)
    meta = {
        **want,
        "source": str(source),
        "source_bytes": len(raw),
        "train_chars": cut,
        "val_chars": len(text) - cut,
        "train_tokens": n_train,
        "val_tokens": n_val,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "tokenizer_name": tok.name,
        "tokenizer_fingerprint": tok.fingerprint(),
        "tokenizer": tok.spec(),
    }
    atomic_write_bytes(out_dir / "meta.json", dump_json(meta).encode("utf-8"))
    return PreparedData(out_dir, meta, rebuilt=True, seconds=time.perf_counter() - t0)


def load_prepared(out_dir: str | Path) -> tuple[dict[str, Any], Tokenizer]:
    """meta.json and the tokenizer rebuilt from its spec."""
    meta = _read_meta(Path(out_dir))
    try:
        return meta, tokenizer_from_spec(meta["tokenizer"])
    except KeyError:
        raise QuillError(f"{Path(out_dir) / 'meta.json'} has no tokenizer; rebuild it with `quill prepare --force`") from None


def load_tokens(out_dir: str | Path, split: str) -> np.memmap:
    """(N,) token ids of one split, memory-mapped read-only."""
    if split not in ("train", "val"):
        raise QuillError(f"split must be 'train' or 'val', got {split!r}")
    out_dir = Path(out_dir)
    meta = _read_meta(out_dir)
    path = out_dir / f"{split}.bin"
    try:
        dtype, vocab_size, n = np.dtype(meta["dtype"]), int(meta["vocab_size"]), int(meta[f"{split}_tokens"])
    except (KeyError, TypeError, ValueError):
        raise QuillError(f"{out_dir / 'meta.json'} is incomplete; rebuild it with `quill prepare --force`") from None
    if vocab_size > np.iinfo(dtype).max + 1:
        raise QuillError(
            f"{out_dir / 'meta.json'} says dtype {dtype.name}, too small for vocab_size {vocab_size}; "
            "rebuild it with `quill prepare --force`"
        )
    if not path.is_file() or path.stat().st_size != n * dtype.itemsize:
        raise QuillError(f"{path} is missing or not the {n} tokens meta.json expects; rebuild it with `quill prepare --force`")
    return np.memmap(path, dtype=dtype, mode="r")


# ---------------------------------------------------------------------------------------------
# batches: x = a window of block_size ids, y = the same window shifted by one (the next tokens)


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


class BatchSampler:
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

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
