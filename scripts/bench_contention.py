"""Training beside another busy process: the step time of `quill train` alone and beside a
competing process (one Python spin loop, the "busy laptop"), for several OpenMP settings.

    python scripts/bench_contention.py                                 # configs/quickstart.yaml, 60 steps
    python scripts/bench_contention.py --config configs/shakespeare_char_cpu.yaml --rounds 3

Each run is the real command, `python -m quillgpt train ... train.max_iters=N -q` in a
subprocess, with the setting in its environment; a step's time is the gap between consecutive
`elapsed_s` in its metrics.jsonl (the first steps, with their one-time costs, are left out; the
median of the rest). Rounds interleave the settings, so a change of the machine's mood hits them
all. The figure that matters is the last column: steps/s beside the busy process as a fraction
of the quiet steps/s of `quill` as shipped (its threads giving way to other processes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Settings to compare, as environment variables. "quill" sets nothing: the trainer's own choice
# (threads that give way to other processes, quillgpt/train/cpu_share.py). A fixed OMP_NUM_THREADS
# turns that off: "fixed threads" is quill before it gave way (torch's default count, libgomp's
# default spinning); the others are what a user could try by hand.
CORES = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
SETTINGS = {
    "quill": {},
    f"fixed threads ({CORES})": {"OMP_NUM_THREADS": CORES},
    "fixed + OMP_WAIT_POLICY=PASSIVE": {"OMP_NUM_THREADS": CORES, "OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}
SPIN = "while True: pass"


def step_ms(config: Path, steps: int, env: dict[str, str], data_path: str | None, busy: bool) -> float:
    """Median step time (ms) of one `quill train` run with `env`, beside a spin loop if `busy`."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "quillgpt",
            "train",
            "--config",
            str(config),
            f"train.out_dir={out}/run",
            f"train.max_iters={steps}",
            "train.log_interval=1",
            "train.eval_interval=1000000",
            "train.time_budget=null",
            "train.eval_iters=1",
            "-q",
        ]
        if data_path:
            cmd.append(f"data.path={data_path}")
        clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
        spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
        try:
            subprocess.run(cmd, env={**clean, **env}, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
        records = [json.loads(line) for line in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
        elapsed = [r["elapsed_s"] for r in records if "train_loss" in r]
    gaps = [b - a for a, b in zip(elapsed, elapsed[1:])][5:-1]  # one-time costs and the final evaluation out
    return 1000 * statistics.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data-path", help="data.path override (a local copy of the text)")
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    args = ap.parse_args()
    times: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.rounds):
        for name in args.settings:
            for busy in (False, True):
                ms = step_ms(args.config, args.steps, SETTINGS[name], args.data_path, busy)
                times.setdefault((name, busy), []).append(ms)
                print(f"round {r + 1}: {name:<32} {'busy' if busy else 'quiet'}  {ms:7.1f} ms/step", flush=True)
    base = statistics.median(times.get(("quill", False), times[(args.settings[0], False)]))
    print(
        f"\n## train beside one busy process: {args.config.name}, {args.steps} steps, "
        f"{os.cpu_count()} CPUs, median of {args.rounds} rounds (ms/step)"
    )
    print(f"{'setting':<32} {'quiet':>8} {'busy':>8}  {'quiet vs ours':>14}  {'busy, of ours quiet':>20}")
    for name in args.settings:
        quiet, busy = statistics.median(times[(name, False)]), statistics.median(times[(name, True)])
        print(f"{name:<32} {quiet:8.1f} {busy:8.1f}  {base / quiet:13.2f}×  {base / busy:19.0%}")


if __name__ == "__main__":
    main()
