#!/usr/bin/env python
"""QuillGPT benchmarks: every figure of a table is measured in the same run, side by side.

    python scripts/bench.py                     # --suite all, default repetitions
    python scripts/bench.py --suite train --reps 5 --json bench.json
    python scripts/bench.py --smoke             # seconds: every suite on a tiny model (the test suite's)

Suites: train (quill's step vs a nanoGPT-style one, fp32 and bf16, MFU, the recipe's Muon step,
loss per step), sample (KV cache vs recompute vs transformers on the same weights; fp32, bf16 and
int8 weights), prepare (MB/s), gpu (CUDA only): docs/performance.md says how each measures; the
method is scripts/harness.py's. OpenMP is left as users run it (docs/performance.md has why); the
header prints the OMP_* variables that are set.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from harness import (
    ROOT,
    PeakMemory,
    Report,
    Row,
    Stats,
    add_common,
    interleaved,
    load_line,
    machine,
    machine_line,
    read_bandwidth,
    step_weight_bytes,
    timed,
    tiny_run,
    trainer,
)
from torch import nn

from quillgpt import runs
from quillgpt.config import Config, DataConfig, ModelConfig, TrainConfig, load_config
from quillgpt.data.batches import BatchSampler, batch_from_starts, fixed_windows
from quillgpt.data.prepare import load_tokens, prepare
from quillgpt.device import cpu_has_bf16, measure_matmul_peak, peak_flops
from quillgpt.errors import QuillError
from quillgpt.inference.engine import in_dtype
from quillgpt.inference.generate import generate_tokens
from quillgpt.model.gpt import GPT
from quillgpt.quant import plan_of, quantize
from quillgpt.quant.int8 import Int8Linear
from quillgpt.quant.int8_kernels import KERNELS
from quillgpt.train.loop import Trainer, lr_at, train_step
from quillgpt.train.optim import Muon, newton_schulz

State = dict[str, torch.Tensor]  # a model's state_dict: the weights two variants start from
DEFAULT_TEXT = ROOT / "data" / "downloads" / "input.txt"  # where the README's quickstart downloads Tiny Shakespeare


# --- data -------------------------------------------------------------------------------------


def char_tokens(text_path: Path, work: Path) -> tuple[np.ndarray, np.ndarray, int, str]:
    """Char ids (train, val), vocab size and source: Tiny Shakespeare via quill's own prepare,
    or random ids without it."""
    if text_path.is_file():
        out = prepare(DataConfig(path=str(text_path), tokenizer="char", out_dir=str(work / "char")), progress=False)
        train, val = load_tokens(out.out_dir, "train"), load_tokens(out.out_dir, "val")
        return train, val, out.meta["vocab_size"], f"{text_path.name}, char"
    rng = np.random.default_rng(0)
    return rng.integers(0, 65, 1_000_000).astype(np.uint16), rng.integers(0, 65, 100_000).astype(np.uint16), 65, "random ids"


# --- the reference: a plain nanoGPT-style model and training step -----------------------------


class RefAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head, self.dropout = n_head, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class RefBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=False)
        self.attn = RefAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd, bias=False)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd, bias=False), c_proj=nn.Linear(4 * n_embd, n_embd, bias=False)))
        self.mlp_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        h = F.gelu(self.mlp.c_fc(self.ln_2(x)))  # exact (erf) GELU, as nanoGPT's nn.GELU()
        return x + self.mlp_dropout(self.mlp.c_proj(h))


class RefGPT(nn.Module):
    """nanoGPT's model, minimal: same parameter names as quill's, so both can start equal."""

    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        blocks = nn.ModuleList(RefBlock(n_embd, n_head, dropout) for _ in range(n_layer))
        embeddings = dict(wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block, n_embd), drop=nn.Dropout(dropout))
        self.transformer = nn.ModuleDict(dict(**embeddings, h=blocks, ln_f=nn.LayerNorm(n_embd, bias=False)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def ref_optimizer(model: nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """nanoGPT's configure_optimizers on CPU: decay on matrices, the default (for-loop) AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=tc.learning_rate, betas=(tc.beta1, tc.beta2))


