"""Several processes, one run: process group, model wrapping, and each rank's own random stream.

Under torchrun every rank draws the same global batch and keeps its slice (data.BatchSampler is
seeded by train.seed alone), while everything else random — dropout above all — comes from the
rank's own stream, seeded with train.seed + rank. Each rank's stream is saved in the checkpoint
and given back to that rank on resume, so a resumed DDP run with dropout is exact too.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from quillgpt.perf import resolve_device


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")  # NCCL reduces CUDA tensors only
    owns_group: bool = False  # setup_distributed created the process group (so teardown ends it)

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

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` as a list indexed by rank on rank 0 (None elsewhere)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size if self.master else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def setup_distributed(device_name: str) -> tuple[Dist, torch.device]:
    """Under torchrun (WORLD_SIZE > 1): NCCL on GPUs, gloo on CPU; one device per rank.

    A process group that already exists (set up by the caller) is used as it is, and left open.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), resolve_device(device_name, "train.device")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, "train.device")
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Dist(rank, local_rank, world, device, owns), device


def teardown_distributed(ddp: Dist) -> None:
    if ddp.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: torch.nn.Module, ddp: Dist, device: torch.device) -> torch.nn.Module:
    """The module the training step calls: DDP across ranks (which also copies rank 0's weights
    to every rank), the model itself in one process. Checkpoints always save the unwrapped model."""
    if not ddp.enabled:
        return model
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


# --- random streams: everything random is saved, so resume is exact --------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def seed_rank(seed: int, ddp: Dist) -> None:
    """This rank's own stream: seed + rank (rank 0, and a single process, use `seed` itself)."""
    seed_everything(seed + ddp.rank)


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


def rank_rng_states(ddp: Dist, device: torch.device) -> dict[str, Any]:
    """The checkpoint's RNG keys (a collective: every rank calls it, rank 0 gets the result).

    `rng` is rank 0's stream (as in a one-process run); `rank_rng`, in DDP runs only, lists every
    rank's stream by rank."""
    states = ddp.gather(rng_state(device))
    if states is None:
        return {}
    return {"rng": states[0], **({"rank_rng": states} if ddp.enabled else {})}


def restore_rank_rng(state: dict[str, Any], seed: int, ddp: Dist, device: torch.device) -> None:
    """Give this rank its own saved stream; a rank the checkpoint has none for (a run resumed on
    more processes than it was saved from) starts its stream afresh from seed + rank."""
    saved = state.get("rank_rng") or [state["rng"]]
    if ddp.rank < len(saved):
        set_rng_state(saved[ddp.rank], device)
    else:
        seed_rank(seed, ddp)
