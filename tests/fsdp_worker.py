"""One rank of tests/train/test_fsdp_checkpoint.py's two-process FSDP runs (started by support.two_ranks, with
RANK, WORLD_SIZE and WORLD_INIT set).

    python tests/fsdp_worker.py train OUT_DIR override...    straight: 6 steps; crashed: killed mid-save at step 4
    python tests/fsdp_worker.py resume OUT_DIR override...   crashed: resumed to step 6

The kill: both ranks leave with os._exit right after every shard of step 4 is on disk, before
rank 0 commits the checkpoint — as a SIGKILL mid-save would.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from support import join_group_from_env

from quillgpt.config import load_config
from quillgpt.train import fsdp_checkpoint as sharded
from quillgpt.train.loop import train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char_cpu.yaml"
KILLED = 17


def kill_after_shards_of(step: int) -> None:
    real = sharded.dcp.save

    def save(state, storage_writer):
        real(state, storage_writer=storage_writer)
        if Path(storage_writer.path).name.startswith(f".step-{step:08d}-"):
            os._exit(KILLED)

    sharded.dcp.save = save


def main() -> None:
    phase, out, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    join_group_from_env()  # ours: train() uses it and leaves it open
    run = lambda name, *extra: train(load_config(CONFIG, [*overrides, f"train.out_dir={out / name}", *extra]), progress=False)
    if phase == "train":
        assert run("straight").step == 6
        kill_after_shards_of(4)
        run("crashed")
        raise AssertionError("the crashed run was not killed")
    assert run("crashed", "train.resume=true").step == 6
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
    # The work is done and checked; skip interpreter teardown, where a torch/gloo background thread
    # still joinable at exit aborted the process (SIGABRT, "terminate called without an active
    # exception") in 1 of 5 full-suite runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
