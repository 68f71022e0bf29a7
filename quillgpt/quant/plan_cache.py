"""Kernel plans kept across runs: `--quantize` measures which int8 kernel is fastest for each
input size (quant/plan.py), which took tens of seconds on a busy machine at every load. The
plan is stored per machine, model shape and build of the C++ kernel in a JSON file under the
user's cache directory ($QUILL_CACHE_DIR, else $XDG_CACHE_HOME/quillgpt, else
~/.cache/quillgpt), so the probe is paid once; deleting the file measures again. A cache that
cannot be read or written is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

FILE = "kernel_plans.json"


def cache_dir() -> Path:
    if os.environ.get("QUILL_CACHE_DIR"):
        return Path(os.environ["QUILL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quillgpt"


def machine(device: torch.device) -> dict[str, Any]:
    """What a measurement depends on besides the model: the processor, torch, its threads."""
    if device.type == "cuda":
        chip = torch.cuda.get_device_name(device)
    else:
        chip = _cpu_name() or platform.processor() or platform.machine()
    return {
        "chip": chip,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": device.type,
    }


def _cpu_name() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def key(device: torch.device, shape: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps({"machine": machine(device), **shape}, sort_keys=True).encode()).hexdigest()


def lookup(k: str) -> dict[str, Any] | None:
    try:
        return json.loads((cache_dir() / FILE).read_text()).get(k)
    except (OSError, ValueError, AttributeError):
        return None


def store(k: str, value: dict[str, Any]) -> Path | None:
    """Add one entry (other processes' entries kept; the file replaced at once). None: not written."""
    path = cache_dir() / FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            entries = {}
        entries = entries if isinstance(entries, dict) else {}
        entries[k] = value
        tmp = path.with_name(f"{FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)
        return path
    except OSError:
        return None
