"""The run directory and its policy: one process owns it, an existing run is never replaced
without --overwrite, a resume continues the run's own model and data and must match the run
otherwise (tokenizer, optimizer, adapters), and nothing is written until the first step has
given a finite loss.

    config.yaml      the resolved config that produced it
    tokenizer.json   the tokenizer spec (rebuilds the tokenizer without the corpus)
    ckpt.pt          the latest checkpoint (everything needed to resume exactly)
    best.pt          the weights with the lowest validation loss so far
    metrics.jsonl    one JSON object per logged step (train/metrics.py)
    sharded/         an FSDP run's sharded checkpoints (train/fsdp_checkpoint.py)
    .lock            held by the one process training in it
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from quillgpt import checkpoint as ckpt
from quillgpt import quant, runs
from quillgpt.config import Config, DataConfig, LoraConfig, ModelConfig, TrainConfig, load_config, save_config, with_base_tokenizer
from quillgpt.data.prepare import PreparedData, prepare
from quillgpt.data.tokenizer_files import save_tokenizer, tokenizer_from_spec
from quillgpt.errors import QuillError
from quillgpt.files import check_output_dir, probe_writable, shown
from quillgpt.metrics_log import METRICS, read_metrics
from quillgpt.train import fsdp_checkpoint as sharded
from quillgpt.train import state_check
from quillgpt.train.distributed import Dist
from quillgpt.train.metrics import MetricsWriter, check_tensorboard, truncate_metrics
from quillgpt.train.state import Trainer

# What a run writes into train.out_dir (name → output kind): an existing file of these that is
# not a run's (an HF model's tokenizer.json, someone's config.yaml) is never replaced silently.
RUN_WRITES = {
    r"config\.yaml": "config",
    r"tokenizer\.json": "tokenizer",
    r"metrics\.jsonl": "metrics",
    r"ckpt\.pt": "checkpoint",
    r"best\.pt": "checkpoint",
}


def remove_stale_temps(out_dir: str | Path) -> None:
    """Delete temp files that a killed writer left in a run directory (call holding its lock)."""
    for name in (ckpt.LATEST, ckpt.BEST, METRICS):
        for tmp in Path(out_dir).glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)


class RunLock:
    """An exclusive lock on a run directory; the OS drops it when the holder dies."""

    def __init__(self, out_dir: str | Path):
        self.path = Path(out_dir) / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)  # a FIFO: no wait
            if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                os.close(self._fd)
                raise IsADirectoryError(21, "not a regular file")
        except OSError as e:  # a directory or FIFO named .lock, a read-only file...
            self._fd = None
            raise QuillError(
                f"cannot lock {self.path}: {e.strerror}; remove it (it is no lock quill made) or pass a different train.out_dir"
            ) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            self._fd = None
            raise QuillError(
                f"{self.path.parent} is in use by a running quill train (pid {holder}); wait for it, or pass a different train.out_dir"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def open_run(cfg: Config, ddp: Dist, stack: contextlib.ExitStack, progress: bool) -> tuple[PreparedData, dict[str, Any] | None]:
    """Lock the run directory, decide whether this is a resume, prepare the data; returns the
    prepared data and, for a resume, the checkpoint it continues (read_resume_state). Rank 0 does
    the checks before any rank does work, and a refusal there stops every rank (instead of
    leaving them waiting for rank 0 forever)."""
    out_dir, failure, saved = Path(cfg.train.out_dir), None, None
    with_base_tokenizer(cfg)  # a Config built in Python, not by load_config
    if ddp.master:
        try:
            probe_writable(out_dir, "train.out_dir")
            check_output_dir(out_dir, "train.out_dir", "run", RUN_WRITES, force=bool(cfg.train.overwrite), how="pass --overwrite")
            stack.enter_context(RunLock(out_dir))
            remove_stale_temps(out_dir)
            sharded.remove_stale(out_dir)
            if _resuming(cfg.train, out_dir):
                saved = _continue_run(cfg, out_dir, tqdm.write)
            if cfg.train.tensorboard:
                check_tensorboard()
            prepared = prepare(cfg.data, progress=progress, chat_tokens=cfg.model.block_size + 1)
        except QuillError as e:
            failure = e
    if ddp.any(failure is not None):
        raise failure or QuillError("rank 0 could not start the run (its message says why)")
    resuming = bool(ddp.broadcast_int(int(saved is not None)))
    if not ddp.master:
        if resuming:
            saved = _continue_run(cfg, out_dir, None)
        prepared = prepare(cfg.data, progress=False, chat_tokens=cfg.model.block_size + 1)
    return prepared, saved


def _continue_run(cfg: Config, out_dir: Path, say: Callable[[str], None] | None) -> dict[str, Any]:
    """A resume continues the run as it was: its checkpoint, the data it recorded and its model
    (before the data is prepared: a chat row's cap is the model's block_size)."""
    state = read_resume_state(out_dir)
    cfg.data = recorded_data(cfg, out_dir, say)
    cfg.model = recorded_model(cfg, state, _state_path(out_dir, state), say)
    return state


def recorded_data(cfg: Config, out_dir: Path, say: Callable[[str], None] | None) -> DataConfig:
    """A resume reads the data the run recorded in its config.yaml (what it trained on), not what
    the config given now would prepare (`--config configs/quickstart.yaml --resume` of a run
    trained on data.path=mytext.txt); data keys given on the command line still apply."""
    try:
        recorded = load_config(out_dir / "config.yaml").data
    except QuillError:
        return cfg.data  # no readable config.yaml (an old or damaged run): the config given
    given = {k.split(".", 1)[1] for k in cfg.overridden if k.startswith("data.")}
    data = dataclasses.replace(recorded, **{k: getattr(cfg.data, k) for k in given if hasattr(cfg.data, k)})
    changed = [k for k in ("path", "url", "out_dir", "tokenizer", "format") if getattr(data, k) != getattr(cfg.data, k)]
    if changed and say is not None:
        shown_keys = ", ".join(f"data.{k}={getattr(data, k)}" for k in changed)
        say(f"resuming on the data the run recorded ({shown_keys}, from {out_dir / 'config.yaml'})")
    return data


RESUME_APPLIED = ("dropout",)  # the model keys a resume takes from the config given (the rest are the run's)


def recorded_model(cfg: Config, state: dict[str, Any], path: Path, say: Callable[[str], None] | None) -> ModelConfig:
    """A resume's model is the one its checkpoint was trained as (as nanoGPT resumes from the
    checkpoint's model args), not the given config's (`--config RECIPE --resume` of a run trained
    with model.block_size=64 on the command line); of the given model keys only RESUME_APPLIED
    apply. One given on the command line that differs is refused: a trained model cannot take it."""
    run = ModelConfig(**state["config"]["model"])
    given = {k.split(".", 1)[1] for k in cfg.overridden if k.startswith("model.")}
    refused = [
        f"model.{k}: {getattr(run, k)!r} → {getattr(cfg.model, k)!r}"
        for k in sorted(given)
        if k not in RESUME_APPLIED and getattr(run, k) != getattr(cfg.model, k)
    ]
    if refused:
        raise QuillError(
            f"cannot resume {path}: the command line changes {'; '.join(refused)}, which a trained model cannot take; "
            f"drop {'it' if len(refused) == 1 else 'them'} to go on with the run's model (or use the run's own config.yaml), "
            "or train a new run in another train.out_dir"
        )
    model = dataclasses.replace(run, **{k: getattr(cfg.model, k) for k in RESUME_APPLIED})
    changed = [
        f.name
        for f in dataclasses.fields(model)
        if getattr(model, f.name) != getattr(cfg.model, f.name) and not (f.name == "vocab_size" and cfg.model.vocab_size is None)
    ]
    if changed and say is not None:
        shown_keys = ", ".join(f"model.{k}={getattr(model, k)}" for k in changed)
        say(f"resuming with the model the run recorded ({shown_keys}, from {path})")
    return model


def _resumable(out_dir: Path) -> bool:
    """Whether out_dir holds a checkpoint to resume: ckpt.pt, or an FSDP run's shards."""
    return (out_dir / ckpt.LATEST).is_file() or (out_dir / sharded.SHARDED / sharded.POINTER).is_file()


