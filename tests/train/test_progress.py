"""The training bar (quillgpt/train/progress.py): 'evaluating…' while the val loss is measured,
and that time kept out of the bar's step rate; a reader of its output that goes away."""

import io
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

from support import CPU_CONFIG, ROOT, tiny

from quillgpt.checkpoint import load_checkpoint
from quillgpt.train.progress import Progress


def test_the_bar_says_evaluating_and_keeps_evaluation_out_of_its_rate():
    t = SimpleNamespace(budget_s=None, horizon=100, step=0, elapsed_before=0.0)
    progress = Progress(t, enabled=True)
    progress.bar.close()
    progress.bar = type(progress.bar)(total=100, file=io.StringIO(), mininterval=0, smoothing=1.0)  # every update redraws
    for _ in range(3):
        time.sleep(0.02)
        progress.update(t)
    progress.set_postfix(loss="1.0000")
    with progress.evaluating():
        assert "now=evaluating…" in str(progress.bar) and "loss=1.0000" in str(progress.bar)
        time.sleep(0.5)
    assert "evaluating" not in str(progress.bar) and "loss=1.0000" in str(progress.bar)
    time.sleep(0.02)
    progress.update(t)  # the step after the evaluation: its own time, not the evaluation's
    rate = progress.bar.format_dict["rate"]
    assert rate is not None and rate > 1 / 0.25, rate  # ~1/0.02 steps/s; 2 steps/s had the 0.5 s counted
    progress.close()


def test_ctrl_c_after_the_pipe_reader_died_still_saves_the_checkpoint(data_dir, shakespeare_path, tmp_path):
    """`quill train … 2>&1 | tee log` and Ctrl-C: tee dies with quill, and the bar's next write
    into the dead pipe (EPIPE) must neither stop the run before its save nor hide the save. Here
    the reader goes away mid-run, steps go on (the bar writing every step), then SIGINT: ckpt.pt
    holds the step it stopped at, exit 130. No terminal here (a new session), so the lines that
    would go to the terminal go nowhere."""
    out = tmp_path / "run"
    args = [
        "train",
        "--config",
        str(CPU_CONFIG),
        *tiny(shakespeare_path, data_dir, out, "train.max_iters=100000", "train.eval_interval=100000"),
    ]
    read_end, write_end = os.pipe()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_MININTERVAL": "0"}  # the bar redraws at every step
    proc = subprocess.Popen(
        [sys.executable, "-m", "quillgpt", *args], cwd=ROOT, env=env, stdout=write_end, stderr=write_end, start_new_session=True
    )
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as reader:
            reader.read1(1)  # the start-up line: the run is under way
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 5):  # steps after the reader left
            assert proc.poll() is None, f"the trainer died (exit {proc.returncode}) when its output pipe closed"
            assert time.monotonic() < deadline, "no steps in 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
        proc.wait()
    assert load_checkpoint(out / "ckpt.pt")["step"] >= 5
