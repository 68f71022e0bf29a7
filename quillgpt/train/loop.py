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

import numpy as np
import torch
from tqdm import tqdm

from quillgpt import checkpoint as ckpt
from quillgpt.config import Config, ModelConfig, TrainConfig, parse_duration, save_config
from quillgpt.data.prepare import BatchSampler, PreparedData, fixed_windows, load_prepared, load_tokens, prepare
from quillgpt.train import fsdp_checkpoint as sharded
from quillgpt.train.distributed import (
    Dist, full_weights, grad_sync, is_sharded, prepare_model, rank_rng_states, resolve_strategy, restore_rank_rng,
    seed_rank, setup_distributed, teardown_distributed, wrap_model,
)
from quillgpt.errors import QuillError
from quillgpt.evaluate.scores import evaluate_windows
from quillgpt.files import probe_writable
from quillgpt.train.metrics import METRICS, MetricsWriter, check_tensorboard, truncate_metrics
from quillgpt.model.gpt import GPT
from quillgpt.model.variants import variant_of
from quillgpt.train.optim import MuonAdamW, build_optimizer
from quillgpt.train.prefix_batches import PrefixLengths, PrefixSampler, separator_id
from quillgpt.device import peak_flops, resolve_dtype
from quillgpt.train.memory import check_train_memory
from quillgpt.data.tokenizer import Tokenizer, save_tokenizer

FIT_AFTER_STEPS = 10  # train.time_budget: the horizon is fitted once, at this step or warmup's end


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    best_val_loss: float
    last_val_loss: float | None
    elapsed_s: float
    stopped: str  # "done" | "time_budget" | "interrupted"


# --- schedule, optimizer, devices -------------------------------------------------------------


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of a run of `total` steps."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    if cfg.lr_schedule == "wsd":  # warmup, stable, then linear decay over the last decay_frac
        decay_start = total - int(cfg.decay_frac * total)
        if step < decay_start:
            return cfg.learning_rate
        frac = (step - decay_start) / max(1, total - decay_start)
    else:  # cosine from the end of warmup to the end of the run
        frac = (step - cfg.warmup_iters) / max(1, total - cfg.warmup_iters)
        frac = 0.5 * (1.0 - math.cos(math.pi * min(frac, 1.0)))
    return cfg.learning_rate - min(frac, 1.0) * (cfg.learning_rate - cfg.min_lr)


def fit_horizon(step: int, cfg: TrainConfig, pace_s: float, budget_left_s: float, world_size: int = 1) -> int:
    """The last step that fits in the time budget at `pace_s` seconds per step, so the lr
    schedule decays in time. Evaluations are counted as forward passes (a third of a training
    micro-step each); the budget still stops the run if the pace changes later."""
    per_step = pace_s * (1 + eval_step_times(cfg, world_size) / cfg.eval_interval)
    return min(cfg.max_iters, max(step + 1, step + int(budget_left_s / per_step)))


def eval_step_times(cfg: TrainConfig, world_size: int = 1) -> float:
    """One evaluation (2 splits × eval_iters forward batches, a third of a micro-step each) in step-times."""
    return 2 * cfg.eval_iters * world_size / (3 * cfg.grad_accum)


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

    def __enter__(self) -> "StopFlag":
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


def estimate_loss(
    model: GPT,
    windows: dict[str, tuple[np.ndarray, np.ndarray]],
    batch_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, float]:
    """Mean loss per split over the same windows every time, so curves are comparable across steps.

    On CPU this runs in fp32 even when training in bf16: the few eval batches cost little, and the
    logged val loss is then exactly what `quill eval` reports for the saved weights.
    """
    with autocast(device, torch.float32 if device.type == "cpu" else dtype):
        return {
            split: evaluate_windows(model, tokens, starts, batch_size=batch_size, device=device).loss
            for split, (tokens, starts) in windows.items()
        }


# --- the trainer ------------------------------------------------------------------------------


