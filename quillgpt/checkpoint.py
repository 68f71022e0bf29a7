"""The checkpoint file format: atomic saves, safe loads, and the checks of what a file holds.

A run directory (train/run_dir.py) holds two checkpoints: ckpt.pt, the latest (everything needed
to resume exactly), and best.pt, the weights with the lowest validation loss so far (model,
config, tokenizer, step, val_loss: no optimizer or RNG state). Checkpoints are plain tensors and
containers loaded with `torch.load(weights_only=True)`, so a crafted file cannot run code; every
zip member's CRC and the structure are checked before anything is built from them. Building a
run from a checkpoint (model, tokenizer, LoRA base) is quillgpt/runs.py.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from quillgpt.config import shown_value
from quillgpt.errors import QuillError
from quillgpt.files import atomic_write, input_file, os_error, shown

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
    _check_zip_end(path, damaged)


EOCD, EOCD_SIZE = b"PK\x05\x06", 22  # the zip's end-of-central-directory record (then its comment)


def _check_zip_end(path: Path, damaged: str) -> None:
    """The file ends where its zip does: zipfile reads bytes appended after the archive (up to
    64 KB) as its comment, so junk after a checkpoint would load and be resumed from."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - (1 << 16) - EOCD_SIZE))
            tail = f.read()
    except OSError as e:
        raise os_error(e, path, "read", "checkpoint") from None
    at = tail.rfind(EOCD)
    comment = int.from_bytes(tail[at + 20 : at + 22], "little") if at >= 0 else -1
    if at < 0 or at + EOCD_SIZE + comment != len(tail):
        raise QuillError(damaged.format("bytes follow the end of its zip archive"))


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
    "weights_file": (dict,),  # a quantized run's: its weights file (runs.py)
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
        if not all_finite(t):
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


def weights_checksum(weights: dict[str, torch.Tensor]) -> str:
    """sha256 of a state dict's names, dtypes, shapes and bytes: what a LoRA run's base must keep."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def all_finite(t: torch.Tensor) -> bool:
    """True when no entry is NaN or ±inf: x·0 is 0 for every finite x and NaN otherwise, and one
    sum of that is ~10x faster on CPU than torch.isfinite(t).all() (cannot overflow, unlike t.sum()).
    In chunks of 4M entries, so that checking a large embedding needs no second copy of it."""
    return all(bool(torch.isfinite((chunk * 0).sum())) for chunk in t.reshape(-1).split(1 << 22))