def nanogpt_batches(tokens: np.ndarray, block: int, batch: int, seed: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """nanoGPT's get_batch: random offsets, one numpy slice per row, stacked."""
    g = torch.Generator().manual_seed(seed)

    def get() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(tokens) - block, (batch,), generator=g)
        x = torch.stack([torch.from_numpy(tokens[i : i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(tokens[i + 1 : i + 1 + block].astype(np.int64)) for i in ix])
        return x, y

    return get


def ref_step(model: nn.Module, opt: torch.optim.Optimizer, get_batch: Callable, tc: TrainConfig, lr: float) -> float:
    """nanoGPT's loop body in fp32: forward, backward, clip, step, and loss.item() every step."""
    for group in opt.param_groups:
        group["lr"] = lr
    x, y = get_batch()
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


# --- train suite ------------------------------------------------------------------------------


@dataclass
class Shape:
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    block: int
    batch: int
    dropout: float
    steps_per_rep: int  # optimizer steps timed together in one rep (short steps are noisy)
    warmup: int
    log_every: int  # the `quill train` row: steps per metrics.jsonl line


SHAPES = [
    Shape("baby 4L/4H/128, block 64, batch 12", 4, 4, 128, 64, 12, 0.0, steps_per_rep=10, warmup=5, log_every=20),
    Shape("6L/6H/384, block 256, batch 64", 6, 6, 384, 256, 64, 0.2, steps_per_rep=1, warmup=1, log_every=3),
]
SMOKE = Shape("smoke 1L/2H/32, block 32, batch 4", 1, 2, 32, 32, 4, 0.0, steps_per_rep=1, warmup=1, log_every=2)
SAMPLE, SMOKE_SAMPLE = dict(n_layer=6, n_head=6, n_embd=384), dict(n_layer=1, n_head=2, n_embd=32)  # the sample suite's model


def at_least(args: argparse.Namespace, n: int, reps: int | None = None) -> int:
    """Repetitions: `reps` (default --reps) but at least n; one under --smoke."""
    return 1 if args.smoke else max(n, args.reps if reps is None else reps)


def model_config(s: Shape, vocab: int, **kw: Any) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab, block_size=s.block, n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd, dropout=s.dropout, bias=False, **kw
    )


class QuillTrainer:
    """quill's real step: configure_optimizer (fused AdamW) + train.train_step, as train() runs it."""

    def __init__(
        self, s: Shape, vocab: int, tokens: np.ndarray, dtype: torch.dtype, compile: bool = False, init: State | None = None
    ) -> None:
        torch.manual_seed(0)
        self.model = GPT(model_config(s, vocab))
        if init is not None:
            self.model.load_state_dict(init)
        self.tc = TrainConfig(batch_size=s.batch, learning_rate=1e-3, min_lr=1e-4, beta2=0.99, device="cpu")
        self.model.train()
        self.t = trainer(self.model, self.tc, BatchSampler(tokens, s.block, s.batch, seed=1), dtype, compile)

    def step(self, lr: float | None = None) -> torch.Tensor:
        for group in self.t.optimizer.param_groups:
            group["lr"] = self.tc.learning_rate if lr is None else lr
        return train_step(self.t.model, self.t)


class TrainCommand:
    """`quill train` itself, in a subprocess: one call = one run of `max_iters` steps; its time per
    step is tokens per step / the median tokens_per_sec of its metrics.jsonl lines after the
    first (the first includes start-up and warm-up steps; evaluation is left out by train)."""

    def __init__(self, s: Shape, text: Path, work: Path, dtype: str, log_every: int, lines: int = 3) -> None:
        self.tokens = s.batch * s.block
        self.out = work / f"cmd-{s.n_layer}L-{dtype}"
        steps = log_every * (lines + 1)
        data = dict(path=str(text), tokenizer="char", out_dir=str(work / "char"))
        model = dict(block_size=s.block, n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd, dropout=s.dropout, bias=False)
        train = dict(out_dir=str(self.out), max_iters=steps, batch_size=s.batch, learning_rate=1e-3, min_lr=1e-4, beta2=0.99)
        train |= dict(warmup_iters=0, eval_interval=steps, eval_iters=1, log_interval=log_every, dtype=dtype, device="cpu", overwrite=True)
        self.config = work / f"cmd-{s.n_layer}L-{dtype}.yaml"
        self.config.write_text(json.dumps({"data": data, "model": model, "train": train}))  # JSON is YAML

    def __call__(self) -> float:
        cmd = [sys.executable, "-m", "quillgpt", "train", "-c", str(self.config), "-q"]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        lines = [json.loads(x) for x in (self.out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        rates = [x["tokens_per_sec"] for x in lines if x.get("tokens_per_sec")][1:]
        return self.tokens / statistics.median(rates)


class RefTrainer:
    def __init__(self, s: Shape, vocab: int, tokens: np.ndarray, init: State | None = None, get_batch: Callable | None = None) -> None:
        torch.manual_seed(0)
        self.model = RefGPT(vocab, s.block, s.n_layer, s.n_head, s.n_embd, s.dropout)
        if init is not None:
            self.model.load_state_dict(init)
        self.tc = TrainConfig(batch_size=s.batch, learning_rate=1e-3, min_lr=1e-4, beta2=0.99)
        self.opt = ref_optimizer(self.model, self.tc)
        self.get_batch = get_batch or nanogpt_batches(tokens, s.block, s.batch, seed=1)
        self.model.train()

    def step(self, lr: float | None = None) -> float:
        return ref_step(self.model, self.opt, self.get_batch, self.tc, self.tc.learning_rate if lr is None else lr)


def trainers(s: Shape, vocab: int, tokens: np.ndarray, bf16: bool, compile: bool = False, init: State | None = None) -> dict[str, Callable]:
    """The variants of a training comparison, each built when called: the reference, quill fp32,
    quill bf16 where the CPU has it, and with `compile` both compiled. From `init` (weights) the
    reference reads quill's batches, so that every variant trains on the same ones."""
    batches = BatchSampler(tokens, s.block, s.batch, seed=1).next if init is not None else None
    out = {
        "reference fp32 (nanoGPT-style)": lambda: RefTrainer(s, vocab, tokens, init, batches),
        "quill fp32": lambda: QuillTrainer(s, vocab, tokens, torch.float32, init=init),
    }
    if bf16:
        out["quill bf16 autocast"] = functools.partial(QuillTrainer, s, vocab, tokens, torch.bfloat16, init=init)
    if compile:
        dtypes = {"fp32": torch.float32} | ({"bf16": torch.bfloat16} if bf16 else {})
        out |= {f"quill {k} + torch.compile": functools.partial(QuillTrainer, s, vocab, tokens, d, True) for k, d in dtypes.items()}
    return out


def matmul_peaks(reps: int) -> dict[torch.dtype, Stats]:
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_has_bf16() else [])
    samples = interleaved({str(d): (lambda d=d: measure_matmul_peak(d, seconds=0.3)) for d in dtypes}, reps)
    return {d: Stats.of(samples[str(d)]) for d in dtypes}


def train_suite(report: Report, args: argparse.Namespace, work: Path) -> None:
    group = "train: matmul peak (1024² matmuls, this run)"
    peaks = matmul_peaks(at_least(args, 3))
    for d, st in peaks.items():
        report.add(Row(group, f"torch.mm {str(d).replace('torch.', '')}", "GFLOP/s", st.median / 1e9, st.lo / 1e9, st.hi / 1e9))
    report.print_group(group)

    train_tokens, val_tokens, vocab, source = char_tokens(args.text, work)
    for throwaway in (RefTrainer(args.shapes[0], vocab, train_tokens), QuillTrainer(args.shapes[0], vocab, train_tokens, torch.bfloat16)):
        throwaway.step()  # one-time allocations (thread pools, kernel caches) stay out of the first row's memory
    bf16 = torch.bfloat16 in peaks
    for s in args.shapes:
        if args.quick and s.n_layer > 4:
            continue
        group = f"train: {s.name} ({source})"
        reps = args.reps if s.steps_per_rep > 1 else at_least(args, 3, args.reps // 2)
        variants: dict[str, tuple[Any, torch.dtype]] = {}
        memory: dict[str, PeakMemory] = {}
        notes: dict[str, str] = {}
        for name, build in trainers(s, vocab, train_tokens, bf16, args.compile).items():
            with PeakMemory() as mem:
                made = build()
                warm_s = timed(made.step, s.warmup) * s.warmup
            memory[name] = mem
            variants[name] = (made, torch.bfloat16 if "bf16" in name else torch.float32)
            if "compile" in name:
                notes[name] = f"first {s.warmup} step(s) incl. compiling: {warm_s:.0f} s"
        fns = {n: functools.partial(timed, t.step, s.steps_per_rep) for n, (t, _) in variants.items()}
        cmd_dtype = "bfloat16" if bf16 else "float32"  # what train.dtype=auto picks on this CPU
        cmd = f"quill train command ({'bf16' if bf16 else 'fp32'}, its metrics.jsonl)"
        if args.smoke:
            notes["quill fp32"] = "--smoke: no `quill train` command row"
        elif args.text.is_file():  # the command trains on the text itself
            fns[cmd] = TrainCommand(s, args.text, work, cmd_dtype, s.log_every)
            variants[cmd] = (None, torch.bfloat16 if bf16 else torch.float32)
            notes[cmd] = (
                f"a subprocess per rep, {s.log_every * 4} steps; median tokens_per_sec of its log "
                f"lines after the first (every {s.log_every} steps); memory not measured"
            )
            memory[cmd] = PeakMemory()
        samples = interleaved(fns, reps)
        fpt = GPT(model_config(s, vocab)).flops_per_token()
        tokens = s.batch * s.block
        ref_ms = statistics.median(samples["reference fp32 (nanoGPT-style)"]) * 1e3
        for name, (_, dtype) in variants.items():
            st = Stats.of([tokens / x for x in samples[name]])
            ms = statistics.median(samples[name]) * 1e3
            peak = peaks[dtype].median
            extra = {"ms/step": ms, "MFU": f"{fpt * st.median / peak:.1%}", "vs reference": f"{ref_ms / ms:.2f}×"}
            report.add(Row.of(group, name, "tokens/s", st, extra | {"peak RSS MB": memory[name].rss_mb}, notes.get(name, "")))
        report.print_group(group)
        del variants
    recipe_step_group(report, args, train_tokens, vocab, source)
    loss_check(report, args, train_tokens, val_tokens, vocab, bf16, source)


RECIPE = ROOT / "configs" / "shakespeare_char_75s.yaml"


class PerMatrixMuon(Muon):
    """torch.optim.Muon's step as torch writes it, one Newton–Schulz call per matrix (in quill's
    ns_dtype): the baseline for quill's batched Muon."""

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in (p for p in group["params"] if p.grad is not None):
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - mu)
                update = newton_schulz(p.grad.lerp(buf, mu), group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * math.sqrt(max(1, p.shape[0] / p.shape[1])))


def recipe_config(smoke: bool) -> Config:
    """The 75 s recipe; --smoke: its optimizer and activation on 1 layer × 32, block 32, batch 4."""
    cfg = load_config(RECIPE)
    if smoke:
        cfg.model = dataclasses.replace(cfg.model, n_layer=1, n_embd=32, n_head=2, block_size=32)
        cfg.train = dataclasses.replace(cfg.train, batch_size=4)
    return cfg


def recipe_trainer(vocab: int, tokens: np.ndarray, plain: bool, smoke: bool) -> Trainer:
    """The 75 s recipe's model and optimizer at its batch (--smoke: 1 layer × 32); `plain`: per-matrix Muon and autograd's relu²."""
    cfg = recipe_config(smoke)
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(cfg.model, vocab_size=vocab)).train()
    sampler = BatchSampler(tokens, cfg.model.block_size, cfg.train.batch_size, seed=1)
    t = trainer(model, dataclasses.replace(cfg.train, device="cpu"), sampler)
    if plain:
        for block in model.transformer.h:
            block.mlp.act = lambda h: F.relu(h).square()
        muon = t.optimizer.muon
        t.optimizer.muon = PerMatrixMuon(muon.param_groups, muon.ns_dtype, **muon.defaults)
    return t


def recipe_step_group(report: Report, args: argparse.Namespace, tokens: np.ndarray, vocab: int, source: str) -> None:
    """The time-to-quality recipe's step (fp32 here): its batched Muon and ReLU² backward against
    the plain forms, and the Muon step alone."""
    cfg = recipe_config(args.smoke)
    group = (
        f"train: recipe step, {RECIPE.name} ({cfg.model.n_layer}L/{cfg.model.n_head}H/{cfg.model.n_embd}, "
        f"block {cfg.model.block_size}, batch {cfg.train.batch_size}, Muon, ReLU², fp32) ({source})"
    )
    ours, plain = recipe_trainer(vocab, tokens, False, args.smoke), recipe_trainer(vocab, tokens, True, args.smoke)
    muon_ours, muon_plain = _with_grads(ours.optimizer.muon), _with_grads(plain.optimizer.muon)
    fns = {
        "quill (batched Muon, ReLUSquared)": lambda: timed(lambda: train_step(ours.model, ours), 3),
        "per-matrix Muon, autograd relu²": lambda: timed(lambda: train_step(plain.model, plain), 3),
        "Muon step alone, batched": lambda: timed(muon_ours, 3),
        "Muon step alone, per matrix": lambda: timed(muon_plain, 3),
    }
    for f in fns.values():
        f()
    samples = interleaved(fns, args.reps)
    base = statistics.median(samples["per-matrix Muon, autograd relu²"])
    tokens_per_step = cfg.train.batch_size * cfg.model.block_size
    for name, xs in samples.items():
        st = Stats.of([x * 1e3 for x in xs])
        whole = "alone" not in name
        med = statistics.median(xs)
        vs = f"{base / med:.2f}×" if whole else f"{med / base:.0%} of a plain step"
        report.add(Row.of(group, name, "ms", st, {"tokens/s": tokens_per_step / med if whole else "", "vs plain step": vs}))
    report.print_group(group)


def _with_grads(muon: Muon) -> Callable[[], None]:
    """muon.step with fixed random gradients (the train step leaves none behind)."""
    params = [p for g in muon.param_groups for p in g["params"]]
    grads = [torch.randn_like(p) for p in params]

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        muon.step()

    return step


def loss_check(
    report: Report, args: argparse.Namespace, train_tokens: np.ndarray, val_tokens: np.ndarray, vocab: int, bf16: bool, source: str
) -> None:
    """Same initial weights, same batches, same schedule: does quill learn as fast per step?"""
    s = args.shapes[0]
    n = args.loss_steps
    group = f"train: loss per step, {s.name}, {n} steps, lr 2e-3 warmup 20 cosine ({source})"
    tc = TrainConfig(learning_rate=2e-3, min_lr=2e-4, warmup_iters=20)
    torch.manual_seed(0)
    init = GPT(model_config(s, vocab)).state_dict()
    runs = {name: build() for name, build in trainers(s, vocab, train_tokens, bf16, init=init).items()}
    curves: dict[str, list[float]] = {k: [] for k in runs}
    seconds = dict.fromkeys(runs, 0.0)
    for step in range(n):
        lr = lr_at(step, tc, n)
        for name, run in runs.items():
            t = time.perf_counter()
            loss = run.step(lr)
            seconds[name] += time.perf_counter() - t
            curves[name].append(float(loss))
    starts = fixed_windows(val_tokens, s.block, 240)
    base = curves["quill fp32"]
    for name, run in runs.items():
        model = run.model.eval()
        with torch.no_grad():
            losses = []
            for i in range(0, len(starts), 60):
                x, y = batch_from_starts(val_tokens, starts[i : i + 60], s.block)
                losses.append(model(x, y)[1].item())
        last = curves[name][-20:]
        diff = max(abs(a - b) for a, b in zip(curves[name], base))
        extra = {"train loss (last 20)": f"{statistics.mean(last):.4f}", "max |Δ train loss| vs quill fp32": f"{diff:.4f}"}
        report.add(Row(group, name, "val loss", f"{statistics.mean(losses):.4f}", extra=extra | {"wall s": seconds[name]}))
    report.print_group(group)


# --- sample suite -----------------------------------------------------------------------------


def shape(model: GPT) -> str:
    return f"{model.config.n_layer}L/{model.config.n_head}H/{model.config.n_embd}"


def hf_model(run: Path, out: Path) -> Any:
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from quillgpt.interop.convert import export_hf

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    export_hf(run, out, which="latest", force=True)
    return GPT2LMHeadModel.from_pretrained(out).eval()


def quill_generate(model: GPT, prompts: list[list[int]], n: int, use_cache: bool, **kw: Any) -> tuple[torch.Tensor, list[float]]:
    """All new tokens (B, n) and the time at which each step's token arrived (kw: dtype, compile)."""
    times, out = [], []
    t0 = time.perf_counter()
    for tok in generate_tokens(model, prompts, n, temperature=0.0, use_cache=use_cache, **kw):
        out.append(tok)
        times.append(time.perf_counter() - t0)
    return torch.stack(out, 1), times


def hf_generate(model: Any, prompts: list[list[int]], n: int) -> torch.Tensor:
    ids = torch.tensor(prompts)
    greedy = dict(max_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **greedy)[:, ids.shape[1] :]


def sample_suite(report: Report, args: argparse.Namespace, work: Path) -> None:
    text = args.text.read_text(encoding="utf-8") if args.text.is_file() else "".join(chr(32 + i % 90) for i in range(10**5))
    for block in args.sample_blocks:
        shape = SMOKE_SAMPLE if args.smoke else SAMPLE
        run = tiny_run(work / f"run{block}", text, block_size=block, bias=True, pos=args.sample_pos, **shape)
        loaded = runs.load_run(run, which="latest")
        hf = hf_model(run, work / f"hf{block}") if args.sample_pos == "learned" else None  # GPT-2: learned positions
        for B in (1,) if args.smoke else (1, 8):
            sample_group(report, args, loaded.model, hf, loaded.tokenizer, text, block, B)
        prefill_group(report, args, loaded.model, hf, loaded.tokenizer, text, block)


def sample_group(report: Report, args: argparse.Namespace, model: GPT, hf: Any, tok: Any, text: str, block: int, B: int) -> None:
    """New tokens/s: quill's engine (eager, bf16 weights, int8 weights, compiled decode) vs
    recompute vs transformers, each as a fraction of this machine's weight-streaming and compute
    bounds for the bytes that variant reads."""
    n_new, prompt_len = args.sample_tokens, 16
    past_window = prompt_len + n_new > block
    if past_window and B > 1:  # every token past the window costs a B×block prefill: keep it short
        n_new = block - prompt_len + 50
    group = f"sample: {shape(model)}, block {block:,}, batch {B}, greedy, {n_new:,} new tokens after a {prompt_len}-token prompt"
    prompts = [tok.encode(text[1000 * i : 1000 * i + prompt_len]) for i in range(B)]
    reps = 1 if past_window else args.sample_reps
    tokens: dict[str, torch.Tensor] = {}
    runs = {"quill": model}  # the weights each row runs, for its bounds
    refused = None
    if not past_window:
        runs["bf16"] = in_dtype(model, torch.bfloat16)
        t = time.perf_counter()
        try:
            runs["int8"] = quantize(copy.deepcopy(model), "int8", rows=B)  # as `quill sample --quantize int8` loads it
        except QuillError as e:  # no int8 kernel beats fp32 here: the row says so
            refused = str(e)
        quantize_s = time.perf_counter() - t

    def quill(key: str, model: GPT, **kw: Any) -> Callable[[], float]:
        def run() -> float:
            t = time.perf_counter()
            tokens[key], _ = quill_generate(model, prompts, n_new, use_cache=True, **kw)
            return time.perf_counter() - t

        return run

    def transformers() -> float:
        t = time.perf_counter()
        tokens["hf"] = hf_generate(hf, prompts, n_new)
        return time.perf_counter() - t

    fns = {"quill engine (eager decode)": quill("quill", model)}
    if not past_window:
        fns["quill engine, bf16 weights"] = quill("bf16", model, dtype=torch.bfloat16)  # converted per run, as before
        if "int8" in runs:
            fns["quill engine, int8 weights"] = quill("int8", runs["int8"])  # quantized once, outside the timing
        if args.sample_compile:
            fns["quill engine, compiled decode"] = quill("quill compiled", model, compile=True)
            if "int8" in runs:
                fns["quill engine, int8, compiled decode"] = quill("int8 compiled", runs["int8"], compile=True)
    hf_ok = hf is not None and prompt_len + n_new <= hf.config.n_positions
    if hf_ok:
        fns["transformers generate (use_cache)"] = transformers
    mem: dict[str, float] = {}
    warm: dict[str, float] = {}
    for name, fn in fns.items():  # one full run each first: warm-up (compiling), and its memory peak
        with PeakMemory() as m:
            warm[name] = fn()
        mem[name] = m.rss_mb
    samples = interleaved(fns, reps) if not past_window else {k: [v] for k, v in warm.items()}  # past the window: its one (long) run

    # The recompute path costs ~10× more per token, so it generates fewer tokens, after a prompt
    # chosen so that their contexts average the same length as the full run's; per-token rate.
    n_rec = args.recompute_tokens if B == 1 else max(5, args.recompute_tokens // 5)
    mean_ctx = statistics.mean(min(prompt_len + i, block) for i in range(n_new))
    p_len = max(prompt_len, min(block - 1, round(mean_ctx - n_rec / 2)))
    rec_prompts = [tok.encode((text * 2)[1000 * i : 1000 * i + p_len]) for i in range(B)]
    with PeakMemory() as m:
        _, times = quill_generate(model, rec_prompts, n_rec, use_cache=False)
    mem["quill recompute (no cache)"] = m.rss_mb
    rec = Stats.of([B / x for x in np.diff(times)])  # per-token times (the first also builds the batch)

    bounds = {key: decode_bounds(m, B, mean_ctx) for key, m in runs.items()}
    hf_tps = B * n_new / statistics.median(samples["transformers generate (use_cache)"]) if hf_ok else None
    for name, xs in samples.items():
        st = Stats.of([B * n_new / x for x in xs])
        extra = sample_extra(st.median, rec.median, hf_tps, mem[name])
        extra.update(bound_fractions(st.median, bounds["bf16" if "bf16" in name else "int8" if "int8" in name else "quill"]))
        note = sample_note(name, tokens, past_window, block, hf_ok, warm[name] - xs[0])
        if name == "quill engine, int8 weights":
            note += f"; quantize at load {quantize_s:.1f} s, decode kernel {plan_of(runs['int8']).pick(B)}"
        report.add(Row.of(group, name, "new tokens/s", st, extra, note))
    if refused:
        report.add(Row(group, "quill engine, int8 weights", "new tokens/s", None, note=f"refused: {refused}"))
    if not hf_ok:
        why = "transformers' GPT-2 has learned positions"
        if hf is not None:
            why = f"{prompt_len} + {n_new:,} tokens exceed its n_positions={hf.config.n_positions}; it cannot go past"
        report.add(Row(group, "transformers generate (use_cache)", "new tokens/s", None, note=f"n/a: {why}"))
    extra = sample_extra(rec.median, rec.median, hf_tps, mem["quill recompute (no cache)"])
    note = f"{n_rec} tokens after a {p_len}-token prompt (same mean context); per-token median"
    report.add(Row.of(group, "quill recompute (no cache)", "new tokens/s", rec, extra, note))
    report.add(bounds_row(group, bounds))
    report.print_group(group)


def bounds_row(group: str, bounds: dict[str, dict[str, float]]) -> Row:
    """One row of every variant's bandwidth and compute bounds (quill = fp32 weights)."""
    bw = " | ".join(f"{b['bandwidth']:,.0f}" for b in bounds.values())
    compute = " | ".join(f"{b['compute']:,.0f}" for b in bounds.values())
    reads = ", ".join(f"{k} {b['bytes'] / 1e6:.0f} MB at {b['bw'] / 1e9:.0f} GB/s" for k, b in bounds.items())
    peaks = ", ".join(f"{k} {b['peak'] / 1e9:.0f}" for k, b in bounds.items())
    flops = next(iter(bounds.values()))["flops"]
    note = f"B x read bandwidth / bytes a step reads ({reads}: weights + mean-context KV); peak matmul GFLOP/s ({peaks})"
    name, value = f"bounds ({' | '.join(bounds)})", f"{bw} bw, {compute} compute"
    return Row(group, name, "new tokens/s", value, note=f"{note} / {flops / 1e6:.1f} MFLOP a token")


def sample_note(name: str, tokens: dict[str, torch.Tensor], past_window: bool, block: int, hf_ok: bool, compile_s: float) -> str:
    """Greedy-token agreement of a row with its reference, and what else the reader must know."""
    if name.startswith("quill engine (eager") and past_window:
        return (
            f"past {block} tokens learned positions shift, so the row is refilled every step "
            f"(nanoGPT's crop): a {block}-token prefill per token, like recompute"
        )
    if name.startswith("quill engine (eager") and hf_ok:
        return f"greedy tokens = transformers' for {agreement(tokens['quill'], tokens['hf'])}"
    if name == "quill engine, compiled decode":
        return f"greedy tokens = eager's for {agreement(tokens['quill compiled'], tokens['quill'])}; compiling took {compile_s:.0f} s"
    if name == "quill engine, int8, compiled decode":
        return f"greedy tokens = eager int8's for {agreement(tokens['int8 compiled'], tokens['int8'])}; compiling took {compile_s:.0f} s"
    if name in ("quill engine, bf16 weights", "quill engine, int8 weights"):
        key = name.split(", ")[1].split()[0]
        return f"greedy tokens = fp32 quill's for {agreement(tokens[key], tokens['quill'])}"
    return ""


def decode_bounds(model: GPT, B: int, ctx: float) -> dict[str, float]:
    """Upper bounds on decode tokens/s for the weights as this model stores them: every step
    reads them once (for the B rows) and each row's keys/values; every token costs 2 FLOPs per
    matmul weight + 4·L·C·ctx in attention, at the matmul peak of its activations' dtype."""
    cfg = model.config
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, Int8Linear)))
    weights = step_weight_bytes(model)
    kv = B * 2 * cfg.n_layer * cfg.kv_heads * cfg.head_size * ctx * model.dtype.itemsize
    flops = 2 * matmul + 4 * cfg.n_layer * cfg.n_head * cfg.head_size * ctx
    plan = plan_of(model)
    low = model.dtype == torch.bfloat16 or (plan is not None and KERNELS[plan.pick(B)].bf16)  # its kernel's activations
    # without bf16 units torch converts bf16 and multiplies in fp32: the fp32 peak bounds it
    peak = matmul_peak(torch.bfloat16 if low and cpu_has_bf16() else torch.float32)
    bw = read_bandwidth(int(weights))
    return {"bandwidth": B * bw / (weights + kv), "compute": peak / flops, "bw": bw, "bytes": weights + kv, "peak": peak, "flops": flops}


