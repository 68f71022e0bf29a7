"""Text on top of tokens: prompts in, printable text out, and the one driver of an engine.

`TextStream` turns one row's token ids into printable text (an incremental UTF-8 decoder, so a
character split across BPE tokens is printed whole, and `StopStrings`, which works on the
decoded text, so a stop string may span tokens). `TextBatch` is the one place rows of text
join an engine, step, finish and leave: `quill sample` (through Generation), generate_tokens and
the server's batcher all drive their engine through it. A row finishes at max_new_tokens
("length"), at a stop token such as end-of-text ("eot": not part of the text), at its first
stop string ("stop": the text before it) or where its constraint is complete ("stop": all of
it); the vocabulary is engine.FINISH_REASONS. A row that fails (engine.RowFailed: in the engine,
or while its tokens become text) ends with finish "error" and leaves; the other rows go on.
"""

from __future__ import annotations

import codecs
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from quillgpt.cpu_share import CpuShare
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError
from quillgpt.inference.engine import Finish, Prompt, RowFailed, Rows, RowToken, TokenLogprob
from quillgpt.sampling_params import SamplingParams


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Prompt text → ids, after the tokenizer's BOS where it has one (as its model was trained).
    An empty prompt starts where documents start in training: after BOS or end-of-text, or after
    a newline (char; the first id if there is no newline)."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    if text == "":
        if tokenizer.document_start is not None:
            return [tokenizer.document_start]
        return tokenizer.encode("\n") if not tokenizer.unknown_chars("\n") else [0]
    unknown = tokenizer.unknown_chars(text)
    if unknown:
        shown = ", ".join(repr(c) + (f" ({n}×)" if n > 1 else "") for c, n in list(unknown.items())[:8])
        more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        raise QuillError(
            f"the prompt has {sum(unknown.values())} character(s) that are not in the model's "
            f"{tokenizer.name} vocabulary: {shown}{more}; remove or replace them"
        )
    return bos + tokenizer.encode(text)


class StopStrings:
    """Find the first stop string in text that arrives piece by piece (a stop may span pieces).

    `push` returns the text that can no longer be part of a stop, holding back the longest tail
    that could still be the start of one; at a stop it returns the text before it and then
    nothing more. `flush` releases the held tail when no more text will come.
    """

    def __init__(self, stops: Iterable[str] = ()) -> None:
        self.stops = list(stops)
        if any(s == "" for s in self.stops):
            raise QuillError("a stop string must not be empty")
        self.stopped = False
        self._held = ""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[: min(hits)]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best