@dataclass
class Trainer:
    """Everything the loop touches: built by `setup`, brought back by `restore`, moved on by steps."""

    cfg: Config
    ddp: Dist
    device: torch.device
    dtype: torch.dtype
    out_dir: Path
    tokenizer: Tokenizer
    raw_model: GPT  # what checkpoints save and evaluation runs
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: BatchSampler
    windows: dict[str, tuple[np.ndarray, np.ndarray]]
    budget_s: float | None
    model: torch.nn.Module | None = None  # what the step calls: raw_model, compiled and/or wrapped
    step: int = 0
    tokens_seen: int = 0
    best_val: float = math.inf
    elapsed_before: float = 0.0  # seconds trained before this process (by the runs it resumes)
    horizon: int = 0  # the step the lr schedule ends at: max_iters, or fitted to train.time_budget
    fitted: bool = False  # the horizon was fitted to the budget (once; checkpointed)
    budget_ended: bool = False  # the time budget ended the run
    reserve_s: float = 0.0  # time budget: kept for the final evaluation + checkpoint (the last one's time)
    pace_mark: tuple[float, int] | None = None  # time budget: (time, step) after this process's first step
    t_start: float = 0.0
    first_step: int = 0  # the step this process started from
    log: MetricsWriter | None = None  # rank 0 only

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t_start


