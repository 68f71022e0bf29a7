"""Writing a run's log: metrics.jsonl (its format is quillgpt/metrics_log.py) and TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quillgpt.errors import QuillError
from quillgpt.files import atomic_write
from quillgpt.metrics_log import METRICS, read_log

# metrics.jsonl field → TensorBoard tag
TB_TAGS = {
    "train_loss": "loss/train",
    "eval_train_loss": "loss/eval_train",
    "val_loss": "loss/val",
    "lr": "lr",
    "tokens_per_sec": "perf/tokens_per_sec",
    "mfu": "perf/mfu",
}


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """One line per record, written in one call (a kill leaves at most a cut last line)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def truncate_metrics(path: str | Path, after_step: int) -> int:
    """Keep the readable lines up to `after_step` (a resumed run redoes the rest); returns how
    many unreadable lines were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    log = read_log(path)
    keep = [r for r in log.records if r["step"] <= after_step]
    atomic_write(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in keep).encode()))
    return log.skipped


def check_tensorboard() -> None:
    """Refuse train.tensorboard=true up front when the tensorboard package is missing."""
    _summary_writer()


def _summary_writer() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise QuillError(
            "train.tensorboard=true needs the tensorboard package: pip install 'quillgpt[tensorboard]' (or set train.tensorboard=false)"
        ) from None
    return SummaryWriter


class TensorBoardLog:
    """Scalars of each metrics record as TensorBoard events in the run directory.

    `purge_step` (a resumed run's first new step) hides events a stopped run wrote past its
    checkpoint, as truncate_metrics drops their lines.
    """

    def __init__(self, out_dir: str | Path, purge_step: int | None = None):
        self.writer = _summary_writer()(log_dir=str(out_dir), purge_step=purge_step)

    def add(self, record: dict[str, Any]) -> None:
        for key, tag in TB_TAGS.items():
            if key in record:
                self.writer.add_scalar(tag, record[key], global_step=record["step"])

    def close(self) -> None:
        self.writer.close()


class MetricsWriter:
    """Where the trainer logs: metrics.jsonl always, TensorBoard when asked."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = False, purge_step: int | None = None):
        self.path = Path(out_dir) / METRICS
        self.tb = TensorBoardLog(out_dir, purge_step) if tensorboard else None

    def append(self, record: dict[str, Any]) -> None:
        append_jsonl(self.path, record)
        if self.tb is not None:
            self.tb.add(record)
            if "val_loss" in record:  # evaluations are rare: make them visible in TensorBoard at once
                self.tb.writer.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
