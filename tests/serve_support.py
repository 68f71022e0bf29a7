"""Helpers for the server tests (not collected): a tiny served run and a server on a loopback port."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from quillgpt.checkpoint import save_checkpoint
from quillgpt.config import config_from_dict
from quillgpt.data.tokenizer import CharTokenizer
from quillgpt.model.gpt import GPT
from quillgpt.runs import load_run

BLOCK = 16


def tiny_run_dir(out: Path, shakespeare_path: Path, seed: int = 0, **model: object) -> Path:
    """A run directory with best.pt: Tiny Shakespeare's characters, 2 layers × 2 heads, 32 wide,
    block 16, larger-than-init random weights (varied greedy text, no training needed); `model`:
    other model settings (e.g. attention="prefix")."""
    tok = CharTokenizer.from_text(shakespeare_path.read_text(encoding="utf-8"))
    cfg = config_from_dict(
        {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": BLOCK, "vocab_size": tok.vocab_size, "bias": False, **model}}
    )
    torch.manual_seed(seed)
    model = GPT(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_gain = ".ln_" in name and name.endswith("weight")
            p.normal_(1.0 if is_gain else 0.0, 0.3 if p.dim() > 1 else 0.1)
    out.mkdir(parents=True, exist_ok=True)
    state = {"config": cfg.to_dict(), "model": model.state_dict(), "tokenizer": tok.spec(), "step": 0}
    save_checkpoint(state, out / "best.pt")
    return out


@contextmanager
def running_server(
    run_dir: Path,
    max_batch: int = 4,
    engine=None,
    drain_s: float = 2.0,
    head_timeout_s: float = 10.0,
    compile: bool = False,
    **options,
) -> Iterator[tuple[str, object]]:
    """Serve run_dir on 127.0.0.1:<free port> in a thread; yields (base URL, app); always stops.
    `engine`: a function of the model that makes the engine (default: make_app's, an Engine of
    max_batch rows, `compile`d as quill serve --compile); app.state.server is the uvicorn server
    (set should_exit to start its shutdown)."""
    from quillgpt.serve.batcher import Batcher
    from quillgpt.serve.routes import ServeOptions, create_app
    from quillgpt.serve.server import listen, make_app, model_id, uvicorn_server

    run = load_run(run_dir)
    opts = replace(ServeOptions(model_id=model_id(run_dir)), **options)
    if engine is None:
        app = make_app(run, opts, max_batch, compile=compile)
    else:
        app = create_app(run, Batcher(engine(run.model), max_waiting=opts.max_waiting), opts)
    sock = listen("127.0.0.1", 0)
    server = uvicorn_server(app, drain_s=drain_s, log_level="warning", head_timeout_s=head_timeout_s)
    app.state.server = server
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()
        assert not thread.is_alive(), "the test server did not stop"
