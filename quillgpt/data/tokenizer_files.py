"""Every kind of tokenizer from its name, its spec or its file, and saving one.

Above tokenizer.py (char, tiktoken, BPE) and hf_tokenizer.py (a Hugging Face tokenizer.json), so
neither imports the other: this module is the one place that knows all kinds. `train_tokenizer`
is `quill tokenizer train`: a byte-level BPE learned from a text file and saved.
"""

from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quillgpt.config import shown_value
from quillgpt.data import hf_tokenizer_guard as guard
from quillgpt.data.hf_tokenizer import hf_tokenizer_from_spec, load_hf_tokenizer
from quillgpt.data.tokenizer import (
    MAX_TOKENIZER_BYTES,
    TIKTOKEN_NAMES,
    TOKENIZER_NAMES,
    CharTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    bpe_tokenizer,
    dump_json,
    text_chunks,
    tiktoken_encoding,
    train_bpe,
)
from quillgpt.errors import QuillError
from quillgpt.files import check_output_file, os_error, read_json, read_text, shown, write_file


def build_tokenizer(name: str, text: str | None = None, vocab_size: int = 4096) -> Tokenizer:
    """A tokenizer by name (char/bpe learn from `text`) or from a saved tokenizer JSON path."""
    if name in TIKTOKEN_NAMES:
        return TiktokenTokenizer(tiktoken_encoding(name), name, {"type": "tiktoken", "name": name})
    if name in ("char", "bpe"):
        if text is None:
            raise QuillError(f"the {name} tokenizer is learned from text: pass the training text")
        return CharTokenizer.from_text(text) if name == "char" else train_bpe(text, vocab_size)
    if name.endswith(".json") or os.sep in name or "/" in name or os.path.isfile(name):
        return load_tokenizer(name)
    raise QuillError(
        f"unknown tokenizer {shown_value(name)}: use one of {', '.join(TOKENIZER_NAMES)} "
        "or a path to a tokenizer .json saved by `quill tokenizer train`"
    )


def tokenizer_from_spec(spec: dict[str, Any]) -> Tokenizer:
    """Rebuild a tokenizer from `Tokenizer.spec()` (as stored in meta.json or a checkpoint)."""
    kind = spec.get("type") if isinstance(spec, dict) else None
    try:
        if kind == "char":
            return CharTokenizer(str(spec["chars"]))
        if kind == "hf":
            return hf_tokenizer_from_spec(spec)
        if kind == "tiktoken":
            if spec["name"] not in TIKTOKEN_NAMES:
                raise ValueError(f"unknown encoding {shown_value(spec['name'])}, expected one of {', '.join(TIKTOKEN_NAMES)}")
            return build_tokenizer(spec["name"])
        if kind == "bpe":
            ranks = {base64.b64decode(b, validate=True): int(r) for b, r in spec["ranks"]}
            specials = {str(k): int(v) for k, v in spec["special_tokens"].items()}
            if len(ranks) != len(spec["ranks"]) or sorted(ranks.values()) != list(range(len(ranks))):
                raise ValueError("ranks must be distinct byte strings numbered 0..n-1")
            if any(bytes([b]) not in ranks for b in range(256)):
                raise ValueError("ranks must contain all 256 single bytes")
            if any(v < len(ranks) for v in specials.values()):
                raise ValueError("special token ids must come after the ranks")
            tok = bpe_tokenizer(ranks, str(spec["pattern"]), specials)
            if tok.decode(guard.rust_call(lambda: tok.encode(guard.PROBE), "the bpe tokenizer")) != guard.PROBE:
                raise ValueError("its split pattern drops or changes text (a byte-level BPE encodes every text back exactly)")
            return tok
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise QuillError(f"invalid {shown_value(kind)} tokenizer spec: {str(e)[:200]}") from None
    raise QuillError(f"unknown tokenizer spec type {shown_value(kind)} (expected char, tiktoken, bpe or hf)")


def save_tokenizer(tok: Tokenizer, path: str | Path, what: str = "tokenizer file") -> None:
    """Write the tokenizer's spec as JSON (temp file + rename, so a crash leaves no half file);
    a directory that cannot be made or written is a QuillError naming `what` and the path."""
    path = Path(path)
    data = {"format": "quillgpt-tokenizer", "version": 1, "tokenizer": tok.spec()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, path.parent, "create the directory of", what) from None
    text = dump_json(data).encode("utf-8")
    write_file(path, lambda f: f.write(text), what)


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    hint = " (create one with `quill tokenizer train`)"
    data = read_json(path, "tokenizer file", MAX_TOKENIZER_BYTES, kind="a tokenizer JSON file", hint=hint)
    if isinstance(data, dict) and "model" in data and "added_tokens" in data:  # a Hugging Face tokenizer.json
        return load_hf_tokenizer(path.parent)
    if not isinstance(data, dict) or data.get("format") != "quillgpt-tokenizer":
        raise QuillError(
            f"{shown(path)} is not a QuillGPT tokenizer file (made by `quill tokenizer train`) or a Hugging Face tokenizer.json"
        )
    try:
        return tokenizer_from_spec(data.get("tokenizer"))
    except QuillError as e:
        raise QuillError(f"{shown(path)}: {e}") from None


@dataclass
class TrainedTokenizer:
    """A tokenizer learned from a text file and saved: where, and how well it compresses that text."""

    tokenizer: Tokenizer
    path: Path
    source: Path
    bytes_per_token: float  # UTF-8 bytes of the training text per token it encodes to
    seconds: float  # learning the merges (not reading, encoding or saving)

    def line(self) -> str:
        return (
            f"saved {self.path}: vocab size {self.tokenizer.vocab_size:,}, {self.bytes_per_token:.2f} bytes/token "
            f"on {self.source}, trained in {self.seconds:.2f}s"
        )


def train_tokenizer(source: str | Path, vocab_size: int, out: str | Path, force: bool = False) -> TrainedTokenizer:
    """`quill tokenizer train`: a byte-level BPE of `vocab_size` ids learned from a UTF-8 text file,
    saved as JSON at `out` (a new file, checked before the text is read, unless `force`)."""
    source, out = Path(source), Path(out)
    check_output_file(out, "--out", force=force, inputs=(source,), fresh=True)
    text = read_text(source, "--input")
    t0 = time.perf_counter()
    tok = build_tokenizer("bpe", text, vocab_size)
    seconds = time.perf_counter() - t0
    save_tokenizer(tok, out, what="--out")
    n_tokens = sum(len(ids) for ids in tok.encode_arrays(text_chunks(text)))
    return TrainedTokenizer(tok, out, source, len(text.encode("utf-8")) / max(n_tokens, 1), seconds)
