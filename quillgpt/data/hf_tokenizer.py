"""A Hugging Face tokenizer: the model directory's tokenizer.json, run by the `tokenizers`
library (the Rust tokenizer transformers itself uses), with the special tokens and chat
template of its tokenizer_config.json (or chat_template.jinja) and generation_config.json.

What it adds around a text is what its post-processor adds, as AutoTokenizer does in
transformers 5: a BOS token before it (Llama 3, Mistral) or nothing (Qwen, SmolLM2); quill puts
that BOS before every prompt, every scored text and every prepared document. A suffix the
post-processor would add (EOS) is not added: a prompt must not end. Special tokens written in a
text are read as special tokens, as AutoTokenizer reads them.

Every token also has its raw bytes (`decode_bytes`), so streaming prints whole characters and
`quill attention` labels byte-level tokens as text: byte-level vocabularies (GPT-2's byte ↔
unicode table), SentencePiece-style ones ("▁" for a space, <0xNN> byte fallback), and added
tokens as their text.

A tokenizer.json is untrusted input: data/hf_tokenizer_guard.py runs it on a probe text when it
loads (a Rust panic, a slow regex or a normalizer that multiplies text fails there, in one line)
and bounds every encode by what its normalizer can make of the text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from functools import cached_property
from typing import Any

import numpy as np

from quillgpt.data import hf_tokenizer_guard as guard
from quillgpt.data.chat_template import end_of_turn
from quillgpt.data.hf_tokenizer_files import check_generation_config, check_tokenizer_config, read_json_file
from quillgpt.data.tokenizer import Tokenizer, find_safe_cut
from quillgpt.errors import QuillError

HF_INSTALL = 'pip install -e ".[hf]"'
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise QuillError(f"a Hugging Face tokenizer needs the tokenizers package (the hf extra): {HF_INSTALL}") from None
    return tokenizers


def byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted: the character → the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_kind(decoder: Any) -> str:
    """'byte' for byte-level decoders, 'spm' for SentencePiece-style ones, else 'text'."""
    kinds = {d.get("type") for d in ([decoder] + list((decoder or {}).get("decoders", []))) if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return "byte"
    return "spm" if kinds & {"ByteFallback", "Metaspace", "Replace"} else "text"


class HFTokenizer(Tokenizer):
    """tokenizer.json + the special tokens that matter to quill (see the module docstring)."""

    def __init__(
        self,
        tokenizer_json: str,
        name: str = "hf",
        bos_token: str | None = None,
        eos_token: str | None = None,
        stop_tokens: Iterable[str] = (),
        chat_template: str | None = None,
        source: str = "tokenizer.json",
    ) -> None:
        try:
            self.tk = _tokenizers().Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # noqa: BLE001 — the Rust parser raises its own exception type
            raise QuillError(f"tokenizer.json is not a tokenizer the tokenizers library reads ({str(e)[:120]})") from None
        self._json, self.name, self.chat_template, self.source = tokenizer_json, name, chat_template, source
        self.growth = guard.growth(tokenizer_json)  # untrusted: exercised here, not at the first request
        guard.probe(lambda text: self.tk.encode(text, add_special_tokens=True).ids, self.growth, source)
        self.bos_token, self.eos_token, self.stop_tokens = bos_token, eos_token, tuple(stop_tokens)
        self.vocab_size = max(self.tk.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_id = self._prefix_id()
        self.eot_id = self._id(eos_token) if eos_token else None
        self.kind = _decoder_kind(json.loads(tokenizer_json).get("decoder"))
        self.cuts_pieces = self.kind == "byte"  # SentencePiece-style: a piece's start would gain a "▁"

    def _id(self, token: str) -> int:
        i = self.tk.token_to_id(token)
        if i is None:
            raise QuillError(f"the special token {token!r} is not in the tokenizer's vocabulary")
        return i

    def _prefix_id(self) -> int | None:
        """The one token the post-processor puts before a text (BOS), or None."""
        plain, full = self.encode("a"), guard.rust_call(lambda: self.tk.encode("a", add_special_tokens=True).ids, self.source)
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        if start > 1:
            raise QuillError(f"the tokenizer puts {start} tokens before a text; quill supports one (a BOS token)")
        return full[0] if start == 1 else None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        ids = [self.eot_id] + [self._id(t) for t in self.stop_tokens]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def _encodings(self, texts: list[str]) -> list[Any]:
        """The library's encodings of texts, bounded (hf_tokenizer_guard): a text the normalizer could
        grow beyond its limit, or a panic in the library, is one QuillError, never memory exhaustion."""
        guard.check_length(sum(map(len, texts)), self.growth, self.source)
        if len(texts) == 1:
            return [guard.rust_call(lambda: self.tk.encode(texts[0], add_special_tokens=False), self.source)]
        return guard.rust_call(lambda: self.tk.encode_batch(texts, add_special_tokens=False), self.source)

    def encode(self, text: str) -> list[int]:
        return self._encodings([text])[0].ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._encodings(texts)]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, each id's [start, end) characters in text): where chat templates' spans land."""
        encoding = self._encodings([text])[0]
        return encoding.ids, encoding.offsets

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self._encodings(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tk.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=False)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        table = self._token_bytes
        return b"".join(table[i] if 0 <= i < len(table) else "\ufffd".encode() for i in map(int, ids))

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        """Each id's raw bytes (see the module docstring); ids the vocabulary skips are U+FFFD."""
        added = {i: t.content.encode() for i, t in self.tk.get_added_tokens_decoder().items()}
        inverse = byte_decoder() if self.kind == "byte" else {}
        out = []
        for i in range(self.vocab_size):
            token = self.tk.id_to_token(i)
            if i in added or token is None:
                out.append(added.get(i, "\ufffd".encode()))
            elif self.kind == "byte":
                out.append(bytes(inverse[c] for c in token) if all(c in inverse for c in token) else token.encode())
            elif self.kind == "spm" and (m := _BYTE_FALLBACK.fullmatch(token)):
                out.append(bytes([int(m.group(1), 16)]))
            elif self.kind == "spm":
                out.append(token.replace("\u2581", " ").encode())
            else:
                out.append(self.tk.decode([i]).encode())
        return out

    def safe_cut(self, text: str, index: int, window: int = 10_000) -> int:
        return find_safe_cut(text, index, window) if self.cuts_pieces else index

    def spec(self) -> dict[str, Any]:
        return {
            "type": "hf",
            "name": self.name,
            "tokenizer_json": self._json,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "stop_tokens": list(self.stop_tokens),
            "chat_template": self.chat_template,
        }


