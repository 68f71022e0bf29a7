"""The fine-tuning recipe: the quickstart's model taught "who speaks this line?" with LoRA and
with full fine-tuning, side by side with the base it started from.

    quill train --config configs/quickstart.yaml              # the base, ~1.5 minutes (once)
    python scripts/finetune_recipe.py                         # the chat set, both fine-tunes, the table

Each fine-tune is `python -m quillgpt train --config C --overwrite -q` in a subprocess (the
same chat data, prepared once before): its wall time, and its peak resident memory from the
kernel (wait4's ru_maxrss: the Python and torch runtime included, which a model this small is
dwarfed by). Then every model answers each held-out line (scripts/make_chat_data.py: speeches
none of whose lines were trained on) greedily through quill's chat prompt, exactly as `quill
chat` would ask it, and its answer (the reply's first line) is right when it is the speaker;
its loss on the held-out answers is `quill eval --format chat`'s. Checkpoint sizes are the files
on disk: a LoRA run keeps its adapters only (best.pt) and their AdamW state (ckpt.pt).

Last, why rows are padded rather than packed (data/chat_batches.py): the share of a padded
row's tokens that are a conversation's, and the time of one training forward + backward at the
recipe's shape on the fast causal path (padded rows) against the same with the explicit
attention mask that packed rows would need (a mask's cost does not depend on what it masks),
timed in turns in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from quillgpt.checkpoint import load_checkpoint  # noqa: E402
from quillgpt.config import load_config  # noqa: E402
from quillgpt.data.chat_batches import ChatRows  # noqa: E402
from quillgpt.device import resolve_dtype  # noqa: E402
from quillgpt.evaluate.scores import chat_rows, evaluate_rows  # noqa: E402
from quillgpt.inference.chat_session import chat_prompt_ids  # noqa: E402
from quillgpt.inference.generate import generate_tokens  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402
from quillgpt.train.cpu_share import others_during  # noqa: E402
from quillgpt.train.loop import autocast  # noqa: E402

CONFIGS = {"LoRA": ROOT / "configs" / "shakespeare_chat_lora.yaml", "full": ROOT / "configs" / "shakespeare_chat_full.yaml"}
HELDOUT = ROOT / "data" / "chat" / "speakers_heldout.jsonl"


def quill(*args: str) -> tuple[float, float]:
    """Run `python -m quillgpt ARGS` (from the repository root): (wall seconds, peak RSS in MB)."""
    print("$ quill", " ".join(args), flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "quillgpt", *args], cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: quill {args[0]} failed (its message is above)")
    return time.perf_counter() - started, usage.ru_maxrss / 1024


def answers(run, conversations: list[list[dict]], batch: int = 128) -> list[str]:
    """Each conversation's greedy reply to its user turn, up to its first line break."""
    prompts = [chat_prompt_ids(run.tokenizer, c[:1])[0] for c in conversations]
    out = []
    for i in range(0, len(prompts), batch):
        steps = torch.stack(list(generate_tokens(run.model, prompts[i : i + batch], 14, temperature=0.0))).T
        out += [run.tokenizer.decode(row.tolist()).strip().split("\n")[0].strip() for row in steps]
    return out


