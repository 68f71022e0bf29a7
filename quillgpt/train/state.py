"""The trainer's state: everything the loop touches, in one dataclass that the loop, the
schedule, the progress bar and the run directory read (so none of them imports the loop)."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quillgpt.config import Config
from quillgpt.data.batches import BatchSampler
from quillgpt.data.chat_batches import ChatRows, ChatSampler
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.model.gpt import GPT
from quillgpt.train.distributed import Dist
from quillgpt.train.metrics import MetricsWriter

FIT_AFTER_STEPS = 10  # train.time_budget: the horizon is fitted once, at this step or warmup's end
Windows = dict[str, tuple[np.ndarray | ChatRows, np.ndarray]]  # split → (tokens, window starts) or (rows, picks)


@dataclass
class Trainer:
    """Everything the loop touches: built by `setup`, brought back by `restore`, moved on by steps."""

    cfg: Config
    ddp: Dist
    device: torch.device
    dtype: torch.dtype
    out_dir: Path
    tokenizer: Tokenizer
    raw_model: GPT  # what checkpoints save and evaluation runs
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: BatchSampler | ChatSampler
    windows: Windows
    budget_s: float | None
    model: torch.nn.Module | None = None  # what the step calls: raw_model, compiled and/or wrapped
    step: int = 0
    tokens_seen: int = 0
    best_val: float = math.inf
    elapsed_before: float = 0.0  # seconds trained before this process (by the runs it resumes)
    horizon: int = 0  # the step the lr schedule ends at: max_iters, or fitted to train.time_budget
    fitted: bool = False  # the horizon was fitted to the budget (once; checkpointed)
    fit_at: int = FIT_AFTER_STEPS  # the step it is fitted at (later on a resume with a new budget)
    budget_ended: bool = False  # the time budget ended the run
    reserve_s: float = 0.0  # time budget: kept for the final evaluation + checkpoint (the last one's time)
    pace_mark: tuple[float, int] | None = None  # time budget: (time, step) after this process's first step
    t_start: float = 0.0
    first_step: int = 0  # the step this process started from
    log: MetricsWriter | None = None  # rank 0 only
    lora_base: dict[str, str] | None = None  # LoRA: the base's checkpoint file and weights checksum
    notes: list[str] = dataclasses.field(default_factory=list)  # printed when the loop starts (rank 0)
    stop_reason: str = ""  # time budget: why the run ended where it did
    step_tokens: tuple[int, int] = (0, 0)  # the last step's (data tokens, tokens run with padding), global

    @property
    def fit_step(self) -> int:
        """The step the time budget's end is fitted at: fit_at, and never inside the warmup."""
        return max(self.fit_at, self.cfg.train.warmup_iters)

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t_start
