"""Tokenizers behind one interface: characters, tiktoken's GPT encodings, and BPE you train.

- `char`: the sorted unique characters of the training text. Encoding is a numpy table lookup
  over code points, so millions of characters take milliseconds.
- `gpt2`, `r50k_base`, `cl100k_base`, `o200k_base`: tiktoken's encodings by name.
- `bpe`: byte-level BPE trained on your corpus with rustbpe (GPT-4 split pattern), then run
  by tiktoken, which is much faster at encoding. Saved as plain JSON (base64 bytes + rank).

Every tokenizer has a `spec()`: JSON data that rebuilds it without the corpus, so prepared
data and checkpoints carry their tokenizer with them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import tiktoken

from quillgpt.config import MAX_VOCAB
from quillgpt.errors import QuillError

TIKTOKEN_NAMES = ("gpt2", "r50k_base", "cl100k_base", "o200k_base")
TOKENIZER_NAMES = ("char", *TIKTOKEN_NAMES, "bpe")
EOT = "<|endoftext|>"
MAX_TOKENIZER_BYTES = 1 << 28  # a saved tokenizer; o200k_base as JSON is about 4 MB

# GPT-4's (cl100k) pre-tokenizer: text is split into these pieces before BPE merges bytes.
GPT4_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)

# A place where text can be cut without changing its tokens under the GPT-2, GPT-4 and o200k
# split patterns: after "<non-space>\n", before a letter. No piece of those patterns runs from
# a newline into a letter, and a lone newline splits the same at the end of a string as
# mid-text, so encode(a) + encode(b) == encode(a + b) for such a cut.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=[^\W\d_])")

_REPLACEMENT = "\ufffd"


class Tokenizer:
    """The shared interface; see CharTokenizer, TiktokenTokenizer and hf_tokenizer.HFTokenizer."""

    name: str
    vocab_size: int
    eot_id: int | None  # end of text: separates documents, ends generation
    bos_id: int | None = None  # put before every prompt, scored text and document (Llama 3's <|begin_of_text|>)
    chat_template: str | None = None  # the model's own (Jinja); None: quill's transcript (data/chat_template.py)
    cuts_pieces: bool = True  # a document may be cut into pieces (at safe cuts) and tokenized in parallel

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end a generated text (end of text; an imported model's end of turn)."""
        return () if self.eot_id is None else (self.eot_id,)

    @property
    def document_start(self) -> int | None:
        """The token before each document of a prepared corpus: BOS where the tokenizer has one,
        else end-of-text (as GPT-2 separates documents)."""
        return self.bos_id if self.bos_id is not None else self.eot_id

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """Bulk path for `prepare`: one int array of ids per text."""
        return [np.asarray(ids, dtype=np.int64) for ids in self.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        raise NotImplementedError

    def unknown_chars(self, text: str) -> dict[str, int]:
        return {}

    def safe_cut(self, text: str, index: int, window: int = 10_000) -> int:
        """A position within `window` of `index` where text[:i] and text[i:] encode to the
        same ids as the whole; `index` itself when there is none nearby."""
        return index

    def spec(self) -> dict[str, Any]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A short hash of the spec. A named tiktoken encoding's spec is only its name, which is
        enough: tiktoken checks each encoding's files against a fixed sha256."""
        return hashlib.sha256(_canonical_json(self.spec()).encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} vocab_size={self.vocab_size}>"


# ---------------------------------------------------------------------------------------------
# char


def _code_points(text: str) -> np.ndarray:
    """(len(text),) uint32 code points, without a Python loop."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


class CharTokenizer(Tokenizer):
    """One id per character; the vocabulary is fixed by the training text."""

    def __init__(self, chars: str):
        if not chars:
            raise QuillError("a char tokenizer needs a non-empty vocabulary (the training text is empty)")
        if sorted(set(chars)) != list(chars):
            raise QuillError("a char vocabulary must be sorted unique characters")
        self.name = "char"
        self.chars = chars
        self.vocab_size = len(chars)
        self.eot_id = None
        self._table = np.full(0x110000, -1, dtype=np.int32)  # every code point → id, or -1
        self._table[_code_points(chars)] = np.arange(len(chars), dtype=np.int32)

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        if not text:
            raise QuillError("cannot build a char vocabulary from empty text")
        codes = _code_points(text)
        seen = np.zeros(int(codes.max()) + 1, dtype=bool)
        seen[codes] = True
        return cls("".join(map(chr, np.flatnonzero(seen))))  # sorted unique code points

    def _lookup(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(codes, ids) with id -1 where a character is not in the vocabulary."""
        codes = _code_points(text)
        return codes, self._table[codes]

    def encode_array(self, text: str) -> np.ndarray:
        codes, ids = self._lookup(text)
        bad = np.flatnonzero(ids < 0)
        if len(bad):
            shown = ", ".join(f"{chr(codes[i])!r} at {i}" for i in bad[:5])
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise QuillError(
                f"text has {len(bad)} character(s) not in the char vocabulary: {shown}{more}; "
                "use text covered by the training corpus or a byte-level tokenizer (gpt2, bpe)"
            )
        return ids

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        n = self.vocab_size
        return "".join(self.chars[i] if 0 <= i < n else _REPLACEMENT for i in map(int, ids))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.decode(ids).encode("utf-8", "surrogatepass")

    def unknown_chars(self, text: str) -> dict[str, int]:
        codes, ids = self._lookup(text)
        missing, counts = np.unique(codes[ids < 0], return_counts=True)
        return {chr(c): int(k) for c, k in zip(missing, counts)}

    def spec(self) -> dict[str, Any]:
        return {"type": "char", "chars": self.chars}


# ---------------------------------------------------------------------------------------------
# tiktoken: named encodings and trained BPE


class TiktokenTokenizer(Tokenizer):
    """A tiktoken Encoding: byte-level, so every text encodes and unknown_chars is empty."""

    def __init__(self, enc: tiktoken.Encoding, name: str, spec: dict[str, Any]):
        self.name = name
        self.enc = enc
        self.vocab_size = enc.max_token_value + 1
        self.eot_id = enc.eot_token
        self._spec = spec

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)  # "<|endoftext|>" in user text stays plain text

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        ids = [int(i) for i in ids]
        try:
            return self.enc.decode_bytes(ids)
        except (KeyError, OverflowError, ValueError):  # an id outside the vocabulary
            return b"".join(self._token_bytes(i) for i in ids)

    def _token_bytes(self, i: int) -> bytes:
        try:
            return self.enc.decode_single_token_bytes(i)
        except (KeyError, OverflowError, ValueError):
            return _REPLACEMENT.encode()

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def safe_cut(self, text: str, index: int, window: int = 10_000) -> int:
        return find_safe_cut(text, index, window)

    def spec(self) -> dict[str, Any]:
        return self._spec


