"""A CPU kernel for int8 weights at a few rows (the decode step): y = x·Wᵀ with
W[n, k] = q[n, k]·s[n, g] + o[n, g], g = k // group (per-channel int8: one group a row, o = 0),
in C++ built on first use.

Why a kernel of its own: written as torch ops (quant.grouped_sum) inductor dequantizes each
weight to fp32 and multiplies it, ~7 vector instructions per 16 weights, so on SmolLM2 the
compiled step ran compute-bound at ~14 GB/s of weights while the memory gives 35-40. Here the
activations are rounded to int16 per block of 32 (a step of max|x|/32767: a relative error of
~1e-5, far below bf16's 4e-3) and multiplied with the int8 weights in integer pairs
(`vpmaddwd`: 32 weights in one instruction on AVX-512, two on AVX2); each block's 16 (8) int32
partial sums are scaled into a float accumulator by s·step, and the offsets add o·Σx per group.
No horizontal sum until the row's end. The scales and offsets are read as fp16 (36 bytes per 32
weights where fp32 took 40: the kernel streams at the machine's read bandwidth, so bytes are time;
llama.cpp's Q8_0 reads 34). `-march=native` picks AVX-512BW, AVX2+FMA or the plain
loop; the build is cached by torch per source and CPU (`TORCH_EXTENSIONS_DIR`).

`available()` builds it once (tens of seconds; False, with the reason in `why_not()`, where no
C++ compiler works); `group_gemv` is a torch custom op, so a compiled decode step calls it as one
extern kernel. It equals the dequantized fp32 matmul to the int16 rounding of x
(tests/model/test_group_gemv.py).
"""

from __future__ import annotations

import hashlib
import os

import torch
from torch import Tensor

BLOCK = 32  # activations are rounded per block of 32 inputs; a weight group is a multiple of it

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <utility>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

constexpr int64_t MAX_BLOCKS = 1024;  // K up to 32,768 inputs

// Σ_b d_b · c_b over the blocks, d_b and c_b from part(b), in two accumulators: one fma chain
// would wait on its own latency every block.
template <class Vec, class Part, class Fma>
static std::pair<Vec, Vec> two_chains(int64_t blocks, Vec zero, Part part, Fma fma) {
  Vec acc0 = zero, acc1 = zero;
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    auto [d0, c0] = part(b);
    auto [d1, c1] = part(b + 1);
    acc0 = fma(d0, c0, acc0);
    acc1 = fma(d1, c1, acc1);
  }
  if (b < blocks) {
    auto [d0, c0] = part(b);
    acc0 = fma(d0, c0, acc0);
  }
  return {acc0, acc1};
}

// n fp16 values (their bits) to float
static void halves_to_float(const uint16_t* h, float* f, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
  for (; i < n; ++i) f[i] = _cvtsh_ss(h[i]);
#else
  for (; i < n; ++i) f[i] = float(c10::Half(h[i], c10::Half::from_bits()));
#endif
}

// Row n of W (K int8 weights; per-group fp16 scale s and offset o) dotted with one activation row
// rounded to int16 per block of 32 (xq, the step of each block xs, the float sum of each group xg).
static float row_dot(const int8_t* q, const uint16_t* s16, const uint16_t* o16, const int16_t* xq,
                     const float* xs, const float* xg, int64_t groups, int64_t per_group) {
  float c[MAX_BLOCKS];  // each block's scale: s of its group times its activations' step
  const int64_t blocks = groups * per_group;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  auto mask = [](int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); };
  if (per_group == 1) {  // 16 blocks at a time
    for (int64_t b = 0; b < blocks; b += 16) {
      const __mmask16 m = mask(blocks - b);
      __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, s16 + b));
      _mm512_mask_storeu_ps(c + b, m, _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(m, xs + b)));
    }
  } else {
    for (int64_t g = 0, b = 0; g < groups; ++g)
      for (int64_t j = 0; j < per_group; ++j, ++b) c[b] = _cvtsh_ss(s16[g]) * xs[b];
  }
  auto part = [&](int64_t b) {  // block b's 32 products as 16 int32 pair sums, to float, times c[b]
    __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(q + 32 * b)));
    __m512i d = _mm512_madd_epi16(w, _mm512_loadu_si512((const void*)(xq + 32 * b)));
    return std::make_pair(_mm512_cvtepi32_ps(d), _mm512_set1_ps(c[b]));
  };
  auto fma = [](__m512 d, __m512 c, __m512 acc) { return _mm512_fmadd_ps(d, c, acc); };
  auto [acc0, acc1] = two_chains(blocks, _mm512_setzero_ps(), part, fma);
  __m512 off = _mm512_setzero_ps();  // Σ_g o·Σx, 16 groups at a time (a scalar chain cost ~4 cycles a group)
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 m = mask(groups - g);
    off = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, o16 + g)), _mm512_maskz_loadu_ps(m, xg + g), off);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), off));
#else
  float s[MAX_BLOCKS], o[MAX_BLOCKS];  // the row's scales and offsets as float
  halves_to_float(s16, s, groups);
  halves_to_float(o16, o, groups);
  for (int64_t g = 0, b = 0; g < groups; ++g)
    for (int64_t j = 0; j < per_group; ++j, ++b) c[b] = s[g] * xs[b];
