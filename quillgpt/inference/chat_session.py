"""A conversation with a model (`quill chat`, and the server's /v1/chat/completions prompt).

Each turn renders the whole conversation with the model's chat template (an imported model's
own; quill's transcript for a base model: data/chat_template.py), generates the reply through the
engine, and ends it at the template's end-of-turn token (a stop id) or, for the transcript,
where the model starts the next turn (a stop string). A reply may be cut short (Ctrl-C in the
terminal): what was generated stays in the conversation, so the next turn follows what was seen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quillgpt import quant
from quillgpt.cpu_share import FIRST_LOOK_S, CpuShare, holding, threads_note
from quillgpt.data.chat_template import TRANSCRIPT_STOPS, Message, conversation_ids
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError
from quillgpt.inference.compiled_step import shared_capacity
from quillgpt.inference.driver import TextBatch, TextStream
from quillgpt.inference.engine import RowFailed
from quillgpt.inference.generate import make_engine
from quillgpt.inference.native_decoder import op_by_op_note
from quillgpt.model.gpt import GPT
from quillgpt.runs import LoadOptions, load_run
from quillgpt.sampling_params import SamplingParams

# a first call of the compiled step that took this long compiled it (seconds to minutes); a graph an
# earlier reply compiled takes one step's time (milliseconds; ~0.1 s on a machine busy with other work)
COMPILE_NOTED_S = 0.5


def run_kind(config: Any, tokenizer: Tokenizer, step: int) -> str:
    """What the chat header says the model is, from its run's config: a fine-tune on chat data
    (data.format=chat), an imported model with its chat template, or a base model (the transcript)."""
    how = "its chat template" if tokenizer.chat_template is not None else "a User:/Assistant: transcript"
    if config.data.format == "chat":
        adapters = f"LoRA rank {config.lora.rank} " if config.lora.rank else ""
        return f"a chat fine-tune ({adapters}trained on conversations, step {step}) through {how}"
    if tokenizer.chat_template is not None:
        where = "imported, step 0" if step == 0 else f"trained from a model with a chat template, step {step}"
        return f"a model with its own chat template ({where})"
    return f"a base model (step {step}, not trained to chat) through {how}"


@dataclass
class ReplyStats:
    """One reply's speed: its tokens over the generation's time, the prompt's prefill apart."""

    prompt_tokens: int = 0
    tokens: int = 0
    prefill_s: float = 0.0  # the prompt and the first token
    seconds: float = 0.0  # the whole reply, prefill and compiling included
    compile_s: float = 0.0  # of seconds: compiling the decode step (compile=True, a new cache size)
    threads: str = ""  # the CPU threads it ran on and, when fewer than all, why (cpu_share.threads_note)

    def line(self) -> str:
        rest = self.seconds - self.prefill_s - self.compile_s
        rate = f", {(self.tokens - 1) / rest:.1f} tokens/s after the first" if self.tokens > 1 and rest > 0 else ""
        prefill = f"prompt {self.prompt_tokens} tokens, {self.prefill_s * 1e3:.0f} ms to the first"
        compiled = f"; compiling the decode step {self.compile_s:.1f}s" if self.compile_s >= COMPILE_NOTED_S else ""
        threads = f"; {self.threads}" if self.threads else ""
        return f"({self.tokens} token(s) in {self.seconds:.2f}s{rate}; {prefill}{compiled}{threads})"


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[Message]) -> tuple[list[int], tuple[str, ...]]:
    """(prompt ids, stop strings) of a conversation that the assistant answers next: the model's
    template (its special tokens read as such, nothing added: apply_chat_template's ids), or quill's
    transcript, which ends where the model starts the next turn (data/chat_template.py: what training on
    chat data puts before each reply)."""
    ids = conversation_ids(tokenizer, messages, add_generation_prompt=True)
    return ids, () if tokenizer.chat_template is not None else TRANSCRIPT_STOPS


def fitting(model: GPT, prompt_len: int, max_new_tokens: int) -> int:
    """max_new_tokens, lowered to what the variant leaves room for (a prefix-LM never crops its prompt)."""
    room = model.variant.room(model.config, prompt_len)
    return max_new_tokens if room is None else max(1, min(max_new_tokens, room[0]))


class ChatSession:
    """The messages so far and the settings every reply is sampled with. compile: each reply's
    decode step compiled (the cache sized by compiled_step.shared_capacity, so later replies reuse
    the graph until the conversation outgrows it); threads: a CpuShare, so each reply's threads give
    way to other processes (kept across replies: its decision, and its hold)."""

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        params: SamplingParams,
        system: str | None = None,
        compile: bool = False,
        threads: CpuShare | None = None,
    ) -> None:
        if params.max_new_tokens < 1:
            raise QuillError(f"a reply needs max_new_tokens of at least 1 (it is {params.max_new_tokens}); pass -n 1 or more")
        self.model, self.tokenizer, self.params, self.system, self.compile = model, tokenizer, params, system, compile
        self.threads = threads
        self.messages: list[Message] = []
        self.last = ReplyStats()  # the last reply's speed (/stats)
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
        tokens = len(ids) + params.max_new_tokens
        engine = make_engine(self.model, 1, compile=self.compile, tokens=shared_capacity(tokens) if self.compile else tokens)
        batch = TextBatch(engine, self.tokenizer, self.threads)
        said: list[str] = []
        self.last = ReplyStats(prompt_tokens=len(ids))
        with holding(self.threads):
            try:
                for piece in _pieces(batch, ids, params, self.last):
                    said.append(piece)
                    self.last.compile_s = engine.compile_s
                    yield piece
            finally:
                batch.leave(0)
                self.messages.append({"role": "assistant", "content": "".join(said)})
                self.last.threads = threads_note(self.threads, self.model.device)


