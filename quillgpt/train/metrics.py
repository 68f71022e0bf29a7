"""metrics.jsonl (and TensorBoard): the run's log, written by the trainer, read by plot and resume.

A log is read leniently: a line that cannot be read (cut short by a kill, non-UTF-8 bytes, not a
JSON object, a step or loss that is not a finite number) is skipped and counted, never fatal —
losing one line of a log must not cost the run it describes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quillgpt.errors import QuillError
from quillgpt.files import atomic_write, read_bytes

METRICS = "metrics.jsonl"
# Fields that must be finite numbers when present; `step` must also be a non-negative integer.
NUMERIC = ("tokens", "train_loss", "eval_train_loss", "val_loss", "lr", "tokens_per_sec", "mfu", "elapsed_s")
# metrics.jsonl field → TensorBoard tag
TB_TAGS = {
    "train_loss": "loss/train",
    "eval_train_loss": "loss/eval_train",
    "val_loss": "loss/val",
    "lr": "lr",
    "tokens_per_sec": "perf/tokens_per_sec",
    "mfu": "perf/mfu",
}


@dataclass
class MetricsLog:
    """The readable records of a metrics.jsonl, in file order, and how many lines were skipped."""

    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """One line per record, written in one call (a kill leaves at most a cut last line)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def parse_record(line: bytes) -> dict[str, Any] | None:
    """A metrics line as a dict with an int `step`, or None when it cannot be read."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    step = record.get("step")
    if isinstance(step, float) and math.isfinite(step) and step.is_integer():
        step = int(step)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    for key in NUMERIC:
        value = record.get(key)
        if key in record and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            return None
    return {**record, "step": step}


def read_log(path: str | Path) -> MetricsLog:
    """Every readable line of a metrics.jsonl; blank lines are neither records nor skipped."""
    log = MetricsLog()
    for line in read_bytes(path, METRICS).split(b"\n"):
        if not line.strip():
            continue
        record = parse_record(line)
        if record is None:
            log.skipped += 1
        else:
            log.records.append(record)
    return log


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The readable records of a metrics.jsonl (see `read_log` for the count of skipped lines)."""
    return read_log(path).records


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