def hf_tokenizer_from_spec(spec: dict[str, Any]) -> HFTokenizer:
    return HFTokenizer(
        str(spec["tokenizer_json"]),
        str(spec.get("name", "hf")),
        spec.get("bos_token"),
        spec.get("eos_token"),
        [str(t) for t in spec.get("stop_tokens", [])],
        spec.get("chat_template"),
    )


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def chat_template_of(directory: Any, config: dict[str, Any]) -> str | None:
    """The model's chat template: chat_template.jinja, else tokenizer_config.json's chat_template
    (a string, or a list of named templates: the "default" one)."""
    from quillgpt.files import input_file, read_text

    jinja = directory / "chat_template.jinja"
    if input_file(jinja, "chat_template.jinja"):
        return read_text(jinja, "chat_template.jinja", limit=1 << 24)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


def load_hf_tokenizer(directory: Any, name: str = "hf") -> HFTokenizer:
    """The tokenizer of a Hugging Face model directory: tokenizer.json with tokenizer_config.json's
    special tokens and chat template, and generation_config.json's end-of-sequence ids as stops."""
    from pathlib import Path

    from quillgpt.files import input_file, read_text

    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not input_file(path, "tokenizer.json"):
        raise QuillError(
            f"{directory} has no tokenizer.json: quill reads Hugging Face tokenizers in that format "
            "(download it with the model: hf download REPO --local-dir DIR)"
        )
    text = read_text(path, "tokenizer.json", limit=1 << 28)
    config = read_json_file(directory / "tokenizer_config.json", "tokenizer_config.json")
    generation = read_json_file(directory / "generation_config.json", "generation_config.json")
    tok = HFTokenizer(  # (what it reads of a bad field is nothing: the checks below name the field)
        text,
        name,
        _token_text(config.get("bos_token")),
        _token_text(config.get("eos_token")),
        chat_template=chat_template_of(directory, config),
        source=str(path),
    )
    check_tokenizer_config(config, tok.vocab_size, str(directory / "tokenizer_config.json"))
    check_generation_config(generation, tok.vocab_size, str(directory / "generation_config.json"))
    eos = generation.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    stops = [tok.tk.id_to_token(i) for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    if tok.eos_token is None and stops and stops[0] is not None:
        tok.eos_token, tok.eot_id = stops[0], tok._id(stops[0])
    if tok.chat_template is not None:  # the reply ends at the template's end-of-turn token
        specials = [t.content for t in tok.tk.get_added_tokens_decoder().values()]
        stops.append(end_of_turn(tok.chat_template, specials, tok.bos_token, tok.eos_token))
    tok.stop_tokens = tuple(dict.fromkeys(s for s in stops if s is not None and s != tok.eos_token))
    return tok


def _bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list a ranked byte-level vocabulary implies: each token of two or more bytes is
    the merge of the best-ranked split into two tokens that both exist (tiktoken → HF BPE)."""
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(a, b, rank) for a, b in sorted(splits, key=lambda ab: (ranks[ab[0]], ranks[ab[1]]))]
    return [(a, b) for a, b, _ in sorted(merges, key=lambda m: m[2])]


def hf_files_of(tok: Tokenizer) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json) with the same ids as `tok`, for export-hf:
    transformers, vLLM and llama.cpp's converter read these. Char vocabularies become a BPE without
    merges over single characters; tiktoken and trained BPE a byte-level BPE with their split pattern."""
    tokenizers = _tokenizers()
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

    if isinstance(tok, HFTokenizer):
        config = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
        return tok._json, {k: v for k, v in config.items() if v is not None}
    spec = tok.spec()
    if spec["type"] == "char":
        hf = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(tok.chars)}, merges=[]))
        hf.decoder = decoders.Fuse()
        return hf.to_str(), {}
    ranks, pattern = dict(tok.enc._mergeable_ranks), tok.enc._pat_str  # noqa: SLF001 — tiktoken keeps them there
    to_text = {b: c for c, b in byte_decoder().items()}
    text = lambda b: "".join(to_text[x] for x in b)  # noqa: E731
    hf = tokenizers.Tokenizer(
        models.BPE(
            vocab={text(b): r for b, r in ranks.items()}, merges=[(text(a), text(b)) for a, b in _bpe_merges(ranks)], ignore_merges=True
        )
    )
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder, hf.post_processor = decoders.ByteLevel(), processors.ByteLevel(trim_offsets=False)
    specials = sorted(tok.enc._special_tokens.items(), key=lambda kv: kv[1])  # noqa: SLF001
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s, _ in specials])
    eot = tok.decode([tok.eot_id]) if tok.eot_id is not None else None
    return hf.to_str(), {"eos_token": eot} if eot else {}
