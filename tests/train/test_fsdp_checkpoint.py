"""FSDP2 on CPU (gloo, 2 processes, fp32): the same losses as one process with the same global
batch, a kill mid-save that leaves the previous sharded checkpoint loadable, an exact resume, and
a consolidated ckpt.pt that holds (and samples) what the shards hold."""

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from support import CPU_CONFIG as CONFIG
from support import assert_same_state, losses, tiny, two_ranks
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from quillgpt.checkpoint import load_checkpoint
from quillgpt.config import ModelConfig, TrainConfig, load_config
from quillgpt.errors import QuillError
from quillgpt.inference.generate import generate_tokens
from quillgpt.model.gpt import GPT
from quillgpt.runs import load_run
from quillgpt.train import fsdp_checkpoint as sharded
from quillgpt.train.distributed import FITS_FRACTION, Dist, prepare_model, resolve_strategy
from quillgpt.train.loop import train
from quillgpt.train.memory import estimate_train_bytes
from quillgpt.train.optim import build_optimizer

FSDP = ("train.strategy=fsdp", "train.activation_checkpointing=true", "train.grad_accum=2", "train.max_iters=6")


@pytest.fixture(scope="module")
def runs(shakespeare_path, data_dir, tmp_path_factory):
    """One process (batch 4); two FSDP ranks (batch 2 each) straight to step 6; two more killed
    mid-save at step 4, then resumed in new processes."""
    out = tmp_path_factory.mktemp("fsdp")
    overrides = tiny(shakespeare_path, data_dir, "set-by-worker", "train.batch_size=2", *FSDP)
    train(
        load_config(
            CONFIG, tiny(shakespeare_path, data_dir, out / "single", "train.batch_size=4", "train.grad_accum=2", "train.max_iters=6")
        ),
        progress=False,
    )
    codes = [two_ranks("fsdp_worker.py", "train", str(out), *overrides), None]
    pending = sharded.latest_sharded(out / "crashed")  # what the kill left, before the resume cleans up
    leftovers = sorted(p.name for p in (out / "crashed" / sharded.SHARDED).iterdir())
    codes[1] = two_ranks("fsdp_worker.py", "resume", str(out), *overrides)
    return out, codes, pending, leftovers


