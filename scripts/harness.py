"""What every script in scripts/ shares: the figures' statistics, interleaved repetitions, peak
memory, the machine and load lines, the table, the text and the --smoke switch.

Scripts import it as a sibling (`from harness import ...`): `python scripts/x.py` puts scripts/ on
sys.path itself. It lives beside the scripts, not in quillgpt/, because it is bench code (nothing
in the library needs it) and the scripts need nothing installed but the package.

Why the method: a shared machine's speed drifts over minutes, so the variants of one comparison
are *interleaved* (rep 1 of A, B, C, then rep 2 of A, B, C, ...) and a burst of load slows all of
them alike; each figure is the median of its reps with their min and max. Compare ratios within
one run, and absolute figures only across runs with similar load averages (printed before and after).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
FLAGS = {"AVX2": ("avx2",), "AVX-512": ("avx512f",), "VNNI": ("avx512_vnni", "avx_vnni"), "BF16": ("avx512_bf16",), "AMX": ("amx_bf16",)}


def add_common(p: argparse.ArgumentParser, text: bool = False) -> None:
    """--smoke (every script: a seconds-long run on a tiny model, nothing downloaded) and, for the
    scripts that read Tiny Shakespeare, --data-path (the quickstart's download by default)."""
    p.add_argument("--smoke", action="store_true", help="a seconds-long run on a tiny model; skips what needs a real model")
    if text:
        p.add_argument("--data-path", "--text", dest="text", type=Path, help="Tiny Shakespeare (default: data/downloads/input.txt)")


def text_path(given: Path | None) -> Path:
    """The text a script reads: --data-path, else the quickstart's download; a missing one exits in one line."""
    from quillgpt.data.download import local_text
    from quillgpt.errors import QuillError

    try:
        return local_text(given, ROOT)
    except QuillError as e:
        raise SystemExit(f"error: {e}") from None


def skipped(what: str, why: str) -> None:
    """A part of a script a --smoke run (or this machine) leaves out, said in one line."""
    print(f"{what}: skipped ({why})", flush=True)


def tiny_run(out: Path, text: str = "\n" + "".join(map(chr, range(32, 127))), **model: Any) -> Path:
    """A run directory (config.yaml, tokenizer.json, ckpt.pt) of a random-init char model of `text`'s
    characters (printable ASCII; 1 layer × 32 unless `model` says otherwise): what --smoke runs on."""
    from quillgpt.config import Config, ModelConfig
    from quillgpt.data.tokenizer_files import build_tokenizer
    from quillgpt.model.gpt import GPT
    from quillgpt.runs import write_run

    tok = build_tokenizer("char", text)
    shape = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 128, "dropout": 0.0, **model}
    cfg = Config(model=ModelConfig(vocab_size=tok.vocab_size, **shape))
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    write_run(out, cfg, tok, GPT(cfg.model).state_dict())
    return out


def llama_argmax(llm: Any) -> int:
    """The argmax of a llama_cpp.Llama's last logits after eval (its `scores` hold them only with
    logits_all=True; without, llama.cpp's context keeps the last token's)."""
    import numpy as np

    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))  # noqa: SLF001


# --- statistics and repetitions ------------------------------------------------------------------


@dataclass
class Stats:
    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, xs: list[float]) -> Stats:
        return cls(statistics.median(xs), min(xs), max(xs), len(xs))

    def __str__(self) -> str:
        return f"{self.median:,.1f}" if self.n == 1 else f"{self.median:,.1f} ({self.lo:,.1f}–{self.hi:,.1f})"


def interleaved(fns: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """Call each fn once per rep, round-robin; each returns its own measurement (a time, a rate)."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            out[name].append(fn())
    return out


def timed(fn: Callable[[], Any], n: int = 1) -> float:
    """Seconds per call of fn, over n calls."""
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


# --- memory ----------------------------------------------------------------------------------------


def proc_status_kb(key: str, pid: int | str = "self") -> int | None:
    """A process's /proc status figure in kB (VmRSS, VmHWM), or None (no such process, not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(key + ":")), None)
    except OSError:
        return None


class PeakMemory:
    """Peak RSS rise (MB) inside the block; CUDA max allocated (MB) when on a GPU.

    Linux resets the peak (VmHWM) through /proc/self/clear_refs, and freed heap pages are handed
    back first (malloc_trim) so that memory reused from an earlier variant counts again.
    Elsewhere the figure is ru_maxrss, the process's peak so far (only the first variant's means much).
    """

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.rss_mb = float("nan")
        self.cuda_mb = float("nan")

    def __enter__(self) -> PeakMemory:
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = proc_status_kb("VmRSS")
        except OSError:
            self._base = None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc: object) -> None:
        peak = proc_status_kb("VmHWM") if self._base is not None else None
        if peak is None or self._base is None:
            self.rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        else:
            self.rss_mb = (peak - self._base) / 1024
        if self.cuda:
            self.cuda_mb = torch.cuda.max_memory_allocated() / 2**20