@functools.cache
def matmul_peak(dtype: torch.dtype) -> float:
    return measure_matmul_peak(dtype, seconds=0.5)


def bound_fractions(tps: float, bounds: dict[str, float]) -> dict[str, str]:
    return {"of bw bound": f"{tps / bounds['bandwidth']:.0%}", "of compute bound": f"{tps / bounds['compute']:.1%}"}


def agreement(a: torch.Tensor, b: torch.Tensor) -> str:
    """'k/n': how many leading steps all rows agree (greedy decoding diverges for good at the first tie-break)."""
    same = (a == b).all(dim=0)
    k = int((~same).nonzero()[0, 0]) if not same.all() else len(same)
    return f"{k:,}/{len(same):,} steps"


def sample_extra(tps: float, rec_tps: float, hf_tps: float | None, mem_mb: float) -> dict[str, Any]:
    extra: dict[str, Any] = {"vs recompute": f"{tps / rec_tps:.1f}×"}
    extra["vs transformers"] = f"{tps / hf_tps:.2f}×" if hf_tps else "n/a"
    extra["peak RSS MB"] = mem_mb
    return extra


def prefill_group(report: Report, args: argparse.Namespace, model: GPT, hf: Any, tok: Any, text: str, block: int) -> None:
    """Time to the first new token from a long prompt (the prompt's forward pass)."""
    p_len = min(512, block - 1)
    group = f"sample: prefill latency (time to first token), {shape(model)}, block {block:,}, {p_len}-token prompt"
    fns: dict[str, Callable[[], float]] = {}
    int8 = quantize(copy.deepcopy(model), "int8")
    for B in (1,) if args.smoke else (1, 8):
        prompts = [tok.encode(text[1000 * i : 1000 * i + p_len]) for i in range(B)]

        def q_first(prompts: list[list[int]] = prompts, m: GPT = model) -> float:
            t = time.perf_counter()
            next(iter(generate_tokens(m, prompts, 1)))
            return time.perf_counter() - t

        def hf_first(prompts: list[list[int]] = prompts) -> float:
            t = time.perf_counter()
            hf_generate(hf, prompts, 1)
            return time.perf_counter() - t

        fns[f"quill, batch {B}"] = q_first
        fns[f"quill int8, batch {B}"] = functools.partial(q_first, prompts, int8)
        if hf is not None:
            fns[f"transformers, batch {B}"] = hf_first
    for fn in fns.values():
        fn()
    for name, xs in interleaved(fns, at_least(args, 3, args.sample_reps)).items():
        st = Stats.of([x * 1e3 for x in xs])
        B = int(name.rsplit(" ", 1)[1])
        report.add(Row.of(group, name, "ms", st, {"prompt tokens/s": B * p_len / (st.median / 1e3)}))
    report.print_group(group)