def train(cfg: Config, progress: bool = True) -> TrainResult:
    """Train a GPT as `cfg` says; returns where the run stopped and its losses."""
    ddp, device = setup_distributed(cfg.train.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    try:
        with contextlib.ExitStack() as stack:
            prepared, resuming = open_run(cfg, ddp, stack, progress)
            t, state = setup(cfg, ddp, device, prepared, resuming)
            if state is not None:
                restore(t, state)
            stack.callback(lambda: t.log.close() if t.log is not None else None)
            t.model = wrap_model(torch.compile(t.raw_model) if cfg.train.compile else t.raw_model, ddp, device)
            return loop(t, progress, resumed=state is not None)
    finally:
        teardown_distributed(ddp)


def open_run(cfg: Config, ddp: Dist, stack: contextlib.ExitStack, progress: bool) -> tuple[PreparedData, bool]:
    """Lock the run directory, decide whether this is a resume, prepare the data; returns the
    prepared data and whether to resume. Rank 0 does the checks before any rank does work, and a
    refusal there stops every rank (instead of leaving them waiting for rank 0 forever)."""
    out_dir, failure, resuming = Path(cfg.train.out_dir), None, False
    if ddp.master:
        try:
            probe_writable(out_dir, "train.out_dir")
            stack.enter_context(ckpt.RunLock(out_dir))
            ckpt.remove_stale_temps(out_dir)
            sharded.remove_stale(out_dir)
            resuming = _resuming(cfg.train, out_dir)
            if cfg.train.tensorboard:
                check_tensorboard()
            prepared = prepare(cfg.data, progress=progress)
        except QuillError as e:
            failure = e
    if ddp.any(failure is not None):
        raise failure or QuillError("rank 0 could not start the run (its message says why)")
    if not ddp.master:
        prepared = prepare(cfg.data, progress=False)
    return prepared, bool(ddp.broadcast_int(int(resuming)))


def _resuming(tc: TrainConfig, out_dir: Path) -> bool:
    """Resume, start afresh, or refuse: a run already in out_dir is continued only with
    train.resume and replaced only with train.overwrite, never by a forgotten flag."""
    latest, best = out_dir / ckpt.LATEST, out_dir / ckpt.BEST
    saved = latest.is_file() or (out_dir / sharded.SHARDED / sharded.POINTER).is_file()  # or an FSDP run's shards
    if tc.resume is True and tc.overwrite:
        raise QuillError("--resume continues the run in train.out_dir and --overwrite replaces it; pass one of them")
    if tc.resume is True and not saved:
        hint = (f"its {ckpt.BEST} can seed a new run with train.init_from={best} and another train.out_dir, "
                "or --overwrite starts over here" if best.is_file() else "drop --resume to start a new run")
        raise QuillError(f"cannot resume: no checkpoint at {latest}; {hint}")
    resuming = bool(tc.resume) and not tc.overwrite and saved
    if not resuming and not tc.overwrite and (saved or best.is_file()):
        raise QuillError(
            f"{out_dir} already holds a run ({describe_run(out_dir)}); continue it with --resume "
            "(train.resume=true), or replace it with --overwrite (train.overwrite=true)"
        )
    return resuming


def describe_run(out_dir: Path) -> str:
    """'step 800, best val loss 1.5412' from the run's checkpoint, for messages about the run."""
    for name in (ckpt.LATEST, ckpt.BEST):
        if (out_dir / name).is_file():
            try:
                state = ckpt.load_checkpoint(out_dir / name)
            except QuillError:
                continue
            best = state.get("best_val_loss", state.get("val_loss"))
            shown = f"{best:.4f}" if isinstance(best, float) and math.isfinite(best) else "n/a"
            return f"step {state.get('step', '?')}, best val loss {shown}"
    return "its checkpoints are unreadable"


def setup(
    cfg: Config, ddp: Dist, device: torch.device, prepared: PreparedData, resuming: bool
) -> tuple[Trainer, dict[str, Any] | None]:
    """Build everything a run needs (and check a resume fits it) without writing anything."""
    tc = cfg.train
    _, tokenizer = load_prepared(prepared.out_dir)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tokenizer.vocab_size
    elif cfg.model.vocab_size < tokenizer.vocab_size:
        raise QuillError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}; "
            "remove model.vocab_size to use the tokenizer's"
        )
    init_state = None
    if tc.init_from:
        cfg, init_state = _init_from(cfg, tokenizer.spec())
    strategy = resolve_strategy(tc, cfg.model, ddp, device)
    state = _load_resume_state(Path(tc.out_dir), cfg, tokenizer.spec(), strategy) if resuming else None
    if strategy != "fsdp":  # FSDP holds a 1/world_size share of the state per device
        check_train_memory(cfg.model, tc, device)  # before anything big is allocated
    train_tokens, val_tokens = load_tokens(prepared.out_dir, "train"), load_tokens(prepared.out_dir, "val")

    # Each rank its own stream; DDP copies rank 0's initial weights to all. FSDP shards what every
    # rank built alike (from train.seed, on the CPU: only the shards go to the device), then the
    # ranks' own streams start.
    seed_rank(tc.seed, Dist() if strategy == "fsdp" else ddp)
    model = GPT(cfg.model).to("cpu" if strategy == "fsdp" else device)
    if init_state is not None:
        model.load_state_dict(init_state)
    if strategy == "fsdp":
        seed_rank(tc.seed, ddp)
    dtype = resolve_dtype(tc.dtype, device)
    model = prepare_model(model, tc, strategy, ddp, dtype)  # activation checkpointing, FSDP
    # Every rank draws the same global batch and keeps its own slice, so N ranks with
    # batch B see exactly the windows one process with batch N·B would see.
    sampler = BatchSampler(train_tokens, cfg.model.block_size, tc.batch_size * ddp.world_size, tc.seed, device)
    if variant_of(cfg.model).bidirectional_prefix:  # batches also carry each row's prefix length
        lengths = PrefixLengths(cfg.model, tc.seed + 1, separator_id(cfg.model, tokenizer.encode))
        sampler = PrefixSampler(sampler, lengths)
    n_eval = tc.eval_iters * tc.batch_size * ddp.world_size  # windows depend on the global batch only
    windows = {
        "train": (train_tokens, fixed_windows(train_tokens, cfg.model.block_size, n_eval, "train")),
        "val": (val_tokens, fixed_windows(val_tokens, cfg.model.block_size, n_eval)),
    }
    t = Trainer(
        cfg, ddp, device, dtype, Path(tc.out_dir), tokenizer, model, build_optimizer(model, tc, device),
        torch.amp.GradScaler(device.type, enabled=(dtype == torch.float16)), sampler, windows,
        budget_s=parse_duration(tc.time_budget) if tc.time_budget else None, horizon=tc.max_iters,
    )
    return t, state


