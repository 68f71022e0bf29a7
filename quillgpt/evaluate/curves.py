"""Loss curves of runs (`quill plot`): train and val loss from each run's metrics.jsonl against
steps, tokens or wall time, several runs on one plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from quillgpt.errors import QuillError
from quillgpt.evaluate.figures import IMAGE_FORMATS, matplotlib_figure, save_figure
from quillgpt.metrics_log import read_log

X_LABELS = {"step": "step", "tokens": "tokens seen", "time": "wall time"}


@dataclass
class Curves:
    """One run's losses against the chosen x axis."""

    name: str
    train: tuple[list[float], list[float]]  # (x, train_loss) at every logged step
    val: tuple[list[float], list[float]]  # (x, val_loss) at evaluation steps; may be empty
    last_step: int
    skipped: int = 0  # metrics.jsonl lines that could not be read, left out


def load_curves(run_dir: str | Path, x: Literal["step", "tokens", "time"] = "step") -> Curves:
    """Read a run's metrics.jsonl (also while it trains) with metrics.read_log: lines it cannot
    read (a half-written last line, non-UTF-8 bytes, non-numeric values) are skipped and counted.

    tokens = tokens trained on so far (all processes); time = elapsed_s (seconds of training).
    """
    run = Path(run_dir)
    path = run / "metrics.jsonl"
    if x not in X_LABELS:
        raise QuillError(f"--x must be step, tokens or time, got {x!r}")
    if not path.is_file():
        raise QuillError(f"{run} has no metrics.jsonl; pass a run directory written by quill train")
    log = read_log(path)
    records = log.records
    if not records:
        raise QuillError(f"{path} has no logged steps yet; wait for the first log_interval")
    key = {"step": "step", "tokens": "tokens", "time": "elapsed_s"}[x]
    train = [(float(r[key]), float(r["train_loss"])) for r in records if key in r and "train_loss" in r]
    val = [(float(r[key]), float(r["val_loss"])) for r in records if key in r and "val_loss" in r]
    if not train:
        raise QuillError(f"{path} has no readable line with train_loss and {key} yet ({log.skipped} unreadable skipped)")
    return Curves(
        name=run.resolve().name,
        train=([p[0] for p in train], [p[1] for p in train]),
        val=([p[0] for p in val], [p[1] for p in val]),
        last_step=int(records[-1]["step"]),
        skipped=log.skipped,
    )


def plot_runs(
    run_dirs: list[str | Path],
    out: str | Path,
    x: Literal["step", "tokens", "time"] = "step",
    log: bool = False,
    dpi: int = 100,
    force: bool = False,
) -> list[Curves]:
    """Train (solid) and val (dashed, dots) loss of several runs on one plot, one colour each;
    an existing `out` that is not an image of its format is replaced only with `force`."""
    if not run_dirs:
        raise QuillError("pass at least one run directory")
    out = Path(out)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in IMAGE_FORMATS:
        raise QuillError(f"--out {out} must end in .png or .svg")
    curves = [load_curves(d, x) for d in run_dirs]
    names = [c.name for c in curves]
    if len(set(names)) < len(names):  # same leaf name in different places: use the paths as given
        for c, d in zip(curves, run_dirs):
            c.name = str(d)
    scale, unit = 1.0, ""
    if x == "time":
        longest = max(max(c.train[0] + c.val[0], default=0.0) for c in curves)
        scale, unit = (3600.0, " (h)") if longest > 3 * 3600 else (60.0, " (min)") if longest > 180 else (1.0, " (s)")
    with matplotlib_figure() as Figure:
        fig = Figure(figsize=(8, 5), dpi=dpi, layout="constrained")
        ax = fig.subplots()
        for n, c in enumerate(curves):
            color = f"C{n % 10}"
            ax.plot([v / scale for v in c.train[0]], c.train[1], color=color, lw=1.2, label=f"{c.name} train")
            if c.val[0]:
                ax.plot([v / scale for v in c.val[0]], c.val[1], color=color, ls="--", marker="o", ms=3, label=f"{c.name} val")
        ax.set_xlabel(X_LABELS[x] + unit)
        ax.set_ylabel("loss (nats/token)")
        if log:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
        save_figure(fig, out, fmt, dpi, force)
    return curves
