"""What `quill train` says while it runs: a start-up line, a progress bar whose total is right
from the first step, and the reason a run stopped when it is not the obvious one.

A run with a step budget (train.max_iters) shows steps of max_iters. A run with a time budget
shows seconds of the budget instead: its number of steps is only known once the schedule's end is
fitted to the pace, and may still change with it (see schedule.follow_budget).

`quill train … 2>&1 | tee log` and Ctrl-C end tee with quill, and a write into the dead pipe must
neither come before nor prevent the checkpoint the stop saves: a write that finds its pipe closed
sends the output to the terminal instead, where there is one (follow_the_reader_away).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

import torch
from tqdm import tqdm

from quillgpt.cpu_share import gives_way
from quillgpt.train.state import Trainer


def _reader_gone(fd: int) -> bool:
    """Whether fd is a pipe whose reading end has closed (poll flags the writing end POLLERR)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def follow_the_reader_away() -> None:
    """After a write hit a closed pipe: stdout and stderr whose reader is gone write to the
    terminal from now on (or to /dev/null without one: a service, a test), so nothing raises
    again, at exit either. The same Python streams stay, so tqdm keeps its bookkeeping."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            fd = stream.fileno()
            if _reader_gone(fd):
                try:
                    target = os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY)
                except OSError:
                    target = os.open(os.devnull, os.O_WRONLY)
                os.dup2(target, fd)
                os.close(target)


@contextlib.contextmanager
def reader_may_go() -> Iterator[None]:
    """Run a write; if its pipe has closed, follow the reader away (the write itself is lost)."""
    try:
        yield
    except BrokenPipeError:
        follow_the_reader_away()


def say(line: str, file: TextIO | None = None) -> None:
    """print(line), to the terminal instead if the pipe it went to has closed."""
    file = file or sys.stdout
    with reader_may_go():
        print(line, file=file, flush=True)
        return
    with contextlib.suppress(OSError):
        print(line, file=file, flush=True)


def startup_line(t: Trainer, tokens_per_step: str, resumed: bool) -> str:
    """One line of what is about to happen: the model, the hardware, the budget."""
    tc = t.cfg.train
    params = t.raw_model.num_params(non_embedding=False)
    dtype = str(t.dtype).removeprefix("torch.")
    where = f"{t.device.type}, {dtype}, {torch.get_num_threads()} thread(s)"
    if gives_way(t.device, t.ddp.world_size):  # cpu_share may take fewer: say so before its first "threads: 1 of 2"
        where += " (fewer while other processes use the cores)"
    if t.ddp.world_size > 1:
        where += f", {t.ddp.world_size} processes"
    if t.budget_s is not None:
        budget = f"time budget {tc.time_budget} ({t.budget_s - t.elapsed_before:.0f}s left)"
        budget += ", schedule's end fitted at step " + f"{t.horizon if t.fitted else t.fit_step:,}"
    else:
        budget = f"{tc.max_iters:,} step" + "s" * (tc.max_iters != 1)
    start = f"resuming {t.out_dir} from step {t.step:,}" if resumed else f"training {t.out_dir}"
    return f"{start}: {params / 1e6:.2f}M parameters, {where}, {tokens_per_step} tokens/step, {budget}"


class Progress:
    """The tqdm bar of a run: steps of the horizon, or seconds of the time budget (with the step
    and, once fitted, the schedule's end in its postfix), plus the last logged loss, lr, tokens/s."""

    def __init__(self, t: Trainer, enabled: bool) -> None:
        self.timed, self.stats, self.step = t.budget_s is not None, {}, ""
        kw: dict[str, Any] = dict(disable=not enabled, dynamic_ncols=True)
        if self.timed:
            self.bar = tqdm(
                total=round(t.budget_s),
                initial=round(t.elapsed_before),
                unit="s",
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s [{elapsed}{postfix}]",
                **kw,
            )
        else:
            self.bar = tqdm(total=t.horizon, initial=t.step, unit="step", **kw)

    def update(self, t: Trainer) -> None:
        if not self.timed:
            with reader_may_go():
                self.bar.update(1)
            return
        self.step = f"{t.step:,}" + (f"/{t.horizon:,}" if t.fitted else "")
        self.set_postfix(refresh=False, **self.stats)
        with reader_may_go():
            self.bar.update(min(round(t.elapsed()), self.bar.total) - self.bar.n)  # redraws at tqdm's own pace

    def set_postfix(self, refresh: bool = True, **stats: str) -> None:
        self.stats = stats
        with reader_may_go():
            self.bar.set_postfix({"step": self.step, **stats} if self.timed else stats, refresh=refresh)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """'evaluating…' on the bar while the val loss is measured (a big model's takes a minute),
        and that time left out of the bar's steps/s: its clock of the last redraw moves on by it."""
        stats = dict(self.stats)
        self.set_postfix(**{**stats, "now": "evaluating…"})
        started = time.time()
        try:
            yield
        finally:
            if not self.bar.disable:  # tqdm's rate: steps over the time since its last redraw
                self.bar.last_print_t += time.time() - started
            self.set_postfix(refresh=False, **stats)

    def write(self, line: str) -> None:
        with reader_may_go():
            self.bar.write(line)
            return
        with contextlib.suppress(OSError):  # the same line, to where the output goes now
            self.bar.write(line)

    def close(self) -> None:
        with reader_may_go():
            self.bar.close()
