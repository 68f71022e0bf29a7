"""The engine task: one thread owns the Engine and serves every request (continuous batching).

Requests enter a queue as `Job`s (one per choice). At every step of the loop, jobs whose client
went away leave their row, waiting jobs join free rows (up to the engine's `max_rows`), and one
decode step advances every active row, each with its own sampling settings and seed, so a job's
tokens are the ones it gets alone. Rows join, step, finish and leave through the one driver,
inference.driver.TextBatch, which turns each job's tokens into text with its own `TextStream`
(UTF-8-safe, stop strings); text and the finish reason go back to the HTTP side through the
job's `emit` callback, with how many of its prompt tokens the engine's prompt cache held (the
usage's cached_tokens). Work that must not run beside a decode step (the attention view) is
queued as a plain call and runs between steps. A row that fails (engine.RowFailed) fails its
job alone; when the engine's last step failed for every row in it, `problem` says so (/health).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from quillgpt.cpu_share import CpuShare, holding
from quillgpt.errors import QuillError
from quillgpt.inference.driver import Join, Piece, TextBatch, TextStream
from quillgpt.inference.engine import Prompt

if TYPE_CHECKING:
    from quillgpt.inference.constraint import Constraint
    from quillgpt.inference.engine import Engine, TokenLogprob
    from quillgpt.sampling_params import SamplingParams

log = logging.getLogger("quillgpt.serve")


@dataclass
class Event:
    """What a job produced since the last event: text, and finally why it ended."""

    index: int  # the choice index in its request
    text: str = ""
    finish: Literal["stop", "length", "error"] | None = None  # OpenAI's reasons, or "error" (then text is the message)
    tokens: int = 0  # completion tokens so far
    status: int = 500  # with finish "error": the HTTP status it maps to
    logprobs: list[tuple[int, TokenLogprob]] = field(default_factory=list)  # a job with logprobs: its new tokens since the last event
    cached: int = 0  # prompt tokens read from the engine's prompt cache (usage.prompt_tokens_details)


@dataclass
class Job:
    """One choice of one request: a prompt to continue with its own settings."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    stream: TextStream
    emit: Callable[[Event], None]  # thread-safe: called on the engine thread
    stop_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # report each token's logprob and the top N
    constraint: Constraint | None = None  # response_format / a forced tool call: the tokens it may draw
    tokens: int = 0
    cached: int = 0  # of its prompt's tokens, those the engine's prompt cache held
    pending: list[tuple[int, TokenLogprob]] = field(default_factory=list)  # logprobs not yet emitted (text held back)
    cancelled: threading.Event = field(default_factory=threading.Event)
    admitted: bool = False  # prefilled into a row (set under the batcher's lock)

    def prompt(self) -> Prompt:
        """The job as the engine takes it."""
        return Prompt(self.prompt_ids, self.params, self.stop_ids, self.logprobs, self.constraint)


class Busy(Exception):
    """The queue is full or the server is stopping (answered with 503)."""