def run_child(cmd: list[str], **kw: Any) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MB from the kernel's wait4, stdout) of a command run to its end;
    a failure exits with its output."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{out[-3000:]}")
    return time.perf_counter() - start, usage.ru_maxrss / 1024, out


def serve(ckpt: str | Path, *flags: str, env: dict[str, str] | None = None, echo: bool = True) -> tuple[subprocess.Popen, str, list[str]]:
    """`quill serve` on a free loopback port once it prints the address it listens on: the process,
    that http://127.0.0.1:PORT address and its log from then on (kept by a thread, so the pipe never
    fills); the start-up lines echoed (the weights it serves)."""
    cmd = [sys.executable, "-m", "quillgpt", "serve", "--ckpt", str(ckpt), "--host", "127.0.0.1", "--port", "0", *flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    seen: list[str] = []  # warnings and --compile's lines come before the one with the address
    while not (found := re.search(r"(http://127\.0\.0\.1:\d+)/", line := proc.stderr.readline())) and line:
        seen.append(line)
    if not found:
        proc.kill()
        raise SystemExit(f"quill serve did not start: {''.join(seen)[-2000:]}")
    if echo:
        print("".join(seen) + line.strip(), flush=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    return proc, found.group(1), log


@functools.cache
def read_bandwidth(nbytes: int) -> float:
    """Bytes/s of summing an `nbytes` buffer over and over, as a decode step re-reads its weights
    (from the last-level cache when they fit there, else from memory); measured once per size."""
    x = torch.ones(max(nbytes // 4, 1))
    x.sum()
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < 0.5:
        x.sum()
        reps += 1
    return reps * x.nbytes / elapsed


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads: every linear's weight (int8: + the scales its
    one-row kernel reads; int4: codes, scales, zeros) and bias, the norms' gains, and one row of
    each embedding (a lookup, not a matmul; a tied head's matmul is the lm_head linear)."""
    from quillgpt.quant.int4 import Int4Linear
    from quillgpt.quant.int8 import Int8Linear
    from quillgpt.quant.int8_kernels import KERNELS

    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            total += m.weight[0].nbytes
        elif isinstance(m, Int4Linear):
            total += sum(b.nbytes for b in m.buffers())
        elif isinstance(m, (torch.nn.Linear, Int8Linear)):
            total += m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0)
            if isinstance(m, Int8Linear):
                scale, offset = m.scales_for(KERNELS[m.runs[m.plan.pick(1)]])
                total += scale.nbytes + (offset.nbytes if offset is not None else 0)
        else:
            total += sum(p.nbytes for p in m.parameters(recurse=False))
    return total


# --- the machine and its load ----------------------------------------------------------------------


def cpu() -> tuple[str, list[str]]:
    """The CPU's name and which of AVX2, AVX-512, VNNI, BF16 and AMX it has (/proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), []
    lines = text.splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    return name, [label for label, names in FLAGS.items() if flags.intersection(names)]


def machine() -> dict[str, Any]:
    """What a figure was measured on: the JSON header's fields and machine_line's."""
    name, isa = cpu()
    return {
        "cpu": f"{name} ({', '.join(isa) or 'no AVX2'})",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS") if k in os.environ},
        "python": platform.python_version(),
    }


def machine_line() -> str:
    m = machine()
    env = "".join(f" | {k}={v}" for k, v in m["env"].items())
    return f"CPU {m['cpu']} | {m['threads']} threads | torch {m['torch']} | GPU {m['gpu'] or 'none'}{env}"


def load_line(when: str) -> str:
    """The 1, 5 and 15-minute load averages: print one before and one after a measurement."""
    return f"load average {when}: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


# --- the table ---------------------------------------------------------------------------------------


@dataclass
class Row:
    group: str
    name: str
    metric: str  # what `value` measures, with its unit
    value: float | str | None  # None: not applicable (see note); str: already formatted
    lo: float | None = None
    hi: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more columns: ms/step, MFU, ratio, ...
    note: str = ""

    @classmethod
    def of(cls, group: str, name: str, metric: str, st: Stats, extra: dict[str, Any] | None = None, note: str = "") -> Row:
        """A row of a measured figure: its median and min–max."""
        return cls(group, name, metric, st.median, st.lo, st.hi, extra or {}, note)


class Report:
    """Rows printed group by group as aligned tables, and the whole run as JSON."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.header: dict[str, Any] = {}

    def add(self, row: Row) -> None:
        self.rows.append(row)

    def print_group(self, group: str) -> None:
        rows = [r for r in self.rows if r.group == group]
        if not rows:
            return
        extras = list(dict.fromkeys(k for r in rows for k in r.extra))
        table = [["", rows[0].metric, "min–max", *extras, "note"]]
        for r in rows:
            spread = "" if r.lo is None else f"{fmt(r.lo)}–{fmt(r.hi)}"
            table.append([r.name, "n/a" if r.value is None else fmt(r.value), spread, *(fmt(r.extra.get(k, "")) for k in extras), r.note])
        widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]) - 1)]
        print(f"\n## {group}")
        for i, row in enumerate(table):
            cells = [str(c).ljust(w) if j == 0 else str(c).rjust(w) for j, (c, w) in enumerate(zip(row, widths))]
            print("  ".join(cells) + ("  " + row[-1] if row[-1] else ""))
            if i == 0:
                print("  ".join("-" * w for w in widths))
        sys.stdout.flush()

    def to_json(self) -> dict[str, Any]:
        return {"header": self.header, "rows": [r.__dict__ for r in self.rows]}


