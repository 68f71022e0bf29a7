"""Threads that give way: training and inference on a CPU that another process is also using.

OpenMP's worker threads spin while they wait for work. Beside one busy process on two cores, two
threads fight it for both cores and a training step slows several times over, one thread much
less; decoding suffers more, since a decode step is many short parallel regions (docs/performance.md
has the figures). So about once a second the trainer, and the generation driver between decode
steps (inference/driver.py: sample, chat, serve; and `quill eval` between batches), look at how
much CPU the other processes used since the last look (the machine's busy time in /proc/stat less
this process's own) and keep torch's threads to the cores they leave: all of them on a quiet
machine. A count, once changed, is kept at least hold_s (15 s), so a neighbour that comes and goes
does not flip it every second. A thread count the user chose (OMP_NUM_THREADS) is kept as it is.

The price: some of torch's CPU kernels split their sums by thread, so a run whose thread count
changed rounds a little differently from one that kept it (the quickstart's model gives the same
bits at 1 and 2 threads on an AVX512 CPU; a GPT-2-style one with AdamW does not). Bit-exact
resume holds at a fixed count: set OMP_NUM_THREADS for a run that must repeat bit for bit on a
busy machine; the same for sampling that must repeat bit for bit beside other work.

torch's count belongs to the thread that sets it (OpenMP's setting is per thread): update() is
called on the thread that runs the model (the server's engine thread, not its HTTP threads).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

T = TypeVar("T")
Sample = tuple[float, float, float]  # (wall seconds, CPU seconds of every process, CPU seconds of this one)
# inference's first look: /proc counts in ticks of 10 ms, so 0.1 s on 2 cores is 20 ticks, enough to
# tell one busy neighbour from none before a short sample has decoded most of its tokens
FIRST_LOOK_S = 0.1


def read_proc() -> Sample:
    """The machine's busy CPU time and this process's, from /proc (Linux), in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal: steal is time another guest took from us
    busy = sum(cpu[:3]) + sum(cpu[5:8])
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ours = int(fields[11]) + int(fields[12])  # utime, stime (all threads)
    return time.monotonic(), busy / tick, ours / tick


@dataclass
class CpuShare:
    """Keeps torch's intra-op threads to the cores other processes leave free."""

    max_threads: int
    cores: int
    sample: Callable[[], Sample]
    interval_s: float = 1.0
    clock: Callable[[], float] = time.monotonic  # the samples' wall clock: read every step, /proc only once due
    hold_s: float = 15.0  # a count stays at least this long: a bursty neighbour does not flip it every second
    first_s: float | None = None  # the first look this soon (None: interval_s); inference: FIRST_LOOK_S
    last: Sample = field(init=False)
    changed_at: float = -math.inf
    threads: int = field(init=False)  # the count decided (torch's, while the share is held)
    others_seen: float | None = None  # cores the other processes used at the last look

    def __post_init__(self) -> None:
        self.last = self.sample()
        self.threads = self.max_threads

    @classmethod
    def for_run(cls, device: torch.device, world_size: int = 1, first_s: float | None = None) -> CpuShare | None:
        """None where threads stay as they are (gives_way is False)."""
        if not gives_way(device, world_size):
            return None
        return cls(torch.get_num_threads(), os.cpu_count() or 1, read_proc, first_s=first_s)

    def others(self, now: Sample) -> float:
        """Cores the other processes used on average since the last look."""
        wall, busy, ours = (a - b for a, b in zip(now, self.last))
        return max(0.0, (busy - ours) / wall) if wall > 0 else 0.0

    def update(self) -> str | None:
        """Between steps: resize the thread pool if the free cores changed; says so in one line."""
        due = self.interval_s if self.others_seen is not None or self.first_s is None else self.first_s
        if self.clock() - self.last[0] < due:
            return None
        now = self.sample()
        others = self.others_seen = self.others(now)
        self.last = now
        want = max(1, min(self.max_threads, round(self.cores - others)))
        if want == torch.get_num_threads() or now[0] - self.changed_at < self.hold_s:
            return None
        torch.set_num_threads(want)
        self.threads, self.changed_at = want, now[0]
        return (
            f"threads: {want} of {self.max_threads} (other processes are using {others:.1f} of "
            f"{self.cores} cores; set OMP_NUM_THREADS to fix the count)"
        )

    @contextlib.contextmanager
    def held(self) -> Iterator[CpuShare]:
        """The decided count on this thread while the block runs (a chat reply, a server's engine
        thread), the starting count back afterwards."""
        torch.set_num_threads(self.threads)
        try:
            yield self
        finally:
            torch.set_num_threads(self.max_threads)

    def note(self) -> str:
        """For a stats line: the threads used and, when fewer than all, why."""
        if self.threads == self.max_threads:
            return f"{self.threads} thread" + "s" * (self.threads > 1)
        return f"{self.threads} of {self.max_threads} threads (other processes used {self.others_seen or 0:.1f} of {self.cores} cores)"


def holding(share: CpuShare | None) -> contextlib.AbstractContextManager:
    """share.held(), or nothing to do where threads stay as they are (share is None)."""
    return share.held() if share is not None else contextlib.nullcontext()


def threads_note(share: CpuShare | None, device: torch.device) -> str:
    """The stats lines' words on threads: the share's, or the fixed count and why it is fixed."""
    if device.type != "cpu":
        return ""
    if share is not None:
        return share.note()
    fixed = " (OMP_NUM_THREADS)" if "OMP_NUM_THREADS" in os.environ else ""
    n = torch.get_num_threads()
    return f"{n} thread{'s' * (n > 1)}{fixed}"


def gives_way(device: torch.device, world_size: int) -> bool:
    """Whether a run's threads give way to other processes: not a GPU run, not several processes
    sharing the CPU on purpose (DDP), not a thread count set by the user, and /proc to read."""
    if device.type != "cpu" or world_size > 1 or "OMP_NUM_THREADS" in os.environ:
        return False
    return os.path.exists("/proc/stat") and os.path.exists("/proc/self/stat")


def others_during(measure: Callable[[], T], sample: Callable[[], Sample] = read_proc) -> tuple[T, float]:
    """`measure()` and the cores other processes used on average meanwhile (inf: no /proc to tell)."""
    if not (os.path.exists("/proc/stat") and os.path.exists("/proc/self/stat")):
        return measure(), math.inf
    before = sample()
    value = measure()
    wall, busy, ours = (a - b for a, b in zip(sample(), before))
    return value, (max(0.0, busy - ours) / wall if wall > 0 else math.inf)


def measured_quietly(measure: Callable[[], float], sample: Callable[[], Sample] = read_proc, most: float = 0.25) -> float | None:
    """`measure()` when other processes used at most `most` cores meanwhile, else None: a CPU
    peak timed beside other work is too low, and an MFU divided by it too high (over 100%)."""
    value, others = others_during(measure, sample)
    return value if others <= most else None


@contextlib.contextmanager
def sharing_cpu(device: torch.device, world_size: int = 1, first_s: float | None = None) -> Iterator[CpuShare | None]:
    """A run's CpuShare (or None), and its starting thread count back afterwards: train() or a
    generation may run inside a longer process."""
    share = CpuShare.for_run(device, world_size, first_s)
    if share is None:
        yield None
        return
    with share.held():
        yield share
