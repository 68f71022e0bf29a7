"""What `quill train` says while it runs: a start-up line, a progress bar whose total is right
from the first step, and the reason a run stopped when it is not the obvious one.

A run with a step budget (train.max_iters) shows steps of max_iters. A run with a time budget
shows seconds of the budget instead: its number of steps is only known once the schedule's end is
fitted to the pace, and may still change with it (see schedule.follow_budget).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from quillgpt.cpu_share import gives_way
from quillgpt.train.state import Trainer


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
            self.bar.update(1)
            return
        self.step = f"{t.step:,}" + (f"/{t.horizon:,}" if t.fitted else "")
        self.set_postfix(refresh=False, **self.stats)
        self.bar.update(min(round(t.elapsed()), self.bar.total) - self.bar.n)  # redraws at tqdm's own pace

    def set_postfix(self, refresh: bool = True, **stats: str) -> None:
        self.stats = stats
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
        self.bar.write(line)

    def close(self) -> None:
        self.bar.close()
