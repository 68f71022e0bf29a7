#!/usr/bin/env python
"""The Python half of tests/gpu_check.sh: the steps whose pass or fail needs more than an exit code.

    python tests/gpu_check.py train WORK --text FILE       # step 2: configs/shakespeare_char.yaml, compiled, + quill eval
    python tests/gpu_check.py torchrun WORK --text FILE    # step 4: torchrun --nproc_per_node 1, DDP and FSDP, resume

Both run the commands users run (`python -m quillgpt ...`, `torchrun ... -m quillgpt train`) in
subprocesses from this checkout, print each command's output, then their figures on lines that
start with "SUMMARY " (gpu_check.sh copies those into summary.txt), and exit 0 only if every
check passed. `torchrun` also writes WORK/torchrun.json (tests/test_gpu_check.py reads it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from quillgpt.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "shakespeare_char.yaml"
NANOGPT_A100 = "1.4697 in ~3 min"  # the teaching trainer's figure for this config (its val estimate)
QUILL = [sys.executable, "-m", "quillgpt"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]


def summary(line: str) -> None:
    print(f"SUMMARY {line}", flush=True)


GRACE_S = 10  # after the time limit's signal: how long a command may take to stop (gpu_check.sh kills all at 20)


def run(cmd: list[str], stopped: list[float]) -> tuple[int, str, float]:
    """(exit code, output, seconds) of `cmd`, its output printed once it ends. Once `stopped`
    holds the time of the time limit's signal (the command got it too), it has GRACE_S to end."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while True:
        try:
            output, _ = proc.communicate(timeout=1)
            break
        except subprocess.TimeoutExpired:
            if stopped and time.perf_counter() - stopped[0] > GRACE_S:
                proc.kill()
    print(f"$ {' '.join(cmd)}\n{output}", flush=True)
    return proc.returncode, output, time.perf_counter() - start


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


# --- step 2: the GPU-sized Shakespeare model, compiled, to completion ----------------------------


def train_check(work: Path, text: Path, extra: list[str]) -> bool:
    """`quill prepare`, then `quill train` (train.compile=true) to max_iters, then `quill eval`
    (a full pass over val with best.pt): wall times, the loop's rate and MFU, val losses.
    `extra`: more overrides (tests/test_gpu_check.py runs a tiny version on CPU).

    At the time limit (SIGINT or SIGTERM to the process group) train saves a checkpoint and
    stops; the figures so far are still reported, with the step it reached."""
    from quillgpt.config import load_config

    out, data = work / "shakespeare_char", work / "data" / "shakespeare_char"
    overrides = [f"data.path={text}", f"data.out_dir={data}", f"train.out_dir={out}", "train.compile=true", *extra]
    cfg = load_config(CONFIG, overrides).train
    stopped: list[float] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.append(time.perf_counter()))  # report, then leave
    code, _, prep_s = run([*QUILL, "prepare", "--config", str(CONFIG), *overrides], stopped)
    if code != 0 or stopped:
        summary(f"quill prepare: exit {code}{' (stopped by the time limit)' if stopped else ''}")
        return False
    code, output, train_s = run([*QUILL, "train", "--config", str(CONFIG), "-q", *overrides], stopped)
    records = metrics(out)
    steps = records[-1]["step"] if records else 0
    compiled = "FAILED (fell back to eager)" if "torch.compile failed" in output else "on" if cfg.compile else "off"
    summary(
        f"quill train: exit {code}, {steps:,}/{cfg.max_iters:,} steps in {train_s:.0f} s wall"
        f"{' (stopped by the time limit)' if stopped else ''}; prepare {prep_s:.1f} s before it; torch.compile {compiled}"
    )
    if records:
        rates = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")][1:] or [math.nan]
        mfus = [r["mfu"] for r in records if r.get("mfu")][1:] or [math.nan]
        vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
        summary(
            f"loop: {records[-1].get('elapsed_s', math.nan):.0f} s to step {steps:,}, median "
            f"{statistics.median(rates):,.0f} tokens/s, MFU {statistics.median(mfus):.1%} (its metrics.jsonl)"
        )
        if vals:
            summary(
                f"val loss, the trainer's estimate ({cfg.eval_iters} batches): best {min(vals):.4f}, last {vals[-1]:.4f} "
                f"(nanoGPT on an A100: {NANOGPT_A100})"
            )
    if code != 0 or steps != cfg.max_iters or compiled.startswith("FAILED") or stopped:
        return False
    return eval_check(out, stopped)