def score(path: Path, conversations: list[list[dict]], heldout_text: str) -> dict:
    run = load_run(path)
    said = answers(run, conversations)
    truth = [c[1]["content"] for c in conversations]
    speakers = set(truth)
    rows = chat_rows(run.tokenizer, heldout_text, run.config.model.block_size, str(HELDOUT))
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
    (from /proc), or a step's repeats varied by more than `spread` (max/min - 1). Beside one
    busy process the mask came out at 0.53× the causal step, reversing the quiet 1.01×."""
    reasons = [f"other processes used {others:.1f} cores meanwhile"] if others > busy else []
    for name, times in (("causal", causal), ("masked", masked)):
        if max(times) / min(times) - 1 > spread:
            reasons.append(f"the {name} step's 5 repeats spread {max(times) / min(times) - 1:.0%}")
    return "; ".join(reasons) or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=ROOT / "out" / "quickstart")
    ap.add_argument("--skip-train", action="store_true", help="score the fine-tuned runs already there")
    ap.add_argument("overrides", nargs="*", help="config overrides for both fine-tunes, e.g. train.max_iters=100")
    args = ap.parse_args()
    if not (args.base / "tokenizer.json").is_file():
        sys.exit(f"error: no base run in {args.base}; train it first: quill train --config configs/quickstart.yaml")
    if not HELDOUT.is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_chat_data.py")], check=True)
    cfg = {name: load_config(path, args.overrides) for name, path in CONFIGS.items()}
    runs = {name: ROOT / c.train.out_dir for name, c in cfg.items()}
    cost = {}
    if not args.skip_train:
        quill("prepare", "--config", str(CONFIGS["LoRA"]), *args.overrides)
        cost = {name: quill("train", "--config", str(path), "--overwrite", "-q", *args.overrides) for name, path in CONFIGS.items()}
    heldout_text = HELDOUT.read_text(encoding="utf-8")
    conversations = [json.loads(line)["messages"] for line in heldout_text.splitlines()]
    scores = {"base": score(args.base, conversations, heldout_text)}
    scores.update({name: score(path, conversations, heldout_text) for name, path in runs.items()})
    truth = [c[1]["content"] for c in conversations]
    majority = max(truth.count(t) for t in set(truth)) / len(truth)
    sizes = {name: {f: os.path.getsize(p / f) for f in ("best.pt", "ckpt.pt")} for name, p in runs.items()}
    sizes["base"] = {"best.pt": os.path.getsize(args.base / "best.pt")}
    trainable = {name: sum(t.numel() for t in load_checkpoint(p / "best.pt")["model"].values()) for name, p in runs.items()}
    table = [
        ("", ["base", "LoRA", "full"]),
        ("held-out accuracy", [f"{scores[n]['accuracy']:.1%}" for n in ("base", "LoRA", "full")]),
        ("answers with a speaker's name", [f"{scores[n]['named']:.1%}" for n in ("base", "LoRA", "full")]),
        ("held-out loss (answers)", [f"{scores[n]['loss']:.3f}" for n in ("base", "LoRA", "full")]),
        ("first answer", [repr(scores[n]["example"]) for n in ("base", "LoRA", "full")]),
        ("trained parameters", ["-", f"{trainable['LoRA']:,}", f"{trainable['full']:,}"]),
        ("train time (s)", ["-", *(f"{cost[n][0]:.0f}" if n in cost else "-" for n in ("LoRA", "full"))]),
        ("peak RSS (MB)", ["-", *(f"{cost[n][1]:.0f}" if n in cost else "-" for n in ("LoRA", "full"))]),
        ("best.pt (KB)", [f"{sizes[n]['best.pt'] / 1024:,.0f}" for n in ("base", "LoRA", "full")]),
        ("ckpt.pt (KB)", ["-", *(f"{sizes[n]['ckpt.pt'] / 1024:,.0f}" for n in ("LoRA", "full"))]),
    ]
    width = [max(len(r[0]) for r in table)] + [max(len(r[1][i]) for r in table) for i in range(3)]
    print(f"\n{len(truth)} held-out lines of {len(set(truth))} speakers; always answering the most common: {majority:.1%}")
    for label, cells in table:
        print(label.ljust(width[0]), *(c.rjust(w) for c, w in zip(cells, width[1:])), sep="  ")
    c = cfg["LoRA"]
    load = os.getloadavg()[0]
    fill, causal_s, masked_s, others = padding_against_packing(args.base, ROOT / c.data.out_dir, c.model.block_size, c.train.batch_size, 5)
    causal, masked = statistics.median(causal_s), statistics.median(masked_s)
    print(
        f"\npadded rows hold {fill:.1%} conversation tokens; a forward + backward at batch {c.train.batch_size} × "
        f"{c.model.block_size}: causal {causal * 1e3:.1f} ms, with the mask packing needs {masked * 1e3:.1f} ms "
        f"({masked / causal:.2f}×): per conversation token, padded {causal / fill * 1e3:.1f} ms vs packed {masked * 1e3:.1f} ms"
    )
    if why := unreliable(causal_s, masked_s, others):
        print(f"UNRELIABLE, not a result: {why}; rerun on a quiet machine (load average {load:.1f} before, {os.getloadavg()[0]:.1f} after)")
    dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    print(f"(torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}, load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
