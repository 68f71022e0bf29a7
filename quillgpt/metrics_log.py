"""metrics.jsonl, a run's log: one JSON object a line, written by the trainer, read by `quill plot`
and by a resume.

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

from quillgpt.files import read_bytes

METRICS = "metrics.jsonl"
# Fields that must be finite numbers when present; `step` must also be a non-negative integer.
NUMERIC = ("tokens", "train_loss", "eval_train_loss", "val_loss", "lr", "tokens_per_sec", "mfu", "elapsed_s")


@dataclass
class MetricsLog:
    """The readable records of a metrics.jsonl, in file order, and how many lines were skipped."""

    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0


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
