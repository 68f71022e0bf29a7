"""CPU kernels for int8 and 4-bit weights at a few rows (the decode step): y = x·Wᵀ with
W[n, k] = q[n, k]·s[n, g] + o[n, g], g = k // group (per-channel int8: one group a row, o = 0;
`group_gemv4`: q in [0, 15], two codes a byte in pack4's layout), in C++ built on first use. Both
take the codes in `interleave`'s layout.

Why a kernel of its own: written as torch ops (quant/int8_kernels.py: grouped_sum) inductor dequantizes each
weight to fp32 and multiplies it, ~7 vector instructions per 16 weights, so on SmolLM2 the
compiled step ran compute-bound at ~14 GB/s of weights while the memory gives 35-40. Here the
activations are rounded to int16 per block of 32 (a step of max|x|/32767: a relative error of
~1e-5, far below bf16's 4e-3) and multiplied with the int8 weights in integer pairs
(`vpmaddwd`: 32 weights in one instruction on AVX-512, two on AVX2); each block's 16 (8) int32
partial sums are scaled into a float accumulator by s·step, and the offsets add o·Σx per group.
No horizontal sum until the row's end. The scales and offsets are read as fp16 (36 bytes per 32
weights where fp32 took 40, 4-bit codes 20: bytes are time when the weights stream from memory;
llama.cpp's Q8_0 reads 34, Q4_0 18). Four weight rows run at once (AVX-512 and AVX2), stored
interleaved so that they stream as one (`interleave`), and the weights are prefetched ahead.
`-march=native` picks AVX-512BW, AVX2+FMA or the plain loop; the build is cached by torch per
source and CPU (`TORCH_EXTENSIONS_DIR`).

The C++ is in csrc/ (group_gemv.cpp; decode_block.cpp, the native decode block of
model/native_block.py, is built into the same library and reuses these loops).

`available()` builds it once (tens of seconds; False, with the reason in `why_not()`, where no
C++ compiler works); `group_gemv` and `group_gemv4` are torch custom ops, so a compiled decode step
calls each as one extern kernel. They equal the dequantized fp32 matmul to the int16 rounding of x
(tests/model/test_group_gemv.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

BLOCK = 32  # activations are rounded per block of 32 inputs; a weight group is a multiple of it

# the C++ (quillgpt/model/csrc), one library: the kernels, then the decode block built on them
CSRC = Path(__file__).parent / "csrc"
# avx512_emulated.h (QUILL_GEMV_ISA=avx512-emulated) pasted in where it is included: no include path
# in the build's flags, which would tie a cached build to the checkout it was built from
SOURCE = "\n".join((CSRC / name).read_text() for name in ("group_gemv.cpp", "decode_block.cpp")).replace(
    '#include "avx512_emulated.h"', (CSRC / "avx512_emulated.h").read_text()
)

_built: bool | None = None
_error: str | None = None


# QUILL_GEMV_ISA picks the instruction set to build for: "native" (this CPU: AVX-512BW, AVX2+FMA or
# the plain loop), "avx2" / "plain" to build and test the other two paths on an AVX-512 machine, or
# "avx512-emulated": the AVX-512 path on an AVX2 machine, its intrinsics as scalar stand-ins
# (csrc/avx512_emulated.h; slow, for tests)
ISA_FLAGS = {
    "native": ["-march=native"],
    "avx2": ["-march=haswell"],
    "plain": ["-march=x86-64"],
    "avx512-emulated": ["-march=haswell", "-DQUILL_EMULATE_AVX512"],
}
# -fno-trapping-math: no code here reads floating-point exception flags, and without it GCC keeps
# the branches of a loop with a select (activation functions, exp) and does not vectorize it:
# SwiGLU over SmolLM2's 1,536 hidden units took 12 us a block, 1.3 vectorized. Values are unchanged.
CFLAGS = ["-O3", "-fno-trapping-math", "-fopenmp"]


def _isa() -> str:
    isa = os.environ.get("QUILL_GEMV_ISA", "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"QUILL_GEMV_ISA must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    return isa


def _cflags() -> list[str]:
    return [*CFLAGS, *ISA_FLAGS[_isa()]]


def build_name() -> str:
    """Source, CPU and flags in the name: a build for AVX-512 must not be loaded on an AVX2 machine,
    and a kernel plan measured with another build is measured again (quant/plan.py: cached_plan)."""
    key = SOURCE + torch.backends.cpu.get_cpu_capability() + torch.__version__ + " ".join(_cflags())
    return f"quill_group_gemv_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def available() -> bool:
    """Whether the kernel is built (building it on the first call: a C++ compiler is needed)."""
    global _built, _error
    if _built is not None or _error is not None:
        return _built is not None
    if os.environ.get("QUILL_NO_CPP_KERNELS"):
        _error = "QUILL_NO_CPP_KERNELS is set"
        return False
    try:
        load_inline = _load_inline()
        # a plain library registering quill::group_gemv's CPU kernel: torch.ops calls it from C++,
        # ~7 us a call less than a Python custom op (121 calls a SmolLM2 token)
        load_inline(
            build_name(),
            cpp_sources=[SOURCE],
            extra_cflags=_cflags(),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        _built = True
    except Exception as e:  # no compiler, no headers, a failed build: the other kernels serve
        _error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return _built is not None


def _load_inline() -> Callable[..., object]:
    """torch's load_inline, imported without the warning its import logs on a machine without CUDA
    whose torch was built with it ("No CUDA runtime is found"): quill builds a CPU library."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils.cpp_extension import load_inline
    finally:
        log.setLevel(level)
    return load_inline


