#!/usr/bin/env python
"""Two commits side by side: scripts/bench.py of each, run in turns in one session.

    python scripts/bench_commits.py 598aaa6 --rounds 3 -- --suite train --quick --reps 3
    python scripts/bench_commits.py 598aaa6 --rows "eager decode" -- --suite sample --no-sample-compile

The base commit is checked out (once) as a git worktree beside the system temp dir; each round runs
the base's bench.py, then this checkout's, with the same arguments, so a burst of load hits both
alike. Every row both report is printed as the median over rounds of each run's median, with
after / before (for tokens/s higher is better, for ms lower is). Run nothing else meanwhile.
--smoke compares this checkout with itself, one round of `bench.py --smoke --suite prepare`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import ROOT, add_common


def worktree(commit: str) -> Path:
    """A checkout of `commit` (made once, reused)."""
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"quill-bench-{sha}"
    if not (path / "scripts" / "bench.py").is_file():
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(path), sha], cwd=ROOT, check=True)
    return path


def run_bench(tree: Path, args: list[str], out: Path) -> dict[tuple[str, str], float]:
    """One bench.py run in `tree`: {(group, row): value} of its numeric rows."""
    subprocess.run([sys.executable, "scripts/bench.py", *args, "--json", str(out)], cwd=tree, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["rows"]
    return {(r["group"], r["name"]): r["value"] for r in rows if isinstance(r["value"], (int, float))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", nargs="?", help="the commit to compare with (e.g. a tag or a short sha)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", default="", help="only rows whose group or name contains this text")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    add_common(p, text=True)
    args, bench_args = p.parse_args(argv[:cut]), argv[cut + 1 :]  # after --: scripts/bench.py's arguments
    if args.smoke:
        args.base, args.rounds = "HEAD", 1
        bench_args = ["--smoke", "--suite", "prepare", *(["--data-path", str(args.text)] if args.text else [])]
    elif args.base is None:
        raise SystemExit("error: name the BASE commit, or --smoke")
    trees = {"before": ROOT if args.smoke else worktree(args.base), "after": ROOT}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side, tree in trees.items():
                runs[side].append(run_bench(tree, bench_args, Path(tmp) / f"{side}{r}.json"))
                print(f"round {r + 1}/{args.rounds}: {side} done", file=sys.stderr, flush=True)
    keys = [k for k in runs["after"][0] if all(k in run for side in runs for run in runs[side])]
    keys = [k for k in keys if args.rows in k[0] or args.rows in k[1]]
    print(f"python scripts/bench.py {' '.join(bench_args)}: {args.base} (before) vs this checkout (after), median of {args.rounds} rounds")
    group = None
    for g, name in keys:
        if g != group:
            print(f"\n## {g}\n{'':<48} {'before':>10} {'after':>10}  after/before")
            group = g
        before, after = (statistics.median(run[(g, name)] for run in runs[side]) for side in ("before", "after"))
        ratio = after / before if before else float("nan")
        print(f"{name[:48]:<48} {before:>10,.1f} {after:>10,.1f}  {ratio:.3f}")


if __name__ == "__main__":
    main()
