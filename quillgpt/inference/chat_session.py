"""A conversation with a model (`quill chat`, and the server's /v1/chat/completions prompt).

Each turn renders the whole conversation with the model's chat template (an imported model's
own; quill's transcript for a base model: data/chat.py), generates the reply through the
engine, and ends it at the template's end-of-turn token (a stop id) or, for the transcript,
where the model starts the next turn (a stop string). A reply may be cut short (Ctrl-C in the
terminal): what was generated stays in the conversation, so the next turn follows what was seen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from quillgpt.data.chat_template import TRANSCRIPT_STOPS, Message, conversation_ids
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError
from quillgpt.inference.driver import TextBatch
from quillgpt.inference.engine import RowFailed
from quillgpt.inference.generate import make_engine
from quillgpt.model.gpt import GPT
from quillgpt.sampling_params import SamplingParams


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[Message]) -> tuple[list[int], tuple[str, ...]]:
    """(prompt ids, stop strings) of a conversation that the assistant answers next: the model's
    template (its special tokens read as such, nothing added: apply_chat_template's ids), or quill's
    transcript, which ends where the model starts the next turn (data/chat.py: what training on
    chat data puts before each reply)."""
    ids = conversation_ids(tokenizer, messages, add_generation_prompt=True)
    return ids, () if tokenizer.chat_template is not None else TRANSCRIPT_STOPS


def fitting(model: GPT, prompt_len: int, max_new_tokens: int) -> int:
    """max_new_tokens, lowered to what the variant leaves room for (a prefix-LM never crops its prompt)."""
    room = model.variant.room(model.config, prompt_len)
    return max_new_tokens if room is None else max(1, min(max_new_tokens, room[0]))


class ChatSession:
    """The messages so far and the settings every reply is sampled with."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, params: SamplingParams, system: str | None = None) -> None:
        if params.max_new_tokens < 1:
            raise QuillError(f"a reply needs max_new_tokens of at least 1 (it is {params.max_new_tokens}); pass -n 1 or more")
        self.model, self.tokenizer, self.params, self.system = model, tokenizer, params, system
        self.messages: list[Message] = []
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [] if not self.system else [{"role": "system", "content": self.system}]

    def reply(self, text: str) -> Iterator[str]:
        """Add the user's message and stream the assistant's reply, piece by piece; the reply (all
        of it, or as much as was read before the caller stopped) joins the conversation."""
        ids, stops = chat_prompt_ids(self.tokenizer, [*self.messages, {"role": "user", "content": text}])
        self.messages.append({"role": "user", "content": text})  # (a message that cannot be read is not kept)
        params = dataclasses.replace(
            self.params, stop=self.params.stop + stops, max_new_tokens=fitting(self.model, len(ids), self.params.max_new_tokens)
        )
        batch = TextBatch(make_engine(self.model, 1, tokens=len(ids) + params.max_new_tokens), self.tokenizer)
        said: list[str] = []
        try:
            for piece in _pieces(batch, ids, params):
                said.append(piece)
                yield piece
        finally:
            batch.leave(0)
            self.messages.append({"role": "assistant", "content": "".join(said)})


def _pieces(batch: TextBatch, ids: list[int], params: SamplingParams) -> Iterator[str]:
    """The reply's text as it comes; a failed row (engine.RowFailed) is one QuillError, its cause chained."""
    try:
        pieces = [batch.join(0, ids, params, batch.tokenizer.stop_ids)]
    except RowFailed as e:
        raise QuillError(f"the reply failed: {e}") from e
    while pieces:
        for piece in pieces:
            if piece.error is not None:  # the first token's too (a token that cannot become text)
                raise QuillError(f"the reply failed: {piece.error}") from piece.error
            yield piece.text
        pieces = batch.step() if len(batch) else []


def repl(session: ChatSession, read: Callable[[str], str], write: Callable[[str], None]) -> int:
    """The terminal loop of `quill chat`: a line is a message, /reset forgets the conversation,
    /quit (or end of input) ends; Ctrl-C stops one reply, not the session. Returns replies made."""
    replies = 0
    while True:
        try:
            line = read("> ")
        except EOFError:
            write("\n")
            return replies
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            write("\n(/quit or Ctrl-D ends the chat)\n")
            continue
        command = line.strip()
        if command in ("/quit", "/exit"):
            return replies
        if command == "/reset":
            session.reset()
            write("(conversation cleared)\n")
            continue
        if not command:
            continue
        replies += _turn(session, line, write)


def _turn(session: ChatSession, line: str, write: Callable[[str], None]) -> int:
    """One message and its reply; a message the model cannot read (not UTF-8, a character outside
    its vocabulary, a template that refuses it) is one error line, and the conversation goes on."""
    try:
        line.encode("utf-8")  # a terminal's invalid byte arrives as a lone surrogate
        for piece in session.reply(line):
            write(piece)
    except UnicodeEncodeError:
        write("error: the message is not UTF-8 text (an invalid byte); type it again\n")
        return 0
    except QuillError as e:
        write(f"error: {e}\n")
        return 0
    except KeyboardInterrupt:
        write(" [stopped]")
    write("\n")
    return 1
