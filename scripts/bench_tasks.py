#!/usr/bin/env python
"""lm-eval task speed: `quill eval --tasks` (quill's model class) vs `lm_eval --model hf`, one run.

    python scripts/bench_tasks.py --quill out/smollm2-quill --hf /work/models/smollm2-hf
    python scripts/bench_tasks.py --quill RUN --hf HF_DIR --questions 20 --reps 1 --batch 1,8

A local multiple-choice task is written to a temporary folder (YAML + jsonl, nothing downloaded):
--questions passages of Tiny Shakespeare (--data-path, or the README's download), two lines as the
context and four candidate third lines (the true one and three others): 4 loglikelihood requests
a question. Each row is lm-eval's `simple_evaluate` over that task with one model object loaded
before the clock starts: quill fp32, quill --quantize int8 and lm-eval's HF backend, at each
--batch size, the reps interleaved. Printed: median requests/s with min-max, the ratio to the HF
backend at the same batch, each row's acc and acc_norm (quill fp32 and HF must agree), the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
from harness import Stats, add_common, interleaved, load_line, machine_line, skipped, text_path, tiny_run  # noqa: E402


def write_task(folder: Path, text: str, questions: int, seed: int = 0) -> None:
    lines = [line for line in text.split("\n") if len(line) > 20]
    rng = random.Random(seed)
    starts = rng.sample(range(len(lines) - 3), questions)
    rows = []
    for s in starts:
        others = [lines[rng.randrange(len(lines))] for _ in range(3)]
        rows.append({"context": lines[s] + "\n" + lines[s + 1] + "\n", "choices": [lines[s + 2], *others], "label": 0})
    (folder / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "bench_mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ntest_split: train\ndataset_kwargs:\n  cache_dir: {folder / 'cache'}\n"
        f"  data_files:\n    train: {folder / 'bench.jsonl'}\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{label}}"\ndoc_to_choice: "{{choices}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )


def models(args: argparse.Namespace, batch: int) -> dict:
    """Row name → an lm-eval model object, loaded (not timed)."""
    from lm_eval.models.huggingface import HFLM

    from quillgpt.evaluate.harness import QuillLM
    from quillgpt.runs import load_run

    out = {}
    run = load_run(args.quill, which=args.which)
    out[f"quill fp32, batch {batch}"] = QuillLM(run.model, run.tokenizer, batch_size=batch)
    if not args.no_int8:
        q = load_run(args.quill, which=args.which, quantize="int8", rows=batch)
        out[f"quill int8, batch {batch}"] = QuillLM(q.model, q.tokenizer, batch_size=batch)
    if args.hf:
        out[f"lm-eval hf fp32, batch {batch}"] = HFLM(pretrained=str(args.hf), dtype="float32", batch_size=batch, device="cpu")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quill", type=Path, help="a quill run (e.g. quill import-hf of --hf)")
    parser.add_argument("--hf", type=Path, help="the same weights as a Hugging Face directory")
    parser.add_argument("--which", default="best")
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--no-int8", action="store_true", help="skip the --quantize int8 rows")
    add_common(parser, text=True)
    args = parser.parse_args()
    text = text_path(args.text).read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="bench_tasks_") as tmp:
        if args.smoke:
            args.quill, args.which, args.hf, args.no_int8 = tiny_run(Path(tmp) / "tiny", text), "latest", None, True
            args.questions, args.batch, args.reps = 4, "1", 1
            skipped("lm-eval's HF backend and int8", "--smoke: a tiny random run, no Hugging Face model")
        elif args.quill is None or args.hf is None:
            raise SystemExit("error: --quill RUN and --hf DIR are needed, or --smoke")
        write_task(Path(tmp), text, args.questions)
        compare(args, Path(tmp))


def compare(args: argparse.Namespace, folder: Path) -> None:
    """Every row's lm-eval run of the task, interleaved: requests/s, the ratio to HF's at its batch, acc."""
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    torch.manual_seed(0)
    print(f"{machine_line()}\n{load_line('before')}", flush=True)
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    rows = {}
    for batch in [int(b) for b in args.batch.split(",")]:
        rows.update(models(args, batch))
    scores: dict[str, tuple[float, float]] = {}

    def evaluate(name: str) -> float:
        t0 = time.perf_counter()
        res = lm_eval.simple_evaluate(model=rows[name], tasks=["bench_mc"], task_manager=manager, bootstrap_iters=0, verbosity="ERROR")
        scores[name] = (res["results"]["bench_mc"]["acc,none"], res["results"]["bench_mc"]["acc_norm,none"])
        return time.perf_counter() - t0

    requests = 4 * args.questions
    rates = {name: [requests / t for t in ts] for name, ts in interleaved({n: lambda n=n: evaluate(n) for n in rows}, args.reps).items()}
    print(f"{requests} loglikelihood requests ({args.questions} questions x 4 choices), {args.reps} reps")
    print(f"{'row':28} {'requests/s (min–max)':>24} {'vs hf':>7} {'acc':>6} {'acc_norm':>8}")
    for name, xs in rates.items():
        st, ref = Stats.of(xs), rates.get(f"lm-eval hf fp32, batch {name.rsplit(' ', 1)[1]}")
        vs = f"{st.median / Stats.of(ref).median:6.2f}x" if ref else "n/a"
        print(f"{name:28} {st!s:>24} {vs:>7} {scores[name][0]:6.3f} {scores[name][1]:8.3f}")
    print(load_line("after"))


if __name__ == "__main__":
    main()