def tiktoken_encoding(name: str) -> tiktoken.Encoding:
    try:
        return tiktoken.get_encoding(name)
    except (OSError, ValueError) as e:  # requests' ConnectionError is an OSError
        raise QuillError(
            f"could not load the tiktoken encoding {name!r}: its vocabulary file is not in tiktoken's "
            f"cache and downloading it failed ({type(e).__name__}); go online once to cache it, or "
            "set TIKTOKEN_CACHE_DIR to a folder holding tiktoken's cached files"
        ) from None


def bpe_tokenizer(ranks: dict[bytes, int], pattern: str, specials: dict[str, int]) -> TiktokenTokenizer:
    enc = tiktoken.Encoding(name="quill_bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    spec = {
        "type": "bpe",
        "pattern": pattern,
        "special_tokens": dict(specials),
        "ranks": [[base64.b64encode(b).decode("ascii"), r] for b, r in sorted(ranks.items(), key=lambda kv: kv[1])],
    }
    return TiktokenTokenizer(enc, "bpe", spec)


def find_safe_cut(text: str, index: int, window: int = 10_000) -> int:
    """The cut point (see _SAFE_CUT) nearest to `index` within `window`; else `index` itself."""
    after = _SAFE_CUT.search(text, index, min(len(text), index + window))
    before = None
    for before in _SAFE_CUT.finditer(text, max(0, index - window), index):  # noqa: B007 — keeps the last match
        pass
    options = [m.start() for m in (after, before) if m is not None]
    return min(options, key=lambda i: abs(i - index)) if options else index


def text_chunks(text: str, size: int = 1 << 18, safe_cut: Callable[[str, int, int], int] = find_safe_cut) -> list[str]:
    """Cut text into pieces of about `size` characters at safe cuts (a tokenizer's `safe_cut`,
    by default one safe for every tokenizer here), so encoding the pieces (in parallel) gives
    the same ids as encoding the whole."""
    chunks, start = [], 0
    while len(text) - start > size:
        cut = safe_cut(text, start + size, size // 2)
        chunks.append(text[start:cut])
        start = cut
    chunks.append(text[start:])
    return chunks


def train_bpe(text: str, vocab_size: int, pattern: str = GPT4_SPLIT_PATTERN) -> TiktokenTokenizer:
    """Byte-level BPE with `vocab_size` ids: 256 bytes, vocab_size - 257 merges, then EOT
    (fewer merges when the text runs out of pairs to merge)."""
    import rustbpe

    if not 257 <= vocab_size <= MAX_VOCAB:
        raise QuillError(f"a BPE vocabulary needs at least 257 ids (256 bytes + {EOT}) and at most {MAX_VOCAB:,}, got {vocab_size}")
    if not text:
        raise QuillError("cannot train a BPE tokenizer on empty text")
    trainer = rustbpe.Tokenizer()
    # Chunks cut where the split pattern cuts anyway: the same piece counts as the whole text.
    trainer.train_from_iterator(iter(text_chunks(text, 1 << 16)), vocab_size - 1, pattern=pattern)
    ranks = {bytes(b): r for b, r in trainer.get_mergeable_ranks()}
    return bpe_tokenizer(ranks, pattern, {EOT: len(ranks)})


def dump_json(obj: dict[str, Any]) -> str:
    """JSON with one top-level key per line and each value compact: readable, and a vocabulary
    of thousands of tokens stays on one line instead of thousands."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in obj.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