def _init_from(cfg: Config, tokenizer_spec: dict) -> tuple[Config, dict[str, torch.Tensor]]:
    """Fine-tuning: take the source run's architecture and weights (dropout/block_size may shrink)."""
    source = ckpt.load_run(cfg.train.init_from, which="best")
    if source.tokenizer.spec() != tokenizer_spec:
        raise QuillError(
            f"train.init_from={cfg.train.init_from} uses tokenizer {source.tokenizer.name!r} but the data "
            f"was prepared with {cfg.data.tokenizer!r}; set data.tokenizer to match (e.g. data.tokenizer=gpt2)"
        )
    model_cfg = source.config.model
    if cfg.model.block_size > model_cfg.block_size:
        raise QuillError(
            f"model.block_size={cfg.model.block_size} exceeds the source model's {model_cfg.block_size}"
        )
    state = source.model.state_dict()
    if model_cfg.pos == "learned":
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][: cfg.model.block_size]
    model_cfg.block_size, model_cfg.dropout = cfg.model.block_size, cfg.model.dropout
    cfg.model = model_cfg
    return cfg, state


def _load_resume_state(out_dir: Path, cfg: Config, tokenizer_spec: dict, strategy: str) -> dict[str, Any]:
    """ckpt.pt, or an FSDP run's sharded checkpoint (then state["shards"] is its directory),
    checked against the config; a damaged one says what `train` can do instead."""
    latest, shards = out_dir / ckpt.LATEST, sharded.latest_sharded(out_dir)
    if (shards is not None) != (strategy == "fsdp"):
        raise QuillError(_strategy_mismatch(out_dir, shards is not None))
    try:
        if shards is not None:
            latest = shards / sharded.TRAIN_STATE
            state = {**sharded.load_train_state(shards), "shards": shards}
        else:
            state = ckpt.load_checkpoint(latest)
        if "optimizer" in state:  # weights only (import-hf): _check_compatible says what to do
            ckpt.check_state(state, str(latest), ckpt.RESUME_KEYS)
    except QuillError as e:
        what = str(e).split("; ")[0]  # what is wrong, without advice meant for sample/eval (--which)
        best = out_dir / ckpt.BEST
        keep = f", or keep {ckpt.BEST}'s weights with train.init_from={best} and a new train.out_dir" if best.is_file() else ""
        raise QuillError(f"cannot resume: {what}; start over with --overwrite{keep}") from None
    _check_compatible(state, cfg, tokenizer_spec, latest)
    return state


def _strategy_mismatch(out_dir: Path, has_shards: bool) -> str:
    if has_shards:
        return (f"{out_dir} holds the sharded checkpoint of an FSDP run; resume it under torchrun with "
                "train.strategy=fsdp (any number of processes)")
    return (f"{out_dir / ckpt.LATEST} was written by a DDP or one-process run, not sharded; resume it with "
            "train.strategy=ddp")


def restore(t: Trainer, state: dict[str, Any]) -> None:
    """Bring a checkpoint back: weights, optimizer, scaler, sampler, this rank's random stream,
    counters, and a time budget's fitted horizon (so the schedule continues, not restarts)."""
    if "shards" in state:  # FSDP: every rank reads its own part
        sharded.load_sharded(state["shards"], t.raw_model, t.optimizer)
    else:
        t.raw_model.load_state_dict(ckpt.clean_state_dict(state["model"]))
        t.optimizer.load_state_dict(state["optimizer"])
    t.scaler.load_state_dict(state["scaler"])
    t.sampler.load_state_dict(state["sampler"])
    restore_rank_rng(state, t.cfg.train.seed, t.ddp, t.device)
    t.step, t.tokens_seen = state["step"], state["tokens_seen"]
    t.best_val, t.elapsed_before = state["best_val_loss"], state["elapsed_s"]
    if t.budget_s is not None and state.get("horizon") is not None:
        t.horizon, t.fitted = min(state["horizon"], t.cfg.train.max_iters), True
        t.budget_ended = bool(state.get("budget_ended", False))


