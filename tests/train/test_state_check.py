"""A resume's training state is typed and shaped before anything is restored or written: every
damaged part is one line naming ckpt.pt and the field, exit 2, the run directory unchanged."""

import math
import shutil
from pathlib import Path

import pytest
import torch
from support import CPU_CONFIG, tiny

from quillgpt.checkpoint import load_checkpoint, save_checkpoint
from quillgpt.config import load_config
from quillgpt.train.loop import train


@pytest.fixture(autouse=True)
def without_quill_debug(monkeypatch):
    monkeypatch.delenv("QUILL_DEBUG", raising=False)


@pytest.fixture(scope="module")
def finished(shakespeare_path, data_dir, tmp_path_factory):
    """A finished 2-step run; each test damages a copy of its ckpt.pt."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train(load_config(CPU_CONFIG, tiny(shakespeare_path, data_dir, out, "train.max_iters=2")), progress=False)
    return out


def _first_moment(s):
    first = next(iter(s["optimizer"]["state"].values()))
    first["exp_avg"] = first["exp_avg"].reshape(-1)[:-1].clone()


def _step_nan(s):
    next(iter(s["optimizer"]["state"].values()))["step"] = torch.tensor(math.nan)


def _moment_nan(s):
    next(iter(s["optimizer"]["state"].values()))["exp_avg_sq"].fill_(math.inf)


def _embedding(s):
    s["model"]["transformer.wte.weight"] = torch.zeros(3, 32)


# name → (how ckpt.pt's state is damaged, the field the refusal names)
DAMAGES = {
    "empty optimizer": (lambda s: s.update(optimizer={}), "'optimizer'"),
    "no param groups": (lambda s: s["optimizer"].update(param_groups=[]), "param_groups"),
    "group setting a string": (lambda s: s["optimizer"]["param_groups"][0].update(lr="fast"), "param_groups[0].lr"),
    "state of no parameter": (lambda s: s["optimizer"]["state"].update({999: {}}), "'optimizer'.state"),
    "mis-shaped moment": (_first_moment, "exp_avg"),
    "NaN step count": (_step_nan, "'step'"),
    "infinite moment": (_moment_nan, "exp_avg_sq"),
    "empty sampler": (lambda s: s.update(sampler={}), "'sampler'"),
    "short generator": (lambda s: s["sampler"].update(generator=torch.zeros(7, dtype=torch.uint8)), "'sampler'.generator"),
    "float generator": (lambda s: s["sampler"].update(generator=torch.zeros(5056)), "'sampler'.generator"),
    "torch rng": (lambda s: s["rng"].update(torch=torch.zeros(3, dtype=torch.uint8)), "'rng'.torch"),
    "python rng": (lambda s: s["rng"].update(python=[3, [1, 2], None]), "'rng'.python"),
    "python rng words": (lambda s: s["rng"]["python"][1].__setitem__(0, 2**40), "'rng'.python"),
    "numpy rng position": (lambda s: s["rng"]["numpy"].__setitem__(2, 99_999), "'rng'.numpy"),
    "no rng streams": (lambda s: s.update(rng={}), "'rng'"),
    "model section a string": (lambda s: s["config"].update(model="gpt"), "'config'"),
    "unknown model key": (lambda s: s["config"]["model"].update(n_layers=2), "n_layers"),
    "model key of a wrong type": (lambda s: s["config"]["model"].update(n_layer="two"), "model.n_layer"),
    "extra tensor": (lambda s: s["model"].update(extra=torch.zeros(2)), "extra"),
    "missing tensor": (lambda s: s["model"].pop("transformer.ln_f.weight"), "lacks"),
    "mis-shaped embedding": (_embedding, "transformer.wte.weight"),
    "negative tokens seen": (lambda s: s.update(tokens_seen=-5), "'tokens_seen'"),
    "infinite elapsed time": (lambda s: s.update(elapsed_s=math.inf), "'elapsed_s'"),
    "NaN best loss": (lambda s: s.update(best_val_loss=math.nan), "'best_val_loss'"),
    "negative horizon": (lambda s: s.update(horizon=-3), "'horizon'"),
}


def resume(capsys, shakespeare_path, data_dir, run):
    from quillgpt.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", str(CPU_CONFIG), "-q", "--resume", *tiny(shakespeare_path, data_dir, run, "train.max_iters=4")])
    out, err = capsys.readouterr()
    return exit_.value.code, err


def files(run: Path) -> dict[str, bytes]:
    """Every file of the run but its lock (which records the pid of whoever holds it)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


def refused(capsys, shakespeare_path, data_dir, run, field):
    before = files(run)
    code, err = resume(capsys, shakespeare_path, data_dir, run)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert "cannot resume" in line and "ckpt.pt" in line and field in line, line
    assert f"use the run's other checkpoint (best.pt): train.init_from={run / 'best.pt'}" in line, line
    assert files(run) == before


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_training_state_is_refused_before_anything_is_restored(damage, capsys, shakespeare_path, data_dir, finished, tmp_path):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    state = load_checkpoint(run / "ckpt.pt")
    change, field = DAMAGES[damage]
    change(state)
    save_checkpoint(state, run / "ckpt.pt")
    refused(capsys, shakespeare_path, data_dir, run, field)


def test_bytes_after_the_zip_are_refused(capsys, shakespeare_path, data_dir, finished, tmp_path):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    with open(run / "ckpt.pt", "ab") as f:
        f.write(b"\0junk" * 100)
    refused(capsys, shakespeare_path, data_dir, run, "bytes follow the end of its zip archive")


def test_a_healthy_state_still_resumes(capsys, shakespeare_path, data_dir, finished, tmp_path):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    code, err = resume(capsys, shakespeare_path, data_dir, run)
    assert code == 0, err
    assert load_checkpoint(run / "ckpt.pt")["step"] == 4
