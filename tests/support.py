"""Helpers shared by several test files (not collected: no test_ prefix)."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import quillgpt.train.loop as train_mod

ROOT = Path(__file__).resolve().parents[1]

# Tiny model variants every attention proof runs over: vocab V, block BLOCK.
BLOCK, V = 16, 37
VARIANTS = {
    "mha-learned": {},
    "gqa": {"n_kv_head": 2},
    "mqa": {"n_kv_head": 1},
    "window": {"window": 5},
    "rope": {"pos": "rope"},
    "rope-window-gqa": {"pos": "rope", "window": 5, "n_kv_head": 2},
    "rmsnorm-swiglu": {"norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False, "tie_embeddings": False},
}


def poison_loss_at(monkeypatch, call: int) -> None:
    """Make the `call`-th training forward return a NaN loss (as a diverging run would)."""
    original, calls = train_mod.GPT.forward, {"n": 0}

    def forward(self, idx, targets=None, **kw):
        logits, loss = original(self, idx, targets, **kw)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] == call:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(train_mod.GPT, "forward", forward)


def assert_same_state(a, b, where: str = "") -> None:
    """Nested dicts/lists/tuples of tensors and plain values are equal, bit for bit; the message
    names the first differing path, e.g. optimizer['state'][3]['exp_avg']."""
    import torch

    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def interrupt_after(monkeypatch, n_steps: int) -> None:
    """Deliver a real SIGINT to ourselves right after optimizer step `n_steps`."""
    original, calls = train_mod.train_step, {"n": 0}

    def step_then_maybe_interrupt(*args, **kwargs):
        out = original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == n_steps:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(train_mod, "train_step", step_then_maybe_interrupt)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(worker: str, *args: str) -> list[tuple[int, str]]:
    """Run tests/<worker> as ranks 0 and 1 of a loopback process group (one thread each, killed
    after 240 s); each rank's (return code, last 3,000 characters of stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / worker), *args],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, err[-3000:]) for p, (_, err) in zip(procs, results)]
