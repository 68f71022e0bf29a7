"""The training loop: AdamW + warmup/cosine, accumulation, AMP, DDP, exact resume.

`train(cfg)` is what `quill train` calls. The loop reads top to bottom like nanoGPT's; what
makes it trustworthy lives in the helpers: every source of randomness is checkpointed (resume
is bit-identical on CPU), checkpoints are atomic, one process owns a run directory, and faults
(Ctrl-C, SIGTERM, a non-finite loss, OOM, a full disk) end with a clear message and the last
good checkpoint intact.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from quillgpt import checkpoint as ckpt
from quillgpt.config import Config, ModelConfig, TrainConfig, parse_duration, save_config
from quillgpt.data import BatchSampler, fixed_windows, load_prepared, load_tokens, prepare
from quillgpt.errors import QuillError
from quillgpt.evaluate import evaluate_windows
from quillgpt.model import GPT
from quillgpt.perf import cpu_has_bf16, peak_flops, resolve_device
from quillgpt.tokenizer import save_tokenizer


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


def configure_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms, biases or gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA where supported, else fp16; bf16 on CPUs with bf16 units (AVX512-BF16,
    AMX: matmuls ~4× fp32's rate, same loss per step — see scripts/bench.py); else fp32."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and cpu_has_bf16():
            return torch.bfloat16
        return torch.float32
    if name == "float16" and device.type == "cpu":
        raise QuillError("train.dtype=float16 is not supported on CPU; use bfloat16 or float32")
    return getattr(torch, name)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# --- RNG state: everything random is saved, so resume is exact --------------------------------


def rng_state(device: torch.device) -> dict[str, Any]:
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


# --- distributed ------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")  # NCCL reduces CUDA tensors only

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def master(self) -> bool:
        return self.rank == 0

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any rank (so all ranks stop together)."""
        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over ranks (for logging a loss all ranks agree on)."""
        if not self.enabled:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world_size

    def broadcast_int(self, value: int) -> int:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def setup_distributed(device_name: str) -> tuple[Dist, torch.device]:
    """Under torchrun (WORLD_SIZE > 1): NCCL on GPUs, gloo on CPU; one device per rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), resolve_device(device_name, "train.device")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, "train.device")
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Dist(rank, local_rank, world, device), device


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


