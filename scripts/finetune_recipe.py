"""The fine-tuning recipe: the quickstart's model taught "who speaks this line?" with LoRA and
with full fine-tuning, side by side with the base it started from.

    quill train --config configs/quickstart.yaml              # the base, ~1.5 minutes (once)
    python scripts/finetune_recipe.py                         # the chat set, both fine-tunes, the table

Each fine-tune is `python -m quillgpt train --config C --overwrite -q` in a subprocess (the chat
data prepared once before): its wall time and peak RSS (wait4's, the Python and torch runtime
included). Then every model answers each held-out line (scripts/make_chat_data.py: speeches none
of whose lines were trained on) greedily through quill's chat prompt, as `quill chat` asks it;
an answer (the reply's first line) is right when it is the speaker. Its held-out loss is `quill
eval --format chat`'s; checkpoint sizes are the files (LoRA: its adapters in best.pt, with their
AdamW state in ckpt.pt). Last, why rows are padded rather than packed (data/chat_batches.py): the
share of a padded row's tokens that are a conversation's, and one training forward + backward at
the recipe's shape on the causal path (padded rows) against the same with the attention mask
packed rows would need, timed in turns in this process.

    python scripts/finetune_recipe.py --score data/chat/speakers_heldout.jsonl --ckpt out/smollm2 --ckpt out/smol-ft

--score scores the runs given instead (e.g. an imported chat model beside its fine-tune): each
conversation's first user turn through the run's own chat prompt, its last assistant turn the
expected answer. --smoke scores a tiny random base on a few conversations (no fine-tune, no timing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import ROOT, add_common, load_line, run_child, skipped, tiny_run

from quillgpt.checkpoint import load_checkpoint
from quillgpt.config import load_config
from quillgpt.cpu_share import others_during
from quillgpt.data.chat_batches import ChatRows
from quillgpt.device import resolve_dtype
from quillgpt.evaluate.scores import chat_rows, evaluate_rows
from quillgpt.inference.chat_session import chat_prompt_ids
from quillgpt.inference.generate import generate_tokens
from quillgpt.runs import load_run
from quillgpt.train.loop import autocast

CONFIGS = {"LoRA": ROOT / "configs" / "shakespeare_chat_lora.yaml", "full": ROOT / "configs" / "shakespeare_chat_full.yaml"}
HELDOUT = ROOT / "data" / "chat" / "speakers_heldout.jsonl"


def quill(*args: str) -> tuple[float, float]:
    """Run `python -m quillgpt ARGS` (from the repository root): (wall seconds, peak RSS in MB)."""
    print("$ quill", " ".join(args), flush=True)
    seconds, peak_mb, _ = run_child([sys.executable, "-m", "quillgpt", *args], cwd=ROOT)
    return seconds, peak_mb


def answers(run, conversations: list[list[dict]], batch: int = 128) -> list[str]:
    """Each conversation's greedy reply to its user turn, up to its first line break or end of turn."""
    prompts = [chat_prompt_ids(run.tokenizer, c[:1])[0] for c in conversations]
    ends = [e for e in (run.tokenizer.decode([i]) for i in run.tokenizer.stop_ids) if e]  # an imported model's end of turn
    out = []
    for i in range(0, len(prompts), batch):
        steps = torch.stack(list(generate_tokens(run.model, prompts[i : i + batch], 14, temperature=0.0))).T
        said = [run.tokenizer.decode(row.tolist()) for row in steps]
        out += [min((a.split(e)[0] for e in ends), key=len, default=a).strip().split("\n")[0].strip() for a in said]
    return out


def score(path: Path, conversations: list[list[dict]], heldout: Path) -> dict:
    run = load_run(path)
    said = answers(run, conversations)
    truth = [c[-1]["content"].strip() for c in conversations]
    speakers = set(truth)
    rows = chat_rows(run.tokenizer, heldout.read_text(encoding="utf-8"), run.config.model.block_size, str(heldout))
    return {
        "accuracy": sum(a == t for a, t in zip(said, truth)) / len(truth),
        "named": sum(a in speakers for a in said) / len(truth),
        "loss": evaluate_rows(run.model, rows).loss,
        "example": said[0],
    }


