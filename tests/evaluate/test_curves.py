"""Loss curves (quill plot) of runs in progress, runs without validation, and several runs at once."""

import json

import pytest
from matplotlib.image import imread

from quillgpt.cli import main
from quillgpt.config import load_config, save_config
from quillgpt.errors import QuillError
from quillgpt.evaluate import curves as viz


def cli(*args):
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in args])
    return exit_.value.code


def write_run(path, records, tail="", batch_size=4, grad_accum=2, block_size=16):
    """A run directory with config.yaml and metrics.jsonl (plus an optional cut-off last line)."""
    path.mkdir(parents=True)
    cfg = load_config(None, [f"train.batch_size={batch_size}", f"train.grad_accum={grad_accum}", f"model.block_size={block_size}"])
    save_config(cfg, path / "config.yaml")
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (path / "metrics.jsonl").write_text(lines + tail)
    return path


def records(n, val_every=None):
    return [
        {
            "step": s,
            "tokens": 128 * s,
            "train_loss": 4.0 / s,
            "lr": 1e-3,
            "elapsed_s": 2.0 * s,
            **({"val_loss": 4.5 / s} if val_every and s % val_every == 0 else {}),
        }
        for s in range(1, n + 1)
    ]


def test_curves_of_a_run_in_progress_and_one_without_val(tmp_path):
    live = write_run(tmp_path / "live", records(6, val_every=3), tail='{"step": 7, "train_lo')
    c = viz.load_curves(live)
    assert c.train[0] == [1, 2, 3, 4, 5, 6] and c.val == ([3.0, 6.0], [1.5, 0.75]) and c.last_step == 6
    assert viz.load_curves(live, "tokens").train[0] == [128 * s for s in range(1, 7)]
    assert viz.load_curves(live, "time").val[0] == [6.0, 12.0]
    no_val = write_run(tmp_path / "noval", records(4))
    assert viz.load_curves(no_val).val == ([], [])

    out = tmp_path / "curves.png"
    curves = viz.plot_runs([live, no_val], out, x="tokens", log=True, dpi=50)
    assert [c.name for c in curves] == ["live", "noval"]
    pixels = imread(out)
    assert pixels.shape[:2] == (250, 400) and pixels[..., :3].var() > 0


def test_plot_problems_are_quill_errors(tmp_path):
    with pytest.raises(QuillError, match="no metrics.jsonl"):
        viz.load_curves(tmp_path)
    empty = write_run(tmp_path / "empty", [], tail='{"step": 1, "tr')
    with pytest.raises(QuillError, match="no logged steps yet"):
        viz.load_curves(empty)
    with pytest.raises(QuillError, match="--x"):
        viz.load_curves(empty, "epochs")


def test_cli_plot_same_names_and_svg(tmp_path, capsys):
    a = write_run(tmp_path / "a" / "run", records(5, val_every=5))
    b = write_run(tmp_path / "b" / "run", records(3))
    out = tmp_path / "c.svg"
    assert cli("plot", a, b, "--out", out, "--x", "time") == 0
    printed = capsys.readouterr().out
    assert str(a) in printed and "best val 0.9000" in printed and "no val points yet" in printed
    assert "<svg" in out.read_text()
    assert cli("plot", a, "--out", tmp_path / "c.gif") == 2
    assert "png or .svg" in capsys.readouterr().err
