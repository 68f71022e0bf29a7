"""The training loop: AdamW + warmup/cosine, accumulation, AMP, DDP, exact resume.

`train(cfg)` is what `quill train` calls, and reads as its steps:

    open_run   lock the run directory, refuse to replace a run nobody said to, prepare the data
    setup      tokenizer, model, optimizer, sampler, evaluation windows (nothing written yet)
    restore    a resumed run's weights, optimizer, sampler, random streams, counters, horizon
    start_run  only now write config.yaml / tokenizer.json and start or trim metrics.jsonl
    loop       train_step, log, evaluate_and_save, stop on a signal or the time budget

What makes it trustworthy lives in the helpers: every source of randomness is checkpointed (resume
is bit-identical on CPU, per rank under DDP), checkpoints are atomic, one process owns a run
directory, an existing run is never replaced without --overwrite, and faults (Ctrl-C, SIGTERM, a
non-finite loss, OOM, a full disk) end with a clear message and the last good checkpoint intact.

Fine-tuning starts from train.init_from. Chat data (data.format=chat) trains on whole
conversations, the loss on the assistant's tokens (data/chat_batches.py). LoRA (lora.rank > 0)
freezes the base and trains adapters only (model/lora.py); its checkpoints hold the adapters
and the base's path and checksum, and resuming it checks the base is unchanged.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quillgpt import checkpoint as ckpt
from quillgpt.config import Config, TrainConfig, parse_duration
from quillgpt.cpu_share import measured_quietly, sharing_cpu
from quillgpt.data.batches import BatchSampler, fixed_windows
from quillgpt.data.chat_batches import ChatRows, ChatSampler
from quillgpt.data.prefix_batches import PrefixLengths, PrefixSampler, separator_id
from quillgpt.data.prepare import PreparedData, load_prepared, load_tokens
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.device import peak_flops, resolve_dtype
from quillgpt.errors import QuillError
from quillgpt.evaluate.scores import evaluate_rows, evaluate_windows
from quillgpt.model.gpt import GPT
from quillgpt.model.lora import adapter_state, add_lora
from quillgpt.model.variants import variant_of
from quillgpt.train import fsdp_checkpoint as sharded
from quillgpt.train.distributed import (
    Dist,
    full_weights,
    grad_sync,
    is_sharded,
    prepare_model,
    rank_rng_states,
    resolve_strategy,
    restore_rank_rng,
    seed_rank,
    setup_distributed,
    teardown_distributed,
    wrap_model,
)
from quillgpt.train.memory import check_train_memory
from quillgpt.train.optim import build_optimizer
from quillgpt.train.progress import Progress, startup_line
from quillgpt.train.run_dir import check_restorable, check_resume_state, init_from_run, last_val_loss, open_run, start_run
from quillgpt.train.schedule import follow_budget, lr_at
from quillgpt.train.state import FIT_AFTER_STEPS, Trainer, Windows


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    best_val_loss: float
    last_val_loss: float | None
    elapsed_s: float
    stopped: str  # "done" | "time_budget" | "interrupted" | "finished" (a resume of a run that had ended)
    reason: str = ""  # why, where it is not obvious (a time budget's end; how to extend a finished run)
    session_s: float | None = None  # seconds this process trained (elapsed_s counts the runs it resumed too)

    def time_text(self) -> str:
        """'88s' for a run in one go; '30s (125s in all)' for one that continued an earlier run."""
        if self.session_s is None or self.elapsed_s - self.session_s <= 0:  # nothing before this process
            return f"{self.elapsed_s:.0f}s"
        return f"{self.session_s:.0f}s ({self.elapsed_s:.0f}s in all)"


# --- schedule, optimizer, devices -------------------------------------------------------------


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# --- signals ----------------------------------------------------------------------------------


class StopFlag:
    """Turns SIGINT/SIGTERM into a request to stop after the current step (with a checkpoint).

    A second Ctrl-C interrupts at once, for a loop that is stuck.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


# --- evaluation on fixed windows --------------------------------------------------------------


