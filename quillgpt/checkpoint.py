"""Checkpoints: atomic saves, safe loads, and a run loaded for use (model, tokenizer, config).

A run directory (train/run_dir.py) holds two checkpoints: ckpt.pt, the latest (everything needed
to resume exactly), and best.pt, the weights with the lowest validation loss so far (model,
config, tokenizer, step, val_loss: no optimizer or RNG state). Checkpoints are plain tensors and
containers loaded with `torch.load(weights_only=True)`, so a crafted file cannot run code; every
zip member's CRC and the structure are checked before anything is built from them.

A LoRA run (lora.rank > 0) saves its adapters only, with `lora_base`: the base checkpoint's path
and a checksum of its weights. Loading it for use (`load_state`, `load_run`) loads the base,
refuses one whose weights changed since, and merges the adapters into it: every command gets a
plain GPT, as fast as the base. `merge_run` writes that merged model as a run of its own.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from quillgpt.config import Config, LoraConfig, ModelConfig, config_from_dict, save_config, shown_value
from quillgpt.data.tokenizer import Tokenizer, save_tokenizer, tokenizer_from_spec
from quillgpt.device import available_bytes
from quillgpt.errors import QuillError
from quillgpt.files import atomic_write, input_file, made_dir, os_error, shown
from quillgpt.model import quant
from quillgpt.model.gpt import GPT
from quillgpt.model.lora import adapter_shapes, merge_adapters

FORMAT = "quillgpt-checkpoint-v1"
ZIP_MAGIC = b"PK\x03\x04"
LATEST, BEST = "ckpt.pt", "best.pt"
CHECKPOINT_FILES = {"latest": LATEST, "best": BEST}


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """Atomically save a checkpoint dict; a full disk says so and keeps the previous file."""
    state = {"format": FORMAT, **state}
    try:
        atomic_write(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:
        # torch.save reports a failed write of its file object as a RuntimeError whose
        # __context__ is the OSError (ENOSPC etc.), so look down the chain for it.
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES):
            raise QuillError(
                f"could not write checkpoint {path}: {cause.strerror}; the previous checkpoint (if any) "
                "is intact — free disk space or choose another train.out_dir, then resume"
            ) from None
        raise


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", require: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load a checkpoint safely (no code runs) and check it: every zip member's CRC (bytes
    damaged on disk), the structure (STATE_TYPES, plus `require`, e.g. RESUME_KEYS) and finite
    weights. Anything wrong is one QuillError naming the file."""
    path = Path(path)
    shown_path = shown(path)
    try:
        if not input_file(path, "checkpoint"):
            raise QuillError(f"checkpoint not found: {shown_path}")
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise os_error(e, path, "read", "checkpoint") from None
    if magic != ZIP_MAGIC:  # torch.save writes a zip; anything else is never unpickled
        raise QuillError(
            f"{shown_path} is not a QuillGPT checkpoint (not a PyTorch zip archive); "
            "pass a run directory or a ckpt.pt/best.pt written by quill train"
        )
    damaged = (
        f"{shown_path} is not a readable checkpoint (truncated or corrupt: {{}}); use the other checkpoint "
        "in the run (ckpt.pt or best.pt) or retrain"
    )
    _verify_zip(path, damaged)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise QuillError(
            f"{shown_path} was refused: loading it needs code execution, which is unsafe ({refused_call(e)}); "
            "only load checkpoints written by quill"
        ) from None
    except Exception as e:  # noqa: BLE001 — damaged bytes fail in torch.load with many types
        raise QuillError(damaged.format((str(e).splitlines() or [type(e).__name__])[0][:100])) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise QuillError(
            f"{shown_path} is not a QuillGPT checkpoint (no {FORMAT!r} marker); pass a ckpt.pt/best.pt "
            "written by quill train (GPT-2 weights come in with quill import-hf)"
        )
    check_state(state, shown_path, require)
    return state


