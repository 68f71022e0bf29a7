"""LoRA fine-tuning speed, side by side: quill against Hugging Face peft + transformers' Trainer.

    python -m quillgpt import-hf /work/models/smollm2-hf --out out/smollm2
    python -m quillgpt finetune out/smollm2 --data chats.jsonl -o out/smol-ft   # prepares out/smol-ft/data (stop it any time)
    python scripts/bench_finetune.py --hf /work/models/smollm2-hf --run out/smollm2 --data out/smol-ft/data

Both train the same model (the HF directory and its `quill import-hf`) on the same batches (the
prepared train split's first rows in order, each batch padded to its longest row, the loss on the
assistant's tokens) with the same LoRA adapters (q, k, v, o), AdamW, clipping at 1.0, fp32. Each
side is a fresh subprocess per round, the sides in turn, and reports real (non-padding) tokens/s
over its timed steps; the parent takes its peak RSS from wait4. Printed: medians with min-max,
the ratio, the load average before and after. quill's side runs `quill train`'s steps (the head
on scored targets only, the batch's common prefix once, LoRA added in place, fused AdamW);
quill-unshared runs every row's own prefix; peft's side is `transformers.Trainer` with
`peft.get_peft_model` (pip install peft; not a quill dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, Stats, add_common, load_line, run_child, skipped, tiny_run

TARGETS_HF = ["q_proj", "k_proj", "v_proj", "o_proj"]
SIDES = ["quill", "quill-unshared", "peft"]  # quill-unshared: every row runs its system prompt itself, as peft's


def batches(data: Path, rows: int, n: int):
    """The first n batches of `rows` conversations of the prepared train split, as (x, y) and the real token count."""
    import numpy as np

    from quillgpt.data.chat_batches import ChatRows, flags_through

    through = flags_through(data)  # the row length the data was prepared for (None: any)
    split = ChatRows.prepared(data, "train", (1 << 20) if through is None else through - 1)
    out = []
    for i in range(n):
        picks = np.arange(i * rows, (i + 1) * rows) % len(split)
        out.append((*split.batch(picks), split.real_tokens(picks)))
    return out


def quill_worker(args: argparse.Namespace, share_prefix: bool = True) -> float:
    import torch

    from quillgpt.config import LoraConfig, TrainConfig
    from quillgpt.model.lora import add_lora
    from quillgpt.runs import load_run
    from quillgpt.train.optim import build_optimizer

    model = load_run(args.run, which="latest").model.float().train()
    add_lora(model, LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=["q", "k", "v", "o"]))
    opt = build_optimizer(model, TrainConfig(learning_rate=args.lr, weight_decay=0.0), torch.device("cpu"))
    work = batches(args.data, args.rows, args.warmup + args.steps)
    real, started = 0, 0.0
    for i, (x, y, n) in enumerate(work):
        if i == args.warmup:
            real, started = 0, time.perf_counter()
        _, loss = model(x, y, scored_only=True, share_prefix=share_prefix)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        real += n
    return real / (time.perf_counter() - started)


def hf_worker(args: argparse.Namespace) -> float:
    import peft
    import torch
    import transformers

    work = batches(args.data, args.rows, args.warmup + args.steps)
    rows = []  # HF shifts labels itself: a row's ids through its last scored target, labels unshifted (-100: not scored)
    for x, y, _ in work:
        for r in range(x.shape[0]):
            k = int((y[r] != -1).nonzero().max())
            ids, targets = x[r, : k + 1].tolist() + [int(y[r, k])], y[r, : k + 1].tolist()
            rows.append({"input_ids": ids, "labels": [-100] + [t if t != -1 else -100 for t in targets]})
    real = [n for _, _, n in work]
    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32, attn_implementation="sdpa")
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS_HF))
    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            times.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            times[-1] = time.perf_counter() - times[-1]

    class InOrder(transformers.Trainer):  # the same batches as quill's, in the same order
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    optim = dict(learning_rate=args.lr, weight_decay=0.0, lr_scheduler_type="constant", max_grad_norm=1.0)
    quiet = dict(use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    steps = dict(per_device_train_batch_size=args.rows, max_steps=args.warmup + args.steps)
    targs = transformers.TrainingArguments(output_dir=str(args.tmp), **steps, **optim, **quiet)

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:  # right padding to the batch's longest row, as quill's
        T = max(len(r["input_ids"]) for r in rows)
        pad = [T - len(r["input_ids"]) for r in rows]
        return {
            "input_ids": torch.tensor([r["input_ids"] + [0] * n for r, n in zip(rows, pad)]),
            "labels": torch.tensor([r["labels"] + [-100] * n for r, n in zip(rows, pad)]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * n for r, n in zip(rows, pad)]),
        }

    InOrder(model=model, args=targs, train_dataset=rows, data_collator=collate, callbacks=[Clock()]).train()
    timed = times[args.warmup :]
    return sum(real[args.warmup :]) / sum(timed)


def run_side(side: str, args: argparse.Namespace) -> tuple[float, float]:
    """One fresh subprocess of `side`: (real tokens/s, peak RSS in MB)."""
    given = ("hf", "run", "data", "rows", "rank", "lr", "warmup", "steps", "tmp")
    cmd = [sys.executable, __file__, "--worker", side, *(x for k in given for x in (f"--{k}", str(getattr(args, k))))]
    _, peak_mb, out = run_child(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return float(out.strip().splitlines()[-1]), peak_mb


def smoke_data(tmp: Path) -> tuple[Path, Path]:
    """A tiny random run and a few conversations prepared with its tokenizer."""
    from quillgpt.config import DataConfig
    from quillgpt.data.prepare import prepare

    run = tiny_run(tmp / "run")
    chats = [{"messages": [{"role": "user", "content": f"line {i}"}, {"role": "assistant", "content": "HAMLET"}]} for i in range(40)]
    (tmp / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    data = DataConfig(path=str(tmp / "chats.jsonl"), format="chat", tokenizer=str(run / "tokenizer.json"), out_dir=str(tmp / "data"))
    prepare(data, progress=False)
    return run, tmp / "data"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", type=Path, default=Path("/work/models/smollm2-hf"), help="the Hugging Face model directory")
    ap.add_argument("--run", type=Path, default=ROOT / "out" / "smollm2", help="its `quill import-hf`")
    ap.add_argument("--data", type=Path, default=ROOT / "out" / "smol-ft" / "data", help="a prepared chat dataset of that tokenizer")
    ap.add_argument("--rows", type=int, default=8, help="conversations a batch")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tmp", type=Path, default=ROOT / "out" / "bench_finetune_hf")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    add_common(ap)
    args = ap.parse_args()
    if args.worker:
        work = {"quill": quill_worker, "quill-unshared": lambda a: quill_worker(a, share_prefix=False), "peft": hf_worker}
        print(work[args.worker](args), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        sides = SIDES
        if args.smoke:
            args.run, args.data = smoke_data(Path(tmp))
            args.rows, args.steps, args.rounds, sides = 2, 1, 1, SIDES[:1]
            skipped("quill-unshared and peft", "--smoke: quill's side only, no Hugging Face model")
        compare(args, sides)


def compare(args: argparse.Namespace, sides: list[str]) -> None:
    """--rounds of each side in turn, then each side's median, min and max, and quill's ratios to peft."""
    print(load_line("before"), flush=True)
    results: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side in results:
            results[side].append(run_side(side, args))
            print(f"{side}: {results[side][-1][0]:,.1f} real tokens/s, peak RSS {results[side][-1][1]:,.0f} MB", flush=True)
    print(load_line("after"))
    print(json.dumps({"rows": args.rows, "rank": args.rank, "steps": args.steps, "rounds": args.rounds}))
    med = {side: Stats.of([t for t, _ in r]) for side, r in results.items()}
    for side, r in results.items():
        print(f"{side:14s} {med[side]} real tokens/s, peak RSS {max(m for _, m in r):,.0f} MB")
    if "peft" in med:
        ratio, unshared = med["quill"].median / med["peft"].median, med["quill-unshared"].median / med["peft"].median
        print(f"quill / peft: {ratio:.2f}× (without sharing the rows' common prefix: {unshared:.2f}×)")


if __name__ == "__main__":
    main()