def start_run(t: Trainer, resumed: bool) -> None:
    """The point of no return, reached after the first step gave a finite loss: only now are the
    run's files written, so a run that fails or is stopped before it really starts changes
    nothing. A fresh run clears what an earlier one left; --overwrite says so."""
    if t.ddp.master:
        metrics = t.out_dir / METRICS
        if resumed:
            skipped = truncate_metrics(metrics, t.first_step)  # the checkpoint's step
            if skipped:
                tqdm.write(f"note: dropped {skipped} unreadable line(s) of {metrics}")
        else:
            replaced = describe_run(t.out_dir) if (t.out_dir / ckpt.LATEST).is_file() or (t.out_dir / ckpt.BEST).is_file() else None
            for path in [t.out_dir / ckpt.LATEST, t.out_dir / ckpt.BEST, metrics, *t.out_dir.glob("events.out.tfevents.*")]:
                path.unlink(missing_ok=True)
            sharded.remove_sharded(t.out_dir)
            if replaced is not None:
                tqdm.write(f"--overwrite: replaced the run in {t.out_dir} ({replaced}) with a new one")
        t.cfg.train.overwrite = False  # a one-off permission: the run's config.yaml must not carry it on
        save_config(t.cfg, t.out_dir / "config.yaml")
        save_tokenizer(t.tokenizer, t.out_dir / "tokenizer.json")
        t.log = MetricsWriter(t.out_dir, t.cfg.train.tensorboard, purge_step=t.first_step + 1 if resumed else None)


def loop(t: Trainer, progress: bool, resumed: bool) -> TrainResult:
    """Steps until the horizon, a stop signal or the time budget; evaluates and checkpoints."""
    tc, ddp = t.cfg.train, t.ddp
    tokens_per_step = tc.batch_size * tc.grad_accum * ddp.world_size * t.cfg.model.block_size
    meter = Meter(t.raw_model.flops_per_token() * tokens_per_step / ddp.world_size, peak_flops(t.device, t.dtype))
    last_val, stopped = None, None
    t.t_start, t.first_step = time.time(), t.step
    meter.start(t.step)
    bar = tqdm(total=t.horizon, initial=t.step, disable=not (progress and ddp.master), unit="step", dynamic_ncols=True)
    with StopFlag() as stop:
        t.model.train()
        verified = not tc.compile  # a compiled model proves itself on its first step
        while t.step < t.horizon:
            lr = lr_at(t.step, tc, t.horizon)
            for group in t.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
            loss = train_step(t.model, t) if verified else _first_compiled_step(t)
            verified = True
            t.step += 1
            t.tokens_seen += tokens_per_step
            bar.update(1)
            if t.step == t.first_step + 1 and not _started(t, loss, stop, resumed, bar):
                t.step, stopped = t.first_step, "interrupted"  # the step is not kept: nothing was saved
                break
            _follow_budget(t, bar)
            record = _log_record(t, loss, lr, meter, bar, tokens_per_step) if t.step % tc.log_interval == 0 or t.step == t.horizon else {}
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
    return TrainResult(t.out_dir, t.step, t.best_val, last_val, t.elapsed(), stopped)


@dataclass
class Meter:
    """tokens/s and MFU between log lines, with evaluation time left out."""

    flops_per_step: float
    peak: float
    t_log: float = 0.0
    step_at_log: int = 0

    def start(self, step: int) -> None:
        self.t_log, self.step_at_log = time.time(), step

    def exclude(self, seconds: float) -> None:
        self.t_log += seconds


def _started(t: Trainer, loss: torch.Tensor, stop: StopFlag, resumed: bool, bar: tqdm) -> bool:
    """After this process's first step: start the run's files, unless the loss is not finite (an
    error) or a stop was asked for already (then nothing was written, and False)."""
    _checked_loss(loss, t.step, t.ddp)
    if t.ddp.any(stop.signal is not None):
        bar.write(f"stopped before the run started; nothing in {t.out_dir} was changed")
        return False
    start_run(t, resumed)
    return True


