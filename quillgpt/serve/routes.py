"""The HTTP side: OpenAI routes, Server-Sent Events, auth, body limits and the web page.

`create_app` builds a FastAPI app around a loaded run and a running `Batcher`; nothing here
touches the model directly. Every route turns its body into `Job`s (one per choice), hands them
to the batcher and turns the `Event`s that come back into OpenAI's JSON or SSE chunks. A request
is checked whole before its reply starts (a streamed one too), bodies are JSON only (a web
page's form or text/plain "simple request" cannot reach the model), and on shutdown the `Drain`
ends each reply that cannot finish in time: a stream with an error event and [DONE].
`response_format` and `tools` become a grammar each choice is held to and the template's tools,
and a reply's tool calls are parsed back (serve/structured.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from quillgpt.data.chat_template import TemplateFailed, conversation_ids
from quillgpt.errors import QuillError
from quillgpt.inference.chat_session import chat_prompt_ids, fitting
from quillgpt.inference.driver import TextStream, encode_prompt
from quillgpt.inference.engine import check_prompt, check_room, prompt_logprobs
from quillgpt.inference.generate import row_params
from quillgpt.sampling_params import InvalidParam, SamplingParams
from quillgpt.serve.access_log import AccessLog
from quillgpt.serve.batcher import Batcher, Busy, Event, Job
from quillgpt.serve.errors import APIError, install_handlers
from quillgpt.serve.responses import DONE, Entry, Reply, chat_logprobs, completion_logprobs, sse
from quillgpt.serve.schemas import (
    AttentionRequest,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    logprob_count,
    parse_body,
    reject_unsupported,
    stop_strings,
)
from quillgpt.serve.structured import Tools, parse_tool_calls, request_grammar, request_tools, template_message

if TYPE_CHECKING:
    from quillgpt.inference.constraint import Grammar
    from quillgpt.runs import LoadedRun

STATIC = Path(__file__).resolve().parent / "static"
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams field → request field
JSON_TYPES = (b"application/json",)  # the media types a POST body may have
log = logging.getLogger("quillgpt.serve")


@dataclass(frozen=True)
class ServeOptions:
    """What the server allows; fixed at start-up."""

    model_id: str
    api_key: str | None = None
    max_tokens: int = 2048  # the largest max_tokens a request may ask for (also the chat default)
    max_prompt_tokens: int = 4096
    max_body_bytes: int = 1 << 20
    max_waiting: int = 256  # choices queued beyond the running batch before answering 503
    attention_max_tokens: int = 128  # the attention view keeps the last tokens: T×T weights per head get large fast
    cors: str | None = None
    body_timeout_s: float = 30.0  # a request body must arrive whole within this (a stalled upload is 408)
    prompt_cache_mb: int | None = None  # the engine's prompt cache (None: sized from the KV and memory; 0: off)


def create_app(run: LoadedRun, batcher: Batcher, options: ServeOptions) -> FastAPI:
    """The app; starting it starts the batcher's thread, stopping it stops the thread."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            batcher.stop()

    app = FastAPI(title="quill serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.drain = drain = Drain()
    install_handlers(app)
    app.add_middleware(Guard, api_key=options.api_key, max_body=options.max_body_bytes, body_timeout_s=options.body_timeout_s)
    if options.cors:
        app.add_middleware(
            CORSMiddleware, allow_origins=[options.cors], allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]
        )
    app.add_middleware(AccessLog)  # added last: outermost, so refusals are logged too
    routes = Routes(run, batcher, options, drain)
    app.get("/", include_in_schema=False)(lambda: FileResponse(STATIC / "index.html"))
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.get("/health")(routes.health)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id}")(routes.model)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat)
    app.post("/v1/attention")(routes.attention)
    return app