class Batcher:
    """Owns the engine on its own thread; `submit` jobs, `cancel` them, `call` functions."""

    def __init__(self, engine: Engine, max_waiting: int = 256, threads: CpuShare | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.threads = threads  # torch's threads on the engine thread give way to other processes
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting: collections.deque[Job] = collections.deque()
        self._batch = TextBatch(engine, threads=threads)  # jobs are the keys; each brings its own TextStream
        self._rows: dict[int, Job] = {}  # id(job) → job, for the jobs that hold a row
        self._queued = 0  # jobs submitted and not yet prefilled (inbox + waiting)
        self._lock = threading.Lock()
        self._stopping = False
        self._failure: str | None = None  # why the engine's last step failed for every row in it
        self._thread = threading.Thread(target=self._run, name="quill-engine", daemon=True)

    # --- called from the HTTP side ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        with self._lock:
            if self._stopping:
                raise Busy("the server is shutting down")
            if self._queued + len(jobs) > self.max_waiting:
                raise Busy(f"{self._queued} choices are already waiting for a free row (limit {self.max_waiting}); retry shortly")
            self._queued += len(jobs)
            self._inbox.put(jobs)  # under the lock: never behind stop()'s sentinel

    def cancel(self, job: Job) -> None:
        """The client went away: the row is freed at the next step (no-op once the job ended);
        a job still waiting stops counting against the queue limit at once."""
        with self._lock:
            if job.cancelled.is_set():
                return
            job.cancelled.set()
            if not job.admitted:
                self._queued -= 1

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn on the engine thread between steps; the Future holds its result or exception."""
        future: Future = Future()
        with self._lock:
            if self._stopping:
                raise Busy("the server is shutting down")
            self._inbox.put((fn, future))
        return future

    def problem(self) -> str | None:
        """Why the engine cannot serve now (None: it can): its thread is gone, or its last step
        failed for every row in it (cleared by the next step or prefill that works)."""
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping:
            return "the engine thread has stopped"
        return None if self._failure is None else f"the engine's last step failed: {self._failure}"

    def load(self) -> dict[str, Any]:
        """/health's figures: rows at work, choices waiting, the batch's size, where they give way
        to other processes the engine's threads now, and the prompt cache's size and hits."""
        threads = {} if self.threads is None else {"threads": self.threads.threads}
        cache = {"prompt_cache": self.engine.prompt_cache_summary()}  # read while the engine thread works: plain ints
        return {"active": len(self._rows), "waiting": self._queued, "max_batch": self.engine.max_rows, **threads, **cache}

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new work, end the jobs still running (as errors) and join the thread."""
        with self._lock:
            self._stopping = True
            self._inbox.put(None)
        self._thread.join(timeout)

    # --- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        with holding(self.threads):
            self._loop()
        self._fail_all("the server stopped before this request finished")

    def _loop(self) -> None:
        while True:
            try:
                if not self._take_inbox(block=not self._rows and not self._waiting):
                    break
                self._drop_cancelled()
                self._admit()
                if self._rows:
                    pieces = self._batch.step()
                    failed = [p for p in pieces if p.finish == "error"]
                    self._failure = str(failed[0].error) if failed and len(failed) == len(pieces) else None
                    for piece in pieces:
                        self._deliver(piece)
            except Exception as e:  # a bug here, not in a row (the engine fails rows itself): the jobs fail, the server goes on
                log.exception("engine task error")
                self._failure = f"{type(e).__name__}: {e}"
                for key, job in self._rows.items():
                    self._batch.leave(key)
                    job.emit(Event(job.index, "internal error while generating (logged on the server)", "error", job.tokens))
                self._rows.clear()

    def _fail_all(self, message: str) -> None:
        while True:  # nothing can enter the inbox any more (stop() holds _stopping)
            try:
                item = self._inbox.get(block=False)
            except queue.Empty:
                break
            if isinstance(item, list):
                self._waiting.extend(item)
            elif isinstance(item, tuple) and item[1].set_running_or_notify_cancel():
                item[1].set_exception(Busy(message))
        for job in [*self._rows.values(), *self._waiting]:
            job.emit(Event(job.index, message, "error", job.tokens, status=503))
        self._rows.clear()
        self._waiting.clear()

    def _take_inbox(self, block: bool) -> bool:
        """Move new jobs to the waiting line and run queued calls; False once stop() was called."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            if isinstance(item, tuple):
                fn, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # handed to the caller, who decides
                        future.set_exception(e)
            else:
                self._waiting.extend(item)

    def _drop_cancelled(self) -> None:
        for key, job in list(self._rows.items()):
            if job.cancelled.is_set():
                self._batch.leave(key)
                del self._rows[key]
        self._waiting = collections.deque(j for j in self._waiting if not j.cancelled.is_set())

    def _admit(self) -> None:
        """Prefill waiting jobs into free rows, those whose prompts have one length together (the
        engine's add_all: a request's n choices, a burst); each prefill yields its job's first token.
        A job the engine refuses gets its 400 alone, before any row is claimed."""
        jobs: list[Job] = []
        while self._waiting and len(jobs) < self.engine.free_rows():
            job = self._waiting.popleft()
            with self._lock:
                if job.cancelled.is_set():
                    continue
                job.admitted = True
                self._queued -= 1
            try:
                self.engine.check(job.prompt())
            except (QuillError, ValueError, TypeError) as e:
                job.emit(Event(job.index, str(e), "error", status=400))
                continue
            jobs.append(job)
        if jobs:
            self._join(jobs)

    def _join(self, jobs: list[Job]) -> None:
        """Prefill checked jobs together; where that raises, which job was it? Each alone."""
        try:
            firsts = self._batch.join_all([Join(id(job), job.prompt(), job.stream) for job in jobs])
        except Exception as e:  # nothing was added: the engine released every row it had claimed
            if len(jobs) > 1:
                for job in jobs:
                    self._join([job])
            elif isinstance(e, (QuillError, ValueError)):
                jobs[0].emit(Event(jobs[0].index, str(e), "error", status=400))
            else:  # a bug: this job fails, the others go on
                log.exception("prefill failed")
                jobs[0].emit(Event(jobs[0].index, "internal error during prefill (logged on the server)", "error"))
            return
        for job, first in zip(jobs, firsts):
            self._failure = None if first.error is None else str(first.error)  # a failed prefill: the engine released its row
            job.cached = first.cached
            self._rows[id(job)] = job
            self._deliver(first)

    def _deliver(self, piece: Piece) -> None:
        """A row's new text → its job; at the row's end, the finish reason in OpenAI's words."""
        job = self._rows[piece.key]
        job.tokens = piece.tokens
        if piece.error is not None:  # the row is released; the job ends in an error event
            del self._rows[piece.key]
            log.error("a request failed after %d token(s): %s", job.tokens, piece.error)
            job.emit(Event(job.index, f"generation failed: {piece.error}", "error", job.tokens))
            return
        finish = None if piece.finish is None else "length" if piece.finish == "length" else "stop"
        if finish is not None:
            del self._rows[piece.key]
        if piece.logprob is not None and piece.finish != "eot":  # a stop token is not part of the text
            job.pending.append((piece.token, piece.logprob))
        if piece.text or finish:
            logprobs, job.pending = job.pending, []
            job.emit(Event(job.index, piece.text, finish, job.tokens, logprobs=logprobs, cached=job.cached))
