"""Constrained decoding: a row's next token limited to what a grammar allows (JSON schemas, tool calls).

The grammar work is llguidance's (the `structured` extra): it takes any vocabulary as a list of
token bytes, so quill's char, tiktoken/BPE and Hugging Face tokenizers all fit one wrapper, and it
computes one row's mask in tens of microseconds, lazily, with no per-vocabulary precompilation of
the schema. A `Grammar` is checked and compiled once per request (an invalid or unsupported
schema is an `InvalidGrammar` naming what is wrong); each row gets its own `Constraint` (the
parser's state), which the engine asks for an allowed-token mask before each draw and tells each
drawn token. A row ends when its grammar is complete (`done`). Rows without a constraint never
touch any of this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError

INSTALL = "pip install 'quillgpt[structured]'"
# JSON as json.dumps writes it (", " and ": ", no other whitespace): the spacing models have seen
# most, and no run of whitespace a small model could loop in
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


class InvalidGrammar(QuillError):
    """A schema or grammar that llguidance refuses (invalid, or a keyword it does not implement)."""


class Constraint(Protocol):
    """One row's token constraint, owned by the engine thread."""

    done: bool  # the grammar is complete: the row ends here

    def allowed(self, vocab_size: int) -> Tensor | None:
        """(vocab_size,) bool: the tokens the row may draw next (None: any)."""

    def advance(self, token: int) -> None:
        """The row drew `token`."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise QuillError(f"structured output (response_format, tools) needs the llguidance library: {INSTALL}") from None
    return llguidance


def available() -> str | None:
    """None when constrained decoding can run here, else why not (the extra to install)."""
    try:
        _llguidance()
    except QuillError as e:
        return str(e)
    return None


def _special_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids that are control tokens, not text (a grammar's literal text must never use them): the
    stop ids, a Hugging Face tokenizer's special added tokens, tiktoken's special tokens."""
    ids = set(tokenizer.stop_ids) | ({tokenizer.bos_id} if tokenizer.bos_id is not None else set())
    tk = getattr(tokenizer, "tk", None)  # HFTokenizer
    if tk is not None:
        ids |= {i for i, t in tk.get_added_tokens_decoder().items() if t.special}
    enc = getattr(tokenizer, "enc", None)  # TiktokenTokenizer
    if enc is not None:
        ids |= set(enc._special_tokens.values())  # noqa: SLF001 - tiktoken has no public list
    return sorted(i for i in ids if 0 <= i < tokenizer.vocab_size)


class _Vocabulary:
    """quill's tokenizer as llguidance's TokenizerWrapper reads it: each id's bytes and an encoder."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, eos: int) -> None:
        self.tokenizer = tokenizer
        self.tokens = [tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size)]
        self.tokens += [b""] * (n_vocab - len(self.tokens))  # a model's padding ids: no text
        self.special_token_ids = sorted({*_special_ids(tokenizer), eos})
        self.eos_token_id, self.bos_token_id = eos, tokenizer.bos_id

    def __call__(self, text: bytes | str) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        unknown = self.tokenizer.unknown_chars(text)  # a char vocabulary: the characters it has
        return self.tokenizer.encode("".join(c for c in text if c not in unknown))


@lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """llguidance's tokenizer over quill's (built once per tokenizer: about a second for 150k ids);
    vocab_size: the model's, which may be padded past the tokenizer's. A tokenizer without a stop
    id (quill's char vocabularies) gets one past the model's vocabulary, which no row can draw."""
    llg = _llguidance()
    stops = list(tokenizer.stop_ids) or [vocab_size]
    n_vocab = max(vocab_size, stops[0] + 1)
    vocab = _Vocabulary(tokenizer, n_vocab, stops[0])
    return llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=n_vocab, eos_token=stops)


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of JSON text matching `schema` (None: any JSON object)."""
    llg = _llguidance()
    try:
        return llg.LLMatcher.grammar_from_json_schema(ANY_OBJECT if schema is None else schema, overrides=JSON_STYLE)
    except ValueError as e:
        raise InvalidGrammar(f"the JSON schema is not valid: {e}") from None


def lark_grammar(lark: str) -> str:
    """A grammar in llguidance's Lark syntax (`%json {schema}` embeds a JSON schema)."""
    return _llguidance().LLMatcher.grammar_from_lark(lark)


def tool_call_grammar(open_tag: str, close_tag: str, calls: list[dict[str, Any]]) -> str:
    """One tool call as open_tag {"name": ..., "arguments": {...}} close_tag, the JSON one of
    `calls` (each a JSON schema of the object: its name a const, its arguments the tool's parameters)."""
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    body = json.dumps({**schema, "x-guidance": JSON_STYLE})  # the JSON's options travel inside its schema
    return lark_grammar(f"start: {json.dumps(open_tag)} call {json.dumps(close_tag)}\ncall: %json {body}\n")


@dataclass(frozen=True)
class Grammar:
    """A checked grammar over one tokenizer's vocabulary: `constraint()` makes a row's parser state
    (a copy of the start state: the compiled grammar is shared, so it costs microseconds)."""

    start: Any  # llguidance's LLMatcher before any token
    n_vocab: int  # llguidance's vocabulary: the model's (and a stop id past it, where the tokenizer has none)

    @classmethod
    def compile(cls, grammar: str, tokenizer: Tokenizer, vocab_size: int, what: str = "the grammar") -> Grammar:
        """Check `grammar` against the tokenizer: InvalidGrammar naming what is wrong, or when the
        model's vocabulary (vocab_size ids) cannot write even its first token."""
        llg = _llguidance()
        lltok = grammar_tokenizer(tokenizer, vocab_size)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
        if is_error:
            raise InvalidGrammar(f"{what} is not supported: {' '.join(messages[0].split())[:300]}")
        out = cls(llg.LLMatcher(lltok, grammar, log_level=0), lltok.vocab_size)
        if not out.constraint().allowed(vocab_size).any():
            raise InvalidGrammar(f"the model's vocabulary cannot write {what}: none of its tokens can start it")
        return out

    def constraint(self) -> GrammarConstraint:
        return GrammarConstraint(self.start.deep_copy(), self.n_vocab)


class GrammarConstraint:
    """A row's llguidance matcher: masks from its bitmask, done once the grammar is complete."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self.matcher = matcher
        self.done = False
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)  # one bit a token, in little-endian words

    def allowed(self, vocab_size: int) -> Tensor:
        """The model's vocab_size ids, True where the grammar allows them (none once it failed)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.matcher.is_error():  # a dead end: llguidance would offer only its end token
            return torch.zeros(vocab_size, dtype=torch.bool)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self.done = self.matcher.is_stopped()