def holds_run(out_dir: Path) -> bool:
    """Whether out_dir holds a run that a new one must not silently replace (its checkpoints)."""
    return _resumable(out_dir) or (out_dir / ckpt.BEST).is_file()


def _resuming(tc: TrainConfig, out_dir: Path) -> bool:
    """Resume, start afresh, or refuse: a run already in out_dir is continued only with
    train.resume and replaced only with train.overwrite, never by a forgotten flag."""
    latest, best = out_dir / ckpt.LATEST, out_dir / ckpt.BEST
    saved = _resumable(out_dir)
    if tc.resume is True and tc.overwrite:
        raise QuillError("--resume continues the run in train.out_dir and --overwrite replaces it; pass one of them")
    if tc.resume is True and not saved:
        hint = (
            f"its {ckpt.BEST} can seed a new run with train.init_from={best} and another train.out_dir, or --overwrite starts over here"
            if best.is_file()
            else "drop --resume to start a new run"
        )
        raise QuillError(f"cannot resume: no checkpoint at {latest}; {hint}")
    resuming = bool(tc.resume) and not tc.overwrite and saved
    if not resuming and not tc.overwrite and holds_run(out_dir):
        raise QuillError(
            f"{out_dir} already holds a run ({describe_run(out_dir)}); start a new run beside it with "
            f"train.out_dir={_free_name(out_dir)}, continue this one with --resume (train.resume=true), or replace it "
            "with --overwrite (train.overwrite=true)"
        )
    return resuming