# --- prepare suite ----------------------------------------------------------------------------


def prepare_suite(report: Report, args: argparse.Namespace, work: Path) -> None:
    if not args.text.is_file():
        group = f"prepare: {args.text}"
        report.add(Row(group, "prepare", "MB/s", None, note=f"n/a: {args.text} not found"))
        report.print_group(group)
        return
    size_mb = args.text.stat().st_size / 1e6
    group = f"prepare: {args.text.name} ({size_mb:.2f} MB), prepare(force=True): read, hash, tokenize, write"
    mem: dict[str, float] = {}

    def make(name: str) -> Callable[[], float]:
        cfg = DataConfig(path=str(args.text), tokenizer=name, out_dir=str(work / f"prep_{name}"))

        def run() -> float:
            t = time.perf_counter()
            prepare(cfg, force=True, progress=False)
            return time.perf_counter() - t

        return run

    fns = {f"{name} tokenizer": make(name) for name in ("char",) + (() if args.smoke else ("gpt2",))}
    for name, fn in fns.items():
        with PeakMemory() as m:
            fn()  # warm-up: tiktoken loads its BPE ranks once per process
        mem[name] = m.rss_mb
    samples = interleaved(fns, at_least(args, 5))
    for name, xs in samples.items():
        st = Stats.of([size_mb / x for x in xs])
        report.add(Row.of(group, name, "MB/s", st, {"ms": statistics.median(xs) * 1e3, "peak RSS MB": mem[name]}))
    report.print_group(group)


