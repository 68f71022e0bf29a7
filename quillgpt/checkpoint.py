"""Run directories and checkpoints: atomic writes, safe loads, one writer per run.

A run directory holds
    config.yaml      the resolved config that produced it
    tokenizer.json   the tokenizer spec (rebuilds the tokenizer without the corpus)
    ckpt.pt          the latest checkpoint (everything needed to resume exactly)
    best.pt          the checkpoint with the lowest validation loss so far
    metrics.jsonl    one JSON object per logged step
Checkpoints are plain tensors and containers loaded with `torch.load(weights_only=True)`,
so a crafted file cannot run code.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pickle
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from quillgpt.config import Config, ModelConfig, config_from_dict
from quillgpt.errors import QuillError
from quillgpt.files import atomic_write
from quillgpt.model import GPT
from quillgpt.tokenizer import Tokenizer, tokenizer_from_spec

FORMAT = "quillgpt-checkpoint-v1"
ZIP_MAGIC = b"PK\x03\x04"
LATEST, BEST = "ckpt.pt", "best.pt"
CHECKPOINT_FILES = {"latest": LATEST, "best": BEST}


def remove_stale_temps(out_dir: str | Path) -> None:
    """Delete temp files that a killed writer left in a run directory (call holding its lock)."""
    for name in (LATEST, BEST, "metrics.jsonl"):
        for tmp in Path(out_dir).glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)


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


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint safely (no code runs); anything else is one clear QuillError."""
    path = Path(path)
    if not path.is_file():
        raise QuillError(f"checkpoint not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != ZIP_MAGIC:  # torch.save writes a zip; anything else is never unpickled
            raise QuillError(
                f"{path} is not a QuillGPT checkpoint (not a PyTorch zip archive); "
                "pass a run directory or a ckpt.pt/best.pt written by quill train"
            )
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"it would call {unsafe.group(1)}" if unsafe else str(e).splitlines()[0][:120]
        raise QuillError(
            f"{path} was refused: loading it needs code execution, which is unsafe ({what}); "
            "only load checkpoints written by quill"
        ) from None
    except Exception as e:  # noqa: BLE001 — damaged bytes fail in torch.load with many types
        raise QuillError(
            f"{path} is not a readable checkpoint (truncated or corrupt: {str(e).splitlines()[0][:100]}); "
            "use the other checkpoint in the run (--which latest/best) or retrain"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise QuillError(
            f"{path} is not a QuillGPT checkpoint (no {FORMAT!r} marker); pass a ckpt.pt/best.pt "
            "written by quill train (GPT-2 weights come in with quill import-hf)"
        )
    return state


def clean_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the `_orig_mod.` (torch.compile) and `module.` (DDP) prefixes."""
    out = {}
    for key, value in state_dict.items():
        for prefix in ("_orig_mod.", "module."):
            if key.startswith(prefix):
                key = key[len(prefix):]
        out[key] = value
    return out


def resolve_checkpoint(path: str | Path, which: str = "best") -> Path:
    """A run directory or a .pt file → the checkpoint file to load."""
    path = Path(path)
    if which not in CHECKPOINT_FILES:
        raise QuillError(f"--which must be best or latest, got {which!r}")
    if path.is_dir():
        preferred = path / CHECKPOINT_FILES[which]
        if preferred.is_file():
            return preferred
        other = path / (LATEST if which == "best" else BEST)
        if other.is_file():
            return other
        raise QuillError(f"no checkpoint in {path} (expected {LATEST} or {BEST}); train one with quill train")
    if path.is_file():
        return path
    raise QuillError(f"checkpoint not found: {path} (pass a run directory or a .pt file)")


@dataclass
class LoadedRun:
    """A model ready for inference, with everything needed to use it."""

    model: GPT
    tokenizer: Tokenizer
    config: Config
    step: int
    path: Path


def model_from_state(state: dict[str, Any], device: str | torch.device = "cpu") -> tuple[GPT, Config]:
    config = config_from_dict(state["config"])
    model = GPT(config.model)
    try:
        model.load_state_dict(clean_state_dict(state["model"]))
    except RuntimeError as e:
        raise QuillError(f"checkpoint weights do not match its own config: {str(e).splitlines()[0]}") from None
    return model.to(device), config


def load_run(path: str | Path, which: str = "best", device: str | torch.device = "cpu") -> LoadedRun:
    """Load model (eval mode), tokenizer and config from a run directory or checkpoint file."""
    ckpt = resolve_checkpoint(path, which)
    state = load_checkpoint(ckpt, map_location="cpu")
    try:
        model, config = model_from_state(state, device)
        tokenizer = tokenizer_from_spec(state["tokenizer"])
    except KeyError as e:
        raise QuillError(f"{ckpt} is missing {e.args[0]!r}; it was not written by quill train") from None
    model.eval()
    return LoadedRun(model, tokenizer, config, int(state.get("step", 0)), ckpt)


def config_differences(old: ModelConfig, new: ModelConfig, ignore: tuple[str, ...] = ("dropout",)) -> list[str]:
    """Model keys whose values differ, as 'model.key: old → new' strings."""
    return [
        f"model.{f.name}: {getattr(old, f.name)!r} → {getattr(new, f.name)!r}"
        for f in fields(ModelConfig)
        if f.name not in ignore and getattr(old, f.name) != getattr(new, f.name)
    ]


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """metrics.jsonl as a list of dicts, skipping a last line cut short by a kill."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def truncate_metrics(path: str | Path, after_step: int) -> None:
    """Drop metric lines past `after_step` (written after the checkpoint we resume from)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= after_step]
    atomic_write(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in keep).encode()))


class RunLock:
    """An exclusive lock on a run directory; the OS drops it when the holder dies."""

    def __init__(self, out_dir: str | Path):
        self.path = Path(out_dir) / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            self._fd = None
            raise QuillError(
                f"{self.path.parent} is in use by a running quill train (pid {holder}); "
                "wait for it, or pass a different train.out_dir"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