def step_seconds(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, pos: torch.Tensor | None, reps: int, dtype: torch.dtype
) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        with autocast(torch.device("cpu"), dtype):  # as the fine-tunes train (train.dtype: auto)
            _, loss = model(x, y, pos=pos)
        loss.backward()
    return (time.perf_counter() - start) / reps


def padding_against_packing(base: Path, data_dir: Path, block: int, batch: int, reps: int) -> tuple[float, list[float], list[float], float]:
    """(fill of padded rows, causal step times, masked step times, cores other processes used
    meanwhile), the two steps timed in turns."""
    rows = ChatRows.prepared(data_dir, "train", block)
    model = load_run(base).model.train()
    x, y = rows.batch(torch.arange(batch).numpy())
    pos = torch.arange(block).expand(batch, block)  # explicit positions: GPT builds a (B, 1, T, T) mask
    dtype = resolve_dtype("auto", torch.device("cpu"))
    step_seconds(model, x, y, None, 2, dtype), step_seconds(model, x, y, pos, 2, dtype)  # warm up
    causal, masked = [], []

    def timed() -> None:
        for _ in range(5):
            causal.append(step_seconds(model, x, y, None, reps, dtype))
            masked.append(step_seconds(model, x, y, pos, reps, dtype))

    _, others = others_during(timed)
    return rows.fill, causal, masked, others


def unreliable(causal: list[float], masked: list[float], others: float, spread: float = 0.15, busy: float = 0.25) -> str | None:
    """Why a timing is not to be trusted, or None: another process used the cores meanwhile
    (from /proc), or a step's repeats varied by more than `spread` (max/min - 1): beside a busy
    process the figure can reverse (docs/performance.md)."""
    reasons = [f"other processes used {others:.1f} cores meanwhile"] if others > busy else []
    for name, times in (("causal", causal), ("masked", masked)):
        if max(times) / min(times) - 1 > spread:
            reasons.append(f"the {name} step's 5 repeats spread {max(times) / min(times) - 1:.0%}")
    return "; ".join(reasons) or None


def fine_tunes(args: argparse.Namespace) -> tuple[dict[str, Path], dict[str, tuple[float, float]]]:
    """Both fine-tunes trained (unless --skip-train) on the chat set: their runs and (seconds, peak RSS MB)."""
    if not (args.base / "tokenizer.json").is_file():
        sys.exit(f"error: no base run in {args.base}; train it first: quill train --config configs/quickstart.yaml")
    if not HELDOUT.is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_chat_data.py")], check=True)
    cfg = {name: load_config(path, args.overrides) for name, path in CONFIGS.items()}
    cost = {}
    if not args.skip_train:
        quill("prepare", "--config", str(CONFIGS["LoRA"]), *args.overrides)
        cost = {name: quill("train", "--config", str(path), "--overwrite", "-q", *args.overrides) for name, path in CONFIGS.items()}
    return {name: ROOT / c.train.out_dir for name, c in cfg.items()}, cost


def print_table(base: Path, runs: dict[str, Path], cost: dict[str, tuple[float, float]], heldout: Path) -> None:
    """The base beside each fine-tune: held-out accuracy and loss, parameters, time, memory, file sizes."""
    conversations = [json.loads(line)["messages"] for line in heldout.read_text(encoding="utf-8").splitlines()]
    scores = {name: score(path, conversations, heldout) for name, path in {"base": base, **runs}.items()}
    names = list(scores)
    truth = [c[-1]["content"].strip() for c in conversations]
    majority = max(truth.count(t) for t in set(truth)) / len(truth)
    size = {n: {f: os.path.getsize(p / f) for f in ("best.pt", "ckpt.pt") if (p / f).is_file()} for n, p in {"base": base, **runs}.items()}
    trainable = {name: sum(t.numel() for t in load_checkpoint(p / "best.pt")["model"].values()) for name, p in runs.items()}

    def cells(fn) -> list[str]:
        return [fn(n) for n in names]

    table = [
        ("", names),
        ("held-out accuracy", cells(lambda n: f"{scores[n]['accuracy']:.1%}")),
        ("answers with a speaker's name", cells(lambda n: f"{scores[n]['named']:.1%}")),
        ("held-out loss (answers)", cells(lambda n: f"{scores[n]['loss']:.3f}")),
        ("first answer", cells(lambda n: repr(scores[n]["example"]))),
        ("trained parameters", cells(lambda n: f"{trainable[n]:,}" if n in trainable else "-")),
        ("train time (s)", cells(lambda n: f"{cost[n][0]:.0f}" if n in cost else "-")),
        ("peak RSS (MB)", cells(lambda n: f"{cost[n][1]:.0f}" if n in cost else "-")),
        ("best.pt (KB)", cells(lambda n: f"{size[n]['best.pt'] / 1024:,.0f}" if "best.pt" in size[n] else "-")),
        ("ckpt.pt (KB)", cells(lambda n: f"{size[n]['ckpt.pt'] / 1024:,.0f}" if n != "base" and "ckpt.pt" in size[n] else "-")),
    ]
    width = [max(len(r[0]) for r in table)] + [max(len(r[1][i]) for r in table) for i in range(len(names))]
    print(f"\n{len(truth)} held-out lines of {len(set(truth))} speakers; always answering the most common: {majority:.1%}")
    for label, row in table:
        print(label.ljust(width[0]), *(c.rjust(w) for c, w in zip(row, width[1:])), sep="  ")