def _free_name(out_dir: Path) -> Path:
    """out/quickstart → out/quickstart-2 (the first such name not taken)."""
    n = 2
    while (out_dir.parent / f"{out_dir.name}-{n}").exists():
        n += 1
    return out_dir.parent / f"{out_dir.name}-{n}"


def last_val_loss(out_dir: Path, step: int) -> float | None:
    """The run's last val loss up to `step`, as its metrics.jsonl logged it (None: no line has one)."""
    try:
        records = read_metrics(out_dir / METRICS)
    except QuillError:  # no readable log: the loss is not known, the run still is
        return None
    logged = [r["val_loss"] for r in records if "val_loss" in r and r["step"] <= step]
    return logged[-1] if logged else None


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


INIT_APPLIED = ("block_size", "dropout", "attn_impl")  # what fine-tuning may change (block_size: shrink only)


def init_from_run(cfg: Config, tokenizer_spec: dict) -> tuple[Config, dict[str, torch.Tensor], dict[str, str] | None]:
    """Fine-tuning: the source run's architecture and weights, and for LoRA (lora.rank > 0) the
    base a LoRA run records: its checkpoint file and weights checksum. Of the config's model keys
    only INIT_APPLIED apply; one given on the command line that would change the architecture is
    refused (the weights fix it), never silently ignored."""
    state, path = runs.load_state(cfg.train.init_from, which="best")
    if runs.is_quantized_run(state) and not cfg.lora.rank:
        raise QuillError(
            f"train.init_from={cfg.train.init_from} is a quantized run (int4/int8 codes), which training cannot update; "
            "train LoRA adapters on it (lora.rank=8; quill finetune does) or fine-tune a float run: "
            "`quill import-gguf FILE.gguf --dequantize -o DIR` (or the run it was quantized from)"
        )
    if path.resolve().parent == Path(cfg.train.out_dir).resolve():
        raise QuillError(
            f"train.init_from={cfg.train.init_from} is the run in train.out_dir, which this run would "
            "replace; fine-tune into another train.out_dir"
        )
    base = {"path": str(path.resolve()), "checksum": runs.base_identity(state)} if cfg.lora.rank else None
    try:
        spec = tokenizer_from_spec(state["tokenizer"]).spec()
        model, source_cfg = runs.model_from_state(state, dtype=torch.float32)
        quant.dequantize(model)  # a quantized base: LoRA trains on the float values its codes hold
    except QuillError as e:
        raise QuillError(f"{shown(path)}: {e}") from None
    if spec != tokenizer_spec:
        raise QuillError(
            f"train.init_from={cfg.train.init_from} was trained with the tokenizer {_describe_tokenizer(spec)} but "
            f"data.tokenizer={cfg.data.tokenizer} gives {_describe_tokenizer(tokenizer_spec)}; leave data.tokenizer "
            "unset to use the base run's own"
        )
    model_cfg = source_cfg.model
    given = sorted(k.split(".", 1)[1] for k in cfg.overridden if k.startswith("model."))
    refused = [
        k
        for k in given
        if k not in INIT_APPLIED and k != "vocab_size" and hasattr(model_cfg, k) and getattr(cfg.model, k) != getattr(model_cfg, k)
    ]
    if refused:
        shown_keys = ", ".join(f"model.{k}={getattr(cfg.model, k)} (it has {getattr(model_cfg, k)})" for k in refused)
        raise QuillError(
            f"train.init_from={cfg.train.init_from} takes its architecture from that run, so {shown_keys} "
            f"cannot apply; drop {'it' if len(refused) == 1 else 'them'} (fine-tuning may change "
            f"model.{', model.'.join(INIT_APPLIED)})"
        )
    if cfg.model.block_size > model_cfg.block_size:
        raise QuillError(f"model.block_size={cfg.model.block_size} exceeds the source model's {model_cfg.block_size}")
    model_cfg.block_size, model_cfg.dropout = cfg.model.block_size, cfg.model.dropout
    if "model.attn_impl" in cfg.overridden:
        model_cfg.attn_impl = cfg.model.attn_impl
    cfg.model = model_cfg
    return cfg, runs.crop_positions(model.state_dict(), model_cfg), base


