"""Faults: kill -9 at random points, Ctrl-C / SIGTERM, a full or unwritable disk, NaN, two trainers.

The kill and signal tests drive the real `quill train` in subprocesses (tiny model, a checkpoint
every step so kills land during writes too) and compare the resumed run with a straight one
tensor by tensor. Everything else runs in-process through `quillgpt.cli.main`.
"""

import errno
import io
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import poison_loss_at

import quillgpt.checkpoint as ckpt_mod
import quillgpt.train.metrics as metrics_mod
from quillgpt.checkpoint import load_checkpoint
from quillgpt.cli import main
from quillgpt.config import load_config
from quillgpt.data.prepare import prepare
from quillgpt.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "shakespeare_char_cpu.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # same arithmetic in every subprocess
CKPT_TEMPS = (".ckpt.pt.", ".best.pt.")  # atomic_write's temp-file prefixes


@pytest.fixture(autouse=True)
def without_quill_debug(monkeypatch):
    """QUILL_DEBUG=1 in a developer's shell would turn the exit-2 paths into tracebacks."""
    monkeypatch.delenv("QUILL_DEBUG", raising=False)


def overrides(shakespeare_path, data_dir, out_dir, *extra):
    """A tiny run that checkpoints every step (dropout on, so the RNG state must be restored too)."""
    return [
        f"data.path={shakespeare_path}",
        f"data.out_dir={data_dir}",
        f"train.out_dir={out_dir}",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "model.dropout=0.1",
        "train.batch_size=4",
        "train.max_iters=50",
        "train.eval_interval=1",
        "train.eval_iters=2",
        "train.log_interval=1",
        "train.warmup_iters=2",
        "train.device=cpu",
        "train.resume=auto",
        *extra,
    ]


def train_args(shakespeare_path, data_dir, out_dir, *extra):
    return ["train", "--config", str(CONFIG), "-q", *overrides(shakespeare_path, data_dir, out_dir, *extra)]