# --- gpu suite --------------------------------------------------------------------------------


def cuda_timed(fn: Callable[[], Any], n: int = 10) -> float:
    """Seconds per call of `fn` on the GPU: the mean of `n` between CUDA events, after 3 warm-ups."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def cuda_copy_bandwidth(nbytes: int = 2**31) -> float:
    """Bytes/s of a device-to-device copy of random data, counting bytes read and written."""
    x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * nbytes / cuda_timed(lambda: y.copy_(x))


def cuda_matmul_peak(n: int = 8192) -> float:
    """FLOP/s of n×n×n bf16 matmuls on random data (never zeros: they run faster)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / cuda_timed(lambda: a @ b)


def gpu_suite(report: Report, args: argparse.Namespace, work: Path) -> None:
    """GPT-2-124M-shaped training (bf16, torch.compile, flash SDPA) and KV-cached sampling, each
    against the ceilings measured in this run (and training against the card's datasheet peak)."""
    if not torch.cuda.is_available():
        print("\ngpu: skipped (no CUDA device)")
        report.header["gpu_suite"] = "skipped: no CUDA device"
        return
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device)
    bandwidth, matmul = cuda_copy_bandwidth(), cuda_matmul_peak()
    group = f"gpu: {name}, ceilings measured in this run"
    report.add(Row(group, "device-to-device copy, 2 GiB", "GB/s", bandwidth / 1e9, note="bytes read + written"))
    sheet = (peak_flops(device, torch.bfloat16) or math.nan) / 1e12
    sheet_note = f"datasheet dense bf16 (device.GPU_PEAKS): {sheet:.0f}"
    report.add(Row(group, "bf16 matmul 8192³, random data", "TFLOP/s", matmul / 1e12, note=sheet_note))
    report.print_group(group)
    cfg = ModelConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=False, dropout=0.0)
    if args.smoke:
        cfg = dataclasses.replace(cfg, n_layer=1, n_head=2, n_embd=64, block_size=128)
    gpu_train_group(report, args, cfg, name, matmul)
    gpu_sample_group(report, args, cfg, name, bandwidth)


