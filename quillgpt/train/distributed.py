"""Several processes, one run: process group, DDP or FSDP, and each rank's own random stream.

train.strategy picks how N ranks share the model: `ddp` keeps a whole copy on each rank and
averages gradients; `fsdp` (FSDP2, `fully_shard` per block and on the whole model) keeps 1/N of
the weights, gradients and AdamW state on each rank and gathers a block's weights only while it
runs; `auto` takes ddp when the model fits on one device (see `resolve_strategy`).

Under torchrun every rank draws the same global batch and keeps its slice (data.BatchSampler is
seeded by train.seed alone), while everything else random — dropout above all — comes from the
rank's own stream, seeded with train.seed + rank. Each rank's stream is saved in the checkpoint
and given back to that rank on resume, so a resumed DDP run with dropout is exact too.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from quillgpt.config import ModelConfig, TrainConfig
from quillgpt.device import available_bytes, resolve_device
from quillgpt.errors import QuillError
from quillgpt.model.gpt import GPT
from quillgpt.train.memory import estimate_train_bytes

FITS_FRACTION = 0.7  # auto: ddp when one micro-step's whole training state takes ≤ 70% of free device memory
TIMEOUT_ENV = "QUILL_DIST_TIMEOUT"  # seconds a rank waits for its peers in a collective before it fails


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")  # NCCL reduces CUDA tensors only
    owns_group: bool = False  # setup_distributed created the process group (so teardown ends it)
    grouped: bool = False  # in a process group, which one process joins only for train.strategy ddp/fsdp

    @property
    def enabled(self) -> bool:
        return self.grouped or self.world_size > 1

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


def setup_distributed(device_name: str, strategy: str = "auto") -> tuple[Dist, torch.device]:
    """Under torchrun (WORLD_SIZE > 1): NCCL on GPUs, gloo on CPU; one device per rank.

    One process runs alone, unless torchrun started it (RANK is set) and `strategy` names ddp or
    fsdp: then it is a group of one, so that one GPU runs those paths (NCCL, the DDP wrapper, FSDP
    shards and their checkpoints) and resumes an FSDP run's sharded checkpoint.
    A process group that already exists (set up by the caller) is used as it is, and left open.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not (strategy in ("ddp", "fsdp") and "RANK" in os.environ):
        return Dist(), resolve_device(device_name, "train.device")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, "train.device")
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=group_timeout())
    return Dist(rank, local_rank, world, device, owns, grouped=True), device


def group_timeout() -> timedelta | None:
    """How long a rank waits for its peers (at the start and in each collective) before it fails
    with an error naming the wait, instead of waiting on a stuck or vanished peer: $QUILL_DIST_TIMEOUT
    seconds, else torch's default (30 minutes: rank 0 alone prepares the data while the others wait)."""
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise QuillError(
            f"{TIMEOUT_ENV} must be a number of seconds above 0, got {value[:100]!r}; unset it for torch's default (30 minutes)"
        )
    return timedelta(seconds=seconds)


def teardown_distributed(ddp: Dist) -> None:
    if ddp.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def resolve_strategy(tc: TrainConfig, model_cfg: ModelConfig, ddp: Dist, device: torch.device) -> str:
    """'single' (one process), 'ddp' or 'fsdp'. auto: ddp when the model "fits", i.e. fp32
    weights + gradients + AdamW's two moments (16 bytes per parameter) plus one micro-batch of
    activations (train/memory.py) take at most FITS_FRACTION of the device's free memory
    at start; fsdp otherwise. On CPU (and MPS) auto is ddp: there memory is the host's, shared."""
    if not ddp.enabled:
        return "single"
    strategy = tc.strategy
    if strategy == "auto":
        free = available_bytes(device) if device.type == "cuda" else None
        need = estimate_train_bytes(model_cfg, tc).total
        strategy = "fsdp" if free is not None and need > FITS_FRACTION * free else "ddp"
    if strategy == "fsdp" and tc.optimizer != "adamw":
        raise QuillError("train.optimizer=muon needs whole matrices, which FSDP shards; use train.strategy=ddp or train.optimizer=adamw")
    return strategy


def prepare_model(model: GPT, tc: TrainConfig, strategy: str, ddp: Dist, dtype: torch.dtype) -> GPT:
    """Before the optimizer is built (FSDP replaces the parameters): activation checkpointing on
    each block if asked, then FSDP2 on each block and on the whole model (the embeddings, the head
    tied to them and the final norm). Mixed precision follows train.dtype: weights are gathered in
    it, gradients reduced in fp32, and the sharded master weights stay fp32."""
    if tc.activation_checkpointing:
        from torch.distributed._composable import checkpoint  # recompute a block in backward: same names, same RNG

        for block in model.transformer.h:
            checkpoint(block)
    if strategy != "fsdp":
        return model
    mesh = init_device_mesh(ddp.device.type, (ddp.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # moves the shards to the mesh's device
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)


def wrap_model(model: torch.nn.Module, ddp: Dist, device: torch.device) -> torch.nn.Module:
    """The module the training step calls: DDP across ranks (which also copies rank 0's weights
    to every rank), the model itself in one process or under FSDP (sharded in prepare_model).
    Checkpoints always save the unwrapped model."""
    if not ddp.enabled or is_sharded(model):
        return model
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def grad_sync(model: torch.nn.Module, raw_model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Gradient accumulation: reduce gradients across ranks on the last micro-step only."""
    if isinstance(raw_model, FSDPModule):
        raw_model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return model.no_sync() if isinstance(model, DDP) and not sync else contextlib.nullcontext()


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict, as a one-process run saves it. Under FSDP a collective
    (every rank calls it): rank 0 gets the gathered weights on CPU, the others an empty dict."""
    if not is_sharded(model):
        return model.state_dict()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# --- random streams: everything random is saved, so resume is exact --------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)  # seed + rank may pass numpy's range
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
