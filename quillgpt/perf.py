"""The hardware: which device to run on, and the matmul peak MFU is measured against."""

from __future__ import annotations

import time

import torch

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
    """auto → cuda, mps or cpu; an unknown or unavailable device is a user error naming `setting`."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise QuillError(f"{setting} must be auto, cpu, cuda, cuda:N or mps, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QuillError(f"{setting} {name} asks for CUDA, which is not available here; use cpu or auto")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise QuillError(f"{setting} {name} asks for MPS, which is not available here; use cpu or auto")
    return device