def test_fsdp_matches_one_process_with_the_same_global_batch(runs):
    """2 ranks × batch 2 with activation checkpointing and 2 accumulation micro-steps = 1 process
    × batch 4: same losses, and the gathered weights agree."""
    out, codes, *_ = runs
    assert [c for c, _ in codes[0]] == [17, 17], codes[0]  # both killed where the worker kills them
    single, multi = losses(out / "single"), losses(out / "straight")
    assert [s for s, *_ in single] == [s for s, *_ in multi] == [1, 2, 3, 4, 5, 6]
    for (_, a, va), (_, b, vb) in zip(single, multi):
        assert a == pytest.approx(b, abs=1e-5)
        if va is not None:
            assert va == pytest.approx(vb, abs=1e-5)
    a, b = (load_checkpoint(out / name / "ckpt.pt")["model"] for name in ("single", "straight"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0, msg=k)


def test_kill_mid_save_keeps_the_last_checkpoint_and_resume_is_exact(runs):
    """Killed after step 4's shards were written but before the commit: `latest` still names
    step 2's complete checkpoint; resumed from it, the run ends with the straight run's weights,
    AdamW state, sampler, RNG streams and metrics."""
    out, codes, pending, leftovers = runs
    assert all(c == 0 for c, _ in codes[1]), codes[1]
    assert pending.name.startswith("step-00000002-")
    assert len(leftovers) == 3 and any(n.startswith(".step-00000004-") and n.endswith(".tmp") for n in leftovers)
    assert sorted(p.name for p in (out / "crashed" / sharded.SHARDED).iterdir()) == [
        "latest",
        sharded.latest_sharded(out / "crashed").name,
    ]  # the temp dir went at the restart
    straight, crashed = (shard_state(out / name) for name in ("straight", "crashed"))
    assert_same_state(straight, crashed)
    states = [sharded.load_train_state(sharded.latest_sharded(out / name)) for name in ("straight", "crashed")]
    for key in ("step", "sampler", "rank_rng", "tokens_seen"):
        assert_same_state(states[0][key], states[1][key])
    assert len(states[0]["rank_rng"]) == 2
    assert losses(out / "straight") == losses(out / "crashed")


def test_consolidated_checkpoint_holds_and_samples_what_the_shards_hold(runs):
    out = runs[0] / "straight"
    run = load_run(out, which="latest")
    shards = shard_state(out)["model"]
    weights = run.model.state_dict()
    assert set(shards) <= set(weights)
    for k, v in shards.items():
        assert torch.equal(weights[k], v), k
    from_shards = GPT(run.config.model)
    from_shards.load_state_dict(shards, strict=False)  # a tied head is the embedding
    assert torch.equal(from_shards.lm_head.weight, weights["lm_head.weight"])
    from_shards.eval()
    prompt = [run.tokenizer.encode("ROMEO:")]
    sample = lambda model: torch.stack(list(generate_tokens(model, prompt, 24, temperature=1.0, seed=3))).tolist()
    assert sample(run.model) == sample(from_shards)


def test_resuming_an_fsdp_run_without_fsdp_is_one_line(runs, shakespeare_path, data_dir):
    out = runs[0] / "straight"
    cfg = load_config(CONFIG, tiny(shakespeare_path, data_dir, out, "train.batch_size=2", "train.max_iters=8", "train.resume=true"))
    with pytest.raises(QuillError, match="sharded checkpoint of an FSDP run; resume it under torchrun with train.strategy=fsdp"):
        train(cfg, progress=False)


def test_crafted_metadata_is_refused_before_dcp_unpickles_it(runs, tmp_path):
    path = sharded.latest_sharded(runs[0] / "straight")
    sharded._check_metadata(path / ".metadata")  # DCP's own metadata passes
    (tmp_path / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(QuillError, match="refused.*it would load posix.system"):
        sharded._check_metadata(tmp_path / ".metadata")


def test_auto_strategy_shards_only_what_does_not_fit():
    model, tc = ModelConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=1024), TrainConfig(batch_size=8)
    need = estimate_train_bytes(model, tc).total
    two = Dist(rank=0, world_size=2)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_strategy(tc, model, Dist(), cuda) == "single"
    assert resolve_strategy(tc, model, two, cpu) == "ddp"  # host memory: always ddp
    free = {"now": int(need / FITS_FRACTION) + 1}
    import quillgpt.train.distributed as distributed

    real = distributed.available_bytes
    distributed.available_bytes = lambda device: free["now"]
    try:
        assert resolve_strategy(tc, model, two, cuda) == "ddp"
        free["now"] = int(need / FITS_FRACTION) - 1
        assert resolve_strategy(tc, model, two, cuda) == "fsdp"
        tc.strategy = "ddp"
        assert resolve_strategy(tc, model, two, cuda) == "ddp"
    finally:
        distributed.available_bytes = real
    with pytest.raises(QuillError, match="train.optimizer=muon needs whole matrices"):
        resolve_strategy(TrainConfig(strategy="fsdp", optimizer="muon"), model, two, cpu)


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    """Recomputed blocks (dropout on: the RNG is replayed) = stored activations, bit for bit."""
    cfg = ModelConfig(vocab_size=65, n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1)
    plain, recomputed = GPT(cfg), GPT(cfg)
    recomputed.load_state_dict(plain.state_dict())
    prepare_model(recomputed, TrainConfig(activation_checkpointing=True), "single", Dist(), torch.float32)
    assert list(recomputed.state_dict()) == list(plain.state_dict())  # checkpoints keep their names
    x = torch.randint(0, 65, (2, 16))
    for model in (plain, recomputed):
        torch.manual_seed(1)
        model(x, x)[1].backward()
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        assert torch.equal(p.grad, q.grad), name


def shard_state(run_dir):
    """A run's sharded checkpoint read back in this one process by PyTorch's own converter."""
    target = Path(run_dir) / "consolidated-for-test.pt"
    dcp_to_torch_save(sharded.latest_sharded(run_dir), target)
    return torch.load(target, weights_only=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: on purpose
def test_shards_load_into_one_process_and_damage_is_one_line(runs, tmp_path):
    """load_sharded reads the shards into an unsharded model (DCP reshards 2 → 1) and gets the
    consolidated weights; a shard cut short is refused with one line naming the checkpoint."""
    out = runs[0] / "straight"
    run = load_run(out, which="latest")
    model = GPT(run.config.model)
    optimizer = build_optimizer(model, run.config.train, torch.device("cpu"))
    sharded.load_sharded(sharded.latest_sharded(out), model, optimizer)
    for k, v in run.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert optimizer.state_dict()["state"]  # AdamW's moments came back too
    damaged = tmp_path / "step-00000006-0"
    shutil.copytree(sharded.latest_sharded(out), damaged)
    shard = damaged / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(QuillError, match=r"cannot resume from .*step-00000006-0: .*; start over with --overwrite"):
        sharded.load_sharded(damaged, model, optimizer)
