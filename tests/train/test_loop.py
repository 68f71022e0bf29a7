"""The trainer: schedule, exact resume, DDP equivalence, and faults that keep work safe."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from support import assert_same_state, deadline, interrupt_after, poison_loss_at

import quillgpt.train.loop as train_mod
import quillgpt.train.schedule as schedule
from quillgpt.checkpoint import load_checkpoint, save_checkpoint
from quillgpt.config import TrainConfig, load_config, save_config
from quillgpt.errors import QuillError
from quillgpt.metrics_log import read_metrics
from quillgpt.runs import load_run
from quillgpt.train.loop import train
from quillgpt.train.run_dir import RunLock
from quillgpt.train.schedule import lr_at
from quillgpt.train.state import FIT_AFTER_STEPS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data") / "char"


def tiny_overrides(shakespeare_path, data_dir, out_dir, *extra):
    return [
        f"data.path={shakespeare_path}",
        f"data.out_dir={data_dir}",
        f"train.out_dir={out_dir}",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.batch_size=4",
        "train.max_iters=8",
        "train.eval_interval=4",
        "train.eval_iters=2",
        "train.log_interval=1",
        "train.warmup_iters=2",
        "train.device=cpu",
        *extra,
    ]


def tiny_config(shakespeare_path, data_dir, out_dir, *extra):
    return load_config(ROOT / "configs" / "shakespeare_char_cpu.yaml", tiny_overrides(shakespeare_path, data_dir, out_dir, *extra))


def losses(out_dir):
    return [(r["step"], r["train_loss"], r.get("val_loss")) for r in read_metrics(Path(out_dir) / "metrics.jsonl")]


def test_lr_schedule_shapes():
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10)
    assert lr_at(0, cfg, 100) == pytest.approx(1 / 11)
    assert lr_at(10, cfg, 100) == pytest.approx(1.0)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)  # cosine midpoint
    wsd = TrainConfig(learning_rate=1.0, min_lr=0.0, warmup_iters=0, lr_schedule="wsd", decay_frac=0.2)
    assert lr_at(79, wsd, 100) == 1.0 and lr_at(90, wsd, 100) == pytest.approx(0.5)
    const = TrainConfig(learning_rate=0.3, min_lr=0.0, warmup_iters=0, lr_schedule="constant")
    assert lr_at(99, const, 100) == 0.3


def test_training_writes_a_complete_run(shakespeare_path, data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(train_mod, "run_peak", lambda device, dtype: 1e12)  # a peak measured on a quiet machine
    result = train(tiny_config(shakespeare_path, data_dir, tmp_path / "run"), progress=False)
    run = tmp_path / "run"
    assert result.step == 8 and result.stopped == "done"
    for name in ("config.yaml", "tokenizer.json", "ckpt.pt", "best.pt", "metrics.jsonl"):
        assert (run / name).is_file(), name
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert {"train_loss", "lr", "tokens_per_sec", "mfu", "elapsed_s"} <= set(records[0])
    assert [r["tokens"] for r in records] == [4 * 16 * s for s in range(1, 9)]  # batch 4 × block 16
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    best = load_checkpoint(run / "best.pt")
    assert best["val_loss"] == min(r["val_loss"] for r in evals)
    assert best["step"] == min(evals, key=lambda r: r["val_loss"])["step"]


@pytest.mark.parametrize("extra", [[], ["train.grad_accum=2", "model.dropout=0.1"]], ids=["plain", "accum+dropout"])
def test_resume_is_bit_identical(shakespeare_path, data_dir, tmp_path, monkeypatch, extra):
    straight = train(tiny_config(shakespeare_path, data_dir, tmp_path / "a", *extra), progress=False)

    interrupt_after(monkeypatch, 3)
    first = train(tiny_config(shakespeare_path, data_dir, tmp_path / "b", *extra), progress=False)
    assert first.stopped == "interrupted" and first.step == 3
    monkeypatch.undo()
    resumed = train(tiny_config(shakespeare_path, data_dir, tmp_path / "b", *extra, "train.resume=true"), progress=False)

    assert resumed.step == straight.step == 8
    a = load_checkpoint(tmp_path / "a" / "ckpt.pt")["model"]
    b = load_checkpoint(tmp_path / "b" / "ckpt.pt")["model"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_resume_refuses_a_different_model(shakespeare_path, data_dir, tmp_path):
    train(tiny_config(shakespeare_path, data_dir, tmp_path / "r", "train.max_iters=4"), progress=False)
    cfg = tiny_config(shakespeare_path, data_dir, tmp_path / "r", "train.resume=true", "model.n_layer=3")
    with pytest.raises(QuillError, match=r"model\.n_layer: 2 → 3"):
        train(cfg, progress=False)


def test_resume_without_checkpoint_is_a_clear_error(shakespeare_path, data_dir, tmp_path):
    cfg = tiny_config(shakespeare_path, data_dir, tmp_path / "empty", "train.resume=true")
    with pytest.raises(QuillError, match="cannot resume: no checkpoint"):
        train(cfg, progress=False)


def test_resume_auto_starts_fresh_then_continues(shakespeare_path, data_dir, tmp_path):
    cfg = tiny_config(shakespeare_path, data_dir, tmp_path / "auto", "train.resume=auto", "train.max_iters=4")
    assert train(cfg, progress=False).step == 4
    cfg = tiny_config(shakespeare_path, data_dir, tmp_path / "auto", "train.resume=auto", "train.max_iters=6")
    assert train(cfg, progress=False).step == 6


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(shakespeare_path, data_dir, tmp_path, monkeypatch):
    cfg = tiny_config(shakespeare_path, data_dir, tmp_path / "nan", "train.eval_interval=2")
    poison_loss_at(monkeypatch, 3)
    with pytest.raises(QuillError, match="at step 3"):
        train(cfg, progress=False)
    kept = load_checkpoint(tmp_path / "nan" / "ckpt.pt")
    assert kept["step"] == 2
    assert all(torch.isfinite(t).all() for t in kept["model"].values())


def test_a_second_trainer_on_the_same_run_is_refused(shakespeare_path, data_dir, tmp_path):
    out = tmp_path / "locked"
    out.mkdir()
    with RunLock(out):
        with pytest.raises(QuillError, match="in use by a running quill train"):
            train(tiny_config(shakespeare_path, data_dir, out), progress=False)
    assert train(tiny_config(shakespeare_path, data_dir, out, "train.max_iters=2"), progress=False).step == 2


def test_time_budget_stops_with_a_checkpoint_and_decayed_lr(shakespeare_path, data_dir, tmp_path):
    cfg = tiny_config(
        shakespeare_path,
        data_dir,
        tmp_path / "budget",
        "train.max_iters=1000000",
        "train.time_budget=3s",
        "train.eval_interval=100000",
        "train.log_interval=5",
    )
    result = train(cfg, progress=False)
    assert result.stopped == "time_budget" and 0 < result.step < 1_000_000
    assert load_checkpoint(tmp_path / "budget" / "ckpt.pt")["step"] == result.step
    last = read_metrics(tmp_path / "budget" / "metrics.jsonl")[-1]
    # the horizon follows the pace, so the cosine is well into its decay when time runs out
    assert "val_loss" in last and last["lr"] < 0.75 * cfg.train.learning_rate


def test_bfloat16_autocast_on_cpu_trains(shakespeare_path, data_dir, tmp_path):
    result = train(tiny_config(shakespeare_path, data_dir, tmp_path / "bf16", "train.dtype=bfloat16"), progress=False)
    assert result.step == 8 and result.last_val_loss is not None and result.last_val_loss < 5


def test_cli_train_reports_and_writes_resolved_config(shakespeare_path, data_dir, tmp_path, capsys):
    from quillgpt.cli import main

    args = tiny_overrides(shakespeare_path, data_dir, tmp_path / "cli", "train.max_iters=2")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", str(ROOT / "configs" / "shakespeare_char_cpu.yaml"), "-q", *args])
    assert exit_.value.code == 0
    assert "done: step 2" in capsys.readouterr().out
    saved = load_config(tmp_path / "cli" / "config.yaml")
    assert saved.train.max_iters == 2 and saved.model.vocab_size == 65
    json.loads((tmp_path / "cli" / "tokenizer.json").read_text())


def test_resuming_a_weights_only_checkpoint_points_to_init_from(shakespeare_path, data_dir, tmp_path):

    train(tiny_config(shakespeare_path, data_dir, tmp_path / "w", "train.max_iters=2"), progress=False)
    state = load_checkpoint(tmp_path / "w" / "ckpt.pt")
    save_checkpoint({k: v for k, v in state.items() if k in ("model", "config", "tokenizer", "step")}, tmp_path / "w" / "ckpt.pt")
    with pytest.raises(QuillError, match="holds weights only.*train.init_from"):
        train(tiny_config(shakespeare_path, data_dir, tmp_path / "w", "train.resume=true"), progress=False)


def test_eval_lines_off_the_log_interval_still_carry_lr_time_and_tokens(shakespeare_path, data_dir, tmp_path):
    train(tiny_config(shakespeare_path, data_dir, tmp_path / "x", "train.log_interval=3"), progress=False)
    records = read_metrics(tmp_path / "x" / "metrics.jsonl")
    assert [r["step"] for r in records] == [3, 4, 6, 8]
    assert all({"lr", "elapsed_s", "tokens", "train_loss"} <= set(r) for r in records)


def test_a_failing_compile_falls_back_to_eager_with_one_warning(shakespeare_path, data_dir, tmp_path, monkeypatch):
    class BrokenCompiled(torch.nn.Module):  # a compiled model whose backend fails on its first call
        def forward(self, *args, **kwargs):
            raise RuntimeError("backend exploded")

    train(tiny_config(shakespeare_path, data_dir, tmp_path / "eager"), progress=False)
    monkeypatch.setattr(train_mod.torch, "compile", lambda model: BrokenCompiled())
    with pytest.warns(UserWarning, match="torch.compile failed .*backend exploded"):
        result = train(tiny_config(shakespeare_path, data_dir, tmp_path / "fallback", "train.compile=true"), progress=False)
    assert result.step == 8
    a = load_checkpoint(tmp_path / "eager" / "ckpt.pt")["model"]
    b = load_checkpoint(tmp_path / "fallback" / "ckpt.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # the failed step was redone on the same batch


# --- a run is never lost: refusals, --overwrite, weights-only best.pt, damaged inputs ------------

CONFIG = ROOT / "configs" / "shakespeare_char_cpu.yaml"
RUN_FILES = ("config.yaml", "tokenizer.json", "metrics.jsonl", "ckpt.pt", "best.pt")


@pytest.fixture(autouse=True)
def without_quill_debug(monkeypatch):
    monkeypatch.delenv("QUILL_DEBUG", raising=False)


@pytest.fixture(scope="module")
def finished(shakespeare_path, data_dir, tmp_path_factory):
    """A finished 2-step run; tests work on copies of it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train(tiny_config(shakespeare_path, data_dir, out, "train.max_iters=2", "train.eval_interval=2"), progress=False)
    return out