def estimate_loss(model: GPT, windows: Windows, batch_size: int, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Mean loss per split over the same windows (chat data: the same conversations, the
    assistant's tokens) every time, so curves are comparable across steps.

    On CPU this runs in fp32 even when training in bf16: the few eval batches cost little, and the
    logged val loss is then exactly what `quill eval` reports for the saved weights.
    """
    with autocast(device, torch.float32 if device.type == "cpu" else dtype):
        return {
            split: (
                evaluate_rows(model, data, picks, batch_size=batch_size, device=device)
                if isinstance(data, ChatRows)
                else evaluate_windows(model, data, picks, batch_size=batch_size, device=device)
            ).loss
            for split, (data, picks) in windows.items()
        }


def train(cfg: Config, progress: bool = True) -> TrainResult:
    """Train a GPT as `cfg` says; returns where the run stopped and its losses."""
    ddp, device = setup_distributed(cfg.train.device, cfg.train.strategy)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    try:
        with contextlib.ExitStack() as stack:
            prepared, state = open_run(cfg, ddp, stack, progress)
            t = setup(cfg, ddp, device, prepared, state)
            if state is not None:
                restore(t, state)
            stack.callback(lambda: t.log.close() if t.log is not None else None)
            if state is not None and t.step >= t.horizon:  # nothing left to do: say how to go on
                return finished(t)
            t.model = wrap_model(torch.compile(t.raw_model) if cfg.train.compile else t.raw_model, ddp, device)
            result = loop(t, progress, resumed=state is not None)
            # the DDP wrapper's reducer holds the process group: dropped while every rank is still
            # here, then a barrier, so no rank tears its group down while a peer's gloo threads
            # still talk to it (a rank that exited first left the other's teardown waiting forever)
            t.model = t.raw_model
            ddp.barrier()
            return result
    finally:
        teardown_distributed(ddp)


def _fit_vocab(cfg: Config, tokenizer: Tokenizer) -> None:
    """model.vocab_size: the tokenizer's when unset; one that cannot hold its ids is refused."""
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tokenizer.vocab_size
    elif cfg.model.vocab_size < tokenizer.vocab_size:
        raise QuillError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}; "
            "remove model.vocab_size to use the tokenizer's"
        )


def setup(cfg: Config, ddp: Dist, device: torch.device, prepared: PreparedData, state: dict[str, Any] | None) -> Trainer:
    """Build everything a run needs (and check that a resume's `state` fits it) without writing anything."""
    tc = cfg.train
    _, tokenizer = load_prepared(prepared.out_dir)
    _fit_vocab(cfg, tokenizer)
    init_state, lora_base = None, None
    if tc.init_from:
        cfg, init_state, lora_base = init_from_run(cfg, tokenizer.spec())
    strategy = resolve_strategy(tc, cfg.model, ddp, device)
    _check_combination(cfg, strategy)
    if state is not None:
        check_resume_state(state, Path(tc.out_dir), cfg, tokenizer.spec(), strategy, lora_base)
    chat = cfg.data.format == "chat"  # its batches' shape comes from the conversations, known once they are read
    if strategy != "fsdp" and not chat:  # FSDP holds a 1/world_size share of the state per device
        _check_memory(cfg, device, None)  # before anything big is allocated, windows included
    sampler, windows, batch_notes = _batches(cfg, ddp, device, prepared, tokenizer)
    if strategy != "fsdp" and chat:
        _check_memory(cfg, device, sampler)

    # Each rank its own stream; DDP copies rank 0's initial weights to all. FSDP shards what every
    # rank built alike (from train.seed, on the CPU: only the shards go to the device), then the
    # ranks' own streams start.
    seed_rank(tc.seed, Dist() if strategy == "fsdp" else ddp)
    model = GPT(cfg.model).to("cpu" if strategy == "fsdp" else device)
    if init_state is not None:
        model.load_state_dict(init_state)
    notes = []
    if cfg.lora.rank:  # frozen base, fresh adapters (B = 0: the base's output exactly)
        add_lora(model, cfg.lora)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        notes.append(
            f"LoRA rank {cfg.lora.rank} on {', '.join(cfg.lora.targets)}: {trained:,} trained parameters "
            f"({trained / sum(p.numel() for p in model.parameters()):.1%}); the base {lora_base['path']} is frozen"
        )
    if strategy == "fsdp":
        seed_rank(tc.seed, ddp)
    dtype = resolve_dtype(tc.dtype, device)
    model = prepare_model(model, tc, strategy, ddp, dtype)  # activation checkpointing, FSDP
    t = Trainer(
        cfg,
        ddp,
        device,
        dtype,
        Path(tc.out_dir),
        tokenizer,
        model,
        build_optimizer(model, tc, device),
        torch.amp.GradScaler(device.type, enabled=(dtype == torch.float16)),
        sampler,
        windows,
        budget_s=parse_duration(tc.time_budget) if tc.time_budget else None,
        horizon=tc.max_iters,
        lora_base=lora_base,
        notes=notes + batch_notes + warmup_warning(tc),
    )
    return t


