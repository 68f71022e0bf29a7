"""Sharded checkpoints of FSDP runs: every rank writes its own shard, committed as a whole.

    out_dir/sharded/latest                     the name of the last complete checkpoint below
    out_dir/sharded/step-00000400-<stamp>/     torch.distributed.checkpoint (DCP) files: each
        __<rank>_0.distcp, .metadata           rank's shard of the model and AdamW state
        train_state.pt                         step, sampler, every rank's RNG, counters, config,
                                               tokenizer (a quill checkpoint without weights)

Every rank writes into `.step-….tmp/`; when all have finished, rank 0 adds train_state.pt,
renames the directory and only then replaces `latest` (atomic rename). A kill at any moment
leaves `latest` naming a complete checkpoint; the next start removes half-written directories.
On resume DCP reshards, so the number of ranks may change. The run directory must be on a
filesystem every rank sees (one shared path on every node).

Loading is kept as safe as ckpt.pt's: DCP unpickles `.metadata` and non-tensor items, so
`.metadata` is first read with an unpickler that knows only DCP's own classes, and non-tensor
items load with torch.load(weights_only=True).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from quillgpt import checkpoint as ckpt
from quillgpt.errors import QuillError
from quillgpt.files import atomic_write_text, os_error, shown
from quillgpt.train.distributed import Dist

SHARDED, POINTER, TRAIN_STATE = "sharded", "latest", "train_state.pt"
TRAIN_STATE_KEYS = tuple(k for k in ckpt.RESUME_KEYS if k != "optimizer")  # the optimizer is in the shards


def latest_sharded(out_dir: str | Path) -> Path | None:
    """The directory `sharded/latest` names, or None when the run has no sharded checkpoint."""
    root = Path(out_dir) / SHARDED
    try:
        name = (root / POINTER).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise QuillError(f"cannot read {shown(root / POINTER)}: {e}; the sharded checkpoint is damaged") from None
    if not name.startswith("step-") or "/" in name or not (root / name).is_dir():
        raise QuillError(
            f"{shown(root / POINTER)} names {name[:80]!r}, which is not a checkpoint in {shown(root)}; "
            "the run directory is damaged — start over with --overwrite"
        )
    return root / name


def remove_stale(out_dir: str | Path) -> None:
    """Delete the temp directories and pointer files that killed saves left (rank 0, holding the
    run's lock). A complete directory never pointed at goes with the next commit."""
    root = Path(out_dir) / SHARDED
    for tmp in root.glob(".*.tmp") if root.is_dir() else ():
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def remove_sharded(out_dir: str | Path) -> None:
    """A fresh run (--overwrite) starts without the old run's sharded checkpoints."""
    shutil.rmtree(Path(out_dir) / SHARDED, ignore_errors=True)


def save_sharded(
    out_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any] | None, ddp: Dist
) -> Path:
    """A collective (every rank calls it): each rank writes its shard of model + optimizer into a
    new directory, which rank 0 commits with train_state (given on rank 0 only)."""
    root = Path(out_dir) / SHARDED
    name = f"step-{step:08d}-{ddp.broadcast_int(time.time_ns() // 1000 % 10**12):012d}"
    tmp, final = root / f".{name}.tmp", root / name
    if ddp.master:
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            raise os_error(e, tmp, "write", "train.out_dir") from None
    ddp.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=FileSystemWriter(tmp))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 — DCP gathers every rank's failure into one (a BaseException)
        raise QuillError(
            f"could not write the sharded checkpoint {shown(tmp)} ({_first_line(e)}); the previous "
            "checkpoint is intact — free disk space or choose another train.out_dir, then resume"
        ) from None
    if ddp.master:
        ckpt.save_checkpoint({**train_state, "model": {}}, tmp / TRAIN_STATE)  # weights: in the shards
        try:
            os.rename(tmp, final)
            _fsync_dir(root)
            atomic_write_text(root / POINTER, name)  # the commit
        except OSError as e:
            raise os_error(e, root, "write", "train.out_dir") from None
        for other in root.glob("step-*"):  # the previous checkpoint, and any never committed
            if other != final:
                shutil.rmtree(other, ignore_errors=True)
    ddp.barrier()
    return final


def load_train_state(path: Path) -> dict[str, Any]:
    """train_state.pt of a sharded checkpoint, checked like ckpt.pt (CRC, structure, safe load)."""
    return ckpt.load_checkpoint(path / TRAIN_STATE, require=TRAIN_STATE_KEYS)


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank reads its part of the model and optimizer from `path` (resharded if the number
    of ranks changed); a damaged or foreign checkpoint is one QuillError."""
    _check_metadata(path / ".metadata")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        dcp.load(state, storage_reader=FileSystemReader(path), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 — missing or truncated shards, shapes that differ
        raise QuillError(f"cannot resume from {shown(path)}: {_first_line(e)}; start over with --overwrite") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, except that non-tensor items load without running code (weights_only)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# What DCP's .metadata may name: its own record classes, dtypes, torch.Size, paths. Nothing callable
# beyond constructors and one layout lookup.
METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": None,  # any of its dataclasses
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = METADATA_GLOBALS.get(module, set())
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module in METADATA_GLOBALS and allowed is None) or name in allowed or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it would load {module}.{name}")


def _check_metadata(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except OSError as e:
        raise os_error(e, path, "read", "sharded checkpoint") from None
    except Exception as e:  # noqa: BLE001 — truncated or crafted pickles fail in many ways
        raise QuillError(
            f"{shown(path)} was refused ({_first_line(e)}); it is damaged or not written by quill train — start over with --overwrite"
        ) from None


def _first_line(e: BaseException) -> str:
    """A failure in a few words; for DCP's CheckpointException, the first rank's own error."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (cause, *_) = next(iter(e.failures.items()))
        return f"rank {rank}: {_first_line(cause)}"
    text = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