def copy_run(finished, tmp_path):
    return Path(shutil.copytree(finished, tmp_path / "run"))


def snapshot(run):
    return {name: (run / name).read_bytes() for name in RUN_FILES}


def quill_train(capsys, overrides, *flags, config=CONFIG):
    """`quill train` in-process: (exit code, stdout, stderr)."""
    from quillgpt.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", str(config), "-q", *flags, *overrides])
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_a_second_train_never_replaces_a_run_unasked(shakespeare_path, data_dir, finished, tmp_path, capsys, monkeypatch):
    run = copy_run(finished, tmp_path)
    before = snapshot(run)
    args = tiny_overrides(shakespeare_path, data_dir, run, "train.max_iters=3", "train.eval_interval=2")
    code, _, err = quill_train(capsys, args)
    assert code == 2
    line = one_error_line(err)
    best = load_checkpoint(run / "best.pt")["val_loss"]
    for part in (str(run), "step 2", f"best val loss {best:.4f}", f"train.out_dir={run}-2", "--resume", "--overwrite"):
        assert part in line, line
    code, _, err = quill_train(capsys, args, "--resume", "--overwrite")
    assert code == 2 and "pass one of them" in one_error_line(err)
    assert snapshot(run) == before

    # Replacing it was asked for, but the new run fails (NaN) or is stopped in its first step: still untouched.
    poison_loss_at(monkeypatch, 1)
    code, _, err = quill_train(capsys, [*args, "train.overwrite=true"])
    assert code == 2 and "loss became nan at step 1" in one_error_line(err)
    monkeypatch.undo()
    interrupt_after(monkeypatch, 1)
    code, out, _ = quill_train(capsys, args, "--overwrite")
    assert code == 130 and f"nothing in {run} was changed" in out
    monkeypatch.undo()
    assert snapshot(run) == before

    code, out, err = quill_train(capsys, args, "--overwrite")
    assert code == 0, err
    assert f"replaced the run in {run} (step 2" in out and "done: step 3" in out
    assert load_config(run / "config.yaml").train.overwrite is False  # reusing the run's config replaces nothing
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]


