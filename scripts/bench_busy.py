#!/usr/bin/env python
"""Inference beside a busy process: `quill sample` and `quill chat` with threads that give way
(quillgpt/cpu_share.py) against a fixed thread count, on the same busy machine, in one run.

    python scripts/bench_busy.py --ckpt out/smollm2 --tokens 128 --reps 3
    python scripts/bench_busy.py --smoke          # a tiny random model, a few tokens

A child process keeps one core busy (a Python loop) while each row runs as a user runs it (a new
`quill` process: load, prefill, decode). Rows per weight scheme (--quantize none / int8 / int4):

  gives way    quill as shipped (OMP_NUM_THREADS unset): it looks at /proc and takes the free cores
  1 thread     OMP_NUM_THREADS=1: the best a user could have chosen by hand on this busy machine
  all threads  OMP_NUM_THREADS=<cores>: what quill did before it gave way

then the same with the machine quiet (no busy child): gives way vs all threads, where giving way
must keep every core. Figures: decode tokens/s (after the first token), the median over --reps
interleaved rounds, and the threads the stats line reports. The target (issue 65): beside the
busy process, `gives way` ≥ 80% of `1 thread`; quiet, `gives way` ≈ `all threads`.
Run it with nothing else running: the busy child must be the only other load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from harness import add_common, load_line, machine_line, tiny_run

PROMPT = "Once upon a time, in a small village by the sea, there lived an old lighthouse keeper who"
CHAT_RATE = re.compile(r"([\d.]+) tokens/s after the first.*?; ((?:\d+ of )?\d+ threads?[^)]*\)?)\)")


@contextlib.contextmanager
def busy_core(on: bool) -> Iterator[None]:
    """A child process spinning on one core while the block runs (nothing when `on` is False)."""
    if not on:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        yield
    finally:
        hog.kill()
        hog.wait()


def env_for(threads: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return env if threads == "gives way" else {**env, "OMP_NUM_THREADS": threads}


def sample(ckpt: Path, quantize: str, tokens: int, env: dict[str, str]) -> tuple[float, str]:
    """`quill sample --json`: (decode tokens/s, the threads it reports)."""
    cmd = [sys.executable, "-m", "quillgpt", "sample", "--ckpt", str(ckpt), "-p", PROMPT, "-n", str(tokens)]
    cmd += ["--temperature", "0", "--json", "--quantize", quantize]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"quill sample failed:\n{out.stderr[-2000:]}")
    stats = json.loads(out.stdout)["stats"]
    if sum(stats["new_tokens"]) < tokens // 2:
        raise SystemExit(f"quill sample stopped after {stats['new_tokens']} tokens of {tokens}: too few to time; try another prompt")
    return stats["decode_tokens_per_s"], stats["threads"]


def chat(ckpt: Path, quantize: str, tokens: int, env: dict[str, str]) -> tuple[float, str]:
    """`quill chat`, one message on stdin: (decode tokens/s of the reply, the threads it reports)."""
    cmd = [sys.executable, "-m", "quillgpt", "chat", "--ckpt", str(ckpt), "-n", str(tokens), "--temperature", "0", "--quantize", quantize]
    out = subprocess.run(cmd, input=PROMPT + "\n", capture_output=True, text=True, env=env, timeout=900)
    found = CHAT_RATE.search(out.stderr)
    if out.returncode != 0 or not found:
        raise SystemExit(f"quill chat failed or printed no stats line:\n{out.stderr[-2000:]}")
    return float(found.group(1)), found.group(2)


def rows(busy: bool) -> list[str]:
    cores = str(os.cpu_count() or 1)
    return ["gives way", "1", cores] if busy else ["gives way", cores]


def measure(args: argparse.Namespace, ckpt: Path, command: Callable, busy: bool) -> dict[tuple[str, str], list[tuple[float, str]]]:
    """Every (scheme, threads) row, --reps rounds, interleaved, beside the busy child or quietly."""
    runs: dict[tuple[str, str], list[tuple[float, str]]] = {}
    with busy_core(busy):
        for _ in range(args.reps):
            for quantize in args.quantize:
                for threads in rows(busy):
                    runs.setdefault((quantize, threads), []).append(command(ckpt, quantize, args.tokens, env_for(threads)))
    return runs


def report(name: str, busy: bool, runs: dict[tuple[str, str], list[tuple[float, str]]]) -> None:
    print(f"\n## {name}, {'beside one busy process' if busy else 'quiet'}: decode tokens/s (median, min–max)")
    for (quantize, threads), got in runs.items():
        rates = [r for r, _ in got]
        said = sorted({t for _, t in got})
        label = threads if threads == "gives way" else f"{threads} thread(s) fixed"
        line = f"{quantize:>5}  {label:<18} {statistics.median(rates):8.1f}  ({min(rates):.1f}–{max(rates):.1f})  says: {' | '.join(said)}"
        base = runs.get((quantize, "1" if busy else str(os.cpu_count() or 1)))
        if threads == "gives way" and base:
            ratios = [a / b for (a, _), (b, _) in zip(got, base)]
            line += f"  → {statistics.median(ratios):.2f}× of {'1 thread' if busy else 'all threads'} (median of per-round ratios)"
        print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", type=Path, help="a run (e.g. `quill import-gguf` of SmolLM2-135M)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quantize", nargs="+", default=["none", "int8", "int4"])
    p.add_argument("--commands", nargs="+", default=["sample", "chat"], choices=["sample", "chat"])
    add_common(p)  # --smoke: the busy rows only
    args = p.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("error: giving a core away needs at least two cores")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt
        if args.smoke:
            ckpt, args.tokens, args.reps, args.quantize = tiny_run(Path(tmp) / "tiny"), 8, 1, ["none"]
        elif ckpt is None:
            raise SystemExit("error: --ckpt RUN is needed (or --smoke)")
        print(machine_line())
        print(load_line("before"))
        for name in args.commands:
            command = sample if name == "sample" else chat
            for busy in (True,) if args.smoke else (True, False):
                report(f"quill {name}", busy, measure(args, ckpt, command, busy))
        print(load_line("after"))


if __name__ == "__main__":
    main()
