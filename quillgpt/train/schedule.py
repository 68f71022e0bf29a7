"""The learning-rate schedule and the time budget that can end it.

`lr_at` is warmup then cosine, warmup-stable-decay or constant, over a horizon of `total` steps:
train.max_iters, or with train.time_budget the step the budget is fitted to reach (`follow_budget`,
once, at a fixed step, so a straight and a resumed run follow the same schedule).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from quillgpt.config import TrainConfig
from quillgpt.train.state import Trainer


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of a run of `total` steps."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    if cfg.lr_schedule == "wsd":  # warmup, stable, then linear decay over the last decay_frac
        decay_start = total - int(cfg.decay_frac * total)
        if step < decay_start:
            return cfg.learning_rate
        frac = (step - decay_start) / max(1, total - decay_start)
    else:  # cosine from the end of warmup to the end of the run
        frac = (step - cfg.warmup_iters) / max(1, total - cfg.warmup_iters)
        frac = 0.5 * (1.0 - math.cos(math.pi * min(frac, 1.0)))
    return cfg.learning_rate - min(frac, 1.0) * (cfg.learning_rate - cfg.min_lr)


def fit_horizon(step: int, cfg: TrainConfig, pace_s: float, budget_left_s: float, world_size: int = 1) -> int:
    """The last step that fits in the time budget at `pace_s` seconds per step, so the lr
    schedule decays in time. Evaluations are counted as forward passes (a third of a training
    micro-step each); the budget still stops the run if the pace changes later."""
    per_step = pace_s * (1 + eval_step_times(cfg, world_size) / cfg.eval_interval)
    return min(cfg.max_iters, max(step + 1, step + int(budget_left_s / per_step)))


def eval_step_times(cfg: TrainConfig, world_size: int = 1) -> float:
    """One evaluation (2 splits × eval_iters forward batches, a third of a micro-step each) in step-times."""
    return 2 * cfg.eval_iters * world_size / (3 * cfg.grad_accum)


def follow_budget(t: Trainer, say: Callable[[str], None]) -> None:
    """train.time_budget: fit the horizon once, at a fixed step (FIT_AFTER_STEPS or warmup's end,
    whichever is later), so the steps before it follow max_iters' schedule identically in a
    straight and a resumed run; stop once the time left only holds one more step and the final
    evaluation and checkpoint (reserve_s: the last one's time; estimated from the pace before the
    first), so they too end inside the budget. `say` prints the fitted end once; t.stop_reason
    keeps why the run ends where it does."""
    if t.budget_s is None or t.budget_ended:
        return
    # seconds per step, after the first one: its one-time costs (lazy kernels, allocations) would
    # count as pace and fit the horizon short (docs/performance.md)
    t.pace_mark = t.pace_mark or (time.time(), t.step)
    since, step = t.pace_mark
    pace = (time.time() - since) / (t.step - step) if t.step > step else time.time() - t.t_start
    reserve = t.reserve_s or pace * eval_step_times(t.cfg.train, t.ddp.world_size)
    if t.ddp.any(t.elapsed() + pace + reserve >= t.budget_s):
        t.stop_reason = (
            f"the time ran out at {t.elapsed():.0f}s of {t.budget_s:.0f}s: one more step ({pace:.2f}s) "
            f"and the final evaluation and checkpoint (~{reserve:.0f}s, train.eval_iters={t.cfg.train.eval_iters}) "
            "would not fit; "
            + (
                f"the steps were slower than when the end (step {t.horizon:,}) was fitted"
                if t.fitted
                else f"the end was to be fitted at step {t.fit_step}"
            )
        )
        t.horizon, t.budget_ended = t.step, True  # finish as if this were the last step
    elif not t.fitted and t.step >= t.fit_step:
        left = t.budget_s - t.elapsed() - reserve
        horizon = fit_horizon(t.step, t.cfg.train, pace, left, t.ddp.world_size)
        t.horizon, t.fitted = t.ddp.broadcast_int(horizon), True
        say(
            f"time_budget: {pace:.3f}s a step fits {t.horizon - t.step:,} more steps in the {left:.0f}s left: "
            f"the schedule ends at step {t.horizon:,}"
        )
        t.stop_reason = (
            f"it reached the schedule's end, fitted at step {t.step:,} from {pace:.3f}s a step "
            "(a machine that speeds up after that ends early: the pace is measured once)"
        )
    if t.step >= t.horizon and t.horizon < t.cfg.train.max_iters:
        t.budget_ended = True  # the fitted end: the budget, not max_iters, ended the run
