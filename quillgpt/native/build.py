"""Building and loading the native library: torch's cpp_extension compiles csrc/ with the machine's
C++ compiler on first use (tens of seconds), for the instruction set QUILL_GEMV_ISA names, and
torch caches the build (TORCH_EXTENSIONS_DIR). QUILL_NO_CPP_KERNELS=1 leaves it unbuilt on purpose."""

from __future__ import annotations

import hashlib
import logging
import os
import types
from pathlib import Path

import torch

from quillgpt.native import ops

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("generic.cpp", "x86.cpp", "gemm.cpp", "decode_block.cpp", "ops.cpp")  # compiled one by one, linked as one library
HEADERS = ("quill.h", "avx512_emulated.h")  # what they include, from beside them

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
# the branches of a loop with a select (activation functions, exp) and does not vectorize it.
# Values are unchanged.
CFLAGS = ["-O3", "-fno-trapping-math", "-fopenmp"]

_built: bool | None = None
_error: str | None = None


def _isa() -> str:
    isa = os.environ.get("QUILL_GEMV_ISA", "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"QUILL_GEMV_ISA must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    return isa


def _cflags() -> list[str]:
    return [*CFLAGS, *ISA_FLAGS[_isa()]]


def build_name() -> str:
    """The sources, CPU, torch and flags in the name, the checkout's path not: a build for AVX-512
    must not be loaded on an AVX2 machine, a kernel plan measured with another build is measured
    again (quant.cached_plan), and a checkout with the same sources finds the cached build."""
    key = "".join(name + (CSRC / name).read_text() for name in (*SOURCES, *HEADERS))
    key += torch.backends.cpu.get_cpu_capability() + torch.__version__ + " ".join(_cflags())
    return f"quill_native_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def available() -> bool:
    """Whether the library is loaded (building it on the first call: a C++ compiler is needed)."""
    global _built, _error
    if _built is not None or _error is not None:
        return _built is not None
    if os.environ.get("QUILL_NO_CPP_KERNELS"):
        _error = "QUILL_NO_CPP_KERNELS is set"
        return False
    try:
        _load(build_name())
        ops.register_fakes()  # torch takes them once the library has defined the ops
        _built = True
    except Exception as e:  # no compiler, no headers, a failed build: the other kernels serve
        _error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return _built is not None


def _load(name: str) -> None:
    """Build (or find built) and load the library `name`: a plain shared library whose
    TORCH_LIBRARY registers the quill ops, which torch.ops calls from C++ (cheaper a call than a
    Python custom op). The sources are copied into torch's build folder of that name first, so
    that its build file names no checkout: a path there would rebuild it for each checkout."""
    cpp = _cpp_extension()
    folder = Path(cpp._get_build_directory(name, verbose=False)) / "csrc"
    folder.mkdir(exist_ok=True)
    for file in (*SOURCES, *HEADERS):
        _write_if_changed(folder / file, (CSRC / file).read_text())
    sources = [str(folder / file) for file in SOURCES]
    cpp.load(name, sources, extra_cflags=_cflags(), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def _write_if_changed(path: Path, text: str) -> None:
    """path's text, replaced atomically and only where it differs (a new time would rebuild)."""
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _cpp_extension() -> types.ModuleType:
    """torch's cpp_extension, imported without the warning its import logs on a machine without
    CUDA whose torch was built with it ("No CUDA runtime is found"): quill builds a CPU library."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension as cpp
    finally:
        log.setLevel(level)
    return cpp


def built() -> bool:
    """Whether the library is loaded already (available() has built it), without building it."""
    return bool(_built)


def why_not() -> str | None:
    """Why the library could not be built (None: it was, or was not tried yet)."""
    return _error