def open_chat(
    ckpt: str | Path, options: LoadOptions, system: str | None = None, flags: dict[str, Any] | None = None
) -> tuple[ChatSession, str]:
    """`quill chat`: load a run (a reply is one row) and start a conversation with `flags`
    (SampleConfig's fields, None: not given) over the run's sample: config; (session, the header
    line that says what the model is and how it runs)."""
    flags = flags or {}
    n = flags.get("max_new_tokens")
    if n is not None and n < 1:
        raise QuillError(f"--max-new-tokens {n}: a reply needs at least 1 token")
    threads = CpuShare.for_run(torch.device(options.device), first_s=FIRST_LOOK_S)  # the load: its first look's window
    run = load_run(ckpt, dataclasses.replace(options, rows=1))
    session = ChatSession(run.model, run.tokenizer, run.config.sample.params(**flags), system, options.compile, threads)
    kind = run_kind(run.config, run.tokenizer, run.step)
    note = quant.weights_note(run.model, "; ", compiled=options.compile and run.model.variant.static_cache) + op_by_op_note(run.model)
    return session, f"chatting with {run.path}: {kind}{note}; /reset, /stats, /quit, /help"


def _pieces(batch: TextBatch, ids: list[int], params: SamplingParams, stats: ReplyStats) -> Iterator[str]:
    """The reply's text as it comes, its speed kept in `stats`; a failed row (engine.RowFailed) is
    one QuillError, its cause chained. A reply cut by its length drops a started stop string."""
    started = time.perf_counter()
    try:
        stream = TextStream(batch.tokenizer, params.stop, drop_cut_stop=True)
        pieces = [batch.join(0, ids, params, batch.tokenizer.stop_ids, stream=stream)]
    except RowFailed as e:
        raise QuillError(f"the reply failed: {e}") from e
    stats.prefill_s = time.perf_counter() - started
    while pieces:
        for piece in pieces:
            if piece.error is not None:  # the first token's too (a token that cannot become text)
                raise QuillError(f"the reply failed: {piece.error}") from piece.error
            stats.tokens, stats.seconds = piece.tokens, time.perf_counter() - started
            yield piece.text
        pieces = batch.step() if len(batch) else []


@contextlib.contextmanager
def typing_kept(fd: int | None) -> Iterator[None]:
    """While a reply streams: the terminal does not echo what is typed (it would land inside the
    reply), but keeps it, so it is the start of the next line read. No-op where fd is no terminal."""
    try:
        import termios

        attrs = termios.tcgetattr(fd) if fd is not None and os.isatty(fd) else None
    except (ImportError, OSError):
        attrs = None
    if attrs is None:
        yield
        return
    quiet = list(attrs)
    # lflag: no echo (canonical mode stays, so typed lines are buffered), and NOFLSH: the Ctrl-C that
    # stops a reply does not flush what was typed during it (a /quit typed ahead is read next)
    quiet[3] = quiet[3] & ~termios.ECHO | termios.NOFLSH
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, attrs)  # TCSANOW, never TCSAFLUSH: the typed input stays


HELP = (
    "/reset forgets the conversation, /stats shows the last reply's speed, /quit (or /exit, Ctrl-D) ends the chat, "
    "Ctrl-C stops a reply; a message that starts with / is sent when it starts with a space"
)


def repl(
    session: ChatSession,
    read: Callable[[str], str],
    write: Callable[[str], None],
    note: Callable[[str], None] | None = None,
    tty: int | None = None,
) -> int:
    """The terminal loop of `quill chat`: a line is a message, /reset forgets the conversation,
    /stats shows the last reply's speed, /quit (or end of input) ends, /help (or any other line that
    starts with /) lists them without reaching the model; Ctrl-C stops one reply, not the session.
    `note` gets each reply's speed line; `tty`: the terminal typed into during a reply (not echoed,
    kept for the next line). Returns replies made."""
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
        command = line.rstrip()
        if command in ("/quit", "/exit"):
            return replies
        if command == "/reset":
            session.reset()
            write("(conversation cleared)\n")
            continue
        if command == "/stats":
            write((session.last.line() if session.last.tokens else "(no reply yet)") + "\n")
            continue
        if command.startswith("/"):  # /help, or a command quill does not have: never sent to the model
            known = command.split()[0] in ("/help", "/?")
            write(("" if known else f"(no command {command.split()[0][:40]}) ") + HELP + "\n")
            continue
        if not command.strip():
            continue
        with typing_kept(tty):
            made = _turn(session, line, write)
        if made and note is not None:
            note(session.last.line())
        replies += made


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