def fmt(x: Any) -> str:
    if not isinstance(x, float):
        return str(x)
    if math.isnan(x):
        return "–"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


# --- training a model of one's own through the package's step -------------------------------------


def trainer(model: torch.nn.Module, tc: Any, sampler: Any, dtype: torch.dtype = torch.float32, compile: bool = False) -> Any:
    """The state `quill train` hands its train_step (build_optimizer's groups, GradScaler), built
    from the same pieces around any sampler with a next() (no run dir, no log, no evaluation)."""
    from quillgpt.config import Config
    from quillgpt.train.distributed import Dist
    from quillgpt.train.loop import Trainer
    from quillgpt.train.optim import build_optimizer

    device = torch.device(tc.device if tc.device != "auto" else "cpu")
    opt = build_optimizer(model, tc, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    t = Trainer(Config(model=model.config, train=tc), Dist(), device, dtype, Path(tc.out_dir), None, model, opt, scaler, sampler, {}, None)
    t.model = torch.compile(model) if compile else model
    return t


def add_toy_task(p: argparse.ArgumentParser, steps: int, batch: int) -> None:
    """The options of a toy task's two small models (passkey.py, prefix_task.py), and --smoke."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-n", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    add_common(p)


def train_toy(model: torch.nn.Module, args: argparse.Namespace, sampler: Any) -> float:
    """add_toy_task's --steps of the package's train_step on `sampler` (warmup a quarter, at most 50;
    cosine to a tenth of --lr; no weight decay); returns seconds."""
    from quillgpt.config import TrainConfig

    schedule = dict(learning_rate=args.lr, min_lr=args.lr / 10, warmup_iters=min(50, args.steps // 4))
    tc = TrainConfig(batch_size=args.batch, weight_decay=0.0, beta2=0.999, device="cpu", **schedule)
    return train(trainer(model, tc, sampler), args.steps)


def train(t: Any, steps: int) -> float:
    """`steps` of the package's train_step at train.py's schedule (lr_at, each group's lr_mult); returns seconds."""
    from quillgpt.train.loop import lr_at, train_step

    start = time.perf_counter()
    t.raw_model.train()
    for step in range(steps):
        lr = lr_at(step, t.cfg.train, steps)
        for group in t.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        train_step(t.model, t)
    return time.perf_counter() - start
