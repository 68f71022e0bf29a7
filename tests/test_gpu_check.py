"""tests/gpu_check.sh, the GPU check, as far as a machine without a GPU can take it: its dry run
(every file and command it needs is here), its one-line refusal of missing offline files, the
bench's gpu suite skipping cleanly, and its two Python checks run small on CPU: the training
check's figures, and torchrun with one process for DDP and FSDP (gloo here, NCCL there), whose
resumed runs end where the straight runs end, bit for bit."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from support import ROOT

SCRIPT = ROOT / "tests" / "gpu_check.sh"
ENTRY = ROOT / "scripts" / "gpu_check.sh"  # what a GPU session runs: it hands over to SCRIPT
HELPER = [sys.executable, str(ROOT / "tests" / "gpu_check.py")]
ENV = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}


def test_dry_run_lists_every_step_and_finds_what_they_need(real_shakespeare_path, tmp_path):
    done = subprocess.run(
        [str(ENTRY), str(tmp_path / "out"), "--shared", str(real_shakespeare_path.parents[1]), "--dry-run"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [line.split("  ")[0] for line in done.stdout.splitlines() if " limit " in line]
    assert [s.split()[0] for s in steps] == ["1a", "1b", "2", "3", "4"]
    last = re.fullmatch(r"dry run: every file and command above is here \((\d+) CUDA tests; .*nothing ran", done.stdout.splitlines()[-1])
    assert last and int(last[1]) >= 10, done.stdout  # the marker selects the CUDA tests
    assert not (tmp_path / "out").exists()  # nothing ran


def test_missing_offline_files_are_one_line_and_exit_2(tmp_path):
    done = subprocess.run(
        [str(SCRIPT), str(tmp_path / "out"), "--shared", str(tmp_path), "--dry-run"], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert done.returncode == 2
    assert "missing: Tiny Shakespeare: data/tinyshakespeare.txt under --shared DIR" in done.stderr
    assert not (tmp_path / "out").exists()


def test_only_names_steps_that_exist(tmp_path):
    done = subprocess.run(
        [str(SCRIPT), str(tmp_path / "out"), "--only", "1b,5", "--dry-run"], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert done.returncode == 2 and done.stderr == "--only: no step 5; the steps are 1a 1b 2 3 4\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the suite runs (tests/gpu_check.sh step 3)")
def test_bench_gpu_suite_skips_cleanly_without_cuda(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--suite", "gpu", "--json", str(tmp_path / "b.json")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpu: skipped (no CUDA device)" in done.stdout
    assert json.loads((tmp_path / "b.json").read_text())["header"]["gpu_suite"] == "skipped: no CUDA device"


def test_training_check_reports_its_figures(shakespeare_path, tmp_path):
    tiny = [
        "train.device=cpu",
        "train.compile=false",
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=32",
        "train.batch_size=4",
        "train.max_iters=20",
        "train.eval_interval=10",
        "train.eval_iters=2",
    ]
    done = subprocess.run(
        [*HELPER, "train", str(tmp_path), "--text", str(shakespeare_path), *(f"--override={o}" for o in tiny)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert lines[0].startswith("SUMMARY quill train: exit 0, 20/20 steps") and "torch.compile off" in lines[0]
    assert "tokens/s" in lines[1] and "best 4." in lines[2]
    assert lines[3].startswith("SUMMARY quill eval (best.pt, every val token once): val loss 4.")


def test_torchrun_one_process_runs_ddp_and_fsdp_and_resumes_bit_for_bit(shakespeare_path, tmp_path):
    done = subprocess.run(
        [*HELPER, "torchrun", str(tmp_path), "--text", str(shakespeare_path), "--device", "cpu", "--steps", "4"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    results = json.loads((tmp_path / "torchrun.json").read_text())
    for strategy in ("ddp", "fsdp"):
        r = results[strategy]
        assert r["problems"] == [] and r["backend"] == "gloo", r
        assert r["max_loss_diff"] == r["max_weight_diff"] == 0.0, r
    assert (tmp_path / "fsdp" / "half" / "sharded" / "latest").is_file()
    assert sum(line.startswith("SUMMARY ") and "PASS" in line for line in done.stdout.splitlines()) == 2