def _follow_budget(t: Trainer, bar: tqdm) -> None:
    """train.time_budget: fit the horizon once, at a fixed step (FIT_AFTER_STEPS or warmup's end,
    whichever is later), so the steps before it follow max_iters' schedule identically in a
    straight and a resumed run; stop once the time left only holds one more step and the final
    evaluation and checkpoint (reserve_s: the last one's time; estimated from the pace before the
    first), so they too end inside the budget."""
    if t.budget_s is None or t.budget_ended:
        return
    # seconds per step, after the first one: its one-time costs (lazy kernels, allocations) took
    # ~15 s of a 3-minute run on a busy machine and made the fitted horizon ~25% short
    t.pace_mark = t.pace_mark or (time.time(), t.step)
    since, step = t.pace_mark
    pace = (time.time() - since) / (t.step - step) if t.step > step else time.time() - t.t_start
    reserve = t.reserve_s or pace * eval_step_times(t.cfg.train, t.ddp.world_size)
    if t.ddp.any(t.elapsed() + pace + reserve >= t.budget_s):
        t.horizon, t.budget_ended = t.step, True  # finish as if this were the last step
    elif not t.fitted and t.step >= max(FIT_AFTER_STEPS, t.cfg.train.warmup_iters):
        horizon = fit_horizon(t.step, t.cfg.train, pace, t.budget_s - t.elapsed() - reserve, t.ddp.world_size)
        t.horizon, t.fitted = t.ddp.broadcast_int(horizon), True
        bar.total = t.horizon
    if t.step >= t.horizon and t.horizon < t.cfg.train.max_iters:
        t.budget_ended = True  # the fitted end: the budget, not max_iters, ended the run


def _log_record(t: Trainer, loss: torch.Tensor, lr: float, meter: Meter, bar: tqdm, tokens_per_step: int) -> dict[str, Any]:
    """A metrics line for this step (reading the loss waits for the device: only at log steps)."""
    now = time.time()
    train_loss = _checked_loss(loss, t.step, t.ddp)
    dt, steps = max(now - meter.t_log, 1e-9), t.step - meter.step_at_log
    tok_s, mfu = tokens_per_step * steps / dt, meter.flops_per_step * steps / dt / meter.peak
    bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", mfu=f"{mfu:.1%}")
    meter.start(t.step)
    return {"step": t.step, "tokens": t.tokens_seen, "train_loss": train_loss, "lr": lr, "tokens_per_sec": tok_s,
            "mfu": mfu, "elapsed_s": t.elapsed_before + now - t.t_start}


def evaluate_and_save(t: Trainer, loss: torch.Tensor, lr: float, record: dict[str, Any], bar: tqdm) -> float:
    """Val loss on the fixed windows, then metrics line, best.pt (if better) and ckpt.pt."""
    train_loss = _checked_loss(loss, t.step, t.ddp)  # before anything is saved
    eval_started = time.time()
    losses = estimate_loss(t.raw_model, t.windows, t.cfg.train.batch_size, t.device, t.dtype)
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


def _save_on_stop(t: Trainer, loss: torch.Tensor, bar: tqdm) -> None:
    _checked_loss(loss, t.step, t.ddp)
    save_latest(t, rank_rng_states(t.ddp, t.device), full_weights(t.raw_model))
    if t.ddp.master:
        bar.write(f"stopped at step {t.step}; checkpoint saved to {t.out_dir / ckpt.LATEST} (resume with --resume)")


def save_latest(t: Trainer, rngs: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """ckpt.pt, written by rank 0. FSDP: first every rank writes its shard of the weights and
    AdamW state (sharded.py: what resume reads), then ckpt.pt gets the gathered weights only, so
    sample/eval/export-hf read an FSDP run like any other."""
    if is_sharded(t.raw_model):
        sharded.save_sharded(t.out_dir, t.step, t.raw_model, t.optimizer, run_state(t, rngs) if t.ddp.master else None, t.ddp)
        if t.ddp.master:
            ckpt.save_checkpoint(weights_state(t, weights, best_val_loss=t.best_val), t.out_dir / ckpt.LATEST)
    elif t.ddp.master:
        ckpt.save_checkpoint(checkpoint_state(t, rngs), t.out_dir / ckpt.LATEST)


def checkpoint_state(t: Trainer, rngs: dict[str, Any]) -> dict[str, Any]:
    """ckpt.pt: everything needed to continue exactly (`rngs` from rank_rng_states)."""
    return {"model": t.raw_model.state_dict(), "optimizer": t.optimizer.state_dict(), **run_state(t, rngs)}


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
    }