def gpu_train_group(report: Report, args: argparse.Namespace, cfg: ModelConfig, name: str, matmul: float) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device, batch = torch.device("cuda"), args.gpu_batch
    peak = peak_flops(device, torch.bfloat16) or math.nan  # nan: a GPU without a datasheet entry, MFU "nan%"
    group = f"gpu: {name}, GPT-2-124M shape (12L/12H/768, block 1,024, vocab 50,304), batch {batch}, bf16"
    tokens = np.random.default_rng(0).integers(0, 50257, 2_000_000).astype(np.uint16)
    tc = TrainConfig(batch_size=batch, learning_rate=6e-4, device="cuda")

    def make(compile: bool) -> tuple[Callable[[], float], PeakMemory, float]:
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        sampler = BatchSampler(tokens, cfg.block_size, batch, seed=1, device=device)
        t = trainer(model, tc, sampler, torch.bfloat16, compile)

        def one() -> None:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                train_step(t.model, t)

        with PeakMemory(cuda=True) as mem:
            t0 = time.perf_counter()
            for _ in range(3):  # warm-up (and compilation)
                one()
            torch.cuda.synchronize()
            warm = time.perf_counter() - t0

        def timed() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.gpu_steps):
                one()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / args.gpu_steps

        return timed, mem, warm

    with torch.device("meta"):  # the FLOP count needs the shapes only
        fpt = GPT(cfg).flops_per_token()
    variants = {"quill bf16 + torch.compile + flash SDPA": make(True), "quill bf16 eager + flash SDPA": make(False)}
    samples = interleaved({k: v[0] for k, v in variants.items()}, max(3, args.reps))
    for vname, xs in samples.items():
        st = Stats.of([batch * cfg.block_size / x for x in xs])
        _, mem, warm = variants[vname]
        extra = {"ms/step": statistics.median(xs) * 1e3, "MFU": f"{fpt * st.median / peak:.1%}"}
        extra |= {"of measured matmul": f"{fpt * st.median / matmul:.1%}", "CUDA max alloc MB": mem.cuda_mb}
        note = f"MFU against {peak / 1e12:.0f} TFLOP/s (datasheet bf16); warm-up 3 steps {warm:.0f} s"
        report.add(Row.of(group, vname, "tokens/s", st, extra, note))
    report.print_group(group)


