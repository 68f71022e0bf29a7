"""The hardware: which device and dtype to run on, the memory it has free, and the matmul peak
MFU is measured against. Every device and dtype a user names is checked here."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

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


def measure_matmul_peak(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.3, repeats: int = 1) -> float:
    """FLOP/s of square matmuls on this CPU with the current thread count: the best of `repeats`
    timings of `seconds / repeats` each (a burst of other work lowers one timing, not the best)."""
    g = torch.Generator().manual_seed(0)  # never touch the global RNG: resume must stay exact
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    torch.mm(a, b)  # warm-up: kernel selection, thread pool start
    best = 0.0
    for _ in range(repeats):
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / repeats:
            torch.mm(a, b)
            reps += 1
        best = max(best, 2 * n**3 * reps / elapsed)
    return best


def gpu_peak(name: str, dtype: torch.dtype) -> float | None:
    """The datasheet's dense matmul peak of a GPU named `name` (None: not in GPU_PEAKS)."""
    for key, peak in GPU_PEAKS.items():
        if key in name:
            return peak if dtype != torch.float32 else peak / 2  # TF32 is half the bf16 rate
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The matmul peak MFU is measured against on `device` for compute in `dtype`: a GPU's
    datasheet figure, a CPU's measured one; None where neither is known (a GPU not in
    GPU_PEAKS, MPS): then no MFU is shown rather than one divided by a guess."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        return measure_matmul_peak(dtype if dtype == torch.bfloat16 else torch.float32, repeats=3)
    return None


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
        raise QuillError(
            f"{setting} {name}: this machine has {torch.cuda.device_count()} CUDA device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise QuillError(f"{setting} {name} asks for MPS, which is not available here; use cpu or auto")
    if device.type == "cpu" and device.index not in (None, 0):
        raise QuillError(f"{setting} {name}: there is one CPU device; use cpu")
    return device


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str, setting: str = "--dtype") -> torch.dtype:
    """A dtype a user names (float32, bfloat16, float16) → the torch dtype, or one QuillError."""
    if name not in DTYPES:
        raise QuillError(f"{setting} must be float32, bfloat16 or float16, got {str(name)[:60]!r}")
    return DTYPES[name]


def resolve_dtype(name: str, device: torch.device, setting: str = "train.dtype") -> torch.dtype:
    """auto: bf16 on CUDA where supported, else fp16; bf16 on CPUs with bf16 units (AVX512-BF16,
    AMX: matmuls several times fp32's rate, the same loss per step: scripts/bench.py); else fp32."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and cpu_has_bf16():
            return torch.bfloat16
        return torch.float32
    if name == "float16" and device.type == "cpu":
        raise QuillError(f"{setting}=float16 is not supported on CPU; use bfloat16 or float32")
    return parse_dtype(name, setting)


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


OPENMP_LIBRARIES = ("libgomp.so.1", "libiomp5.so", "libomp.so")  # GNU (torch's Linux wheels), Intel, LLVM


def release_thread_pool() -> bool:
    """Free the calling thread's idle OpenMP worker threads (omp_pause_resource_all), before another
    thread takes over the torch work (quill serve's engine thread). While this thread's pool lives,
    the runtime counts more threads than cores and stops the new thread's workers spinning between
    parallel regions: each region then waits for a sleeping worker, which slowed quill serve's
    decoding several times over (docs/performance.md). False where no OpenMP runtime is loaded or
    it has no such call."""
    for name in OPENMP_LIBRARIES:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only one already in the process
            return lib.omp_pause_resource_all(2) == 0  # omp_pause_hard
        except (OSError, AttributeError):
            continue
    return False
