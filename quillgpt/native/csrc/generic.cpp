// The portable part of the library: x rounded to int16 per block of 32, fp16 conversions, and the
// kernels of a build without AVX2 (x86.cpp's vector kernels serve otherwise).
#include "quill.h"

// n fp16 values (their bits) to float, and n floats to fp16: F16C's converts where the build has
// them, torch's Half otherwise (the same values)
#if defined(__F16C__)
void halves_to_float(const Half* h, float* f, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
  for (; i < n; ++i) f[i] = _cvtsh_ss(h[i]);
}

void floats_to_halves(const float* f, Half* h, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i*)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) h[i] = _cvtss_sh(f[i], _MM_FROUND_TO_NEAREST_INT);
}
#else
void halves_to_float(const Half* h, float* f, int64_t n) {
  for (int64_t i = 0; i < n; ++i) f[i] = float(c10::Half(h[i], c10::Half::from_bits()));
}

void floats_to_halves(const float* f, Half* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = c10::Half(f[i]).x;
}
#endif

void block_scales_any(float* c, const Half* s16, const float* xs, int64_t groups, int64_t per_group) {
  float s[MAX_BLOCKS];
  halves_to_float(s16, s, groups);
  for (int64_t g = 0, b = 0; g < groups; ++g)
    for (int64_t j = 0; j < per_group; ++j, ++b) c[b] = s[g] * xs[b];
}

void round_row(const float* x, int64_t m, int64_t K, int64_t G, Rounded& r) {
  const int64_t blocks = K / 32, per_group = blocks / G;
  float* sum = r.sum.data() + m * G;
  for (int64_t g = 0; g < G; ++g) sum[g] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = x + m * K + 32 * b;
    int16_t* q = r.q.data() + m * K + 32 * b;
    float amax = 0.f, total = 0.f;
#pragma omp simd reduction(max : amax) reduction(+ : total)
    for (int i = 0; i < 32; ++i) {
      amax = std::max(amax, std::fabs(v[i]));
      total += v[i];
    }
    const float inv = amax > 0.f ? r.levels / amax : 0.f;
#pragma omp simd
    for (int i = 0; i < 32; ++i) q[i] = int16_t(std::nearbyint(v[i] * inv));
    r.step[m * blocks + b] = amax / r.levels;
    sum[b / per_group] += total;
  }
}

void round_room(int64_t M, int64_t K, Rounded& r) {
  r.q.resize(M * K);
  r.step.resize(M * K / 32);
  r.sum.resize(M * K / 32);
}

void round_x(const float* x, int64_t M, int64_t K, int64_t G, Rounded& r) {
  round_room(M, K, r);
  for (int64_t m = 0; m < M; ++m) round_row(x, m, K, G, r);
}

#if !defined(QUILL_VECTOR)  // a build without AVX2: these loops are its kernels
// Σ_g o_g · Σx over group g: the offsets' share of a row's dot product
static float offsets_dot(const Half* o16, const float* xg, int64_t groups) {
  float o[MAX_BLOCKS], total = 0.f;
  halves_to_float(o16, o, groups);
  for (int64_t g = 0; g < groups; ++g) total += o[g] * xg[g];
  return total;
}

// One row of W (block b's 32 codes at q + stride·b; per-group fp16 scale s and offset o) dotted
// with one activation row rounded to int16 per block of 32 (xq, the step of each block xs, the
// float sum of each group xg). INT4: 64 codes to the 32 bytes at q + stride·p, so one 32-byte
// read, a mask and a shift give two whole blocks of 32 in order (K a multiple of 64).
template <Format F>
static float row_dot(const uint8_t* q, int64_t stride, const Half* s16, const Half* o16, const int16_t* xq, const float* xs,
                     const float* xg, int64_t groups, int64_t per_group) {
  float c[MAX_BLOCKS];
  block_scales_any(c, s16, xs, groups, per_group);
  float total = 0.f;
  if constexpr (F == Format::INT4) {
    for (int64_t p = 0; p < groups * per_group / 2; ++p) {
      int32_t d0 = 0, d1 = 0;
      const uint8_t* w = q + stride * p;
      for (int64_t j = 0; j < 32; ++j) {
        d0 += int32_t(w[j] & 15) * int32_t(xq[64 * p + j]);
        d1 += int32_t(w[j] >> 4) * int32_t(xq[64 * p + 32 + j]);
      }
      total += float(d0) * c[2 * p] + float(d1) * c[2 * p + 1];
    }
  } else {
    for (int64_t b = 0; b < groups * per_group; ++b) {
      int32_t d = 0;
      const int8_t* w = reinterpret_cast<const int8_t*>(q + stride * b);
      for (int64_t i = 0; i < 32; ++i) d += int32_t(w[i]) * int32_t(xq[32 * b + i]);
      total += float(d) * c[b];
    }
  }
  if (!o16) return F == Format::INT4 ? total + symmetric_offset(F) * offsets_dot(s16, xg, groups) : total;
  return total + offsets_dot(o16, xg, groups);
}

void gemv_columns(const Weights& w, const Rounded& r, int64_t M, float* y, int64_t n0, int64_t n1) {
  const int64_t blocks = w.K / 32, per_group = blocks / w.G, K = w.K, G = w.G, N = w.N;
  auto dot = w.format == Format::INT4 ? row_dot<Format::INT4> : row_dot<Format::INT8>;
  for (int64_t n = n0; n < n1;) {
    const int64_t rows = n + 4 <= n1 ? 4 : 1;
    const uint8_t* group = w.q + n * w.row_bytes;
    for (int64_t m = 0; m < M; ++m) {
      const int16_t* xq = r.q.data() + m * K;
      const float *xs = r.step.data() + m * blocks, *xg = r.sum.data() + m * G;
      for (int64_t i = 0; i < rows; ++i)
        y[m * N + n + i] = dot(group + 32 * i, 32 * rows, w.s + (n + i) * G, offsets_of(w, n + i), xq, xs, xg, G, per_group);
    }
    n += rows;
  }
}

bool attend_lanes(const float*, const float*, const float*, int64_t, const float*, int64_t, int64_t, float*, float*) { return false; }
bool attend_lanes(const float*, const Half*, const Half*, int64_t, const float*, int64_t, int64_t, float*, float*) { return false; }
#endif