def test_other_data_never_replaces_the_data_a_run_trained_on(shakespeare_path, tmp_path, capsys):
    """Two runs, one data.out_dir: the second run's other text is refused in one line naming both
    sources and a data.out_dir of its own; the first run's data stay, so its eval still works."""
    from quillgpt.data.prepare import load_prepared
    from quillgpt.evaluate.scores import evaluate_checkpoint

    shared = tmp_path / "data" / "shakespeare_char"
    first = train(tiny_config(shakespeare_path, shared, tmp_path / "first", "train.max_iters=2"), progress=False)
    meta = (shared / "meta.json").read_bytes()
    mine = tmp_path / "mytext.txt"
    mine.write_text(shakespeare_path.read_text(encoding="utf-8")[:20_000].upper(), encoding="utf-8")
    args = tiny_overrides(shakespeare_path, shared, tmp_path / "mine", "train.max_iters=2", f"data.path={mine}")
    code, _, err = quill_train(capsys, args)
    line = one_error_line(err)
    assert code == 2 and str(shakespeare_path) in line and str(mine) in line
    assert f"data.out_dir={tmp_path / 'data' / 'mytext_char'}" in line and "--force" in line
    assert (shared / "meta.json").read_bytes() == meta and not (tmp_path / "mine" / "ckpt.pt").exists()
    assert evaluate_checkpoint(first.out_dir, device="cpu")[0].tokens > 0  # the first run's data, still its own
    code, _, err = quill_train(capsys, [*args, f"data.out_dir={tmp_path / 'data' / 'mytext_char'}"])
    assert code == 0, err
    assert load_prepared(tmp_path / "data" / "mytext_char")[0]["sources"][0]["path"] == str(mine)
    copy = tmp_path / "copy.txt"  # the same bytes under another name are the same data
    copy.write_bytes(shakespeare_path.read_bytes())
    assert train(tiny_config(shakespeare_path, shared, tmp_path / "third", "train.max_iters=1", f"data.path={copy}"), progress=False)