def eval_check(out: Path, stopped: list[float]) -> bool:
    code, output, eval_s = run([*QUILL, "eval", "--ckpt", str(out), "--json"], stopped)
    try:
        loss = json.loads(output.strip().splitlines()[-1])["loss"] if code == 0 else math.nan
    except (ValueError, KeyError, IndexError):
        loss = math.nan
    summary(f"quill eval (best.pt, every val token once): val loss {loss:.4f} in {eval_s:.0f} s (exit {code})")
    return code == 0 and math.isfinite(loss)


# --- step 4: torchrun, one process, NCCL: DDP and FSDP start, step, checkpoint and resume ----------

TINY = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "model.block_size=64",
    "model.dropout=0.1",
    "train.batch_size=8",
    "train.lr_schedule=constant",
    "train.warmup_iters=0",
    "train.eval_iters=2",
    "train.log_interval=1",
    "train.compile=false",
]  # constant lr: stopping at max_iters keeps the schedule
STRATEGIES = ("ddp", "fsdp")


def torchrun_check(work: Path, text: Path, device: str, steps: int, tolerance: float) -> bool:
    """For ddp and fsdp: a straight run of `steps` and a run of steps/2 (side by side), then that
    run resumed to `steps`. Passes when every launch exits 0, the group really ran (DDP: ckpt.pt
    holds each rank's stream; FSDP: a sharded checkpoint; CUDA: NCCL's log lines), and the resumed
    run's losses and weights equal the straight run's within `tolerance` (CPU: bit for bit)."""
    from quillgpt.config import load_config
    from quillgpt.data.prepare import prepare

    half = steps // 2
    data = work / "data" / "torchrun"
    base = [f"data.path={text}", f"data.out_dir={data}", f"train.device={device}", f"train.eval_interval={half}", *TINY]
    prepare(load_config(CONFIG, base).data, progress=False)  # once: the launches would race to prepare it
    logs = work / "torchrun"
    logs.mkdir(parents=True, exist_ok=True)
    config = lambda s, name, n, *extra: [*base, f"train.strategy={s}", f"train.out_dir={work / s / name}", f"train.max_iters={n}", *extra]
    codes = launch_all({(s, name): config(s, name, n) for s in STRATEGIES for name, n in (("straight", steps), ("half", half))}, logs)
    codes.update(launch_all({(s, "half-resumed"): config(s, "half", steps, "train.resume=true") for s in STRATEGIES}, logs))
    results = {s: compare(work / s, s, steps, logs, device, {k[1]: v for k, v in codes.items() if k[0] == s}) for s in STRATEGIES}
    (work / "torchrun.json").write_text(json.dumps(results, indent=1) + "\n")
    ok = True
    for s, r in results.items():
        passed = r["problems"] == [] and r["max_loss_diff"] <= tolerance and r["max_weight_diff"] <= tolerance
        ok &= passed
        exact = (
            "bit for bit"
            if r["max_loss_diff"] == r["max_weight_diff"] == 0
            else (f"max |Δloss| {r['max_loss_diff']:.2e}, max |Δweight| {r['max_weight_diff']:.2e} (tolerance {tolerance:g})")
        )
        seconds = ", ".join(f"{name} {t:.0f} s" for name, t in r["seconds"].items())
        summary(
            f"{s}: {'PASS' if passed else 'FAIL'} — backend {r['backend']}, {half} steps + resume to {steps} = {steps} "
            f"straight: {exact}; launches {seconds}" + "".join(f"; {p}" for p in r["problems"])
        )
    return ok