def gpu_sample_group(report: Report, args: argparse.Namespace, cfg: ModelConfig, name: str, bandwidth: float) -> None:
    """Greedy decoding with bf16 weights at batch 1 and 64, eager and compiled (CUDA graphs), as
    a fraction of the bandwidth bound: each step reads every weight once plus each row's keys and
    values at the mean context."""
    n, prompt_len = args.gpu_sample_tokens, 16
    torch.manual_seed(0)
    model = GPT(cfg).to("cuda", torch.bfloat16).eval()
    ctx = prompt_len + (n - 1) / 2
    for B in (1, 64):
        group = f"gpu: {name}, KV-cached greedy sampling, GPT-2-124M shape, batch {B}, {n} new tokens"
        prompts = [list(range(1 + i, 1 + i + prompt_len)) for i in range(B)]
        out: dict[str, torch.Tensor] = {}
        runs = {"bf16": model}
        try:  # int8 linears against the bf16 ones they replace (gpt-fast's form pays compiled)
            runs["int8"] = quantize(copy.deepcopy(model), "int8", rows=B)
        except QuillError as e:
            report.add(Row(group, "quill engine, int8 weights", "new tokens/s", None, note=f"refused: {e}"))

        def run(key: str, compile: bool, prompts: list[list[int]] = prompts, out: dict = out, runs: dict = runs) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            out[f"{key} {compile}"] = torch.stack(list(generate_tokens(runs[key], prompts, n, compile=compile)), 1)
            torch.cuda.synchronize()
            return time.perf_counter() - t

        fns = {}
        for key in runs:
            weights = "bf16 weights" if key == "bf16" else f"int8 weights ({plan_of(runs[key]).pick(B)})"
            fns[f"quill engine, {weights}, eager decode"] = functools.partial(run, key, False)
            fns[f"quill engine, {weights}, compiled decode (CUDA graphs)"] = functools.partial(run, key, True)
        mem, first = {}, {}
        for vname, fn in fns.items():  # one run each first: warm-up and compiling
            with PeakMemory(cuda=True) as m:
                first[vname] = fn()
            mem[vname] = m.cuda_mb
        samples = interleaved(fns, max(2, args.sample_reps))
        kv = B * 2 * cfg.n_layer * cfg.kv_heads * cfg.head_size * ctx * 2
        bounds = {key: B * bandwidth / (step_weight_bytes(m) + kv) for key, m in runs.items()}
        for vname, xs in samples.items():
            key = "bf16" if "bf16" in vname else "int8"
            st = Stats.of([B * n / x for x in xs])
            note = ""
            if "compiled" in vname:
                same = agreement(out[f"{key} True"], out[f"{key} False"])
                note = f"greedy tokens = eager's for {same}; first run (compiling) {first[vname]:.0f} s"
            elif key == "int8":
                note = f"greedy tokens = bf16 eager's for {agreement(out['int8 False'], out['bf16 False'])}"
            extra = {"of bandwidth bound": f"{st.median / bounds[key]:.1%}", "CUDA max alloc MB": mem[vname]}
            report.add(Row.of(group, vname, "new tokens/s", st, extra, note))
        reads = ", ".join(f"{k} {(step_weight_bytes(m) + kv) / 1e6:,.0f} MB" for k, m in runs.items())
        note = f"B x copy bandwidth {bandwidth / 1e9:,.0f} GB/s / bytes a step reads ({reads}: weights + mean-context KV)"
        report.add(Row(group, f"bound ({' | '.join(runs)})", "new tokens/s", " | ".join(f"{b:,.0f}" for b in bounds.values()), note=note))
        report.print_group(group)


