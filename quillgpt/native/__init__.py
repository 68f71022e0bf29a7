"""QuillGPT's native library: C++ kernels for int8 and 4-bit weights, at a few rows (the decode
step) and GEMM-blocked at many (a prompt's forward, csrc/gemm.cpp), y = x·Wᵀ with
W[n, k] = q[n, k]·s[n, g] + o[n, g], g = k // group (per-channel int8: one group a row, o = 0;
4-bit: q in [0, 15], two codes a byte in pack4's layout), both reading the codes in
interleave's layout; and pre-norm decoder blocks' decode step in one call (decode_blocks,
decode_tokens; inference/native_decoder.py says when it runs), and the greedy draw (argmax_finite).

Why kernels of their own: written as torch ops, inductor dequantizes each weight to fp32 and
multiplies it, several vector instructions per weight, so the compiled step ran compute-bound
well below the memory's speed. Here the activations are rounded to int16 per block of 32 (a step
of max|x|/32767: a relative error of ~1e-5, far below bf16's 4e-3) and multiplied with the codes
in integer pairs (`vpmaddwd`); each block's int32 partial sums are scaled into a float
accumulator by s·step, and the offsets add o·Σx per group. No horizontal sum until the row's end.
The scales and offsets are read as fp16 (36 bytes per 32 int8 weights where fp32 took 40, 4-bit
codes 20: bytes are time when the weights stream from memory; llama.cpp's Q8_0 reads 34, Q4_0
18). Four weight rows run at once, stored interleaved so that they stream as one, and the weights
are prefetched ahead. docs/performance.md has the measurements behind these choices.

The C++ is csrc/ (quill.h says which file holds what), built by build.py on first use:
`available()` builds it once (False, with the reason in `why_not()`, where no C++ compiler works).
Its ops are torch custom ops, so a compiled decode step calls each as one extern kernel. The
kernels equal the dequantized fp32 matmul to the int16 rounding of x (tests/native/test_kernels.py,
for every instruction-set build).
"""

from quillgpt.native.build import available, build_name, built, why_not
from quillgpt.native.layout import BLOCK, Format, deinterleave, interleave, nibbles, pack4, rows_of, unpack4
from quillgpt.native.ops import argmax_finite, decode_blocks, decode_tokens, group_gemv, group_gemv4, group_gemv4_x8

__all__ = [
    "BLOCK",
    "Format",
    "argmax_finite",
    "available",
    "build_name",
    "built",
    "decode_blocks",
    "decode_tokens",
    "deinterleave",
    "group_gemv",
    "group_gemv4",
    "group_gemv4_x8",
    "interleave",
    "nibbles",
    "pack4",
    "rows_of",
    "unpack4",
    "why_not",
]