class Guard:
    """ASGI middleware: the API key (every path but the page, its files and /health), the body's
    size cap, media type (JSON) and deadline, checked before any route runs."""

    def __init__(self, app: Any, api_key: str | None, max_body: int, body_timeout_s: float) -> None:
        self.app, self.max_body, self.body_timeout_s = app, max_body, body_timeout_s
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            extra = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None
            return await refusal.response(extra)(scope, receive, send)
        seen, whole, loop = 0, False, asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s

        async def counted() -> dict:
            nonlocal seen, whole
            if whole:  # the body is in: what follows is waiting for a disconnect, unbounded
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s", code="body_timeout") from None
            seen += len(message.get("body", b""))
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            if seen > self.max_body:
                raise APIError(413, f"the request body is over {self.max_body:,} bytes", code="body_too_large")
            return message

        await self.app(scope, counted, send)

    def _refusal(self, scope: dict, headers: dict[bytes, bytes]) -> APIError | None:
        public = scope["path"] in ("/", "/health") or scope["path"].startswith("/static/")
        if self.expected is not None and not public and scope["method"] != "OPTIONS":  # deny by default
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return APIError(401, "missing or wrong API key: send the header Authorization: Bearer KEY", code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and not length.isdigit():
            return APIError(400, "the Content-Length header is not a number", code="invalid_body")
        if length is not None and int(length) > self.max_body:
            return APIError(413, f"the request body is over {self.max_body:,} bytes", code="body_too_large")
        media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope["method"] == "POST" and media not in JSON_TYPES:
            got = repr(media.decode("latin-1")[:60]) if media else "none"
            return APIError(
                415,
                f"the request body must be JSON: send the header Content-Type: application/json (got {got})",
                code="unsupported_media_type",
            )
        return None


class Drain:
    """Shutdown's deadline for the replies still running: `start` gives them `seconds`, then
    every reply waiting in `next_event` ends itself (logged once, in one line)."""

    def __init__(self) -> None:
        self.expired = asyncio.Event()
        self.running = 0  # replies waiting on the engine now

    def start(self, seconds: float) -> None:
        asyncio.get_running_loop().call_later(seconds, self._expire, seconds)

    def _expire(self, seconds: float) -> None:
        if self.running:
            log.warning("shutting down: %d reply(ies) still generating after the %g s drain end with an error", self.running, seconds)
        self.expired.set()

    async def next_event(self, events: asyncio.Queue) -> Event | None:
        """The next event of a reply, or None once the drain has expired."""
        if self.expired.is_set():
            return None
        if not events.empty():  # the common case while generating: no task to make
            return events.get_nowait()
        getting = asyncio.ensure_future(events.get())
        expiring = asyncio.ensure_future(self.expired.wait())
        try:
            await asyncio.wait({getting, expiring}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            expiring.cancel()
            if not getting.done():
                getting.cancel()
        return getting.result() if getting.done() and not getting.cancelled() else None


class Relay:
    """Carries events from the engine thread to the event loop: one wake-up of the loop per
    burst (a decode step's events for every row), not one per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Event]] = []

    def post(self, queue: asyncio.Queue, event: Event) -> None:
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:
                return  # a wake-up is already on its way
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, event in pending:
            queue.put_nowait(event)


class Routes:
    """The route handlers, sharing the run, the batcher and the options."""

    def __init__(self, run: LoadedRun, batcher: Batcher, options: ServeOptions, drain: Drain) -> None:
        self.run, self.batcher, self.options, self.drain = run, batcher, options, drain
        self.created = int(time.time())
        self._relays: dict[asyncio.AbstractEventLoop, Relay] = {}

    def _relay(self, loop: asyncio.AbstractEventLoop) -> Relay:
        if loop not in self._relays:
            self._relays[loop] = Relay(loop)
        return self._relays[loop]

    async def health(self) -> Any:
        """ok, or 503 with the reason when the engine cannot serve (its last step failed)."""
        problem = self.batcher.problem()
        if problem is not None:
            return JSONResponse({"status": "error", "reason": problem, **self.batcher.load()}, status_code=503)
        return {"status": "ok", **self.batcher.load()}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        self._check_model(model_id)
        return self._model_card()

    def _model_card(self) -> dict[str, Any]:
        cfg = self.run.config.model
        return {
            "id": self.options.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "quill",
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "block_size": cfg.block_size,
            "vocab_size": cfg.vocab_size,
            "step": self.run.step,
            "max_tokens": self.options.max_tokens,
        }

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.options.model_id:
            raise APIError(
                404,
                f"model {model!r} is not served here; this server serves {self.options.model_id!r}",
                param="model",
                code="model_not_found",
            )

    async def completions(self, request: Request) -> Any:
        req = parse_body(await request.body(), CompletionRequest)
        prompt = req.prompt
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not prompts:
            raise APIError(400, "prompt is an empty list; give at least one prompt", param="prompt")
        ids = [self._encode(p, "prompt") if isinstance(p, str) else self._token_prompt(p) for p in prompts]
        texts = [p if isinstance(p, str) else self.run.tokenizer.decode(p) for p in prompts]
        out = Output(False, logprob_count(req), texts if req.echo else None)
        grammar = await self._grammar(req, None)
        return await self._generate(request, req, ids, stops=(), default_max=16, out=out, grammar=grammar)

    def _token_prompt(self, ids: list[int]) -> list[int]:
        """A prompt sent as token ids (lm-eval's local-completions sends them): used as they are."""
        try:
            check_prompt(ids, self.run.model.config.vocab_size)
        except QuillError as e:
            raise APIError(400, str(e), param="prompt", code="invalid_prompt") from None
        return self._checked(ids, "prompt")

    async def chat(self, request: Request) -> Any:
        req = parse_body(await request.body(), ChatRequest)
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        tok = self.run.tokenizer
        tools = request_tools(req, tok.chat_template)
        messages = [template_message(m) for m in req.messages]
        try:  # the model's template (untrusted code, time-limited) in a worker thread: a slow one holds up no other request
            if tools is None:
                ids, stops = await asyncio.to_thread(chat_prompt_ids, tok, messages)
            else:  # a template that renders tools (request_tools checked): no stop strings
                ids, stops = await asyncio.to_thread(conversation_ids, tok, messages, True, tools.tools), ()
        except TemplateFailed as e:  # the template's own failure, not the messages'
            raise APIError(500, str(e), code="chat_template_failed") from None
        except QuillError as e:
            raise APIError(400, str(e), param="messages", code="invalid_prompt") from None
        out = Output(True, logprob_count(req), tools=tools if tools is not None and tools.parse else None)
        grammar = await self._grammar(req, tools)
        return await self._generate(
            request, req, [self._checked(ids, "messages")], stops=stops, default_max=self.options.max_tokens, out=out, grammar=grammar
        )  # _max_tokens fits the room

    async def _grammar(self, req: ChatRequest | CompletionRequest, tools: Tools | None) -> Grammar | None:
        """The grammar the request's choices are held to (response_format, a forced tool call), or None."""
        if req.response_format is None and (tools is None or tools.forced is None):
            return None
        vocab = self.run.model.config.vocab_size
        return await asyncio.to_thread(request_grammar, req, tools, self.run.tokenizer, vocab)  # the first builds llguidance's vocabulary

    async def attention(self, request: Request) -> dict[str, Any]:
        from quillgpt.evaluate.attention_views import attention_weights

        req = parse_body(await request.body(), AttentionRequest)
        self._check_model(req.model)
        if not req.prompt:
            raise APIError(400, "prompt is empty; give some text to look at", param="prompt")
        self._encode(req.prompt, "prompt")  # unknown characters and the prompt limit: a 400 here
        limit = self.options.attention_max_tokens  # a longer text keeps its last tokens, as the CLI crops
        attn = await self._on_engine(lambda: attention_weights(self.run.model, self.run.tokenizer, req.prompt, limit))
        return {
            "object": "attention",
            "model": self.options.model_id,
            "tokens": attn.tokens,
            "token_ids": attn.ids,
            "cropped": attn.cropped,
            "n_layer": len(attn.weights),
            "n_head": attn.weights[0].shape[0],
            "weights": [(w * 1e4).round().div(1e4).tolist() for w in attn.weights],  # [layer][head][query][key]
        }

    async def _on_engine(self, fn: Any) -> Any:
        try:
            future = self.batcher.call(fn)
        except Busy as e:
            raise APIError(503, str(e), code="server_busy") from None
        return await asyncio.wrap_future(future)

    def _encode(self, text: str, param: str) -> list[int]:
        try:
            ids = encode_prompt(self.run.tokenizer, text)
        except QuillError as e:
            raise APIError(400, str(e), param=param, code="invalid_prompt") from None
        return self._checked(ids, param)

    def _checked(self, ids: list[int], param: str) -> list[int]:
        if len(ids) > self.options.max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {len(ids):,} tokens; this server takes at most {self.options.max_prompt_tokens:,}",
                param=param,
                code="prompt_too_long",
            )
        return ids

    def _params(self, req: SamplingFields, max_tokens: int, seed: int | None, stops: tuple[str, ...]) -> SamplingParams:
        try:
            return SamplingParams(
                max_new_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=req.top_k or None,
                top_p=1.0 if req.top_p is None else req.top_p,
                min_p=req.min_p or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                seed=seed,
                stop=stops,
            )
        except InvalidParam as e:
            param = OPENAI_NAMES.get(e.param, e.param)
            raise APIError(400, e.message(param), param=param, code="invalid_value") from None

    def _max_tokens(self, req: SamplingFields, default: int, ids: list[list[int]], least: int = 1) -> int:
        """The request's max_tokens, or a default that fits every prompt's room (a prefix-LM's
        prompt + reply must fit block_size); a prompt it cannot continue is refused here,
        before any reply starts, naming the HTTP field. 0 (least=0) with echo: score the prompt only."""
        cap, model = self.options.max_tokens, self.run.model
        if req.max_tokens is None:
            n = min(fitting(model, len(p), min(default, cap)) for p in ids)
        else:
            n = req.max_tokens
        if not least <= n <= cap:
            raise APIError(
                400,
                f"max_tokens must be between {least} and {cap:,} (the server's --max-tokens), got {n}"
                + ("; 0 scores the prompt only, with echo: true" if n == 0 else ""),
                param="max_tokens",
                code="invalid_value",
            )
        for p in ids:
            try:
                check_room(model, len(p), n, name="max_tokens", flag="max_tokens")
            except QuillError as e:
                raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        return n

    async def _generate(
        self,
        request: Request,
        req: SamplingFields,
        ids: list[list[int]],
        stops: tuple[str, ...],
        default_max: int,
        out: Output,
        grammar: Grammar | None = None,
    ) -> Any:
        """Check the request, queue one job per choice (each held to `grammar` where given),
        answer with SSE or the whole reply."""
        self._check_model(req.model)
        reject_unsupported(req)
        n = self._choices(req, len(ids))
        stops = stops + stop_strings(req.stop)
        max_tokens = self._max_tokens(req, default_max, ids, least=0 if out.echo is not None else 1)
        first = self._params(req, max(max_tokens, 1), req.seed, stops)  # checks the seed as the client sent it
        params = [row_params(first, k) for k in range(n)]  # choice k: seed + k (wrapping), as quill sample's rows
        if out.echo is not None:
            await self._echo(out, ids, n)
        reply = Reply(out.chat, self.options.model_id, sum(map(len, ids)), bool(req.stream_options and req.stream_options.include_usage))
        request.state.reply = reply
        if max_tokens == 0:  # echo alone: the prompt scored, nothing generated
            return self._echo_only(reply, out, len(ids) * n, bool(req.stream))
        events: asyncio.Queue[Event] = asyncio.Queue()
        relay = self._relay(asyncio.get_running_loop())
        emit = lambda event: relay.post(events, event)  # noqa: E731 (called on the engine thread)
        jobs = self._jobs(ids, params, stops, emit, out, grammar)
        try:
            self.batcher.submit(jobs)
        except Busy as e:
            raise APIError(503, str(e), code="server_busy") from None
        out.per_choice = n
        if req.stream:
            return StreamingResponse(
                self._stream(reply, jobs, events, out),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._collect(request, reply, jobs, events, out)

    def _choices(self, req: SamplingFields, prompts: int) -> int:
        """n, checked: n × prompts rows must fit the engine's batch."""
        n, rows = (1 if req.n is None else req.n), self.batcher.engine.max_rows
        if n < 1 or n * prompts > rows:
            raise APIError(
                400,
                f"n × prompts must be between 1 and {rows} (the server's --max-batch), got {n} × {prompts}",
                param="n",
                code="invalid_value",
            )
        return n

    def _jobs(
        self,
        ids: list[list[int]],
        params: list[SamplingParams],
        stops: tuple[str, ...],
        emit: Callable[[Event], None],
        out: Output,
        grammar: Grammar | None,
    ) -> list[Job]:
        """One job per choice, prompt by prompt (choice k of a prompt samples with params[k]),
        each with its own text stream and, with a grammar, its own copy of its state."""
        tok = self.run.tokenizer
        return [
            Job(
                i * len(params) + k,
                prompt,
                p,
                TextStream(tok, stops),
                emit,
                stop_ids=tok.stop_ids,
                logprobs=out.logprobs,
                constraint=None if grammar is None else grammar.constraint(),
            )
            for i, prompt in enumerate(ids)
            for k, p in enumerate(params)
        ]

    async def _echo(self, out: Output, ids: list[list[int]], n: int) -> None:
        """With logprobs, each prompt's tokens scored (one forward on the engine thread, the
        engine's weights); echo without logprobs needs only the text."""
        out.per_choice = n
        if out.logprobs is None:
            return
        block = self.run.model.config.block_size
        if any(len(p) > block for p in ids):
            raise APIError(
                400,
                f"echo with logprobs scores at most block_size ({block}) prompt tokens; shorten the prompt",
                param="prompt",
                code="context_length_exceeded",
            )
        model, k = self.batcher.engine.model, out.logprobs
        out.echo_entries = await self._on_engine(lambda: [prompt_logprobs(model, p, k) for p in ids])

    def _echo_only(self, reply: Reply, out: Output, choices: int, stream: bool) -> Any:
        """max_tokens 0 with echo: each choice is its prompt (and the prompt's logprobs)."""
        firsts = [out.first(self.run.tokenizer, i) for i in range(choices)]
        if not stream:
            return reply.full([t for t, _ in firsts], ["length"] * choices, 0, [lp for _, lp in firsts])
        chunks = [sse(reply.chunk(i, t, "length", logprobs=lp)) for i, (t, lp) in enumerate(firsts)]
        usage = [sse(reply.usage_chunk(0))] if reply.include_usage else []
        return StreamingResponse(iter([*chunks, *usage, DONE]), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _stream(self, reply: Reply, jobs: list[Job], events: asyncio.Queue, out: Output) -> AsyncIterator[str]:
        """SSE chunks as the engine produces text; a client that leaves cancels its jobs; a
        stream the shutdown drain cuts ends with an error event and [DONE]."""
        self.drain.running += 1
        reply.streamed = True
        try:
            if reply.chat:
                for job in jobs:
                    yield sse(reply.chunk(job.index, role=True))
            elif out.echo is not None:
                for job in jobs:
                    text, lp = out.first(self.run.tokenizer, job.index)
                    yield sse(reply.chunk(job.index, text, logprobs=lp))
            left, tokens, cached = len(jobs), {}, {}
            while left:
                first = await self.drain.next_event(events)
                batch = [first or _shutdown_event()]
                while first is not None and not events.empty():  # behind (slow client, busy loop): one chunk per choice
                    batch.append(events.get_nowait())
                error = next((e for e in batch if e.finish == "error"), None)
                if error is not None:
                    yield sse(APIError(error.status, error.text, code="generation_failed").body())
                    break
                merged: dict[int, Event] = {}
                for e in batch:
                    merge(merged.setdefault(e.index, Event(e.index)), e)
                shown = list(merged.values()) if out.tools is None else out.hold(merged.values())
                if shown:
                    yield "".join(self._chunk(reply, out, m) for m in shown)
                tokens.update((m.index, m.tokens) for m in merged.values())
                cached.update((e.index, e.cached) for e in batch)
                reply.completion_tokens, reply.cached_tokens = sum(tokens.values()), out.cached_prompt_tokens(cached)
                left -= sum(m.finish is not None for m in merged.values())
            else:
                if reply.include_usage:
                    yield sse(reply.usage_chunk(sum(tokens.values())))
            yield DONE
            reply.completed = True  # resumed after [DONE] was sent; a client that left cancels us before
        finally:
            self.drain.running -= 1
            for job in jobs:
                self.batcher.cancel(job)

    def _chunk(self, reply: Reply, out: Output, m: Event) -> str:
        """A choice's new text as an SSE chunk; with tools, its end: the calls parsed from its whole text."""
        tok = self.run.tokenizer
        if out.tools is not None and m.finish is not None:
            content, calls = parse_tool_calls(m.text, out.tools.names)
            if calls:
                return sse(reply.chunk(m.index, content or "", "tool_calls", logprobs=out.more(tok, m), tool_calls=calls))
        return sse(reply.chunk(m.index, m.text, m.finish, logprobs=out.more(tok, m)))

    async def _collect(self, request: Request, reply: Reply, jobs: list[Job], events: asyncio.Queue, out: Output) -> Any:
        """Wait for every choice to finish (or the client to leave) and build the whole reply."""
        texts: list[list[str]] = [[] for _ in jobs]
        entries: list[list[tuple]] = [[] for _ in jobs]
        finishes: list[str | None] = [None] * len(jobs)
        tokens, cached = [0] * len(jobs), {}
        gone = asyncio.ensure_future(_disconnected(request))
        self.drain.running += 1
        try:
            while None in finishes:
                getting = asyncio.ensure_future(self.drain.next_event(events))
                await asyncio.wait({getting, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getting.done():
                    getting.cancel()
                    return JSONResponse({}, status_code=499)  # the client left: nobody will read it
                event = getting.result() or _shutdown_event()
                if event.finish == "error":
                    raise APIError(event.status, event.text, code="generation_failed")
                texts[event.index].append(event.text)
                entries[event.index] += event.logprobs
                tokens[event.index] = event.tokens
                cached[event.index] = event.cached
                reply.completion_tokens, reply.cached_tokens = sum(tokens), out.cached_prompt_tokens(cached)
                finishes[event.index] = event.finish
        finally:
            self.drain.running -= 1
            gone.cancel()
            for job in jobs:
                self.batcher.cancel(job)
        whole = [out.whole(self.run.tokenizer, i, "".join(t), entries[i]) for i, t in enumerate(texts)]
        contents: list[str | None] = [t for t, _ in whole]
        calls: list[list[dict[str, Any]]] = [[] for _ in whole]
        if out.tools is not None:
            for i, text in enumerate(contents):
                contents[i], calls[i] = parse_tool_calls(text, out.tools.names)
                finishes[i] = "tool_calls" if calls[i] else finishes[i]
        return reply.full(contents, finishes, sum(tokens), [lp for _, lp in whole], tool_calls=calls)


@dataclass
class Output:
    """What a request asked to see besides the text: `logprobs` N alternatives per token (None:
    no logprobs), and (completions) `echo`: each prompt's text, its tokens scored in echo_entries."""

    chat: bool
    logprobs: int | None = None
    echo: list[str] | None = None
    echo_entries: list[list[Entry]] | None = None
    tools: Tools | None = None  # the reply's tool calls are parsed (its text held until it ends when streamed)
    held: dict[int, Event] = field(default_factory=dict)  # with tools: each streamed choice's text so far
    per_choice: int = 1  # choices per prompt (n)
    offsets: dict[int, int] = field(default_factory=dict)  # choice → characters of text so far (text_offset)

    def _shape(self, tok: Any, index: int, entries: list[Entry]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, lambda i: tok.decode_bytes([i]))
        shaped = completion_logprobs(entries, lambda i: tok.decode_bytes([i]), self.offsets.get(index, 0))
        self.offsets[index] = sum(map(len, shaped["tokens"])) + self.offsets.get(index, 0)
        return shaped

    def hold(self, events: Any) -> list[Event]:
        """With tools, a streamed choice's events are held until it ends (a call is parsed whole):
        the choices that ended, each as one event of all its text."""
        ended = []
        for e in events:
            merge(self.held.setdefault(e.index, Event(e.index)), e)
            if e.finish is not None:
                ended.append(self.held.pop(e.index))
        return ended

    def cached_prompt_tokens(self, by_choice: dict[int, int]) -> int:
        """usage's cached prompt tokens: each prompt's, as its first choice found them (choices
        share their prompt, counted once in prompt_tokens)."""
        return sum(n for index, n in by_choice.items() if index % self.per_choice == 0)

    def first(self, tok: Any, index: int) -> tuple[str, dict[str, Any] | None]:
        """Choice `index`'s echo: its prompt's text and logprobs (the start of its text_offset)."""
        prompt = index // self.per_choice
        entries = self.echo_entries[prompt] if self.echo_entries is not None else []
        return self.echo[prompt], self._shape(tok, index, entries)

    def more(self, tok: Any, event: Event) -> dict[str, Any] | None:
        """The logprobs of a streamed chunk's tokens."""
        return self._shape(tok, event.index, [(t, lp.logprob, lp.top) for t, lp in event.logprobs])

    def whole(self, tok: Any, index: int, text: str, generated: list) -> tuple[str, dict[str, Any] | None]:
        """A finished choice: its text (after the echo) and all its tokens' logprobs."""
        head, entries = "", []
        if self.echo is not None:
            prompt = index // self.per_choice
            head, entries = self.echo[prompt], list(self.echo_entries[prompt]) if self.echo_entries is not None else []
        return head + text, self._shape(tok, index, entries + [(t, lp.logprob, lp.top) for t, lp in generated])


def merge(into: Event, e: Event) -> None:
    """Add a later event of the same choice to `into` (its text and logprobs after; its finish and count)."""
    into.text, into.finish, into.tokens, into.logprobs = into.text + e.text, e.finish, e.tokens, into.logprobs + e.logprobs


def _shutdown_event() -> Event:
    return Event(0, "the server is shutting down: this reply was cut before it finished", "error", status=503)


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