# --- main -------------------------------------------------------------------------------------


SUITES = {"train": train_suite, "sample": sample_suite, "prepare": prepare_suite, "gpu": gpu_suite}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per variant (the 6-layer training shape uses half, at least 3)")
    p.add_argument("--json", type=Path, help="also write every row (and the machine) as JSON here")
    add_common(p, text=True)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd training (slow to compile on CPU)")
    p.add_argument("--quick", action="store_true", help="train suite: the baby shape only")
    p.add_argument("--loss-steps", type=int, default=200, help="steps of the loss-per-step comparison")
    p.add_argument("--sample-tokens", type=int, default=1000)
    p.add_argument("--recompute-tokens", type=int, default=100)
    p.add_argument("--sample-reps", type=int, default=3)
    p.add_argument("--sample-pos", choices=["learned", "rope"], default="learned", help="positions (rope keeps the cache past the block)")
    p.add_argument("--sample-blocks", type=int, nargs="+", default=[1024, 256], help="the sample suite model's block sizes")
    compiled = "also time the compiled decode step (compiling takes 1-2 min per shape on CPU)"
    p.add_argument("--sample-compile", action=argparse.BooleanOptionalAction, default=True, help=compiled)
    p.add_argument("--gpu-batch", type=int, default=16)
    p.add_argument("--gpu-steps", type=int, default=10)
    p.add_argument("--gpu-sample-tokens", type=int, default=500)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.text = args.text or DEFAULT_TEXT  # without it: random ids, and no prepare or `quill train` rows
    args.shapes = [SMOKE] if args.smoke else SHAPES
    if args.smoke:  # seconds: one rep of everything, a few tokens and steps, nothing compiled
        args.reps = args.sample_reps = 1
        args.loss_steps, args.sample_tokens, args.recompute_tokens, args.sample_blocks = 3, 8, 4, [64]
        args.sample_compile, args.gpu_steps, args.gpu_sample_tokens = False, 2, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)

    report = Report()
    report.header.update(machine(), load_average_start=load_line("before"))
    print(machine_line())
    print(load_line("before"))
    print(f"command: python scripts/bench.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="quill-bench-") as tmp:
        suites = [s for s in SUITES if s != "gpu"] + ["gpu"] if args.suite == "all" else [args.suite]
        for name in suites:
            SUITES[name](report, args, Path(tmp))
    report.header.update(load_average_end=load_line("after"), seconds=time.perf_counter() - t0)
    print(f"\n{time.perf_counter() - t0:.0f} s; {load_line('after')}")
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