def built() -> bool:
    """Whether the library is loaded already (available() has built it), without building it."""
    return bool(_built)


def why_not() -> str | None:
    """Why the kernel could not be built (None: it was, or was not tried yet)."""
    return _error


torch.library.define("quill::group_gemv", "(Tensor x, Tensor q, Tensor s, Tensor o) -> Tensor")


@torch.library.register_fake("quill::group_gemv")
def _(x: Tensor, q: Tensor, s: Tensor, o: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


def group_gemv(x: Tensor, q: Tensor, s: Tensor, o: Tensor) -> Tensor:
    """(M, K) float32 x · Wᵀ for W = q·s + o per group of K / s.shape[1] inputs (a multiple of 32),
    q int8 in interleave's layout, s and o float16: (M, N) float32. available() must have returned True (it registers the CPU kernel)."""
    return torch.ops.quill.group_gemv(x.contiguous(), q, s, o)


torch.library.define("quill::group_gemv4", "(Tensor x, Tensor q, Tensor s, Tensor o) -> Tensor")


@torch.library.register_fake("quill::group_gemv4")
def _(x: Tensor, q: Tensor, s: Tensor, o: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


def interleave(codes: Tensor) -> Tensor:
    """(N, B) bytes a row (int8 weights or packed 4-bit codes), B a multiple of 32 → the same shape
    in the kernels' layout: the rows in groups of four, and in each group unit u (32 bytes) of row
    r at 32·(4u + r), so the four rows the kernel reads at once are one sequential stream; the last
    N % 4 rows as they are. On SmolLM2 (2-core Zen 3, AVX2) int8 decoding ran 1.21-1.29x faster
    than with the rows one after another (4 streams 9 cache lines long each, which the hardware
    prefetch barely learns)."""
    n, width = codes.shape
    full = n - n % 4
    body = codes[:full].view(full // 4, 4, width // BLOCK, BLOCK).transpose(1, 2).reshape(full, width)
    return torch.cat([body, codes[full:]])


def deinterleave(codes: Tensor) -> Tensor:
    """interleave's inverse: the rows one after another again (a copy)."""
    n, width = codes.shape
    full = n - n % 4
    body = codes[:full].view(full // 4, width // BLOCK, 4, BLOCK).transpose(1, 2).reshape(full, width)
    return torch.cat([body, codes[full:]])


def pack4(q: Tensor) -> Tensor:
    """(N, K) codes in [0, 15], K a multiple of 64 → (N, K / 2) uint8 in group_gemv4's layout: byte
    j of each 32 holds code 64p + j (low nibble) and code 64p + 32 + j (high nibble), interleaved."""
    n, k = q.shape
    pairs = q.to(torch.uint8).view(n, k // 64, 2, 32)
    return interleave((pairs[:, :, 0] | (pairs[:, :, 1] << 4)).view(n, k // 2))


def unpack4(packed: Tensor) -> Tensor:
    """pack4's inverse: (N, K / 2) uint8 → (N, K) uint8 codes."""
    n, half = packed.shape
    p = deinterleave(packed).view(n, half // 32, 1, 32)
    return torch.cat([p & 15, p >> 4], dim=2).view(n, 2 * half)


def group_gemv4(x: Tensor, q: Tensor, s: Tensor, o: Tensor) -> Tensor:
    """group_gemv for 4-bit codes: W = q·s + o per group with q in [0, 15] packed by pack4 (K a
    multiple of 64); (M, K) float32 x → (M, N) float32."""
    return torch.ops.quill.group_gemv4(x.contiguous(), q, s, o)