def refused_call(e: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, in a few words: 'it would call posix.system'."""
    unsafe = re.search(r"GLOBAL ([\w.]+)", str(e))
    return f"it would call {unsafe.group(1)}" if unsafe else (str(e).splitlines() or ["unsafe content"])[0][:120]


def _verify_zip(path: Path, damaged: str) -> None:
    """Check every member's CRC-32 (torch.load does not): flipped bytes are refused here instead
    of loading as silently wrong weights. About 1 GB/s."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as e:
        raise QuillError(damaged.format(str(e)[:100] or type(e).__name__)) from None
    except OSError as e:
        raise os_error(e, path, "read", "checkpoint") from None
    if bad is not None:
        raise QuillError(damaged.format(f"{bad} fails its CRC check: bytes on disk changed"))


# What each key of a checkpoint must hold; RESUME_KEYS are required where training continues.
STATE_TYPES: dict[str, tuple[type, ...]] = {
    "model": (dict,),
    "config": (dict,),
    "tokenizer": (dict,),
    "step": (int,),
    "tokens_seen": (int,),
    "optimizer": (dict,),
    "scaler": (dict,),
    "sampler": (dict,),
    "rng": (dict,),
    "best_val_loss": (float, int),
    "val_loss": (float, int),
    "elapsed_s": (float, int),
    "lora_base": (dict,),
}
REQUIRED_KEYS = ("model", "config", "tokenizer", "step")
RESUME_KEYS = ("optimizer", "scaler", "sampler", "rng", "tokens_seen", "best_val_loss", "elapsed_s")


def check_state(state: dict[str, Any], name: str, require: tuple[str, ...] = ()) -> None:
    """The structure a checkpoint must have, so a damaged or foreign one fails here with its
    name instead of as a KeyError, a TypeError or NaN text later."""
    for key in (*REQUIRED_KEYS, *require):
        if key not in state:
            raise QuillError(f"{name} is missing {key!r}; it was not written by quill train, or is damaged")
    for key, types in STATE_TYPES.items():
        value = state.get(key)
        if key in state and (not isinstance(value, types) or isinstance(value, bool)):
            raise QuillError(
                f"{name}: {key!r} must be {' or '.join(t.__name__ for t in types)}, "
                f"got {type(value).__name__}; the file is damaged or not from quill"
            )
    if state["step"] < 0:
        raise QuillError(f"{name}: 'step' is {state['step']}, must be ≥ 0; the file is damaged")
    for key, t in state["model"].items():
        if not isinstance(key, str) or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"a {t.dtype} tensor"
            raise QuillError(
                f"{name}: weight {shown_value(key)} is {what}, not a floating-point tensor; the file is damaged or not from quill"
            )
        if not _all_finite(t):
            raise QuillError(
                f"{name}: weight {key[:100]} holds NaN or infinite values; the model it saved "
                "had diverged or the file is damaged: use the run's other checkpoint or retrain"
            )


def clean_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the `_orig_mod.` (torch.compile) and `module.` (DDP) prefixes."""
    out = {}
    for key, value in state_dict.items():
        for prefix in ("_orig_mod.", "module."):
            if key.startswith(prefix):
                key = key[len(prefix) :]
        out[key] = value
    return out


def resolve_checkpoint(path: str | Path, which: str = "best") -> Path:
    """A run directory or a .pt file (~ expanded) → the checkpoint file to load."""
    path = Path(path).expanduser()
    if which not in CHECKPOINT_FILES:
        raise QuillError(f"--which must be best or latest, got {shown_value(which)}")
    if os.path.isdir(path):  # os.path: False (not an OSError) for a name too long to exist
        preferred = path / CHECKPOINT_FILES[which]
        if os.path.isfile(preferred):
            return preferred
        other = path / (LATEST if which == "best" else BEST)
        if os.path.isfile(other):
            return other
        try:
            runs = sorted(d.name for d in path.iterdir() if (d / LATEST).is_file() or (d / BEST).is_file())[:8]
        except OSError:
            runs = []
        inside = f"; runs inside it: {', '.join(runs)}" if runs else ""
        raise QuillError(f"no checkpoint in {shown(path)} (expected {LATEST} or {BEST}){inside}; train one with quill train")
    if input_file(path, "checkpoint"):  # a FIFO or device: refused by name; ENAMETOOLONG, EACCES: one line
        return path
    raise QuillError(f"checkpoint not found: {shown(path)} (pass a run directory or a .pt file)")


@dataclass
class LoadedRun:
    """A model ready for inference, with everything needed to use it."""

    model: GPT
    tokenizer: Tokenizer
    config: Config
    step: int
    path: Path


def model_from_state(state: dict[str, Any], device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> tuple[GPT, Config]:
    """The GPT a checked state describes, its weights in `dtype` (None: as saved). Its weights are
    compared with the config's shapes before anything is built, and then become the model's own
    (built on the meta device, assigned). The weights are taken out of `state` and converted one
    tensor at a time, each source dropped once converted: loading bf16 weights as fp32 peaks at
    about the fp32 bytes, not fp32 + bf16."""
    try:
        config = config_from_dict(state["config"])
    except QuillError as e:
        raise QuillError(
            f"the checkpoint's config is not valid for this version of quill ({e}); was it written by a newer version?"
        ) from None
    if config.model.vocab_size is None:  # a trained or imported model always knows its vocabulary
        raise QuillError("the checkpoint's config has no model.vocab_size; the file is damaged")
    weights = clean_state_dict(state["model"])
    state["model"] = {}  # the caller's references go, so each converted source can be freed
    problems = weight_mismatches(weights, config.model)
    if problems:
        raise QuillError(f"checkpoint weights do not match its own config ({problems}); the file is damaged")
    check_fits(weights, dtype, torch.device(device))
    converted: dict[int, torch.Tensor] = {}  # one conversion per storage: tied weights stay one tensor
    for name in list(weights):
        t = weights.pop(name)
        key = storage_key(t)
        if dtype is not None and t.dtype != dtype and key not in converted:
            converted[key] = t.to(dtype)
        weights[name] = converted.get(key, t)
        del t
    with torch.device("meta"):
        model = GPT(config.model)
    model.load_state_dict(weights, assign=True)
    model.materialize()
    return model.to(device), config


def storage_key(t: torch.Tensor) -> int:
    """Where a tensor's data starts: equal for tied weights (one tensor under two names)."""
    return t.untyped_storage().data_ptr() + t.storage_offset()


def check_fits(weights: dict[str, torch.Tensor], dtype: torch.dtype | None, device: torch.device) -> None:
    """Refuse, in one line naming the sizes, weights that cannot fit in the device's free memory."""
    seen: set[int] = set()
    nbytes = 0
    for t in weights.values():
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            nbytes += t.numel() * (dtype or t.dtype).itemsize
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise QuillError(
            f"the model's weights need {nbytes / 1e9:.1f} GB in {str(dtype or 'their dtype').replace('torch.', '')} "
            f"but {device.type} has {free / 1e9:.1f} GB free; load it in a smaller dtype "
            "(--dtype bfloat16) or on another device"
        )


def weight_mismatches(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> str:
    """Missing, unexpected and wrongly shaped weights for GPT(cfg), in a few words ('' if none)."""
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        expected = GPT(cfg).state_dict()
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    wrong = [
        f"{k} {tuple(weights[k].shape)} ≠ {tuple(v.shape)}" for k, v in expected.items() if k in weights and weights[k].shape != v.shape
    ]
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if items:
            more = f" and {len(items) - 4} more" if len(items) > 4 else ""
            problems.append(f"{label}: {', '.join(str(i)[:100] for i in items[:4])}{more}")
    return "; ".join(problems)


def _all_finite(t: torch.Tensor) -> bool:
    """True when no entry is NaN or ±inf: x·0 is 0 for every finite x and NaN otherwise, and one
    sum of that is ~10x faster on CPU than torch.isfinite(t).all() (cannot overflow, unlike t.sum()).
    In chunks of 4M entries, so that checking a large embedding needs no second copy of it."""
    return all(bool(torch.isfinite((chunk * 0).sum())) for chunk in t.reshape(-1).split(1 << 22))


def load_run(
    path: str | Path,
    which: str = "best",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = torch.float32,
    quantize: str | None = None,
    rows: int = 1,
) -> LoadedRun:
    """Load model (eval mode, its weights in `dtype`; None: as saved), tokenizer and config from a
    run directory or checkpoint file (a LoRA run: its base with the adapters merged in);
    quantize="int8": its linears in int8 once loaded, the kernels measured at a decode batch of
    `rows` (model/quant.py)."""
    state, ckpt = load_state(path, which, dtype)
    try:
        model, config = model_from_state(state, device, dtype)
        tokenizer = tokenizer_from_spec(state["tokenizer"])
    except QuillError as e:
        raise QuillError(f"{shown(ckpt)}: {e}") from None
    model.eval()
    quant.quantize(model, quantize, rows=rows, cache=True)  # the kernel plan measured once per machine and shape
    return LoadedRun(model, tokenizer, config, state["step"], ckpt)


def load_state(path: str | Path, which: str = "best", dtype: torch.dtype | None = None) -> tuple[dict[str, Any], Path]:
    """(checked state, its file) of a run directory or checkpoint file, with plain weights: a
    LoRA run's adapters are merged into its base (in `dtype`; None: the base's own)."""
    ckpt = resolve_checkpoint(path, which)
    state = load_checkpoint(ckpt, map_location="cpu")
    return (with_base(state, ckpt, dtype) if "lora_base" in state else state), ckpt


def weights_checksum(weights: dict[str, torch.Tensor]) -> str:
    """sha256 of a state dict's names, dtypes, shapes and bytes: what a LoRA run's base must keep."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def crop_positions(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A base's weights for a fine-tuned copy with a smaller block_size: learned positions cut to it."""
    if cfg.pos == "learned" and "transformer.wpe.weight" in weights:
        weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][: cfg.block_size]
    return weights


def with_base(state: dict[str, Any], ckpt: Path, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A LoRA run's state with its base's weights and the adapters merged in (see the module
    docstring); a missing or changed base, or adapters that do not fit it, is one QuillError."""
    base = state["lora_base"]
    if not isinstance(base.get("path"), str) or not isinstance(base.get("checksum"), str):
        raise QuillError(f"{shown(ckpt)}: 'lora_base' must hold the base's path and checksum; the file is damaged")
    if Path(base["path"]).resolve() == ckpt.resolve():
        raise QuillError(f"{shown(ckpt)} names itself as its LoRA base; the file is damaged")
    if not os.path.isfile(base["path"]):
        raise QuillError(
            f"{shown(ckpt)} holds LoRA adapters for the base {base['path']}, which is missing; put the "
            "base back there (adapters only work on the weights they were trained on)"
        )
    base_state, _ = load_state(base["path"])
    if weights_checksum(base_state["model"]) != base["checksum"]:
        raise QuillError(
            f"{shown(ckpt)} holds LoRA adapters for the base {base['path']}, whose weights have changed "
            f"since (checksum {base['checksum'][:12]}…); adapters only work on the weights they were "
            "trained on: restore that base, or fine-tune again"
        )
    try:
        config = config_from_dict(state["config"])
    except QuillError as e:
        raise QuillError(f"{shown(ckpt)}: its config is not valid for this version of quill ({e})") from None
    adapters = clean_state_dict(state["model"])
    expected = adapter_shapes(config.model, config.lora)
    if {k: tuple(v.shape) for k, v in adapters.items()} != expected:
        raise QuillError(
            f"{shown(ckpt)}: its adapters do not match its lora config (lora.rank={config.lora.rank}, "
            f"lora.targets={config.lora.targets}); the file is damaged"
        )
    weights = crop_positions(clean_state_dict(base_state["model"]), config.model)
    merged = merge_adapters(weights, adapters, config.model, config.lora, dtype)
    return {**{k: v for k, v in state.items() if k != "lora_base"}, "model": merged}


def merge_run(path: str | Path, out_dir: str | Path, which: str = "best", force: bool = False) -> Path:
    """A LoRA run → a plain quill run in `out_dir` (config.yaml with lora off, tokenizer.json and
    ckpt.pt holding the merged weights in the base's dtype), usable like any imported model."""
    ckpt, out_dir = resolve_checkpoint(path, which), Path(out_dir)
    state = load_checkpoint(ckpt)
    if "lora_base" not in state:
        raise QuillError(f"{shown(ckpt)} is not a LoRA run (its lora.rank is 0): its weights are plain already, use it as it is")
    inputs = {ckpt.parent.resolve(), Path(state["lora_base"].get("path", "")).resolve().parent}
    if out_dir.resolve() in inputs:
        raise QuillError(f"--out {shown(out_dir)} is where the LoRA run or its base lives; choose a new directory")
    taken = [n for n in (LATEST, BEST, "config.yaml", "tokenizer.json", "metrics.jsonl") if (out_dir / n).exists()]
    if taken and not force:
        raise QuillError(f"--out {shown(out_dir)} already holds a run ({', '.join(taken)}); choose another or pass --force")
    state = with_base(state, ckpt)
    cfg = config_from_dict(state["config"])
    cfg.lora, cfg.train.init_from, cfg.train.out_dir = LoraConfig(), None, str(out_dir)
    with made_dir(out_dir):  # a failed write leaves no --out it made
        write_run(
            out_dir,
            cfg,
            tokenizer_from_spec(state["tokenizer"]),
            state["model"],
            state["step"],
            state.get("tokens_seen", 0),
            merged_from=str(ckpt),
        )
    return out_dir / LATEST


def write_run(
    out_dir: Path,
    cfg: Config,
    tokenizer: Tokenizer,
    weights: dict[str, torch.Tensor],
    step: int = 0,
    tokens_seen: int = 0,
    **provenance: str,
) -> None:
    """A run directory of given weights (an import, a merge): config.yaml, tokenizer.json and
    ckpt.pt with `provenance` (e.g. imported_from=...); an earlier best.pt and metrics.jsonl,
    there only with --force, are not this model's and go."""
    save_config(cfg, out_dir / "config.yaml")
    save_tokenizer(tokenizer, out_dir / "tokenizer.json")
    for stale in (BEST, "metrics.jsonl"):
        (out_dir / stale).unlink(missing_ok=True)
    save_checkpoint(
        {"model": weights, "config": cfg.to_dict(), "tokenizer": tokenizer.spec(), "step": step, "tokens_seen": tokens_seen, **provenance},
        out_dir / LATEST,
    )


def config_differences(old: ModelConfig, new: ModelConfig, ignore: tuple[str, ...] = ("dropout",)) -> list[str]:
    """Model keys whose values differ, as 'model.key: old → new' strings."""
    return [
        f"model.{f.name}: {getattr(old, f.name)!r} → {getattr(new, f.name)!r}"
        for f in fields(ModelConfig)
        if f.name not in ignore and getattr(old, f.name) != getattr(new, f.name)
    ]