def start(args):
    return subprocess.Popen(
        [sys.executable, "-m", "quillgpt", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(args):
    proc = subprocess.run([sys.executable, "-m", "quillgpt", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc


def run_main(capsys, args):
    """`quill ARGS` in-process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def assert_one_error_line(err, *fragments):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def checkpoint_step(out_dir):
    path = Path(out_dir) / "ckpt.pt"
    return load_checkpoint(path)["step"] if path.is_file() else 0


def wait_for_step(out_dir, proc, above, timeout=120.0):
    """Poll until ckpt.pt holds a step > `above`. Acting as a concurrent reader: every version
    of ckpt.pt that appears must load completely (no partial file is ever visible)."""
    path, seen, deadline = Path(out_dir) / "ckpt.pt", None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} early: {proc.stderr.read()[-2000:]}")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is not None and (st.st_ino, st.st_mtime_ns) != seen:
            seen = (st.st_ino, st.st_mtime_ns)
            step = load_checkpoint(path)["step"]
            if step > above:
                return step
        time.sleep(0.005)
    raise AssertionError(f"no checkpoint past step {above} in {timeout}s")


def ckpt_temps(out_dir):
    return [n for n in os.listdir(out_dir) if n.startswith(CKPT_TEMPS) and n.endswith(".tmp")]


def assert_same(a, b, where="checkpoint"):
    """Every tensor equal (torch.equal), every other value ==, recursively."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_run(straight, resumed):
    """Latest and best checkpoints match exactly (weights, optimizer, sampler, RNG, step, best
    loss), and so do the logged losses. Only wall time and the out_dir in the config differ."""
    for name in ("ckpt.pt", "best.pt"):
        a, b = load_checkpoint(straight / name), load_checkpoint(resumed / name)
        for state in (a, b):
            state.pop("elapsed_s", None)  # best.pt holds weights only, no clock
            state["config"]["train"].pop("out_dir")
        assert_same(a, b, name)
    logged = lambda run: [(r["step"], r["train_loss"], r.get("val_loss")) for r in read_metrics(run / "metrics.jsonl")]
    assert logged(straight) == logged(resumed)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, shakespeare_path):
    """Prepared once here, so subprocesses only check that it is up to date."""
    data_dir = tmp_path_factory.mktemp("data") / "char"
    prepare(load_config(CONFIG, overrides(shakespeare_path, data_dir, "unused")).data, progress=False)
    return data_dir


@pytest.fixture(scope="module")
def straight(tmp_path_factory, shakespeare_path, data_dir):
    """The uninterrupted reference run."""
    out = tmp_path_factory.mktemp("straight") / "run"
    finish(train_args(shakespeare_path, data_dir, out))
    assert checkpoint_step(out) == 50
    return out


def test_sigkill_at_random_points_then_resume_is_bit_identical(shakespeare_path, data_dir, straight, tmp_path):
    out = tmp_path / "killed"
    args = train_args(shakespeare_path, data_dir, out)
    rng = random.Random(1337)
    kills, mid_write = 0, 0
    while kills < 5:
        proc = start(args)
        wait_for_step(out, proc, above=checkpoint_step(out))  # resumed and trained at least a step
        if kills % 2 == 0:  # aim at a checkpoint write: kill as soon as a temp file shows up
            while not ckpt_temps(out) and proc.poll() is None:
                time.sleep(0.001)
        else:  # anywhere: a random moment a little later
            time.sleep(rng.uniform(0.0, 0.1))
        proc.kill()
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
        kills += 1
        mid_write += bool(ckpt_temps(out))  # the writer died between temp file and rename
        for name in ("ckpt.pt", "best.pt"):  # whatever is there is whole
            if (out / name).exists():
                load_checkpoint(out / name)
    assert mid_write >= 1, "no kill landed during a checkpoint write"

    finish(args)  # the last resume runs to the end; it also removes the killed writers' temp files
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    assert_same_run(straight, out)


def test_ctrl_c_and_sigterm_save_a_checkpoint_exit_cleanly_and_resume_exactly(shakespeare_path, data_dir, straight, tmp_path):
    out = tmp_path / "signalled"
    args = train_args(shakespeare_path, data_dir, out)
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = start(args)
        wait_for_step(out, proc, above=checkpoint_step(out))
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, (sig, stderr[-2000:])
        assert "Traceback" not in stderr and "error" not in stderr, stderr[-2000:]
        stopped = int(re.search(r"interrupted: step (\d+)", stdout).group(1))
        assert checkpoint_step(out) == stopped < 50
        assert "resume with --resume" in stdout
    finish(args)
    assert_same_run(straight, out)


def test_a_second_trainer_is_refused_and_a_killed_holder_does_not_block(shakespeare_path, data_dir, tmp_path, capsys):
    out = tmp_path / "shared"
    holder = start(train_args(shakespeare_path, data_dir, out, "train.max_iters=100000", "train.eval_interval=3"))
    try:
        wait_for_step(out, holder, above=0)
        code, _, err = run_main(capsys, train_args(shakespeare_path, data_dir, out))
        assert code == 2
        assert_one_error_line(err, f"{out} is in use by a running quill train (pid {holder.pid})", "train.out_dir")
    finally:
        holder.kill()
        holder.communicate()
    # The dead holder's .lock file is still there, but the OS dropped its lock: a new run proceeds.
    assert (out / ".lock").is_file()
    step = checkpoint_step(out)
    code, out_text, err = run_main(capsys, train_args(shakespeare_path, data_dir, out, f"train.max_iters={step + 2}"))
    assert code == 0, err
    assert f"done: step {step + 2}" in out_text and checkpoint_step(out) == step + 2


@pytest.mark.parametrize("where", ["under_a_file", "is_a_file"])
def test_unwritable_out_dir_is_refused_before_any_work(shakespeare_path, tmp_path, capsys, where):
    (tmp_path / "a_file").write_text("not a directory")
    out = tmp_path / "a_file" / "run" if where == "under_a_file" else tmp_path / "a_file"
    data_dir = tmp_path / "data"
    code, _, err = run_main(capsys, train_args(shakespeare_path, data_dir, out))
    assert code == 2
    assert_one_error_line(err, f"train.out_dir {out} is not writable", "choose another directory")
    assert not data_dir.exists()  # refused before preparing data, let alone training
    assert (tmp_path / "a_file").read_text() == "not a directory"


class DiskFillsUp(io.RawIOBase):
    """A file on a disk with `room` bytes left: then each write fails as the kernel's does."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def writable(self):
        return True

    def write(self, b):
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(b)
        return self.f.write(b)


@pytest.mark.parametrize("room", [0, 64 << 10], ids=["first_write", "mid_file"])
def test_disk_full_mid_run_keeps_the_previous_checkpoint(shakespeare_path, data_dir, tmp_path, capsys, monkeypatch, room):
    """The third checkpoint write runs out of space, at once or 64 KiB in (torch.save then
    reports a RuntimeError whose context is the OSError)."""
    real_atomic_write, writes = ckpt_mod.atomic_write, {"n": 0}

    def atomic_write_on_full_disk(path, write):
        writes["n"] += 1
        return real_atomic_write(path, write if writes["n"] < 3 else lambda f: write(DiskFillsUp(f, room)))

    monkeypatch.setattr(ckpt_mod, "atomic_write", atomic_write_on_full_disk)
    out = tmp_path / "full"
    args = train_args(shakespeare_path, data_dir, out, "train.max_iters=4")
    code, _, err = run_main(capsys, args)  # writes: best@1, ckpt@1, best@2 ← disk full
    assert code == 2
    assert_one_error_line(
        err, f"could not write checkpoint {out / 'best.pt'}: No space left on device", "previous checkpoint", "free disk space"
    )
    assert load_checkpoint(out / "ckpt.pt")["step"] == 1 and load_checkpoint(out / "best.pt")["step"] == 1
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    assert (out / "ckpt.pt").stat().st_mode == (out / "config.yaml").stat().st_mode  # not left 0600 by mkstemp

    monkeypatch.undo()  # space freed: the run resumes and finishes
    code, out_text, err = run_main(capsys, args)
    assert code == 0 and "done: step 4" in out_text, err


def test_disk_full_outside_a_checkpoint_is_one_line_too(shakespeare_path, data_dir, tmp_path, capsys, monkeypatch):
    """Any other write that runs out of space (here metrics.jsonl) ends with one line, not a traceback."""
    real_append, calls = metrics_mod.append_jsonl, {"n": 0}

    def append_on_full_disk(path, record):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_append(path, record)

    monkeypatch.setattr(metrics_mod, "append_jsonl", append_on_full_disk)
    out = tmp_path / "full_metrics"
    code, _, err = run_main(capsys, train_args(shakespeare_path, data_dir, out))
    assert code == 2
    assert_one_error_line(err, f"No space left on device while writing {out / 'metrics.jsonl'}", "free disk space")
    assert load_checkpoint(out / "ckpt.pt")["step"] == 2


def test_nan_loss_stops_with_the_step_and_exit_code_2(shakespeare_path, data_dir, tmp_path, capsys, monkeypatch):
    poison_loss_at(monkeypatch, 3)
    out = tmp_path / "nan"
    code, _, err = run_main(capsys, train_args(shakespeare_path, data_dir, out))
    assert code == 2
    assert_one_error_line(err, "loss became nan at step 3", "last good checkpoint is kept")
    assert load_checkpoint(out / "ckpt.pt")["step"] == 2


def test_nan_weights_are_caught_before_they_are_checkpointed(shakespeare_path, data_dir, tmp_path, capsys, monkeypatch):
    """A finite loss but non-finite gradients: the step poisons the weights, and the evaluation
    right after it must stop the run instead of saving them over the last good checkpoint."""
    original, calls = torch.nn.utils.clip_grad_norm_, {"n": 0}

    def clip_then_poison(params, max_norm, *a, **kw):
        params = list(params)
        calls["n"] += 1
        if calls["n"] == 3:
            for p in params:
                p.grad.fill_(float("inf"))
        return original(params, max_norm, *a, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_then_poison)
    out = tmp_path / "nan_weights"
    code, _, err = run_main(capsys, train_args(shakespeare_path, data_dir, out))
    assert code == 2
    assert_one_error_line(err, "validation loss became nan at step 3", "last good checkpoint is kept")
    kept = load_checkpoint(out / "ckpt.pt")
    assert kept["step"] == 2 and all(torch.isfinite(t).all() for t in kept["model"].values())
