"""Time to quality: train a recipe for a wall-clock budget with the real `quill train`, score it
with `quill eval`, and print one row per run.

    python scripts/speedrun.py --budget 75s                # configs/shakespeare_char_75s.yaml
    python scripts/speedrun.py --budget 3m --compare       # + the previous recipe, same budget
    python scripts/speedrun.py --budget 10m --config my.yaml --data-path ../shared/data/tinyshakespeare.txt

Each run is `python -m quillgpt train --config C train.time_budget=B` in a subprocess (the budget
covers the training loop with its evaluations and checkpoints, not the set-up), then `python -m
quillgpt eval --ckpt RUN` (best.pt; a full pass over the val split). --compare then trains the
previous recipe (configs/shakespeare_char_cpu.yaml) with the same budget. Row: budget, steps,
tokens, train loss (the final logged evaluation's), full-pass val loss, tokens/s (up to the final
evaluation), the loop's time at the last checkpoint (≤ the budget) and the wall time of the
whole `quill train` command (start-up included).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, add_common, load_line

from quillgpt.checkpoint import load_checkpoint
from quillgpt.config import parse_duration
from quillgpt.errors import QuillError
from quillgpt.metrics_log import read_metrics

RECIPES = {"75s": 75, "3m": 180, "10m": 600}  # configs/shakespeare_char_<name>.yaml, budget in seconds
PREVIOUS = ROOT / "configs" / "shakespeare_char_cpu.yaml"
SMOKE = "model.n_layer=1 model.n_head=2 model.n_embd=32 model.block_size=32 train.batch_size=4 train.eval_iters=1 train.compile=false"


def recipe_for(budget_s: float) -> Path:
    """The shipped recipe made for this budget: the shortest one whose budget is at least it."""
    name = next((n for n, s in RECIPES.items() if budget_s <= s), "10m")
    return ROOT / "configs" / f"shakespeare_char_{name}.yaml"


def run(name: str, config: Path, budget: str, args: argparse.Namespace) -> dict:
    """Train `config` for `budget` in out_dir/name, then evaluate it: the row's numbers."""
    out = Path(args.out_dir) / name
    overrides = [f"train.time_budget={budget}", f"train.out_dir={out}", *args.overrides]
    if args.text:
        overrides.append(f"data.path={args.text}")
    cmd = [sys.executable, "-m", "quillgpt", "train", "--config", str(config), *overrides, "--overwrite", "-q"]
    print("$ quill", " ".join(cmd[3:]), flush=True)  # python -m quillgpt = quill
    started = time.time()
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"error: quill train failed for {config} (its message is above)")
    wall = time.time() - started
    evaluated = subprocess.run([sys.executable, "-m", "quillgpt", "eval", "--ckpt", str(out), "--json"], capture_output=True, text=True)
    if evaluated.returncode != 0:
        sys.exit(f"error: quill eval failed for {out}: {evaluated.stderr.strip()[-500:]}")
    scored = json.loads(evaluated.stdout)
    last = [r for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r][-1]  # the final evaluation
    shown = config.resolve().relative_to(ROOT) if config.resolve().is_relative_to(ROOT) else config
    loop_s = load_checkpoint(out / "ckpt.pt")["elapsed_s"]  # when the last checkpoint was written
    row = dict(run=name, budget=budget, steps=last["step"], tokens=last["tokens"], train_loss=last["eval_train_loss"])
    row |= dict(val_loss=scored["loss"], eval_step=scored.get("step"), tokens_per_s=last["tokens"] / last["elapsed_s"])
    return row | dict(loop_s=loop_s, wall_s=wall, config=str(shown))


def print_rows(rows: list[dict]) -> None:
    header = (
        f"{'run':<10} {'budget':>6} {'steps':>6} {'tokens':>11} {'train loss':>10} {'val loss':>8} "
        f"{'tokens/s':>9} {'loop s':>7} {'wall s':>7}  config"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['run']:<10} {r['budget']:>6} {r['steps']:>6,} {r['tokens']:>11,} {r['train_loss']:>10.4f} {r['val_loss']:>8.4f} "
            f"{r['tokens_per_s']:>9,.0f} {r['loop_s']:>7.1f} {r['wall_s']:>7.1f}  {r['config']}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", help="75s, 3m, 10m (or any duration: 10s, 90s, 5m)")
    p.add_argument("--config", type=Path, help="recipe to train (default: the shipped recipe for the budget)")
    p.add_argument("--compare", action="store_true", help="also train the previous recipe (shakespeare_char_cpu.yaml)")
    p.add_argument("--out-dir", default="out/speedrun", help="run directories go here (replaced)")
    p.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    p.add_argument("overrides", nargs="*", help="section.key=value for every run, e.g. train.device=cpu")
    add_common(p, text=True)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:  # the tiny model for 1 s, its data and runs in a temporary folder
            args.budget, args.out_dir = "1s", tmp
            args.overrides += [*SMOKE.split(), "train.device=cpu", f"data.out_dir={tmp}/data"]
        elif args.budget is None:
            raise SystemExit("error: --budget is needed (75s, 3m, 10m), or --smoke")
        speedrun(args)


def speedrun(args: argparse.Namespace) -> None:
    """The recipe's row (and the previous recipe's with --compare), the load average around them."""
    print(load_line("before"), flush=True)
    try:
        budget_s = parse_duration(args.budget, key="--budget")
    except QuillError as e:
        sys.exit(f"error: {e}")
    config = args.config or recipe_for(budget_s)
    rows = [run("recipe", config, args.budget, args)]
    if args.compare:
        rows.append(run("previous", PREVIOUS, args.budget, args))
    print_rows(rows)
    print(load_line("after"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    runs = " ".join(str(Path(args.out_dir) / r["run"]) for r in rows)
    print(f"\nloss against time: python -m quillgpt plot {runs} --x time -o speedrun_{args.budget}.png")


if __name__ == "__main__":
    main()
