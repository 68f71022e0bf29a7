"""`quill finetune BASE --data FILE.jsonl -o OUT`: the fine-tuning recipe as one command.

It reads the base run's config, prepares the conversations with the base's tokenizer (val: the
last data.val_fraction of the lines, held out), and sizes the run from the data: batches by a
token budget with rows of similar length together (a row is as long as its conversation, so the
longest one sizes the batches, not the context), steps = epochs × batches an epoch, and the
learning rate's warmup as a fraction of those steps. The model keeps the base's context
(model.block_size): a fine-tune on short conversations still reads long chats. It prints that
plan with an estimated time, then trains as `quill train` would with those settings (every one
of them can be overridden with section.key=value, which `quill train` also takes). LoRA by
default (rank 8 on every linear), `full=True` for every weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quillgpt import checkpoint as ckpt
from quillgpt.config import Config, TrainConfig, load_config
from quillgpt.data.chat_batches import ChatRows, ChatSampler
from quillgpt.data.prepare import prepare
from quillgpt.device import peak_flops, resolve_device, resolve_dtype
from quillgpt.errors import QuillError
from quillgpt.files import check_input
from quillgpt.model.kv_cache import prefix_worth_sharing
from quillgpt.train.loop import TrainResult, train
from quillgpt.train.memory import count_params
from quillgpt.train.run_dir import describe_run, holds_run

# The recipe's defaults (docs/finetuning.md has the runs they come from).
LORA_LR, FULL_LR = 1e-3, 5e-5  # peak learning rates: adapters start at zero and move fast; full weights move little
WARMUP_FRAC = 0.05  # of the run's steps
MIN_BATCHES = 16  # an epoch of a small set still has this many steps (batches), when the data allows
MAX_BATCH_TOKENS = 4096  # a micro-batch's token budget (rows × the longest), at most
MAX_ROWS = 64  # conversations a batch, at most
MAX_EPOCHS = 1000  # --epochs: a fine-tune of a billion passes would never end
# the share of the matmul peak a CPU fine-tune reaches, for the plan's time: SmolLM2 LoRA on 2 quiet
# AVX2 cores ran at 0.68 of it by this count (docs/finetuning.md), 0.15 on a machine at load 13-16
EST_MFU = 0.5


@dataclass
class Plan:
    """What a fine-tune will do, from the data: printed before it starts."""

    train_conversations: int
    val_conversations: int
    train_tokens: int  # the train split's conversation tokens (x tokens: padding not counted)
    longest: int
    block_size: int
    batch_tokens: int
    steps: int
    epochs: int
    learning_rate: float
    warmup_iters: int
    est_seconds: float

    def describe(self, cfg: Config) -> str:
        what = "full fine-tuning" if not cfg.lora.rank else f"LoRA rank {cfg.lora.rank} on {', '.join(cfg.lora.targets)}"
        return (
            f"plan: {what} of {cfg.train.init_from} on {self.train_conversations:,} conversations "
            f"({self.train_tokens:,} tokens, the longest {self.longest:,}; {self.val_conversations:,} held out), "
            f"model.block_size={self.block_size:,} (the context; a row is as long as its conversation), "
            f"train.batch_tokens={self.batch_tokens:,}, {self.epochs} epoch(s) = "
            f"{self.steps:,} steps, learning rate {self.learning_rate:.0e} after {self.warmup_iters} warmup step(s), "
            f"about {_duration(self.est_seconds)} here → {cfg.train.out_dir}"
        )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f} min"


def finetune_config(base: Path, data: Path, out: Path, full: bool = False, epochs: int = 3, overrides: list[str] | None = None) -> Config:
    """The base run's config set to fine-tune it on `data` into `out` (before the data is sized):
    chat format, the base's tokenizer, LoRA or full, then the user's overrides."""
    base, out = Path(base), Path(out)
    if not (base / "config.yaml").is_file():
        raise QuillError(f"{base} is not a run directory (no config.yaml): pass a quill run or a `quill import-hf` output")
    if not 1 <= epochs <= MAX_EPOCHS:
        raise QuillError(f"--epochs must be at least 1 and at most {MAX_EPOCHS:,}, got {epochs:,}")
    try:
        check_input(data, "--data")
    except FileNotFoundError:
        raise QuillError(f"--data {data}: no such file (conversations, one JSON object a line)") from None
    recipe = [
        f"data.path={data}",
        "data.format=chat",
        "data.tokenizer=null",  # the base's own (train.init_from's tokenizer.json)
        f"data.out_dir={out / 'data'}",
        f"train.out_dir={out}",
        f"train.init_from={base}",
        "train.optimizer=adamw",
        "train.lr_schedule=cosine",
        "train.grad_accum=1",
        "train.weight_decay=0.0",
        f"train.learning_rate={FULL_LR if full else LORA_LR}",
        "train.min_lr=0",  # the plan sets a tenth of the rate; the base's may exceed --full's lower rate
        *(["lora.rank=0"] if full else ["lora.rank=8", "lora.alpha=16", "lora.targets=[q,k,v,o,mlp]"]),
    ]
    return load_config(base / "config.yaml", recipe + list(overrides or []))


def epoch_tokens(sampler: ChatSampler) -> int:
    """Tokens an epoch's steps run: the padding included, and a batch's shared prefix (a system
    prompt every conversation opens with) once, as GPT.forward's share_prefix runs it."""
    if sampler.batch_tokens is None:
        return sampler.padded_per_epoch()
    total = 0
    for picks in sampler.plan:
        x, y = sampler.rows.batch(picks)
        total += x.numel() - (len(picks) - 1) * prefix_worth_sharing(x, y)
    return total