#if defined(__AVX2__) && defined(__FMA__)
  auto part = [&](int64_t b) {  // block b's 32 products as 8 int32 sums, to float, times c[b]
    __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + 32 * b)));
    __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + 32 * b + 16)));
    __m256i d = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)(xq + 32 * b))),
                                 _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(xq + 32 * b + 16))));
    return std::make_pair(_mm256_cvtepi32_ps(d), _mm256_set1_ps(c[b]));
  };
  auto fma = [](__m256 d, __m256 c, __m256 acc) { return _mm256_fmadd_ps(d, c, acc); };
  auto [acc0, acc1] = two_chains(blocks, _mm256_setzero_ps(), part, fma);
  __m256 off = _mm256_setzero_ps();  // Σ_g o·Σx, 8 groups at a time
  for (int64_t g = 0; g < groups; g += 8) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(groups - g)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    off = _mm256_fmadd_ps(_mm256_maskload_ps(o + g, m), _mm256_maskload_ps(xg + g, m), off);
  }
  __m256 sum = _mm256_add_ps(_mm256_add_ps(acc0, acc1), off);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
#else
  float total = 0.f, offsets = 0.f;
  for (int64_t g = 0; g < groups; ++g) offsets += o[g] * xg[g];
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t d = 0;
    for (int64_t i = 0; i < 32; ++i) d += int32_t(q[32 * b + i]) * int32_t(xq[32 * b + i]);
    total += float(d) * c[b];
  }
  return total + offsets;
#endif  // AVX2
#endif  // AVX-512
}

// x (M, K) float32, q (N, K) int8, s and o (N, K / group) float16 -> (M, N) float32.
torch::Tensor group_gemv(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor o) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous (M, K) float32");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "q: contiguous (N, K) int8");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && K % 32 == 0 && K / 32 <= MAX_BLOCKS, "K must match, be a multiple of 32 and at most 32,768");
  TORCH_CHECK(s.scalar_type() == torch::kHalf && s.is_contiguous() && s.dim() == 2 && s.size(0) == N, "s: (N, G) float16");
  TORCH_CHECK(o.sizes() == s.sizes() && o.scalar_type() == torch::kHalf && o.is_contiguous(), "o: as s");
  const int64_t G = s.size(1), blocks = K / 32;
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 32 == 0, "the group must be a multiple of 32");
  const int64_t per_group = (K / G) / 32;
  std::vector<int16_t> xq(M * K);  // x rounded: small buffers, no tensors (each costs a dispatch)
  std::vector<float> xs(M * blocks), xsum(M * G, 0.f);
  const float* xp = x.data_ptr<float>();
  int16_t* xqp = xq.data();
  float* xsp = xs.data();
  float* xsump = xsum.data();
  for (int64_t r = 0; r < M * blocks; ++r) {  // each block of 32 activations to int16
    const float* v = xp + 32 * r;
    float amax = 0.f, total = 0.f;
    for (int i = 0; i < 32; ++i) { amax = std::max(amax, std::fabs(v[i])); total += v[i]; }
    const float step = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int i = 0; i < 32; ++i) xqp[32 * r + i] = int16_t(std::nearbyint(v[i] * inv));
    xsp[r] = step;
    xsump[(r / blocks) * G + (r % blocks) / per_group] += total;
  }
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
  const uint16_t* op = reinterpret_cast<const uint16_t*>(o.data_ptr<at::Half>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m)  // one weight row, read once, for every activation row
        yp[m * N + n] = row_dot(qp + n * K, sp + n * G, op + n * G, xqp + m * K, xsp + m * blocks, xsump + m * G, G, per_group);
  });
  return y;
}

TORCH_LIBRARY_IMPL(quill, CPU, m) { m.impl("group_gemv", &group_gemv); }
"""

_built: bool | None = None
_error: str | None = None


# QUILL_GEMV_ISA picks the instruction set to build for: "native" (this CPU: AVX-512BW, AVX2+FMA or
# the plain loop), or "avx2" / "plain" to build and test the other two paths on an AVX-512 machine
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=haswell"], "plain": ["-march=x86-64"]}


def _isa() -> str:
    isa = os.environ.get("QUILL_GEMV_ISA", "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"QUILL_GEMV_ISA must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    return isa


def _name() -> str:
    """Source, CPU and flags in the name: a build for AVX-512 must not be loaded on an AVX2 machine."""
    key = SOURCE + torch.backends.cpu.get_cpu_capability() + torch.__version__ + _isa()
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
        from torch.utils.cpp_extension import load_inline

        # a plain library registering quill::group_gemv's CPU kernel: torch.ops calls it from C++,
        # ~7 us a call less than a Python custom op (121 calls a SmolLM2 token)
        load_inline(
            _name(),
            cpp_sources=[SOURCE],
            extra_cflags=["-O3", *ISA_FLAGS[_isa()], "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        _built = True
    except Exception as e:  # no compiler, no headers, a failed build: the other kernels serve
        _error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return _built is not None


def why_not() -> str | None:
    """Why the kernel could not be built (None: it was, or was not tried yet)."""
    return _error


torch.library.define("quill::group_gemv", "(Tensor x, Tensor q, Tensor s, Tensor o) -> Tensor")


@torch.library.register_fake("quill::group_gemv")
def _(x: Tensor, q: Tensor, s: Tensor, o: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


def group_gemv(x: Tensor, q: Tensor, s: Tensor, o: Tensor) -> Tensor:
    """(M, K) float32 x · Wᵀ for W = q·s + o per group of K / s.shape[1] inputs (a multiple of 32),
    s and o float16: (M, N) float32. available() must have returned True (it registers the CPU kernel)."""
    return torch.ops.quill.group_gemv(x.contiguous(), q, s, o)
