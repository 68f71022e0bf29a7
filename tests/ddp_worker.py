"""One rank of tests/train/test_distributed.py's two-process run (started by support.two_ranks, with
RANK, WORLD_SIZE and WORLD_INIT set).

    python tests/ddp_worker.py OUT_DIR override...

In one gloo process group it trains OUT_DIR/straight for 4 steps, then OUT_DIR/resumed for 2
steps and resumes it to 4, and writes the first dropout mask this rank drew to OUT_DIR/mask{rank}.json.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from support import join_group_from_env

from quillgpt.config import load_config
from quillgpt.train.loop import train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char_cpu.yaml"


def record_first_mask(masks: list) -> None:
    real = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        out = real(input, p, training, inplace)
        if training and p > 0 and not masks:
            masks.append((out == 0).flatten().tolist())
        return out

    F.dropout = dropout  # nn.Dropout looks it up on each call


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    join_group_from_env()  # ours: train() uses it and leaves it open
    masks: list = []
    record_first_mask(masks)
    run = lambda name, *extra: train(load_config(CONFIG, [*overrides, f"train.out_dir={out / name}", *extra]), progress=False)
    assert run("straight", "train.max_iters=4").step == 4
    assert run("resumed", "train.max_iters=2").step == 2
    assert run("resumed", "train.max_iters=4", "train.resume=true").step == 4
    (out / f"mask{os.environ['RANK']}.json").write_text(json.dumps(masks[0]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
