"""The hardware: which device to run on, and the matmul peak MFU is measured against."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quillgpt.config import ModelConfig, TrainConfig
from quillgpt.errors import QuillError

# Dense (no sparsity) bf16/fp16 tensor-core peaks, FLOP/s.
GPU_PEAKS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def cpu_has_bf16() -> bool:
    """True where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere torch
    emulates bf16 on CPU, which is slower than fp32."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def measure_matmul_peak(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.3) -> float:
    """FLOP/s of square matmuls on this CPU with the current thread count."""
    g = torch.Generator().manual_seed(0)  # never touch the global RNG: resume must stay exact
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    torch.mm(a, b)  # warm-up: kernel selection, thread pool start
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(a, b)
        reps += 1
    return 2 * n**3 * reps / elapsed


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The matmul peak MFU is measured against on `device` for compute in `dtype`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAKS.items():
            if key in name:
                return peak if dtype != torch.float32 else peak / 2  # TF32 is half the bf16 rate
        return 100e12
    if device.type == "cpu":
        return measure_matmul_peak(dtype if dtype == torch.bfloat16 else torch.float32)
    return float("nan")


def resolve_device(name: str, setting: str = "--device") -> torch.device:
    """auto → cuda, mps or cpu; anything else must be a device this machine has.

    The one place a device name is checked: `meta` (no data), types torch was not built with
    (xpu, hpu, ...), a missing GPU or GPU index, and garbage are each one QuillError naming `setting`.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    choices = f"{setting} must be auto, cpu, cuda, cuda:N or mps"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise QuillError(f"{choices}, got {name[:100]!r}") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise QuillError(f"{choices}, got {name[:100]!r} (QuillGPT runs on CPUs, NVIDIA GPUs and Apple's MPS)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QuillError(f"{setting} {name} asks for CUDA, which is not available here; use cpu or auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise QuillError(f"{setting} {name}: this machine has {torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise QuillError(f"{setting} {name} asks for MPS, which is not available here; use cpu or auto")
    if device.type == "cpu" and device.index not in (None, 0):
        raise QuillError(f"{setting} {name}: there is one CPU device; use cpu")
    return device


# --- will it fit? -----------------------------------------------------------------------------


@dataclass
class TrainMemory:
    """A lower estimate of what one training process allocates, in bytes."""

    params: int  # parameter count
    state_bytes: int  # fp32 weights + gradients + AdamW's two moments: 16 bytes per parameter
    activation_bytes: int  # what one micro-batch keeps for backward, logits included
    eval_bytes: int  # the fixed evaluation windows: eval_iters × batch_size starts per split

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes + self.eval_bytes


def count_params(cfg: ModelConfig, vocab_size: int) -> int:
    """Parameters of GPT(cfg) from the config alone (no model is built); exact without biases
    (model.bias=false), a few thousand short with them."""
    C, L, V = cfg.n_embd, cfg.n_layer, vocab_size
    kv = cfg.kv_heads * cfg.head_dim
    attention = C * (C + 2 * kv) + C * C
    mlp = (3 if cfg.mlp == "swiglu" else 2) * C * cfg.hidden_dim
    embeddings = V * C + (cfg.block_size * C if cfg.pos == "learned" else 0)
    head = 0 if cfg.tie_embeddings else V * C
    return embeddings + L * (attention + mlp + 2 * C) + C + head  # + norm weights


def estimate_train_bytes(model_cfg: ModelConfig, train_cfg: TrainConfig, vocab_size: int | None = None) -> TrainMemory:
    """Bytes one training process needs at least: weights, gradients and AdamW moments (fp32),
    plus one micro-batch of activations (2 bytes each, as under autocast) and fp32 logits with
    their gradient. Meant to refuse what cannot fit, so it errs low."""
    V = vocab_size or model_cfg.vocab_size or 256
    B, T, C, L = train_cfg.batch_size, model_cfg.block_size, model_cfg.n_embd, model_cfg.n_layer
    params = count_params(model_cfg, V)
    per_layer = B * T * (10 * C + 2 * model_cfg.hidden_dim)  # norms, q/k/v, attention out, MLP in/out
    if model_cfg.attn_impl == "math":
        per_layer += 2 * B * model_cfg.n_head * T * min(T, model_cfg.window or T)  # scores and softmax
    activations = 2 * L * per_layer + 2 * 4 * B * T * V + 2 * 8 * B * T  # + logits and grad, x and y
    windows = 2 * 16 * train_cfg.eval_iters * B  # train and val: float64 spacing, then int64 starts
    return TrainMemory(params, 16 * params, activations, windows)


def available_bytes(device: torch.device) -> int | None:
    """Memory free for a new allocation on `device`, or None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        return getattr(torch.mps, "recommended_max_memory", lambda: None)()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_train_memory(model_cfg: ModelConfig, train_cfg: TrainConfig, device: torch.device) -> TrainMemory:
    """Refuse a run that cannot fit on `device`, before anything is allocated."""
    need = estimate_train_bytes(model_cfg, train_cfg)
    free = available_bytes(device)
    if free is not None and need.total > free:
        gb = 1e9
        raise QuillError(
            f"this run needs at least {need.total / gb:,.1f} GB on {device} ({need.params:,} parameters × 16 bytes "
            f"for weights, gradients and AdamW = {need.state_bytes / gb:,.1f} GB, plus {need.activation_bytes / gb:,.1f} GB "
            f"of activations for train.batch_size={train_cfg.batch_size} × model.block_size={model_cfg.block_size}, "
            f"plus {need.eval_bytes / gb:,.1f} GB of evaluation windows for train.eval_iters={train_cfg.eval_iters}), "
            f"but {free / gb:,.1f} GB is free; lower train.batch_size (raise train.grad_accum to keep the batch), "
            "train.eval_iters, or the model's size"
        )
    return need