def print_padding(base: Path, overrides: list[str]) -> None:
    """Padded rows against packed ones at the LoRA recipe's shape, with the reasons not to trust the timing."""
    c = load_config(CONFIGS["LoRA"], overrides)
    print(load_line("before"))
    fill, causal_s, masked_s, others = padding_against_packing(base, ROOT / c.data.out_dir, c.model.block_size, c.train.batch_size, 5)
    causal, masked = statistics.median(causal_s), statistics.median(masked_s)
    print(
        f"\npadded rows hold {fill:.1%} conversation tokens; a forward + backward at batch {c.train.batch_size} × "
        f"{c.model.block_size}: causal {causal * 1e3:.1f} ms, with the mask packing needs {masked * 1e3:.1f} ms "
        f"({masked / causal:.2f}×): per conversation token, padded {causal / fill * 1e3:.1f} ms vs packed {masked * 1e3:.1f} ms"
    )
    if why := unreliable(causal_s, masked_s, others):
        print(f"UNRELIABLE, not a result: {why}; rerun on a quiet machine")
    dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    print(f"(torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}); {load_line('after')}")


SMOKE_CHATS = [("To be, or not to be", "HAMLET"), ("O Romeo, Romeo", "JULIET"), ("Now is the winter", "GLOUCESTER")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=ROOT / "out" / "quickstart")
    ap.add_argument("--skip-train", action="store_true", help="score the fine-tuned runs already there")
    ap.add_argument("--score", type=Path, help="only score --ckpt runs on these conversations (jsonl, {'messages': [...]} a line)")
    ap.add_argument("--ckpt", type=Path, action="append", default=[], help="--score: a run (repeatable)")
    ap.add_argument("-n", type=int, default=200, help="--score: the first N conversations")
    ap.add_argument("overrides", nargs="*", help="config overrides for both fine-tunes, e.g. train.max_iters=100")
    add_common(ap)
    args = ap.parse_args()
    if args.score:
        lines = args.score.read_text(encoding="utf-8").splitlines()[: args.n]
        for ckpt in args.ckpt:
            got = score(ckpt, [json.loads(line)["messages"] for line in lines], args.score)
            right, named = f"{got['accuracy']:.1%} right", f"{got['named']:.1%} an expected answer"
            print(f"{ckpt}: {right}, {named}, of {len(lines)}; held-out loss {got['loss']:.3f}; first reply {got['example']!r}")
        return
    if not args.smoke:
        print_table(args.base, *fine_tunes(args), HELDOUT)
        print_padding(args.base, args.overrides)
        return
    with tempfile.TemporaryDirectory() as tmp:
        skipped("the fine-tunes and the padding timing", "--smoke: a random base, scored on a few lines")
        heldout = Path(tmp) / "heldout.jsonl"
        chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in SMOKE_CHATS]
        heldout.write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
        print_table(tiny_run(Path(tmp) / "base"), {}, {}, heldout)


if __name__ == "__main__":
    main()