def read_resume_state(out_dir: Path) -> dict[str, Any]:
    """ckpt.pt, or an FSDP run's sharded checkpoint (then state["shards"] is its directory); a
    damaged one, or one without the optimizer state a resume needs, says what `train` can do instead."""
    shards = sharded.latest_sharded(out_dir)
    latest = _state_file(out_dir, shards)
    try:
        state = {**sharded.load_train_state(shards), "shards": shards} if shards is not None else ckpt.load_checkpoint(latest)
        if "optimizer" in state or "shards" in state:  # weights only (import-hf): refused below with what to do instead
            ckpt.check_state(state, str(latest), ckpt.RESUME_KEYS if shards is None else sharded.TRAIN_STATE_KEYS)
            state_check.check_resume_file(state, shown(latest))
    except QuillError as e:
        raise refused_resume(out_dir, str(e)) from None
    if "optimizer" not in state and "shards" not in state:
        raise QuillError(
            f"cannot resume {latest}: it holds weights only (e.g. from quill import-hf); "
            f"fine-tune it with train.init_from={out_dir} and a new train.out_dir"
        )
    return state


def refused_resume(out_dir: Path, problem: str) -> QuillError:
    """A damaged resume state, refused with what to do instead: the run's other checkpoint
    (best.pt: its weights seed a new run) where there is one, else starting over."""
    what = problem.split("; ")[0]  # what is wrong, without advice meant for sample/eval (--which)
    best = out_dir / ckpt.BEST
    if best.is_file():
        return QuillError(
            f"cannot resume: {what}; use the run's other checkpoint ({ckpt.BEST}): train.init_from={best} "
            "with a new train.out_dir keeps its weights, or start over with --overwrite"
        )
    return QuillError(f"cannot resume: {what}; start over with --overwrite")