def plan_finetune(cfg: Config, epochs: int, given: frozenset[str] = frozenset()) -> Plan:
    """Prepare the data and size the run from it, setting cfg's batches, steps, schedule and
    evaluation (except the keys the user gave: `given`). model.block_size stays the base's (or the
    smaller one the user gave): it is the model's context, which chat, serve and the exports read;
    a row is only as long as its conversation, so a long context makes no step slower."""
    prepared = prepare(cfg.data, progress=False, chat_tokens=cfg.model.block_size + 1)
    rows = {split: ChatRows.prepared(prepared.out_dir, split, cfg.model.block_size) for split in ("train", "val")}
    longest = max(r.longest for r in rows.values())
    tc = cfg.train

    def put(key: str, value: object) -> None:
        section, name = key.split(".")
        if key not in given:
            setattr(getattr(cfg, section), name, value)

    train_tokens = rows["train"].real_tokens(np.arange(len(rows["train"])))
    put("train.batch_tokens", max(longest, min(MAX_BATCH_TOKENS, train_tokens // MIN_BATCHES)))
    put("train.batch_size", MAX_ROWS)
    sampler = ChatSampler(rows["train"], tc.batch_size, tc.seed, "cpu", tc.batch_tokens)
    steps = epochs * math.ceil(sampler.batches_per_epoch() / tc.grad_accum)
    put("train.max_iters", steps)
    put("train.warmup_iters", max(1, round(WARMUP_FRAC * tc.max_iters)))
    put("train.min_lr", tc.learning_rate / 10)
    put("train.eval_interval", max(1, tc.max_iters // epochs))  # each epoch's end
    put("train.eval_iters", math.ceil(len(rows["val"]) / tc.batch_size))  # every held-out conversation
    put("train.log_interval", max(1, tc.max_iters // 20))
    put("train.time_budget", None)
    cfg.validate()
    device = resolve_device(tc.device, "train.device")
    params = count_params(cfg.model, cfg.model.vocab_size)
    flops = (4 if cfg.lora.rank else 6) * params * epoch_tokens(sampler) * epochs  # frozen: no weight gradients
    seconds = flops / (peak_flops(device, resolve_dtype(tc.dtype, device)) * EST_MFU) if device.type == "cpu" else float("nan")
    return Plan(
        len(rows["train"]),
        len(rows["val"]),
        train_tokens,
        longest,
        cfg.model.block_size,
        tc.batch_tokens,
        tc.max_iters,
        epochs,
        tc.learning_rate,
        tc.warmup_iters,
        seconds,
    )


def check_out_dir(tc: TrainConfig) -> None:
    """Refuse a run already in -o before its data is prepared over OUT/data, in finetune's own
    words: it has no --resume flag (train.resume=true continues a fine-tune), and -o names the run."""
    out = Path(tc.out_dir)
    if tc.resume or tc.overwrite or not holds_run(out):
        return  # training decides: it resumes, replaces, or refuses (a resume with nothing to resume)
    raise QuillError(
        f"{out} already holds a run ({describe_run(out)}); fine-tune into another -o, continue this one "
        "with train.resume=true, or replace it with --overwrite"
    )


def best_checkpoint(out_dir: Path) -> tuple[int, float] | None:
    """(step, held-out loss) of a run's best.pt, the weights chat, merge and the exports load by
    default; None when it has none (or none that reads)."""
    try:
        state = ckpt.load_checkpoint(Path(out_dir) / ckpt.BEST)
    except QuillError:
        return None
    loss = state.get("val_loss")
    return (state["step"], float(loss)) if isinstance(loss, (int, float)) else None


def finetune(
    base: Path, data: Path, out: Path, full: bool = False, epochs: int = 3, overrides: list[str] | None = None, progress: bool = True
) -> tuple[Plan, TrainResult]:
    """Plan the fine-tune (printing it), then train it."""
    cfg = finetune_config(base, data, out, full, epochs, overrides)
    check_out_dir(cfg.train)
    given = frozenset(item.split("=", 1)[0].strip() for item in overrides or [])
    plan = plan_finetune(cfg, epochs, given)
    print(plan.describe(cfg), flush=True)
    return plan, train(cfg, progress=progress)