class TextStream:
    """One row's token ids → the text to print, piece by piece.

    A BPE token is a byte string and one character may span several tokens, so the bytes go
    through an incremental UTF-8 decoder, which keeps an unfinished character until its last byte
    arrives (U+FFFD only for bytes that can never form a character). The decoded text then goes
    through StopStrings. `text` is everything returned so far.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str] = (), drop_cut_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopStrings(stop)
        self._pieces: list[str] = []
        self.done = False
        # A reply cut by its length inside a stop string ("\nUse" of "\nUser:"): drop that start of
        # a stop instead of printing it (a chat reply); a plain continuation keeps it (it may be text).
        self.drop_cut_stop = drop_cut_stop

    @property
    def stopped(self) -> bool:
        """True once a stop string was found."""
        return self._stops.stopped

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def push(self, token_id: int) -> str:
        if self.done:
            return ""
        out = self._stops.push(self._utf8.decode(self.tokenizer.decode_bytes([token_id])))
        self.done = self._stops.stopped
        self._pieces.append(out)
        return out

    def finish(self, cut: bool = False) -> str:
        """No more tokens: end a cut character (as U+FFFD) and release held-back text (not when
        `cut` by the length limit and drop_cut_stop: then the held start of a stop string goes)."""
        if self.done:
            return ""
        out = self._stops.push(self._utf8.decode(b"", final=True))
        if not self._stops.stopped:
            held = self._stops.flush()
            out += "" if cut and self.drop_cut_stop else held
        self.done = True
        self._pieces.append(out)
        return out


@dataclass
class Piece:
    """What one row produced in one step: its token, the text that can be printed now ("" while
    text is held back), why it finished (None: it goes on), its tokens so far, and with finish
    "error" why it failed."""

    key: Hashable
    token: int
    text: str
    finish: Finish | None
    tokens: int
    error: RowFailed | None = None
    logprob: TokenLogprob | None = None  # joined with logprobs=N: the token's logprob and the top N
    cached: int = 0  # a row's first Piece: its prompt tokens read from the engine's prompt cache


@dataclass(frozen=True)
class Join:
    """A prompt for TextBatch.join_all: its key, the engine's Prompt, and the TextStream its text
    goes through (None: a new one with the prompt's params.stop)."""

    key: Hashable
    prompt: Prompt
    stream: TextStream | None = None


@dataclass
class _Text:
    key: Hashable
    stream: TextStream | None
    tokens: int = 0


class TextBatch:
    """Rows of text over one engine: `join` a prompt (prefilled at once: its first Piece), `step`
    every row (a Piece each), `leave` when the reader is gone. A finished row leaves the engine
    by itself. Without a tokenizer the pieces carry tokens only (generate_tokens). With `threads`
    (a CpuShare), torch's threads give way to other processes between steps (cpu_share.py)."""

    def __init__(self, engine: Rows, tokenizer: Tokenizer | None = None, threads: CpuShare | None = None) -> None:
        self.engine, self.tokenizer, self.threads = engine, tokenizer, threads
        self._rows: dict[int, _Text] = {}  # engine row → its text
        self._where: dict[Hashable, int] = {}  # key → engine row

    def __len__(self) -> int:
        return len(self._rows)

    def free(self) -> int:
        return self.engine.free_rows()

    def join(
        self,
        key: Hashable,
        prompt_ids: list[int],
        params: SamplingParams,
        stop_ids: Iterable[int] = (),
        stream: TextStream | None = None,
        logprobs: int | None = None,
    ) -> Piece:
        """Prefill a prompt into a free row of the engine as `key`; its first token's Piece. The
        text goes through `stream` (default: a new TextStream with params.stop); with `logprobs`
        = N every Piece carries its token's logprob and the top N. A row that fails at once
        raises RowFailed."""
        first = self.join_all([Join(key, Prompt(prompt_ids, params, stop_ids, logprobs), stream)])[0]
        if first.error is not None:
            raise first.error
        return first

    def join_all(self, joins: list[Join]) -> list[Piece]:
        """join for several prompts at once (the engine prefills prompts of one length together):
        their first Pieces in order, a row that failed at once among them with finish "error"."""
        keys = set(self._where)
        for j in joins:
            if j.key in keys:
                raise ValueError(f"row {j.key!r} is already generating")
            keys.add(j.key)
        if self.threads is not None:
            self.threads.update()
        firsts = self.engine.add_all([j.prompt for j in joins])
        pieces = []
        for j, first in zip(joins, firsts):
            stream = j.stream
            if stream is None and self.tokenizer is not None:
                stream = TextStream(self.tokenizer, j.prompt.params.stop)
            self._rows[first.row], self._where[j.key] = _Text(j.key, stream), first.row
            pieces.append(self._piece(first))
        return pieces

    def step(self) -> list[Piece]:
        """One new token for every row: a Piece each."""
        if self.threads is not None:
            self.threads.update()
        return [self._piece(t) for t in self.engine.step()]

    def leave(self, key: Hashable) -> None:
        """The reader went away: free the row now (no-op for a row that has finished)."""
        row = self._where.pop(key, None)
        if row is not None:
            del self._rows[row]
            self.engine.release(row)

    def _piece(self, rt: RowToken) -> Piece:
        """A row's new token → its text; at a stop string (or a failure) the row leaves the engine."""
        text_row = self._rows[rt.row]
        stream, text, finish, error = text_row.stream, "", rt.finish, rt.error
        if finish != "error":
            text_row.tokens += 1
            try:
                text, finish = self._text(stream, rt.token, finish)
            except Exception as e:  # e.g. a tokenizer that cannot decode the id: this row's failure
                text, finish, error = "", "error", RowFailed.of("turning the token into text", e)
            if finish in ("stop", "error"):
                self.engine.release(rt.row)  # idempotent if the row also hit its length
        if finish is not None:
            del self._rows[rt.row]
            del self._where[text_row.key]
        return Piece(text_row.key, rt.token, text, finish, text_row.tokens, error, rt.logprob, rt.cached)

    @staticmethod
    def _text(stream: TextStream | None, token: int, finish: Finish | None) -> tuple[str, Finish | None]:
        """The text a row's new token adds, and its finish: "stop" at a stop string."""
        if stream is None:
            return "", finish
        if finish == "eot":  # a stop token: not part of the text
            return stream.finish(), finish
        text = stream.push(token)
        if stream.stopped:
            return text, "stop"
        if finish in ("length", "stop"):  # "stop" here: the row's constraint is complete (its whole text is out)
            text += stream.finish(cut=finish == "length")
        return text, finish