def test_resume_reads_the_runs_recorded_data_and_needs_no_network(shakespeare_path, tmp_path, capsys, monkeypatch):
    """`--config <the recipe> --resume` of a run trained on data.path=X: the recipe's download
    (here a URL nothing answers) is never tried; the run's recorded data.path and data.out_dir are used."""
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mytext.txt"
    mine.write_text(shakespeare_path.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    run = tmp_path / "run"
    code, _, err = quill_train(capsys, tiny_overrides(mine, tmp_path / "mine_char", run, "train.max_iters=2"))
    assert code == 0, err
    recipe_args = [a for a in tiny_overrides(mine, "unused", run, "train.max_iters=4") if not a.startswith("data.")]
    code, out, err = quill_train(capsys, [*recipe_args, "data.url=http://127.0.0.1:9/input.txt", "data.sha256=null"], "--resume")
    assert code == 0, err
    assert f"resuming on the data the run recorded (data.path={mine}, data.out_dir={tmp_path / 'mine_char'}" in out
    assert "done: step 4" in out and not (tmp_path / "data").exists()  # nothing downloaded, no default data.out_dir


def test_best_pt_holds_weights_only_and_loads_for_inference(finished):

    best = load_checkpoint(finished / "best.pt")
    assert set(best) == {"format", "model", "config", "tokenizer", "step", "val_loss"}
    assert (finished / "best.pt").stat().st_size < (finished / "ckpt.pt").stat().st_size / 2
    loaded = load_run(finished, which="best")
    assert loaded.step == 2 and not loaded.model.training


def test_resume_of_a_healthy_checkpoint_skips_unreadable_metrics_lines(shakespeare_path, data_dir, finished, tmp_path, capsys):
    run = copy_run(finished, tmp_path)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'caf\xe9 \xff\n[1, 2]\n{"step": "abc", "train_loss": 1.0}\n{"step": 2, "train_loss": 1e999}\n')
        f.write(b'{"step": 3, "train_loss": 9.5}\n')  # past the checkpoint (a killed run's): redone, not kept
    code, out, err = quill_train(capsys, tiny_overrides(shakespeare_path, data_dir, run, "train.max_iters=3"), "--resume")
    assert code == 0, err
    assert f"dropped 4 unreadable line(s) of {run / 'metrics.jsonl'}" in out and "done: step 3" in out
    logged = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in logged] == [1, 2, 3] and logged[-1]["train_loss"] != 9.5