def _probe_writable(out_dir: Path) -> None:
    """Fail before any work when out_dir cannot take files (an unnamed temp file: nothing to
    clean up after a kill, no clash with another process probing the same directory)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir) as probe:
            probe.write(b"ok")
            probe.flush()
    except OSError as e:
        raise QuillError(f"train.out_dir {out_dir} is not writable ({e.strerror}); choose another directory") from None


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


def train(cfg: Config, progress: bool = True) -> TrainResult:
    """Train a GPT as `cfg` says; returns where the run stopped and its losses."""
    tc = cfg.train
    ddp, device = setup_distributed(tc.device)
    dtype = resolve_dtype(tc.dtype, device)
    out_dir = Path(tc.out_dir)
    budget_s = parse_duration(tc.time_budget) if tc.time_budget else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    with contextlib.ExitStack() as stack:
        # The run directory is locked before anything else, so a second trainer pointed at it
        # refuses before it touches the data; temp files of a killed writer go. Data is prepared
        # once (by rank 0), then memory-mapped by every rank.
        failure: QuillError | None = None
        if ddp.master:
            try:
                _probe_writable(out_dir)
                stack.enter_context(ckpt.RunLock(out_dir))
                ckpt.remove_stale_temps(out_dir)
                prepared = prepare(cfg.data, progress=progress)
            except QuillError as e:
                failure = e
        if ddp.any(failure is not None):  # every rank stops, instead of waiting for rank 0 forever
            raise failure or QuillError("rank 0 could not start the run (its message says why)")
        if not ddp.master:
            prepared = prepare(cfg.data, progress=False)
        meta, tokenizer = load_prepared(prepared.out_dir)
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
        train_tokens, val_tokens = load_tokens(prepared.out_dir, "train"), load_tokens(prepared.out_dir, "val")

        latest = out_dir / ckpt.LATEST
        resume_state = None
        if tc.resume is True and not latest.is_file():
            raise QuillError(f"cannot resume: no checkpoint at {latest}; drop --resume to start a new run")
        if tc.resume and latest.is_file():
            resume_state = ckpt.load_checkpoint(latest)
            _check_compatible(resume_state, cfg, tokenizer.spec(), latest)

        seed_everything(tc.seed)
        model = GPT(cfg.model).to(device)
        if init_state is not None:
            model.load_state_dict(init_state)
        optimizer = configure_optimizer(model, tc, device)
        scaler = torch.amp.GradScaler(device.type, enabled=(dtype == torch.float16))
        # Every rank draws the same global batch and keeps its own slice, so N ranks with
        # batch B see exactly the windows one process with batch N·B would see.
        sampler = BatchSampler(train_tokens, cfg.model.block_size, tc.batch_size * ddp.world_size, tc.seed, device)
        parts = StepParts(optimizer, scaler, sampler, ddp, tc, device, dtype)
        n_eval = tc.eval_iters * tc.batch_size * ddp.world_size  # windows depend on the global batch only
        windows = {
            "train": (train_tokens, fixed_windows(train_tokens, cfg.model.block_size, n_eval, "train")),
            "val": (val_tokens, fixed_windows(val_tokens, cfg.model.block_size, n_eval)),
        }

        step, tokens_seen, best_val, elapsed_before = 0, 0, float("inf"), 0.0
        if resume_state is not None:
            model.load_state_dict(ckpt.clean_state_dict(resume_state["model"]))
            optimizer.load_state_dict(resume_state["optimizer"])
            scaler.load_state_dict(resume_state["scaler"])
            sampler.load_state_dict(resume_state["sampler"])
            set_rng_state(resume_state["rng"], device)
            step, tokens_seen = resume_state["step"], resume_state["tokens_seen"]
            best_val, elapsed_before = resume_state["best_val_loss"], resume_state["elapsed_s"]
        if ddp.master:
            save_config(cfg, out_dir / "config.yaml")
            save_tokenizer(tokenizer, out_dir / "tokenizer.json")
            metrics_path = out_dir / "metrics.jsonl"
            if resume_state is not None:
                ckpt.truncate_metrics(metrics_path, step)
            elif metrics_path.exists():
                metrics_path.unlink()

        raw_model = model
        if tc.compile:
            model = torch.compile(model)
        if ddp.enabled:
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

        def save(path: Path) -> None:
            state = {
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "sampler": sampler.state_dict(),
                "rng": rng_state(device),
                "step": step,
                "tokens_seen": tokens_seen,
                "best_val_loss": best_val,
                "elapsed_s": elapsed_before + time.time() - t_start,
                "config": cfg.to_dict(),
                "tokenizer": tokenizer.spec(),
            }
            ckpt.save_checkpoint(state, path)

        tokens_per_step = tc.batch_size * tc.grad_accum * ddp.world_size * cfg.model.block_size
        flops_per_step = raw_model.flops_per_token() * tokens_per_step / ddp.world_size
        peak = peak_flops(device, dtype)
        horizon = tc.max_iters
        last_val, stopped = None, "done"
        t_start, first_step = time.time(), step
        t_log, step_at_log = time.time(), step
        bar = tqdm(total=tc.max_iters, initial=step, disable=not (progress and ddp.master), unit="step", dynamic_ncols=True)

        with StopFlag() as stop:
            model.train()
            verified = not tc.compile  # a compiled model proves itself on its first step
            while step < horizon:
                lr = lr_at(step, tc, horizon)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                if verified:
                    loss = _train_step(model, parts)
                else:
                    model, loss = _first_compiled_step(model, raw_model, parts)
                    verified = True
                step += 1
                tokens_seen += tokens_per_step
                bar.update(1)
                if budget_s is not None and ddp.any(elapsed_before + time.time() - t_start >= budget_s):
                    horizon, stopped = step, "time_budget"  # finish as if this were the last step

                record: dict[str, Any] = {}
                if step % tc.log_interval == 0 or step == horizon:
                    now = time.time()
                    train_loss = _checked_loss(loss, step, ddp)
                    dt = max(now - t_log, 1e-9)
                    tok_s = tokens_per_step * (step - step_at_log) / dt
                    mfu = flops_per_step * (step - step_at_log) / dt / peak
                    record = {"step": step, "tokens": tokens_seen, "train_loss": train_loss, "lr": lr, "tokens_per_sec": tok_s,
                              "mfu": mfu, "elapsed_s": elapsed_before + now - t_start}
                    bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", mfu=f"{mfu:.1%}")
                    if budget_s is not None and stopped != "time_budget":
                        pace = (now - t_start) / (step - first_step)  # seconds per step, evals included
                        horizon = _budget_horizon(step, tc.max_iters, pace, budget_s - record["elapsed_s"], ddp)
                        bar.total = horizon
                    t_log, step_at_log = now, step

                if step % tc.eval_interval == 0 or step == horizon:
                    train_loss = _checked_loss(loss, step, ddp)  # before anything is saved
                    t_eval = time.time()
                    losses = estimate_loss(raw_model, windows, tc.batch_size, device, dtype)
                    last_val = losses["val"]
                    if not math.isfinite(last_val):  # weights went bad in this step: keep the last checkpoint
                        raise QuillError(
                            f"validation loss became {last_val} at step {step}; training stopped and the last "
                            "good checkpoint is kept — lower train.learning_rate or check the data"
                        )
                    record.setdefault("lr", lr)
                    record.setdefault("elapsed_s", elapsed_before + t_eval - t_start)
                    record.update({"step": step, "tokens": tokens_seen, "eval_train_loss": losses["train"], "val_loss": last_val})
                    record.setdefault("train_loss", train_loss)
                    if ddp.master:
                        # The line goes in before the checkpoint: a checkpoint at step k always has
                        # its line (a kill in between redoes step k, and resume drops the extra line).
                        ckpt.append_jsonl(out_dir / "metrics.jsonl", record)
                        if last_val < best_val:
                            best_val = last_val
                            save(out_dir / ckpt.BEST)
                        save(out_dir / ckpt.LATEST)
                        bar.write(f"step {step}: train {losses['train']:.4f}, val {last_val:.4f}")
                    record = {}
                    ddp.barrier()
                    t_log += time.time() - t_eval  # keep evaluation out of tokens/s

                if record and ddp.master:
                    ckpt.append_jsonl(out_dir / "metrics.jsonl", record)
                if ddp.any(stop.signal is not None) and step < horizon:
                    stopped = "interrupted"
                    _checked_loss(loss, step, ddp)
                    if ddp.master:
                        save(out_dir / ckpt.LATEST)
                        bar.write(f"stopped at step {step}; checkpoint saved to {out_dir / ckpt.LATEST} (resume with --resume)")
                    break
        bar.close()
        elapsed = elapsed_before + time.time() - t_start
    if ddp.enabled:
        dist.destroy_process_group()
    return TrainResult(out_dir, step, best_val, last_val, elapsed, stopped)


@dataclass
class StepParts:
    """Everything one optimizer step touches besides the model."""

    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: BatchSampler
    ddp: Dist
    tc: TrainConfig
    device: torch.device
    dtype: torch.dtype


def _train_step(model: torch.nn.Module, parts: StepParts) -> torch.Tensor:
    """One optimizer step over `grad_accum` micro-batches; returns the mean loss (detached)."""
    optimizer, scaler, sampler, ddp, tc = parts.optimizer, parts.scaler, parts.sampler, parts.ddp, parts.tc
    total = torch.zeros((), device=parts.device)
    for micro in range(tc.grad_accum):
        x, y = sampler.next()
        if ddp.enabled:  # this rank's slice of the global batch
            x = x[ddp.rank * tc.batch_size : (ddp.rank + 1) * tc.batch_size]
            y = y[ddp.rank * tc.batch_size : (ddp.rank + 1) * tc.batch_size]
        last = micro == tc.grad_accum - 1
        sync = model.no_sync() if ddp.enabled and not last else contextlib.nullcontext()
        with sync:
            try:
                with autocast(parts.device, parts.dtype):
                    _, loss = model(x, y)
                loss = loss / tc.grad_accum
                scaler.scale(loss).backward()
            except torch.OutOfMemoryError:
                raise QuillError(
                    f"out of memory at train.batch_size={tc.batch_size}, model.block_size={x.shape[1]}: "
                    "lower train.batch_size (raise train.grad_accum to keep the batch) or the model size"
                ) from None
        total += loss.detach()
    if tc.grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
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


def _budget_horizon(step: int, max_iters: int, pace_s: float, budget_left_s: float, ddp: Dist) -> int:
    """The last step that fits in the time budget at this pace, so the lr schedule still decays."""
    return ddp.broadcast_int(min(max_iters, max(step + 1, step + int(budget_left_s / pace_s))))


def _first_compiled_step(
    model: torch.nn.Module, raw_model: GPT, parts: StepParts
) -> tuple[torch.nn.Module, torch.Tensor]:
    """torch.compile fails lazily, on the first call: then warn once and redo the step eagerly."""
    before = parts.sampler.state_dict()
    try:
        return model, _train_step(model, parts)
    except (QuillError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 — any compiler/backend failure falls back to eager
        reason = f"{type(e).__name__}: {str(e)[:200]}"
        if parts.ddp.enabled:  # DDP's hooks are on the parameters already: a second wrapper would double them
            raise QuillError(f"torch.compile failed under DDP ({reason}); set train.compile=false") from None
        warnings.warn(f"torch.compile failed ({reason}); training without it", stacklevel=2)
        parts.optimizer.zero_grad(set_to_none=True)
        parts.sampler.load_state_dict(before)
        return raw_model, _train_step(raw_model, parts)


def _describe_tokenizer(spec: dict) -> str:
    """A spec in a few words: two char vocabularies differ in their characters, not their name."""
    if spec.get("type") == "char":
        return f"char ({len(spec.get('chars', ''))} characters)"
    if spec.get("type") == "bpe":
        return f"bpe ({len(spec.get('ranks', [])) + len(spec.get('special_tokens', {}))} ids)"
    return str(spec.get("name", spec.get("type")))


def _check_compatible(state: dict[str, Any], cfg: Config, tokenizer_spec: dict, path: Path) -> None:
    """Refuse to resume a run whose model shape or tokenizer differ from the config's."""
    if "optimizer" not in state:
        raise QuillError(
            f"cannot resume {path}: it holds weights only (e.g. from quill import-hf); "
            f"fine-tune it with train.init_from={path.parent} and a new train.out_dir"
        )
    old = ModelConfig(**state["config"]["model"])
    diffs = ckpt.config_differences(old, cfg.model)
    if state["tokenizer"] != tokenizer_spec:
        diffs.append(f"data.tokenizer: {_describe_tokenizer(state['tokenizer'])} → {_describe_tokenizer(tokenizer_spec)}")
    if diffs:
        raise QuillError(
            f"cannot resume {path}: the config differs in {'; '.join(diffs)} — "
            "use the run's own config.yaml or a new train.out_dir"
        )
