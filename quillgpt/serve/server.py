"""Start-up and shutdown: load the run, build the engine task and the app, listen, drain.

`serve` is what `quill serve` calls. Tests and scripts use its parts: `make_app` (a run → an app
with its engine), `listen` (a bound socket, so port 0 picks a free port and a busy port is a
one-line error) and `uvicorn_server` (SIGINT/SIGTERM stop accepting, give in-flight streams
`drain_s` seconds to finish, then end them with an error event and stop the engine thread).
"""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quillgpt.errors import QuillError
from quillgpt.runs import LoadedRun, LoadOptions, load_run

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from quillgpt.serve.routes import ServeOptions

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def make_app(run: LoadedRun, options: ServeOptions, max_batch: int, dtype: torch.dtype | None = None, compile: bool = False) -> FastAPI:
    """A FastAPI app serving `run` (a LoadedRun) with an Engine of `max_batch` rows and a prompt
    cache of options.prompt_cache_mb; compile: its decode step compiled here (Engine.warm),
    before any request can wait for it."""
    from quillgpt.cpu_share import FIRST_LOOK_S, CpuShare
    from quillgpt.device import release_thread_pool
    from quillgpt.inference.engine import Engine
    from quillgpt.serve.batcher import Batcher
    from quillgpt.serve.routes import create_app

    tokens = options.max_prompt_tokens + options.max_tokens  # the most a request's row can hold
    fix = "serve fewer rows at once (--max-batch) or use a smaller dtype (--dtype bfloat16)"
    budget = None if options.prompt_cache_mb is None else options.prompt_cache_mb * 2**20
    engine = Engine(run.model, max_rows=max_batch, dtype=dtype, capacity=tokens, memory_fix=fix, compile=compile, prompt_cache=budget)
    compile_s = engine.warm()
    release_thread_pool()  # the batcher's thread runs the engine from here on
    threads = CpuShare.for_run(run.model.device, first_s=FIRST_LOOK_S)  # given way between steps as load changes
    app = create_app(run, Batcher(engine, max_waiting=options.max_waiting, threads=threads), options)
    app.state.compiled, app.state.compile_s = engine.compiled, compile_s
    app.state.prompt_cache = engine.prompt_cache_note
    return app


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise QuillError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port or --host") from None
    return sock


def uvicorn_server(app: FastAPI, drain_s: float = 5.0, log_level: str = "info", head_timeout_s: float = 10.0) -> uvicorn.Server:
    """uvicorn serving `app` (from create_app): request heads bounded by head_timeout_s, and on
    shutdown running replies get drain_s seconds, then end themselves (serve/connections.py)."""
    import functools

    import uvicorn

    from quillgpt.serve.connections import GRACE_S, BoundedH11, DrainingServer

    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=drain_s + GRACE_S,
        access_log=False,
        server_header=False,
        http=functools.partial(BoundedH11, head_timeout_s=head_timeout_s),
    )
    return DrainingServer(config, app.state.drain, drain_s)


def require_extra() -> None:
    """A clear line instead of an ImportError when the optional "serve" extra is missing."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise QuillError(f'quill serve needs {" and ".join(missing)}, the optional "serve" extra: pip install -e ".[serve]"')


def model_id(ckpt: str | Path) -> str:
    """The name clients pass as `model`: the run directory's name (or the .pt file's stem)."""
    path = Path(ckpt).resolve()
    return path.name if path.is_dir() else path.stem


def serve(
    ckpt: str | Path,
    *,
    which: str = "best",
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_batch: int = 16,
    max_tokens: int = 2048,
    device: str = "auto",
    dtype: str = "float32",
    quantize: str = "none",
    cors: str | None = None,
    compile: bool = False,
    prompt_cache_mb: int | None = None,
    drain_s: float = 5.0,
    announce: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> None:
    """Serve a run over HTTP until SIGINT/SIGTERM (then drain for drain_s seconds and stop).
    Call it from the main thread (signal handlers); tests and embedders use make_app instead."""
    from quillgpt import quant
    from quillgpt.inference.native_decoder import op_by_op_note

    require_extra()
    from quillgpt.serve.routes import ServeOptions

    _check_settings(max_batch, max_tokens, port, api_key, prompt_cache_mb)
    load = LoadOptions.parse(device=device, dtype=dtype, quantize=quantize, which=which, rows=max_batch, compile=compile)
    run = load_run(ckpt, load)  # int8 kernels measured at the engine's decode batch
    options = ServeOptions(model_id=model_id(ckpt), api_key=api_key, max_tokens=max_tokens, cors=cors, prompt_cache_mb=prompt_cache_mb)
    if compile:
        announce("compiling the decode step (30-60 s the first time on a machine, seconds from inductor's cache)")
    app = make_app(run, options, max_batch, compile=load.compile)
    if app.state.compiled:
        announce(f"compiled the decode step in {app.state.compile_s:.1f}s")
    weights = quant.weights_note(run.model, "; ", compiled=app.state.compiled) + op_by_op_note(run.model)
    sock = listen(host, port)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    announce(
        f"serving {run.path} (step {run.step}) as model {options.model_id!r}: http://{shown}:{bound}/ "
        f"(OpenAI API at /v1, up to {max_batch} rows at once{weights}; prompt cache {app.state.prompt_cache})"
    )
    if host not in LOOPBACK and api_key is None:
        announce(f"warning: listening on {host} without an API key: anyone who can reach it can use the model")
    _run_until_stopped(app, sock, drain_s)
    announce("stopped")


def _check_settings(max_batch: int, max_tokens: int, port: int, api_key: str | None, prompt_cache_mb: int | None = None) -> None:
    """The server's own settings, each wrong one as one line (before the checkpoint loads)."""
    if not 1 <= max_batch <= 1024:
        raise QuillError(f"--max-batch must be between 1 and 1024, got {max_batch}")
    if max_tokens < 1:
        raise QuillError(f"--max-tokens must be at least 1, got {max_tokens}")
    if not 0 <= port <= 65535:
        raise QuillError(f"--port must be between 0 and 65535, got {port}")
    if prompt_cache_mb is not None and prompt_cache_mb < 0:
        raise QuillError(f"--prompt-cache-mb must be 0 (off) or more, got {prompt_cache_mb}")
    if api_key is not None and not api_key.strip():  # "" from --api-key '' or QUILL_API_KEY= alike
        raise QuillError("the API key (--api-key or QUILL_API_KEY) is empty; pass a real key, or unset it to serve without one")


def _run_until_stopped(app: FastAPI, sock: socket.socket, drain_s: float) -> None:
    """uvicorn on `sock` until SIGINT or SIGTERM (which ends like Ctrl-C: drained, exit 0)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        uvicorn_server(app, drain_s).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the signal it handled once the drain is done
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