def test_resume_from_a_damaged_checkpoint_says_what_train_can_do(shakespeare_path, data_dir, finished, tmp_path, capsys):
    run = copy_run(finished, tmp_path)
    data = (run / "ckpt.pt").read_bytes()
    (run / "ckpt.pt").write_bytes(data[: len(data) // 2])
    before = snapshot(run)
    code, _, err = quill_train(capsys, tiny_overrides(shakespeare_path, data_dir, run, "train.max_iters=3"), "--resume")
    line = one_error_line(err)
    assert code == 2 and "--which" not in line
    assert "cannot resume" in line and "--overwrite" in line and f"train.init_from={run / 'best.pt'}" in line
    assert snapshot(run) == before


def test_wandb_is_refused_by_name_but_old_runs_still_load(finished, tmp_path):

    with pytest.raises(QuillError, match=r"train\.wandb is no longer supported: .*train\.tensorboard=true"):
        load_config(CONFIG, ["train.wandb=true"])
    assert not hasattr(load_config(CONFIG, ["train.wandb=false"]).train, "wandb")  # an old run's config.yaml
    state = load_checkpoint(finished / "best.pt")
    state["config"]["train"]["wandb"] = False  # as every checkpoint written before the key went
    save_checkpoint(state, tmp_path / "old.pt")
    assert load_run(tmp_path / "old.pt").step == 2


def test_tensorboard_gets_the_runs_scalars(shakespeare_path, data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(train_mod, "run_peak", lambda device, dtype: 1e12)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    train(tiny_config(shakespeare_path, data_dir, out, "train.max_iters=4", "train.tensorboard=true"), progress=False)
    events = EventAccumulator(str(out))
    events.Reload()
    assert {"loss/train", "loss/val", "lr", "perf/tokens_per_sec", "perf/mfu"} <= set(events.Tags()["scalars"])
    logged = read_metrics(out / "metrics.jsonl")
    scalars = events.Scalars("loss/train")
    assert [e.step for e in scalars] == [r["step"] for r in logged]
    assert [e.value for e in scalars] == pytest.approx([r["train_loss"] for r in logged])
    assert [e.step for e in events.Scalars("loss/val")] == [4]


# --- time budget: the horizon is fitted once and checkpointed ------------------------------------


@pytest.mark.parametrize("peak", [None, 1.0])  # unknown (a busy CPU, an unlisted GPU); one a step exceeds
def test_mfu_is_shown_only_against_a_known_peak(shakespeare_path, data_dir, tmp_path, monkeypatch, peak):
    monkeypatch.setattr(train_mod, "run_peak", lambda device, dtype: peak)
    train(tiny_config(shakespeare_path, data_dir, tmp_path / "run", "train.max_iters=2"), progress=False)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records and all("mfu" not in r and r["tokens_per_sec"] > 0 for r in records)


def test_warmup_as_long_as_the_run_is_a_warning(shakespeare_path, data_dir, tmp_path, capsys):
    code, out, _ = quill_train(
        capsys, tiny_overrides(shakespeare_path, data_dir, tmp_path / "a", "train.max_iters=3", "train.warmup_iters=30")
    )
    assert code == 0 and "warning: train.warmup_iters=30 ≥ train.max_iters=3: the learning rate never leaves its warmup" in out
    assert "(it reaches 10% of train.learning_rate); set train.warmup_iters=1" in out  # lr_at(2) = 3/31 of the peak
    code, out, _ = quill_train(capsys, tiny_overrides(shakespeare_path, data_dir, tmp_path / "b", "train.max_iters=3"))
    assert code == 0 and "warning:" not in out


def test_fit_horizon_counts_evaluations_and_stays_in_range():
    cfg = TrainConfig(max_iters=1000, eval_iters=3, eval_interval=4, grad_accum=1)
    # 0.5 s/step plus an evaluation (2 splits × 3 forward batches = 2 step-times) every 4 steps
    assert schedule.fit_horizon(10, cfg, pace_s=0.5, budget_left_s=75.0) == 10 + 100
    assert schedule.fit_horizon(10, cfg, pace_s=0.5, budget_left_s=1e9) == 1000
    assert schedule.fit_horizon(10, cfg, pace_s=0.5, budget_left_s=0.0) == 11


def test_budgeted_run_resumes_on_its_saved_horizon(shakespeare_path, data_dir, tmp_path, monkeypatch):
    """The pace is fixed here (the horizon is a measurement), then taken away before the resume:
    a resume that fitted again, or fell back to max_iters, would end at another step."""
    real_fit = schedule.fit_horizon
    monkeypatch.setattr(schedule, "fit_horizon", lambda step, cfg, pace, left, world=1: real_fit(step, cfg, 0.1, 0.8, world))
    extra = ("train.max_iters=1000", "train.time_budget=1h", "train.eval_interval=4", "train.log_interval=2")
    straight = train(tiny_config(shakespeare_path, data_dir, tmp_path / "a", *extra), progress=False)
    fit_step = max(FIT_AFTER_STEPS, 2)
    horizon = real_fit(fit_step, tiny_config(shakespeare_path, data_dir, "x", *extra).train, 0.1, 0.8)
    assert straight.stopped == "time_budget" and straight.step == horizon > fit_step + 2
    saved = load_checkpoint(tmp_path / "a" / "ckpt.pt")
    assert saved["horizon"] == horizon and saved["budget_ended"] is True

    interrupt_after(monkeypatch, fit_step + 2)
    first = train(tiny_config(shakespeare_path, data_dir, tmp_path / "b", *extra), progress=False)
    assert first.stopped == "interrupted" and load_checkpoint(tmp_path / "b" / "ckpt.pt")["horizon"] == horizon
    monkeypatch.undo()
    resumed = train(tiny_config(shakespeare_path, data_dir, tmp_path / "b", *extra, "train.resume=true"), progress=False)
    assert resumed.stopped == "time_budget" and resumed.step == horizon
    a, b = (load_checkpoint(tmp_path / r / "ckpt.pt")["model"] for r in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_init_from_applies_what_it_can_and_refuses_an_architecture_override(shakespeare_path, data_dir, tmp_path):
    """train.init_from takes the source's architecture: a model.* override that would change it
    is refused naming the key (it was silently ignored); block_size, dropout and attn_impl apply."""
    train(tiny_config(shakespeare_path, data_dir, tmp_path / "src", "train.max_iters=2"), progress=False)
    init = f"train.init_from={tmp_path / 'src'}"
    for override, source_value in (("model.n_layer=3", 2), ("model.n_embd=16", 32), ("model.pos=rope", "learned")):
        with pytest.raises(QuillError) as e:
            train(tiny_config(shakespeare_path, data_dir, tmp_path / "ft", init, override), progress=False)
        assert f"{override} (it has {source_value}) cannot apply" in str(e.value) and "drop it" in str(e.value)
        assert not (tmp_path / "ft" / "ckpt.pt").exists()
    cfg = tiny_config(
        shakespeare_path,
        data_dir,
        tmp_path / "ft",
        init,
        "train.max_iters=2",
        "model.block_size=8",
        "model.dropout=0.1",
        "model.attn_impl=math",
    )
    train(cfg, progress=False)
    saved = load_config(tmp_path / "ft" / "config.yaml").model
    assert (saved.block_size, saved.dropout, saved.attn_impl, saved.n_layer) == (8, 0.1, "math", 2)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_lock_that_is_no_file_is_one_line(shakespeare_path, data_dir, tmp_path, kind):
    import os

    out = tmp_path / "locked"
    out.mkdir()
    (out / ".lock").mkdir() if kind == "directory" else os.mkfifo(out / ".lock")
    with pytest.raises(QuillError, match=r"cannot lock .*\.lock: .*; remove it"), deadline(60):
        train(tiny_config(shakespeare_path, data_dir, out, "train.resume=auto"), progress=False)


def test_fine_tuning_prepares_your_text_with_the_base_runs_tokenizer(shakespeare_path, data_dir, tmp_path):
    """A char model fine-tuned on another text: the data is tokenized with the base run's vocabulary
    (not a new one learned from the text), unless data.tokenizer says otherwise."""
    from quillgpt.data.prepare import load_prepared

    base = train(tiny_config(shakespeare_path, data_dir, tmp_path / "base", "train.max_iters=2"), progress=False)
    own = tmp_path / "mine.txt"
    own.write_text(shakespeare_path.read_text(encoding="utf-8")[:30000].lower(), encoding="utf-8")  # fewer characters
    tuned = tiny_config(
        shakespeare_path,
        tmp_path / "own_data",
        tmp_path / "tuned",
        f"data.path={own}",
        f"train.init_from={base.out_dir}",
        "train.max_iters=2",
        "data.val_fraction=0.2",
    )
    assert tuned.data.tokenizer == str(base.out_dir / "tokenizer.json")
    assert train(tuned, progress=False).step == 2
    base_spec = load_checkpoint(base.out_dir / "ckpt.pt")["tokenizer"]
    assert load_prepared(tmp_path / "own_data")[0]["tokenizer"] == base_spec
    other = tiny_config(
        shakespeare_path,
        tmp_path / "char_data",
        tmp_path / "other",
        f"data.path={own}",
        f"train.init_from={base.out_dir}",
        "data.tokenizer=char",
        "data.val_fraction=0.2",
    )
    with pytest.raises(
        QuillError,
        match=r"trained with the tokenizer char \(65 characters\) but data.tokenizer=char "
        r"gives char \(\d+ characters\); leave data.tokenizer unset",
    ):
        train(other, progress=False)


# --- what a run says: start-up line, why it stopped, how to go on ---------------------------------


def test_train_says_what_it_is_about_to_do_and_how_to_go_on_once_finished(shakespeare_path, data_dir, finished, tmp_path, capsys):
    run = copy_run(finished, tmp_path)
    code, out, err = quill_train(capsys, tiny_overrides(shakespeare_path, data_dir, run, "train.max_iters=2"), "--resume")
    assert code == 0 and "Traceback" not in err
    assert "already reached train.max_iters=2; to go on, resume with more steps (--resume train.max_iters=4," in out
    assert "train.resume=true train.max_iters=4 on `quill finetune`" in out  # which has no --resume flag
    code, out, _ = quill_train(capsys, tiny_overrides(shakespeare_path, data_dir, run, "train.max_iters=4"), "--resume")
    assert code == 0 and f"resuming {run} from step 2: " in out and ", 64 tokens/step, 4 steps" in out
    gives = "OMP_NUM_THREADS" not in os.environ  # cpu_share may take fewer threads: the first line says so
    assert (" thread(s) (fewer while other processes use the cores), 64" in out) == gives and " thread(s)" in out
    assert out.splitlines()[-1].startswith("done: step 4")
    session, total = map(
        int, re.search(r", (\d+)s \((\d+)s in all\) → ", out.splitlines()[-1]).groups()
    )  # this process's time, then the run's
    assert total >= session and total >= load_checkpoint(run / "ckpt.pt")["elapsed_s"] - 1
    fresh = tmp_path / "fresh"
    code, out, _ = quill_train(capsys, tiny_overrides(shakespeare_path, data_dir, fresh, "train.max_iters=1"))
    params = load_checkpoint(fresh / "ckpt.pt")
    assert f"training {fresh}: " in out and "cpu, " in out and "64 tokens/step, 1 step\n" in out and params["step"] == 1


def test_resuming_a_finished_run_prints_its_own_time_and_val_loss(shakespeare_path, data_dir, finished, tmp_path, capsys):
    """The last line gives the run's recorded figures: the time it trained (ckpt.pt's elapsed_s),
    its last val loss (metrics.jsonl) and its best; not this process's clock, nor `n/a`. (The run is
    made to have trained 754 s, its best earlier than its last evaluation.)"""
    run = copy_run(finished, tmp_path)
    val = [r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r][-1]
    saved = {**load_checkpoint(run / "ckpt.pt"), "elapsed_s": 754.4, "best_val_loss": val - 0.25}
    save_checkpoint(saved, run / "ckpt.pt")
    code, out, err = quill_train(capsys, tiny_overrides(shakespeare_path, data_dir, run, "train.max_iters=2"), "--resume")
    assert code == 0, err
    want = f"finished: step 2, val loss {val:.4f} (best {val - 0.25:.4f}), 754s → {run}"
    assert want in out.splitlines(), out


def test_resume_takes_the_model_from_the_run_not_from_the_recipe(shakespeare_path, data_dir, tmp_path, capsys, monkeypatch):
    """A run trained with model.n_layer=1 on the command line, resumed with its recipe alone (which
    says 2), goes on with its own model and ends as the uninterrupted run, bit for bit; a model key
    that the command line changes is refused in one line, and nothing is written."""
    run, recipe = tmp_path / "run", tmp_path / "recipe.yaml"
    save_config(load_config(CONFIG, tiny_overrides(shakespeare_path, data_dir, run)), recipe)
    assert quill_train(capsys, [f"train.out_dir={tmp_path / 'straight'}", "model.n_layer=1"], config=recipe)[0] == 0
    interrupt_after(monkeypatch, 5)
    assert quill_train(capsys, ["model.n_layer=1"], config=recipe)[0] == 130
    monkeypatch.undo()
    before = snapshot(run)
    code, _, err = quill_train(capsys, ["model.n_layer=3"], "--resume", config=recipe)
    assert code == 2 and "model.n_layer: 1 → 3" in one_error_line(err)
    assert snapshot(run) == before
    code, out, err = quill_train(capsys, [], "--resume", config=recipe)
    assert code == 0, err
    assert "resuming with the model the run recorded (model.n_layer=1, from " in out and "done: step 8" in out
    straight, resumed = (load_checkpoint(tmp_path / name / "ckpt.pt") for name in ("straight", "run"))
    assert_same_state(straight["model"], resumed["model"])
    assert losses(tmp_path / "straight") == losses(run)
    assert load_config(run / "config.yaml").model.n_layer == 1


def test_a_budgeted_run_says_where_it_ends_and_extends_on_a_larger_budget(shakespeare_path, data_dir, tmp_path, monkeypatch, capsys):
    """The fitted end is printed; a resume with the same budget says the run had ended; one with a
    larger budget fits the end again from its own pace and goes on from the step it stopped at."""
    # the pace is fixed here (the fitted end is a measurement): 6 more steps in 1 hour, 20 in 2
    monkeypatch.setattr(schedule, "fit_horizon", lambda step, cfg, pace, left, world=1: step + (20 if left > 3600 else 6))
    run = tmp_path / "timed"
    args = tiny_overrides(shakespeare_path, data_dir, run, "train.max_iters=1000", "train.time_budget=1h")
    code, out, _ = quill_train(capsys, args)
    first_end = FIT_AFTER_STEPS + 6
    assert code == 0 and f"the schedule ends at step {first_end}" in out
    assert f"time_budget: step {first_end}" in out and "it reached the schedule's end, fitted at step 10" in out
    code, out, _ = quill_train(capsys, args, "--resume")
    assert "already ended at step" in out and "--resume train.time_budget=10m" in out
    code, out, _ = quill_train(capsys, [*args, "train.time_budget=2h"], "--resume")
    refit_at = first_end + FIT_AFTER_STEPS // 2  # after a few steps of the resumed process's own pace
    assert code == 0 and f"resuming {run} from step {first_end}" in out
    assert f"the schedule ends at step {refit_at + 20}" in out and f"time_budget: step {refit_at + 20}" in out


def test_extending_a_finished_run_by_steps_is_exact_where_the_schedule_allows(shakespeare_path, data_dir, tmp_path):
    """A constant-lr run of 4 steps resumed with train.max_iters=8 is bit-identical to a straight
    8-step run (a cosine schedule instead runs over the new total from where it stopped)."""
    const = ("train.lr_schedule=constant", "train.warmup_iters=0")
    straight = train(tiny_config(shakespeare_path, data_dir, tmp_path / "a", *const), progress=False)
    train(tiny_config(shakespeare_path, data_dir, tmp_path / "b", *const, "train.max_iters=4"), progress=False)
    extended = train(tiny_config(shakespeare_path, data_dir, tmp_path / "b", *const, "train.resume=true"), progress=False)
    assert straight.step == extended.step == 8 and extended.stopped == "done"
    a, b = (load_checkpoint(tmp_path / r / "ckpt.pt") for r in "ab")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_autocast_training_follows_fp32(shakespeare_path, data_dir, tmp_path, dtype):
    """On CUDA, autocast training from the same weights and batches as fp32 gives fp32's losses
    to the dtype's rounding; fp16 runs through the GradScaler, which takes every step (no inf
    found: the scale stays at its start, 2**16, and counts 4 good steps); bf16 needs no scaler."""
    cuda = ("train.device=cuda", "train.max_iters=4", "train.eval_interval=4")
    train(tiny_config(shakespeare_path, data_dir, tmp_path / "fp32", *cuda, "train.dtype=float32"), progress=False)
    result = train(tiny_config(shakespeare_path, data_dir, tmp_path / dtype, *cuda, f"train.dtype={dtype}"), progress=False)
    assert result.step == 4
    for (s, a, va), (_, b, vb) in zip(losses(tmp_path / dtype), losses(tmp_path / "fp32"), strict=True):
        assert a == pytest.approx(b, abs=2e-2), s
        assert (va is None) == (vb is None) and (va is None or va == pytest.approx(vb, abs=2e-2)), s
    scaler = load_checkpoint(tmp_path / dtype / "ckpt.pt")["scaler"]
    if dtype == "float16":
        assert scaler["scale"] == 2.0**16 and scaler["_growth_tracker"] == 4
    else:
        assert scaler == {}
