"""DDP on CPU (gloo, 2 processes): the same windows as one process, each rank its own dropout
stream, and exact resume of every rank's stream."""

import contextlib
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support import CPU_CONFIG as CONFIG
from support import assert_same_state, ended, free_port, losses, tiny, torchrun, two_ranks

from quillgpt.checkpoint import load_checkpoint
from quillgpt.config import ModelConfig, TrainConfig, load_config
from quillgpt.errors import QuillError
from quillgpt.train.distributed import (
    TIMEOUT_ENV,
    Dist,
    group_timeout,
    rank_rng_states,
    resolve_strategy,
    restore_rank_rng,
    seed_rank,
    setup_distributed,
    teardown_distributed,
)
from quillgpt.train.loop import train

ROOT = Path(__file__).resolve().parents[2]


def test_ddp_two_processes_match_one_process(shakespeare_path, data_dir, tmp_path):
    """gloo, 2 ranks × batch 2 sees exactly the windows of 1 rank × batch 4: same losses."""
    train(
        load_config(CONFIG, tiny(shakespeare_path, data_dir, tmp_path / "single", "train.max_iters=4", "train.batch_size=4")),
        progress=False,
    )
    ddp = tiny(shakespeare_path, data_dir, tmp_path / "ddp", "train.max_iters=4", "train.batch_size=2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = torchrun(2, ["-m", "quillgpt", "train", "--config", str(CONFIG), "-q", *ddp], env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    single, multi = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert [s for s, *_ in single] == [s for s, *_ in multi]
    for (_, a, va), (_, b, vb) in zip(single, multi):
        assert a == pytest.approx(b, abs=1e-4)
        if va is not None:
            assert va == pytest.approx(vb, abs=1e-4)


def test_ranks_draw_their_own_dropout_and_resume_restores_each_ranks_stream(shakespeare_path, data_dir, tmp_path):
    """Two ranks with dropout: different masks; stopping at step 2 and resuming to 4 gives the
    weights, optimizer and every rank's RNG state of 4 straight steps, bit for bit."""
    overrides = tiny(
        shakespeare_path, data_dir, "set-by-worker", "model.dropout=0.1", "train.batch_size=2", "train.lr_schedule=constant"
    )  # constant: stopping via max_iters keeps the schedule
    for code, err in two_ranks("ddp_worker.py", str(tmp_path), *overrides):
        assert code == 0, err

    masks = [json.loads((tmp_path / f"mask{r}.json").read_text()) for r in (0, 1)]
    assert len(masks[0]) == len(masks[1]) > 100 and masks[0] != masks[1]
    straight, resumed = (load_checkpoint(tmp_path / name / "ckpt.pt") for name in ("straight", "resumed"))
    assert straight["step"] == resumed["step"] == 4
    ranks = straight["rank_rng"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["torch"], ranks[1]["torch"])
    assert torch.equal(straight["rng"]["torch"], ranks[0]["torch"])
    for key in ("model", "optimizer", "rank_rng", "sampler"):
        assert_same_state(straight[key], resumed[key], key)
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")


def test_rank_streams_round_trip_in_one_process():
    """What a checkpoint keeps of a single process's stream (no rank_rng) brings it back; a rank
    the checkpoint has no stream for starts from seed + rank."""
    device = torch.device("cpu")
    seed_rank(7, Dist())
    saved = rank_rng_states(Dist(), device)
    assert set(saved) == {"rng"}
    expected = torch.rand(3)
    restore_rank_rng(saved, 7, Dist(), device)
    assert torch.equal(torch.rand(3), expected)
    restore_rank_rng(saved, 7, Dist(rank=1, world_size=1), device)  # rank 1 of a run saved by one process
    fresh = torch.rand(3)
    torch.manual_seed(8)
    assert torch.equal(fresh, torch.rand(3))


def test_one_process_under_torchrun_joins_a_group_only_for_a_named_strategy(monkeypatch):
    """WORLD_SIZE=1 with torchrun's variables: train.strategy auto runs alone (no group); ddp or
    fsdp make a group of one (gloo here, NCCL on a GPU), so those paths run on a single device."""
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    alone, _ = setup_distributed("cpu", "auto")
    assert not alone.enabled and not dist.is_initialized()
    for strategy in ("ddp", "fsdp"):
        group, device = setup_distributed("cpu", strategy)
        try:
            assert group.enabled and group.owns_group and group.world_size == 1 and dist.get_backend() == "gloo"
            assert resolve_strategy(TrainConfig(strategy=strategy), ModelConfig(vocab_size=8), group, device) == strategy
        finally:
            teardown_distributed(group)
        assert not dist.is_initialized()


def test_a_hung_torchrun_fails_its_test_and_leaves_no_rank_behind(tmp_path):
    """support.torchrun past its timeout: the test fails, and neither the launcher nor any worker
    (each in a session of its own) is left running to wait on its group."""
    hang = tmp_path / "hang.py"
    hang.write_text("import time\nopen(__import__('sys').argv[1] + '/' + __import__('os').environ['RANK'], 'w').close()\ntime.sleep(600)\n")
    with pytest.raises(AssertionError, match="still running after"):
        torchrun(2, [str(hang), str(tmp_path)], {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=20)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["0", "1"]  # both ranks had started
    alive = [line for line in os.popen("ps -eo args").read().splitlines() if str(hang) in line]
    assert alive == []


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie, killed and not yet reaped by its parent, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# A process that starts a grandchild in a session of its own (as torchrun starts its ranks), says
# both pids, and waits: what `ended` must find and end however the body leaves.
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.mark.parametrize("leaves_by", ["an error", "the end of the body"])
def test_ended_kills_what_a_test_started_and_their_children_on_every_path(leaves_by):
    """support.ended, which two_ranks and torchrun run their processes under: the process and its
    grandchild in another session are both gone after the body, whether it failed or finished."""
    with pytest.raises(RuntimeError) if leaves_by == "an error" else contextlib.nullcontext():
        with ended() as started:
            proc = started.start([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
            pids = [proc.pid, int(proc.stdout.readline())]
            assert all(alive(pid) for pid in pids)
            if leaves_by == "an error":
                raise RuntimeError("the test failed here")
    assert not any(alive(pid) for pid in pids)


def test_a_failing_rank_fails_its_test_and_leaves_no_process_behind(tmp_path):
    """Rank 1 fails at once; rank 0 has started a child in a session of its own and waits for a
    peer that is gone: two_ranks fails the test past its timeout and neither rank nor the child
    is left running."""
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, subprocess, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit('rank 1 failed')\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "open(sys.argv[1] + '/child', 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(AssertionError, match="still running after"):
        two_ranks(str(worker), str(tmp_path), timeout=15)
    child = int((tmp_path / "child").read_text())
    assert not alive(child)
    assert [line for line in os.popen("ps -eo args").read().splitlines() if str(worker) in line] == []


def test_a_collective_waiting_past_the_group_timeout_fails_the_rank(tmp_path, monkeypatch):
    """QUILL_DIST_TIMEOUT bounds a rank's wait on a peer that never joins the collective (alive,
    elsewhere): an error naming the wait, where gloo would wait 30 minutes."""
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "import torch, torch.distributed as dist\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from support import join_group_from_env\n"
        "join_group_from_env()\n"
        "done = Path(sys.argv[1]) / 'rank0.done'\n"
        "if os.environ['RANK'] == '0':\n"
        "    try:\n"
        "        dist.all_reduce(torch.ones(1))\n"
        "    finally:\n"
        "        done.touch()\n"
        "while not done.exists():\n"
        "    time.sleep(0.1)\n"
    )
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    (code0, err0), (code1, _) = two_ranks(str(worker), str(tmp_path), timeout=120)
    assert code0 != 0 and "timed out" in err0.lower(), err0[-1000:]
    assert code1 == 0


def test_the_group_timeout_comes_from_quill_dist_timeout(monkeypatch):
    """setup_distributed hands QUILL_DIST_TIMEOUT to the process group (unset: torch's 30 minutes);
    a value that is not a positive number of seconds is one clear error."""
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout=None: seen.update(backend=backend, timeout=timeout))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", TIMEOUT_ENV: "7.5"}.items():
        monkeypatch.setenv(key, value)
    setup_distributed("cpu", "ddp")
    assert seen == {"backend": "gloo", "timeout": timedelta(seconds=7.5)}
    monkeypatch.delenv(TIMEOUT_ENV)
    assert group_timeout() is None
    for bad in ("0", "-3", "soon", "nan", "inf"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(QuillError, match=f"QUILL_DIST_TIMEOUT must be a number of seconds above 0, got '{bad}'"):
            group_timeout()