def launch_all(launches: dict[tuple[str, str], list[str]], logs: Path) -> dict[tuple[str, str], tuple[int, float]]:
    """Start every torchrun at once (each its own port and run dir) and wait: {key: (exit code, s)}.
    At gpu_check.sh's time limit (SIGINT or SIGTERM) they are ended first: torchrun's workers sit
    in sessions of their own, out of reach of a signal to this process group."""
    procs, start = {}, time.perf_counter()
    for key, overrides in launches.items():
        log = open(logs / f"{'-'.join(key)}.log", "w")  # noqa: SIM115 — closed below
        cmd = [*TORCHRUN, "-m", "quillgpt", "train", "--config", str(CONFIG), "-q", *overrides]
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        procs[key] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NCCL_DEBUG": "INFO"}), log)
    previous = {sig: signal.signal(sig, lambda *_: sys.exit(124)) for sig in (signal.SIGINT, signal.SIGTERM)}
    out: dict[tuple[str, str], tuple[int, float]] = {}
    try:
        while len(out) < len(procs):  # poll: each launch's own time
            for key, (proc, log) in procs.items():
                if key not in out and proc.poll() is not None:
                    out[key] = (proc.returncode, time.perf_counter() - start)
                    log.close()
            time.sleep(0.2)
    finally:
        alive = [(key, proc) for key, (proc, _) in procs.items() if proc.poll() is None]
        for key, proc in alive:
            summary(f"{'-'.join(key)}: still running at the time limit")
            proc.terminate()  # torchrun passes it on to its worker
        deadline = time.perf_counter() + GRACE_S
        for _, proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                proc.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return out


def compare(strategy_dir: Path, strategy: str, steps: int, logs: Path, device: str, codes: dict[str, tuple[int, float]]) -> dict[str, Any]:
    """The straight run against the resumed one: what failed, the largest differences, the backend."""
    from quillgpt.train import fsdp_checkpoint as sharded

    problems = [f"{name} exited {c}" for name, (c, _) in codes.items() if c != 0]
    seconds = {name: round(t, 1) for name, (_, t) in codes.items()}
    text = "".join(p.read_text() for p in sorted(logs.glob(f"{strategy}-*.log")))
    backend = "nccl" if "NCCL INFO" in text else "gloo" if device == "cpu" else "none seen"
    if device != "cpu" and backend != "nccl":
        problems.append("no NCCL log line: the process group did not use NCCL")
    runs = {name: strategy_dir / name for name in ("straight", "half")}
    if not all((d / "ckpt.pt").is_file() for d in runs.values()):
        problems.append("a run left no ckpt.pt")
        for key in sorted(logs.glob(f"{strategy}-*.log")):  # the failing launches' last words
            print(f"--- {key.name} (last 30 lines)\n" + "\n".join(key.read_text().splitlines()[-30:]))
        return {"problems": problems, "backend": backend, "max_loss_diff": math.inf, "max_weight_diff": math.inf, "seconds": seconds}
    ckpts = {name: load_checkpoint(d / "ckpt.pt") for name, d in runs.items()}
    if any(c["step"] != steps for c in ckpts.values()):
        problems.append(f"steps {[c['step'] for c in ckpts.values()]}, expected {steps}")
    if strategy == "ddp" and any(len(c.get("rank_rng", [])) != 1 for c in ckpts.values()):
        problems.append("ckpt.pt holds no rank_rng: DDP did not run")
    if strategy == "fsdp" and any(sharded.latest_sharded(d) is None for d in runs.values()):
        problems.append("no sharded checkpoint: FSDP did not run")
    a, b = (ckpts[n]["model"] for n in ("straight", "half"))
    weight_diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    logged = [[(r["step"], r["train_loss"], r.get("val_loss")) for r in metrics(d)] for d in runs.values()]
    if [s for s, *_ in logged[0]] != [s for s, *_ in logged[1]]:
        problems.append("the two runs logged different steps")
    loss_diff = max(
        (abs(x - y) for p, q in zip(*logged) for x, y in zip(p[1:], q[1:]) if x is not None and y is not None), default=math.inf
    )
    return {"problems": problems, "backend": backend, "max_loss_diff": loss_diff, "max_weight_diff": weight_diff, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("check", choices=["train", "torchrun"])
    p.add_argument("work", type=Path, help="a directory for data and runs (created)")
    p.add_argument("--text", type=Path, required=True, help="Tiny Shakespeare")
    p.add_argument("--device", default="auto", help="torchrun: train.device (auto: cuda where there is one)")
    p.add_argument("--steps", type=int, default=8, help="torchrun: steps of the straight runs")
    p.add_argument("--tolerance", type=float, default=1e-4, help="torchrun: largest |Δ| between resumed and straight")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="train: one more config override for prepare and train (repeatable)",
    )
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.check == "train":
        return 0 if train_check(args.work, args.text.resolve(), args.override) else 1
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    return 0 if torchrun_check(args.work, args.text.resolve(), device, args.steps, args.tolerance) else 1


if __name__ == "__main__":
    sys.exit(main())