def check_restorable(t: Trainer, state: dict[str, Any]) -> None:
    """Before anything of a resume's state is restored: it fits the model, optimizer, sampler
    and scaler this run built (state_check), or the resume is refused in one line."""
    try:
        state_check.check_against(
            state, shown(_state_path(t.out_dir, state)), t.raw_model, t.optimizer, t.sampler, t.scaler, t.lora_base is not None
        )
    except QuillError as e:
        raise refused_resume(t.out_dir, str(e)) from None


def check_resume_state(
    state: dict[str, Any], out_dir: Path, cfg: Config, tokenizer_spec: dict, strategy: str, lora_base: dict[str, str] | None = None
) -> None:
    """Refuse a resume the run cannot take: another strategy's checkpoint, another model shape,
    optimizer, tokenizer, adapters or LoRA base."""
    if ("shards" in state) != (strategy == "fsdp"):
        raise QuillError(_strategy_mismatch(out_dir, "shards" in state))
    _check_compatible(state, cfg, tokenizer_spec, _state_path(out_dir, state), lora_base)


def _state_path(out_dir: Path, state: dict[str, Any]) -> Path:
    """The file a resume's state came from (read_resume_state's)."""
    return _state_file(out_dir, state.get("shards"))


def _state_file(out_dir: Path, shards: Path | None) -> Path:
    """The file a resume's state comes from: ckpt.pt, or a sharded checkpoint's train state."""
    return shards / sharded.TRAIN_STATE if shards is not None else out_dir / ckpt.LATEST


def _strategy_mismatch(out_dir: Path, has_shards: bool) -> str:
    if has_shards:
        return (
            f"{out_dir} holds the sharded checkpoint of an FSDP run; resume it under torchrun with "
            "train.strategy=fsdp (any number of processes)"
        )
    return f"{out_dir / ckpt.LATEST} was written by a DDP or one-process run, not sharded; resume it with train.strategy=ddp"


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


def _describe_tokenizer(spec: dict) -> str:
    """A spec in a few words: two char vocabularies differ in their characters, not their name."""
    if spec.get("type") == "char":
        return f"char ({len(spec.get('chars', ''))} characters)"
    if spec.get("type") == "bpe":
        return f"bpe ({len(spec.get('ranks', [])) + len(spec.get('special_tokens', {}))} ids)"
    return str(spec.get("name", spec.get("type")))


def _check_compatible(
    state: dict[str, Any], cfg: Config, tokenizer_spec: dict, path: Path, lora_base: dict[str, str] | None = None
) -> None:
    """Refuse to resume a run whose model shape, adapters, tokenizer or LoRA base differ from now."""
    old = ModelConfig(**state["config"]["model"])
    diffs = runs.config_differences(old, cfg.model)
    old_optimizer = state["config"].get("train", {}).get("optimizer", "adamw")
    if old_optimizer != cfg.train.optimizer:  # their states do not load into each other
        diffs.append(f"train.optimizer: {old_optimizer} → {cfg.train.optimizer}")
    if state["tokenizer"] != tokenizer_spec:
        diffs.append(f"data.tokenizer: {_describe_tokenizer(state['tokenizer'])} → {_describe_tokenizer(tokenizer_spec)}")
    old_lora = state["config"].get("lora") or {}
    diffs += [
        f"lora.{k}: {old_lora.get(k, v)!r} → {getattr(cfg.lora, k)!r}"
        for k, v in vars(LoraConfig()).items()
        if k != "dropout" and old_lora.get(k, v) != getattr(cfg.lora, k)
    ]
    if diffs:
        raise QuillError(
            f"cannot resume {path}: the config differs in {'; '.join(diffs)} — use the run's own config.yaml or a new train.out_dir"
        )
    saved_base = state.get("lora_base") or {}
    if lora_base is not None and saved_base.get("checksum") != lora_base["checksum"]:
        raise QuillError(
            f"cannot resume {path}: its LoRA base {saved_base.get('path', '?')} is not the weights now at "
            f"train.init_from={cfg.train.init_from} (checksums differ: the base changed); restore that base, or "
            "start over with --overwrite"
        )