def weights_state(t: Trainer, weights: dict[str, torch.Tensor], **extra: float) -> dict[str, Any]:
    """best.pt (and an FSDP run's ckpt.pt): the user's model — weights (full_weights), config,
    tokenizer, step and `extra` (val_loss), nothing to resume."""
    return {"model": weights, "config": t.cfg.to_dict(), "tokenizer": t.tokenizer.spec(), "step": t.step, **extra}


def train_step(model: torch.nn.Module, t: Trainer) -> torch.Tensor:
    """One optimizer step over `grad_accum` micro-batches; returns the mean loss (detached)."""
    tc, ddp = t.cfg.train, t.ddp
    total = torch.zeros((), device=t.device)
    for micro in range(tc.grad_accum):
        x, y, *prefix = t.sampler.next()  # a prefix-LM's batches add each row's prefix length
        if ddp.enabled:  # this rank's slice of the global batch
            x = x[ddp.rank * tc.batch_size : (ddp.rank + 1) * tc.batch_size]
            y = y[ddp.rank * tc.batch_size : (ddp.rank + 1) * tc.batch_size]
            prefix = [p[ddp.rank * tc.batch_size : (ddp.rank + 1) * tc.batch_size] for p in prefix]
        last = micro == tc.grad_accum - 1
        with grad_sync(model, t.raw_model, sync=last):
            try:
                with autocast(t.device, t.dtype):
                    _, loss = model(x, y, prefix_len=prefix[0]) if prefix else model(x, y)
                loss = loss / tc.grad_accum
                t.scaler.scale(loss).backward()
            except torch.OutOfMemoryError:
                raise QuillError(
                    f"out of memory at train.batch_size={tc.batch_size}, model.block_size={x.shape[1]}: "
                    "lower train.batch_size (raise train.grad_accum to keep the batch) or the model size"
                ) from None
        total += loss.detach()
    if tc.grad_clip > 0:
        t.scaler.unscale_(t.optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    t.scaler.step(t.optimizer)
    t.scaler.update()
    t.optimizer.zero_grad(set_to_none=True)
    return total


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


def _describe_tokenizer(spec: dict) -> str:
    """A spec in a few words: two char vocabularies differ in their characters, not their name."""
    if spec.get("type") == "char":
        return f"char ({len(spec.get('chars', ''))} characters)"
    if spec.get("type") == "bpe":
        return f"bpe ({len(spec.get('ranks', [])) + len(spec.get('special_tokens', {}))} ids)"
    return str(spec.get("name", spec.get("type")))


def _check_compatible(state: dict[str, Any], cfg: Config, tokenizer_spec: dict, path: Path) -> None:
    """Refuse to resume a run whose model shape or tokenizer differ from the config's."""
    if "optimizer" not in state and "shards" not in state:
        raise QuillError(
            f"cannot resume {path}: it holds weights only (e.g. from quill import-hf); "
            f"fine-tune it with train.init_from={path.parent} and a new train.out_dir"
        )
    old = ModelConfig(**state["config"]["model"])
    diffs = ckpt.config_differences(old, cfg.model)
    old_optimizer = state["config"].get("train", {}).get("optimizer", "adamw")
    if old_optimizer != cfg.train.optimizer:  # their states do not load into each other
        diffs.append(f"train.optimizer: {old_optimizer} → {cfg.train.optimizer}")
    if state["tokenizer"] != tokenizer_spec:
        diffs.append(f"data.tokenizer: {_describe_tokenizer(state['tokenizer'])} → {_describe_tokenizer(tokenizer_spec)}")
    if diffs:
        raise QuillError(
            f"cannot resume {path}: the config differs in {'; '.join(diffs)} — "
            "use the run's own config.yaml or a new train.out_dir"
        )