def warmup_warning(tc: TrainConfig) -> list[str]:
    """A run of train.max_iters steps whose warmup is as long or longer never reaches its
    learning rate (an imported model's config keeps its pretraining warmup for a 30-step fine-tune)."""
    if tc.time_budget is not None or tc.warmup_iters < tc.max_iters:
        return []  # (a time budget fits the schedule's end after the warmup: schedule.follow_budget)
    reached = lr_at(tc.max_iters - 1, tc, tc.max_iters) / tc.learning_rate
    return [
        f"warning: train.warmup_iters={tc.warmup_iters} ≥ train.max_iters={tc.max_iters}: the learning rate never "
        f"leaves its warmup (it reaches {reached:.0%} of train.learning_rate); set train.warmup_iters="
        f"{max(1, tc.max_iters // 10)} (a tenth of the run), for instance"
    ]


def eval_rows(cfg: Config, T: int) -> int:
    """Rows of an evaluation batch: train.batch_size, or under a token budget as many rows of T tokens as it holds."""
    tc = cfg.train
    return tc.batch_size if tc.batch_tokens is None else max(1, min(tc.batch_size, tc.batch_tokens // T))


def _check_memory(cfg: Config, device: torch.device, sampler: ChatSampler | None) -> None:
    """Refuse a run whose largest micro-batch (chat: of its conversations) cannot fit on `device`."""
    autocast_on = resolve_dtype(cfg.train.dtype, device) != torch.float32
    shape = _micro_batch_shape(cfg, sampler)
    check_train_memory(cfg, device, shape, autocast_on, eval_rows(cfg, shape[1]))


def _micro_batch_shape(cfg: Config, sampler: Any) -> tuple[int, int, int]:
    """(rows, T, scored targets) of the largest micro-batch one process runs: chat rows as long as
    the data's longest conversation (or a token budget's batches), else batch_size windows of block_size."""
    if isinstance(sampler, ChatSampler):
        return sampler.largest_batch()
    return cfg.train.batch_size, cfg.model.block_size, cfg.train.batch_size * cfg.model.block_size


def _check_combination(cfg: Config, strategy: str) -> None:
    """What the model (the base's, under init_from) cannot be trained with."""
    if cfg.train.batch_tokens is not None and strategy != "single":
        raise QuillError("train.batch_tokens batches conversations in one process: unset it (train.batch_size rows) under torchrun")
    if cfg.lora.rank and strategy == "fsdp":
        raise QuillError("LoRA trains under DDP or in one process, not FSDP: set train.strategy=ddp")
    if cfg.data.format == "chat" and variant_of(cfg.model).bidirectional_prefix:
        raise QuillError(
            "chat data trains a causal model's replies; a prefix-LM (model.attention=prefix) trains on "
            "drawn prefixes instead: use data.format=text"
        )


def _batches(
    cfg: Config, ddp: Dist, device: torch.device, prepared: PreparedData, tokenizer: Tokenizer
) -> tuple[BatchSampler | ChatSampler | PrefixSampler, Windows, list[str]]:
    """The training sampler, the fixed evaluation windows and notes about them. Every rank draws
    the same global batch and keeps its own slice, so N ranks with batch B see exactly the
    windows one process with batch N·B would see."""
    tc, block = cfg.train, cfg.model.block_size
    batch, n_eval = tc.batch_size * ddp.world_size, tc.eval_iters * tc.batch_size * ddp.world_size
    if cfg.data.format == "chat":  # one conversation a row, the loss on the assistant's tokens
        rows = {split: ChatRows.prepared(prepared.out_dir, split, block) for split in ("train", "val")}
        notes = [note for r in rows.values() if (note := r.describe())]
        sampler = ChatSampler(rows["train"], batch, tc.seed, device, tc.batch_tokens)
        return sampler, {s: (r, r.fixed(n_eval)) for s, r in rows.items()}, notes
    train_tokens, val_tokens = load_tokens(prepared.out_dir, "train"), load_tokens(prepared.out_dir, "val")
    sampler = BatchSampler(train_tokens, block, batch, tc.seed, device)
    if variant_of(cfg.model).bidirectional_prefix:  # batches also carry each row's prefix length
        sampler = PrefixSampler(sampler, PrefixLengths(cfg.model, tc.seed + 1, separator_id(cfg.model, tokenizer.encode)))
    windows = {
        "train": (train_tokens, fixed_windows(train_tokens, block, n_eval, "train")),
        "val": (val_tokens, fixed_windows(val_tokens, block, n_eval)),
    }
    return sampler, windows, []


def restore(t: Trainer, state: dict[str, Any]) -> None:
    """Bring a checkpoint back: weights, optimizer, scaler, sampler, this rank's random stream,
    counters, and a time budget's fitted horizon (so the schedule continues, not restarts)."""
    check_restorable(t, state)
    if "shards" in state:  # FSDP: every rank reads its own part
        sharded.load_sharded(state["shards"], t.raw_model, t.optimizer)
    else:  # a LoRA run saved its adapters only (check_restorable: all of them): the rest is the base, loaded already
        t.raw_model.load_state_dict(ckpt.clean_state_dict(state["model"]), strict=t.lora_base is None)
        t.optimizer.load_state_dict(state["optimizer"])
    t.scaler.load_state_dict(state["scaler"])
    t.sampler.load_state_dict(state["sampler"])
    restore_rank_rng(state, t.cfg.train.seed, t.ddp, t.device)
    t.step, t.tokens_seen = state["step"], state["tokens_seen"]
    t.best_val, t.elapsed_before = state["best_val_loss"], state["elapsed_s"]
    saved = state["config"].get("train", {}).get("time_budget")
    same_budget = t.budget_s == (parse_duration(saved) if saved else None)
    if t.budget_s is not None and same_budget and state.get("horizon") is not None:
        t.horizon, t.fitted = min(state["horizon"], t.cfg.train.max_iters), True
        t.budget_ended = bool(state.get("budget_ended", False))
    elif t.budget_s is not None:  # a new budget on resume (an extension): fitted again, from this
        t.fit_at = max(t.fit_at, t.step + FIT_AFTER_STEPS // 2)  # process's own pace after a few steps


def finished(t: Trainer) -> TrainResult:
    """A resume of a run that had already ended: nothing trains, and the run's own figures are
    given (the time it trained, its last and best val loss) with how to go on."""
    return TrainResult(t.out_dir, t.step, t.best_val, last_val_loss(t.out_dir, t.step), t.elapsed_before, "finished", extend_hint(t))


def extend_hint(t: Trainer) -> str:
    """What `--resume` of a run that has already ended says: where it ended and how to go on."""
    tc = t.cfg.train
    if t.budget_s is not None:
        return (
            f"{t.out_dir} already ended at step {t.step:,} after {t.elapsed_before:.0f}s of its "
            f"train.time_budget={tc.time_budget}; to go on, resume with a larger budget (the total, counted "
            "from the run's start: --resume train.time_budget=10m) or by steps (train.time_budget=null "
            f"train.max_iters={2 * t.step}); `quill finetune` takes train.resume=true for --resume"
        )
    return (
        f"{t.out_dir} already reached train.max_iters={tc.max_iters:,}; to go on, resume with more steps "
        f"(--resume train.max_iters={2 * tc.max_iters}, or train.resume=true train.max_iters={2 * tc.max_iters} "
        "on `quill finetune`); its lr schedule then runs over the new total"
    )


def loop(t: Trainer, progress: bool, resumed: bool) -> TrainResult:
    """Steps until the horizon, a stop signal or the time budget; evaluates and checkpoints."""
    tc, ddp = t.cfg.train, t.ddp
    tokens_per_step = f"{tc.batch_size * tc.grad_accum * ddp.world_size * t.cfg.model.block_size:,}"
    if isinstance(t.sampler, ChatSampler):  # rows as long as the batch's longest conversation
        rows, T, _ = _micro_batch_shape(t.cfg, t.sampler)
        tokens_per_step = f"≤ {rows * T * tc.grad_accum * ddp.world_size:,}"
    meter = Meter(t.raw_model.flops_per_token() / ddp.world_size, run_peak(t.device, t.dtype))
    last_val, stopped = None, None
    t.t_start, t.first_step = time.time(), t.step
    meter.start(t.step)
    bar = Progress(t, enabled=progress and ddp.master)
    for line in [startup_line(t, tokens_per_step, resumed), *t.notes] if ddp.master else ():
        bar.write(line)
    with StopFlag() as stop, sharing_cpu(t.device, ddp.world_size) as share:
        t.model.train()
        verified = not tc.compile  # a compiled model proves itself on its first step
        while t.step < t.horizon:
            lr = lr_at(t.step, tc, t.horizon)
            for group in t.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
            loss = train_step(t.model, t) if verified else _first_compiled_step(t)
            verified = True
            t.step += 1
            t.tokens_seen += t.step_tokens[0]
            meter.count(*t.step_tokens)
            if t.step == t.first_step + 1 and not _started(t, loss, stop, resumed, bar):
                t.step, stopped = t.first_step, "interrupted"  # the step is not kept: nothing was saved
                break
            follow_budget(t, bar.write)
            if share is not None and (change := share.update()):
                bar.write(change)
            bar.update(t)
            record = _log_record(t, loss, lr, meter, bar) if t.step % tc.log_interval == 0 or t.step == t.horizon else {}
            if t.step % tc.eval_interval == 0 or t.step == t.horizon:
                eval_started = time.time()
                last_val = evaluate_and_save(t, loss, lr, record, bar)
                t.reserve_s = time.time() - eval_started
                meter.exclude(t.reserve_s)  # keep evaluation out of tokens/s
            elif record and ddp.master:
                t.log.append(record)
            if ddp.any(stop.signal is not None) and t.step < t.horizon:
                stopped = "interrupted"
                _save_on_stop(t, loss, bar)
                break
    bar.close()
    stopped = stopped or ("time_budget" if t.budget_ended else "done")
    elapsed, reason = t.elapsed(), t.stop_reason if stopped == "time_budget" else ""
    return TrainResult(t.out_dir, t.step, t.best_val, last_val, elapsed, stopped, reason, session_s=elapsed - t.elapsed_before)


def run_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    """The peak MFU divides by: a GPU's datasheet figure; on a CPU one measured while no other
    process was busy (None otherwise, and MFU is not shown)."""
    if device.type == "cpu":
        return measured_quietly(lambda: peak_flops(device, dtype) or math.nan)
    return peak_flops(device, dtype)


@dataclass
class Meter:
    """tokens/s (the data's tokens: chat padding left out) and MFU (every token the model ran,
    padding included) between log lines, with evaluation time left out."""

    flops_per_token: float
    peak: float | None  # None: unknown, so no MFU
    t_log: float = 0.0
    real: int = 0  # tokens since the last log line
    padded: int = 0

    def start(self, step: int) -> None:
        self.t_log, self.real, self.padded = time.time(), 0, 0

    def count(self, real: int, padded: int) -> None:
        self.real, self.padded = self.real + real, self.padded + padded

    def exclude(self, seconds: float) -> None:
        self.t_log += seconds


def _started(t: Trainer, loss: torch.Tensor, stop: StopFlag, resumed: bool, bar: Progress) -> bool:
    """After this process's first step: start the run's files, unless the loss is not finite (an
    error) or a stop was asked for already (then nothing was written, and False)."""
    _checked_loss(loss, t.step, t.ddp)
    if t.ddp.any(stop.signal is not None):
        bar.write(f"stopped before the run started; nothing in {t.out_dir} was changed")
        return False
    start_run(t, resumed)
    return True


def _log_record(t: Trainer, loss: torch.Tensor, lr: float, meter: Meter, bar: Progress) -> dict[str, Any]:
    """A metrics line for this step (reading the loss waits for the device: only at log steps)."""
    now = time.time()
    train_loss = _checked_loss(loss, t.step, t.ddp)
    dt = max(now - meter.t_log, 1e-9)
    tok_s = meter.real / dt
    mfu = meter.flops_per_token * meter.padded / dt / meter.peak if meter.peak else None
    if mfu is not None and not 0 < mfu <= 1:  # above the peak: the peak was mis-measured, not the step
        mfu = None
    shown = {"mfu": f"{mfu:.1%}"} if mfu is not None else {}
    bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", **shown)
    meter.start(t.step)
    record = {"step": t.step, "tokens": t.tokens_seen, "train_loss": train_loss, "lr": lr, "tokens_per_sec": tok_s}
    return {**record, **({"mfu": mfu} if mfu is not None else {}), "elapsed_s": t.elapsed_before + now - t.t_start}


def evaluate_and_save(t: Trainer, loss: torch.Tensor, lr: float, record: dict[str, Any], bar: Progress) -> float:
    """Val loss on the fixed windows, then metrics line, best.pt (if better) and ckpt.pt."""
    train_loss = _checked_loss(loss, t.step, t.ddp)  # before anything is saved
    eval_started = time.time()
    rows = eval_rows(t.cfg, t.sampler.rows.longest) if isinstance(t.sampler, ChatSampler) else t.cfg.train.batch_size
    with bar.evaluating():
        losses = estimate_loss(t.raw_model, t.windows, rows, t.device, t.dtype)
    val = losses["val"]
    if not math.isfinite(val):  # weights went bad in this step: keep the last checkpoint
        raise QuillError(
            f"validation loss became {val} at step {t.step}; training stopped and the last "
            "good checkpoint is kept — lower train.learning_rate or check the data"
        )
    record.setdefault("lr", lr)
    record.setdefault("elapsed_s", t.elapsed_before + eval_started - t.t_start)
    record.update({"step": t.step, "tokens": t.tokens_seen, "eval_train_loss": losses["train"], "val_loss": val})
    record.setdefault("train_loss", train_loss)
    improved = val < t.best_val
    t.best_val = min(t.best_val, val)
    rngs = rank_rng_states(t.ddp, t.device)  # every rank's stream, gathered on rank 0
    weights = full_weights(t.raw_model)  # FSDP: gathered on rank 0, every rank taking part
    if t.ddp.master:
        # The line goes in before the checkpoint: a checkpoint at step k always has its line
        # (a kill in between redoes step k, and resume drops the extra line).
        t.log.append(record)
        if improved:
            ckpt.save_checkpoint(weights_state(t, weights, val_loss=val), t.out_dir / ckpt.BEST)
    save_latest(t, rngs, weights)
    if t.ddp.master:
        bar.write(f"step {t.step}: train {losses['train']:.4f}, val {val:.4f}")
    t.ddp.barrier()
    return val


def _save_on_stop(t: Trainer, loss: torch.Tensor, bar: Progress) -> None:
    _checked_loss(loss, t.step, t.ddp)
    save_latest(t, rank_rng_states(t.ddp, t.device), full_weights(t.raw_model))
    if t.ddp.master:
        how = "resume with --resume; a fine-tune with train.resume=true"
        bar.write(f"stopped at step {t.step}; checkpoint saved to {t.out_dir / ckpt.LATEST} ({how})")


def save_latest(t: Trainer, rngs: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """ckpt.pt, written by rank 0. FSDP: first every rank writes its shard of the weights and
    AdamW state (fsdp_checkpoint.py: what resume reads), then ckpt.pt gets the gathered weights only, so
    sample/eval/export-hf read an FSDP run like any other."""
    if is_sharded(t.raw_model):
        sharded.save_sharded(t.out_dir, t.step, t.raw_model, t.optimizer, run_state(t, rngs) if t.ddp.master else None, t.ddp)
        if t.ddp.master:
            ckpt.save_checkpoint(weights_state(t, weights, best_val_loss=t.best_val), t.out_dir / ckpt.LATEST)
    elif t.ddp.master:
        ckpt.save_checkpoint(checkpoint_state(t, rngs), t.out_dir / ckpt.LATEST)


def checkpoint_state(t: Trainer, rngs: dict[str, Any]) -> dict[str, Any]:
    """ckpt.pt: everything needed to continue exactly (`rngs` from rank_rng_states)."""
    return {"model": trained(t, t.raw_model.state_dict()), "optimizer": t.optimizer.state_dict(), **run_state(t, rngs)}


def trained(t: Trainer, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights a checkpoint keeps: all of them, or a LoRA run's adapters (the base is its own file)."""
    return adapter_state(weights) if t.lora_base is not None else weights


def lora_state(t: Trainer) -> dict[str, Any]:
    """A LoRA checkpoint's pointer to its base: {"lora_base": {"path", "checksum"}}, else nothing."""
    return {"lora_base": t.lora_base} if t.lora_base is not None else {}


def run_state(t: Trainer, rngs: dict[str, Any]) -> dict[str, Any]:
    """What resume needs besides weights and optimizer: scaler, sampler, every rank's RNG, counters."""
    return {
        "scaler": t.scaler.state_dict(),
        "sampler": t.sampler.state_dict(),
        **rngs,
        "step": t.step,
        "tokens_seen": t.tokens_seen,
        "best_val_loss": t.best_val,
        "elapsed_s": t.elapsed(),
        "horizon": t.horizon if t.fitted else None,  # a time budget's fitted end of the schedule
        "budget_ended": t.budget_ended,
        "config": t.cfg.to_dict(),
        "tokenizer": t.tokenizer.spec(),
        **lora_state(t),
    }


def weights_state(t: Trainer, weights: dict[str, torch.Tensor], **extra: float) -> dict[str, Any]:
    """best.pt (and an FSDP run's ckpt.pt): the user's model — weights (full_weights), config,
    tokenizer, step and `extra` (val_loss), nothing to resume."""
    return {
        "model": trained(t, weights),
        "config": t.cfg.to_dict(),
        "tokenizer": t.tokenizer.spec(),
        "step": t.step,
        **lora_state(t),
        **extra,
    }


def train_step(model: torch.nn.Module, t: Trainer) -> torch.Tensor:
    """One optimizer step over `grad_accum` micro-batches; returns the mean loss (detached).

    Chat data's rows hold different numbers of the assistant's tokens, so its loss is the mean
    over all of the step's (every rank counts the global batch it drew alike): the same step
    whatever the micro-batches and ranks, as for text, where each micro-batch's mean counts 1/grad_accum."""
    tc, ddp = t.cfg.train, t.ddp
    total = torch.zeros((), device=t.device)
    real_before = getattr(t.sampler, "real", None)  # chat: the conversations' tokens, padding left out
    batches = [t.sampler.next() for _ in range(tc.grad_accum)]  # the same draws as one at a time
    padded = sum(x.numel() for x, *_ in batches)
    t.step_tokens = (padded if real_before is None else t.sampler.real - real_before, padded)
    scored = sum((y != -1).sum() for _, y, *_ in batches) if t.cfg.data.format == "chat" else None
    share = scored is not None and shares_prefix(t)
    for micro, (x, y, *prefix) in enumerate(batches):  # a prefix-LM's batches add each row's prefix length
        if ddp.enabled:  # this rank's slice of the global batch
            x = x[ddp.rank * tc.batch_size : (ddp.rank + 1) * tc.batch_size]
            y = y[ddp.rank * tc.batch_size : (ddp.rank + 1) * tc.batch_size]
            prefix = [p[ddp.rank * tc.batch_size : (ddp.rank + 1) * tc.batch_size] for p in prefix]
        last = micro == tc.grad_accum - 1
        with grad_sync(model, t.raw_model, sync=last):
            try:
                with autocast(t.device, t.dtype):
                    # chat: the head runs only where the assistant's tokens are scored, and the rows'
                    # common first tokens (a system prompt) once (the same loss and gradients)
                    _, loss = (
                        model(x, y, prefix_len=prefix[0]) if prefix else model(x, y, scored_only=scored is not None, share_prefix=share)
                    )
                # DDP averages the ranks' gradients: × world_size makes chat's share a sum over ranks
                loss = loss / tc.grad_accum if scored is None else loss * ((y != -1).sum() * ddp.world_size / scored)
                t.scaler.scale(loss).backward()
            except torch.OutOfMemoryError:
                raise QuillError(
                    f"out of memory at {x.shape[0]} rows × {x.shape[1]} tokens: lower train.batch_size or "
                    "train.batch_tokens (raise train.grad_accum to keep the batch), set train.activation_checkpointing=true, "
                    "or lower model.block_size"
                ) from None
        total += loss.detach()
    if tc.grad_clip > 0:
        t.scaler.unscale_(t.optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    t.scaler.step(t.optimizer)
    t.scaler.update()
    t.optimizer.zero_grad(set_to_none=True)
    return total


def shares_prefix(t: Trainer) -> bool:
    """Whether chat steps run the rows' common prefix once (GPT.forward's share_prefix): not when
    compiled (each prefix length would be a new graph) nor under FSDP (a second pass through its
    sharded blocks); activation checkpointing and DDP take it as they take any forward."""
    return not t.cfg.train.compile and not is_sharded(t.raw_model)


def _checked_loss(loss: torch.Tensor, step: int, ddp: Dist) -> float:
    """The step's loss (mean over ranks) as a float, refusing NaN/inf. Reading it makes the host
    wait for the device, so the loop does it only where it logs or saves, not every step; a
    non-finite loss reaches the weights and stays, so it is still caught before any save."""
    value = ddp.mean(loss).item()
    if not math.isfinite(value):
        raise QuillError(
            f"loss became {value} at step {step} (checked every train.log_interval steps); training "
            "stopped and the last good checkpoint is kept — lower train.learning_rate or check the data"
        )
    return value


def _first_compiled_step(t: Trainer) -> torch.Tensor:
    """torch.compile fails lazily, on the first call: then warn once and redo the step eagerly."""
    before = t.sampler.state_dict()
    try:
        return train_step(t.model, t)
    except (QuillError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 — any compiler/backend failure falls back to eager
        reason = f"{type(e).__name__}: {str(e)[:200]}"
        if t.ddp.enabled:  # DDP's hooks are on the parameters already: a second wrapper would double them
            raise QuillError(f"torch.compile failed under DDP ({reason}); set train.compile=false") from None
        warnings.warn(f"torch.compile failed ({reason}); training without it", stacklevel=2)
        t.optimizer.zero_grad(set_to_none=True)
        t.sampler.load_state_dict(before)
        t.model = t.raw_model
        return train_step(t.model, t)
