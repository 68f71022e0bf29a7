"""Helpers shared by several test files (not collected: no test_ prefix)."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import quillgpt.train.loop as train_mod
from quillgpt.train.distributed import TIMEOUT_ENV

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
PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3, 5, 8, 9], [(7 * i + 2) % V for i in range(22)]]  # 22 > block


def kernel_rounded(x, levels: int = 32767):
    """x (…, K) as group_gemv and group_gemv4 multiply it, in float64: per block of 32,
    round(x · (levels / max|x|)) · (max|x| / levels), the product and its rounding in float32 as the
    kernels compute them."""
    import torch

    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, levels / amax, 0.0)
    return (torch.round(blocks * inv).double() * (amax / levels).double()).view(x.shape)


def random_model(variant: str = "mha-learned", seed: int = 0):
    """Larger-than-init random weights: decisive logits, so greedy has no near-ties."""
    import torch

    from quillgpt.config import ModelConfig
    from quillgpt.model.gpt import GPT

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32, **VARIANTS[variant])
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_gain = ".ln_" in name and name.endswith("weight")
            p.normal_(1.0 if is_gain else 0.0, 0.3 if p.dim() > 1 else 0.1)
    return model.eval()


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging the suite) when the body runs longer than `seconds`: SIGALRM
    interrupts even a blocking open() of a FIFO. Main thread only."""

    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: an input that never ends?")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def rel_err(got, ref) -> float:
    """‖got − ref‖ / ‖ref‖ in float64: the error measure of a low-precision path against its
    reference (bf16 lands between 1e-3 and 1e-2, fp32 far under 1e-4)."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).norm() / ref.norm())


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
    """A port free now (another process may take it before it is bound: for one process alone)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TAG_ENV = "QUILL_TEST_PROCESS_TAG"  # in the environment of every process `ended` starts, and so of all they start
GROUP_TIMEOUT_S = "120"  # QUILL_DIST_TIMEOUT for test ranks: a stuck collective fails in 2 minutes, naming itself


@dataclass
class Started:
    """Processes a test started, tagged in their environment (TAG_ENV), which their children
    inherit: so a rank in a session of its own (torchrun starts them so), or one orphaned by its
    launcher's death, is found by kill() too (Linux; elsewhere the started processes themselves)."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, cmd: list[str], env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
        self.procs.append(subprocess.Popen(cmd, env={**(os.environ if env is None else env), TAG_ENV: self.tag}, **popen))
        return self.procs[-1]

    def kill(self) -> None:
        kill_tagged(self.tag)
        for proc in self.procs:
            proc.kill()


@contextlib.contextmanager
def ended() -> Iterator[Started]:
    """Processes started in the body are killed and reaped on every way out of it (done, an
    assertion failed, a timeout, Ctrl-C), with everything they started."""
    started = Started()
    try:
        yield started
    finally:
        started.kill()
        for proc in started.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # reaps it and closes its pipes
                proc.communicate(timeout=30)


def tagged(tag: str) -> list[int]:
    """The processes whose environment holds TAG_ENV=tag (Linux: /proc; elsewhere none)."""
    mark, found = f"{TAG_ENV}={tag}".encode(), []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError, ValueError):
            if mark in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
    return found


def kill_tagged(tag: str) -> None:
    """SIGKILL every process tagged `tag`, again while any is left (one may start another meanwhile)."""
    for _ in range(50):
        pids = tagged(tag)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def two_ranks(worker: str, *args: str, timeout: float = 240) -> list[tuple[int, str]]:
    """Run tests/<worker> as ranks 0 and 1 of a gloo process group (one thread each); each rank's
    (return code, last 3,000 characters of stderr). They meet through a file (WORLD_INIT: no port
    to pick, so none another process can take first) and fail a collective that waits past
    GROUP_TIMEOUT_S. Past `timeout` both are killed and the test fails; on every path no rank,
    nor anything a rank started, is left running (`ended`)."""
    with tempfile.TemporaryDirectory() as meet, ended() as group:
        env = {
            TIMEOUT_ENV: GROUP_TIMEOUT_S,
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "WORLD_SIZE": "2",
            "WORLD_INIT": f"file://{meet}/rendezvous",
        }
        procs = [
            group.start(
                [sys.executable, str(ROOT / "tests" / worker), *args],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in (0, 1)
        ]
        ends = time.monotonic() + timeout
        try:
            results = [proc.communicate(timeout=max(1.0, ends - time.monotonic())) for proc in procs]
        except subprocess.TimeoutExpired:
            group.kill()
            tails = [last_words(proc) for proc in procs]
            raise AssertionError(f"{worker} still running after {timeout} s (both ranks killed); their stderr: {tails}") from None
    return [(p.returncode, err[-3000:]) for p, (_, err) in zip(procs, results)]


def last_words(proc: subprocess.Popen, chars: int = 1500) -> str:
    """The end of a killed process's stderr (empty if something it started still holds the pipe)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        return (proc.communicate(timeout=10)[1] or "")[-chars:]
    return ""


def join_group_from_env() -> None:
    """A worker's gloo group as two_ranks describes it (RANK, WORLD_SIZE, WORLD_INIT)."""
    import torch.distributed as dist

    from quillgpt.train.distributed import group_timeout

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["WORLD_INIT"], rank=rank, world_size=world, timeout=group_timeout())


def torchrun(nproc: int, args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc_per_node N ARGS` with its output captured,
    its ranks failing a collective that waits past GROUP_TIMEOUT_S (unless env sets QUILL_DIST_TIMEOUT).
    Past `timeout` the test fails; on every path the launcher, its workers (each in a session of
    its own) and anything they started are killed (`ended`): a hung run never leaves a rank
    behind to wait on its group (and on the next run's) forever."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    with ended() as group:
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        proc = group.start(cmd, env={TIMEOUT_ENV: GROUP_TIMEOUT_S, **env}, cwd=ROOT, **pipes)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            group.kill()
            raise AssertionError(f"torchrun still running after {timeout} s (killed, with its workers): {last_words(proc, 2000)}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


CPU_CONFIG = ROOT / "configs" / "shakespeare_char_cpu.yaml"


def tiny(shakespeare_path, data_dir, out_dir, *extra):
    return [
        f"data.path={shakespeare_path}",
        f"data.out_dir={data_dir}",
        f"train.out_dir={out_dir}",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.eval_interval=2",
        "train.eval_iters=2",
        "train.log_interval=1",
        "train.warmup_iters=2",
        "train.device=cpu",
        "train.dtype=float32",
        *extra,  # fp32: bf16 sums differ with the batch split
    ]


def losses(out_dir):
    """(step, train loss, val loss or None) of every line of a run's metrics.jsonl."""
    from quillgpt.metrics_log import read_metrics

    return [(r["step"], r["train_loss"], r.get("val_loss")) for r in read_metrics(Path(out_dir) / "metrics.jsonl")]
