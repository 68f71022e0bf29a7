// The many-rows kernel (a prompt's forward): gemm_columns, y = x·Wᵀ for x rounded by round_x as the
// decode kernels round it (int16 per block of 32; or int8, where round_x was asked for 127 levels:
// then 4-bit weights are multiplied as bytes, a lane four inputs, vpdpbusd), GEMM-blocked. gemv_columns streams every
// activation row past each 4 weight rows, so past a few dozen rows the activations fall out of L2
// and each weight group's decode is paid again for every 8 rows. Here:
//   - a panel of LANES weight rows (16 on AVX-512, 8 on AVX2) is unpacked once per block of
//     M_BLOCK activation rows into int16 pairs, lane i of a vector being row i's pair (so a vector
//     times one activation pair, broadcast, is LANES rows' dot products at once: no transposes and
//     no horizontal sums in the inner loop), with the panel's scales and offsets side by side;
//   - a register tile of LANES weight rows × TILE activation rows (12 on AVX-512, 4 on AVX2): per
//     pair of inputs one weight load and TILE pair-dots (vpdpwssd, the activation pair a broadcast
//     operand); per block of 32 inputs the TILE int32 sums are converted and scaled by s·step into
//     float accumulators, per group the offsets add o·Σx. 16 pair-dots to 3 float ops a block.
//   - M_BLOCK activation rows (their int16 codes: M_BLOCK · K · 2 bytes) are read from L2/L3 once per
//     panel; the panel (LANES · K · 2 bytes) stays in L2 while they pass.
// The threads split the weight rows (ops.cpp), each a contiguous range, so each unpacks only its own
// panels and the activations, read-only, are shared.
#include "quill.h"
#if defined(QUILL_VECTOR)
#if defined(QUILL_EMULATE_AVX512)
#include "avx512_emulated.h"
#endif
#include <immintrin.h>

constexpr int64_t M_BLOCK = 256;  // activation rows a panel is unpacked for

#if defined(QUILL_AVX512)
struct Lanes {
  static constexpr int LANES = 16, TILE = 12;
  using Ints = __m512i;
  using Floats = __m512;
  static Ints dot(const int32_t* w, const int32_t* x) { return _mm512_madd_epi16(_mm512_loadu_si512((const void*)w), _mm512_set1_epi32(*x)); }
#if defined(QUILL_EMULATE_AVX512) || defined(__AVX512VNNI__)
  static Ints dot_add(Ints acc, Ints w, const int32_t* x) { return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(*x)); }
#else
  static Ints dot_add(Ints acc, Ints w, const int32_t* x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(*x))); }
#endif
  // int8 activations: lanes of 4 weight codes (u8) times 4 activations (s8), broadcast
#if defined(QUILL_EMULATE_AVX512) || defined(__AVX512VNNI__)
  static Ints dot8_add(Ints acc, Ints w, const int32_t* x) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(*x)); }
#else
  static Ints dot8_add(Ints acc, Ints w, const int32_t* x) {  // codes ≤ 15: the int16 pair sums cannot saturate
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, _mm512_set1_epi32(*x)), _mm512_set1_epi16(1)));
  }
#endif
  static Ints dot8(const int32_t* w, const int32_t* x) { return dot8_add(_mm512_setzero_si512(), load(w), x); }
  static Ints load(const int32_t* w) { return _mm512_loadu_si512((const void*)w); }
  static Floats zero() { return _mm512_setzero_ps(); }
  static Floats load(const float* p) { return _mm512_loadu_ps(p); }
  static Floats scaled(Floats acc, Ints d, Floats s, float step) {  // acc + d·s·step
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, _mm512_set1_ps(step)), acc);
  }
  static Floats fma(Floats a, float b, Floats c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
  static void store(float* y, Floats v, int64_t n) {  // the first n lanes
    if (n == LANES)
      _mm512_storeu_ps(y, v);
    else
      _mm512_mask_storeu_ps(y, __mmask16((1u << n) - 1), v);
  }
};
#else
struct Lanes {
  static constexpr int LANES = 8, TILE = 4;
  using Ints = __m256i;
  using Floats = __m256;
  static Ints dot(const int32_t* w, const int32_t* x) { return _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)w), _mm256_set1_epi32(*x)); }
  static Ints dot_add(Ints acc, Ints w, const int32_t* x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi32(*x))); }
  static Ints dot8_add(Ints acc, Ints w, const int32_t* x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(*x)), _mm256_set1_epi16(1)));
  }
  static Ints dot8(const int32_t* w, const int32_t* x) { return dot8_add(_mm256_setzero_si256(), load(w), x); }
  static Ints load(const int32_t* w) { return _mm256_loadu_si256((const __m256i*)w); }
  static Floats zero() { return _mm256_setzero_ps(); }
  static Floats load(const float* p) { return _mm256_loadu_ps(p); }
  static Floats scaled(Floats acc, Ints d, Floats s, float step) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s, _mm256_set1_ps(step)), acc);
  }
  static Floats fma(Floats a, float b, Floats c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), c); }
  static void store(float* y, Floats v, int64_t n) {
    alignas(32) float f[8];
    _mm256_store_ps(f, v);
    for (int64_t i = 0; i < n; ++i) y[i] = f[i];
  }
};
#endif
constexpr int64_t L = Lanes::LANES;

// The activations' codes: int16 (each int32 lane a pair of inputs, vpdpwssd) or, asked for by
// round_x's levels 127, int8 with 4-bit weights (a lane 4 inputs, vpdpbusd: twice the products an
// instruction). UNIT inputs a lane, PER_BLOCK lanes a block of 32.
enum class Acts { I16, I8 };
template <Acts A>
constexpr int64_t UNIT = A == Acts::I16 ? 2 : 4;
template <Acts A>
constexpr int64_t PER_BLOCK = 32 / UNIT<A>;

// A panel of L weight rows, unpacked: w[p·L + i] = row i's codes at inputs UNIT·p.. as int32 lane
// (int16 activations: two int16; int8: four bytes), s[b·L + i] the scale of row i's block b,
// o[g·L + i] the offset of its group g. Rows past the layer's last are zeros.
struct Panel {
  std::vector<int32_t> w;
  std::vector<float> s, o;
};

// Row n's unit u (32 bytes) in the layout of quill.h: in a group of 4 rows, or one of the last N % 4
static inline const uint8_t* row_unit(const Weights& w, int64_t n, int64_t u) {
  const int64_t full = w.N - w.N % 4;
  return n < full ? unit<4>(w.q + (n - n % 4) * w.row_bytes, int(n % 4), u) : unit<1>(w.q + n * w.row_bytes, 0, u);
}

// Lane i of the panel from row n's codes (INT4: unit u holds inputs 64u + j in its low nibbles and
// 64u + 32 + j in its high ones; INT8: unit u is block u; int8 activations take INT4 only)
template <Format F, Acts A>
static void unpack_row(const Weights& w, int64_t n, int64_t i, int32_t* out) {
  const int64_t units = w.row_bytes / 32;
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* c = row_unit(w, n, u);
    if constexpr (A == Acts::I8) {
      int32_t* low = out + 16 * u * L;  // quads 16u..16u + 7: the low nibbles; then the high ones
      for (int j = 0; j < 8; ++j) {
        uint32_t lo = 0, hi = 0;
        for (int t = 0; t < 4; ++t) lo |= uint32_t(c[4 * j + t] & 15) << (8 * t), hi |= uint32_t(c[4 * j + t] >> 4) << (8 * t);
        low[j * L + i] = int32_t(lo), low[(8 + j) * L + i] = int32_t(hi);
      }
    } else if constexpr (F == Format::INT4) {
      int32_t* low = out + 32 * u * L;  // pairs 32u..32u + 15: the low nibbles; then the high ones
      for (int j = 0; j < 16; ++j) {
        low[j * L + i] = int32_t(c[2 * j] & 15) | (int32_t(c[2 * j + 1] & 15) << 16);
        low[(16 + j) * L + i] = int32_t(c[2 * j] >> 4) | (int32_t(c[2 * j + 1] >> 4) << 16);
      }
    } else {
      const int8_t* v = reinterpret_cast<const int8_t*>(c);
      for (int j = 0; j < 16; ++j) out[(16 * u + j) * L + i] = int32_t(uint32_t(uint16_t(int16_t(v[2 * j]))) | (uint32_t(uint16_t(int16_t(v[2 * j + 1]))) << 16));
    }
  }
}

#if defined(QUILL_AVX512)
// r[j] lane i = r[i] lane j (16 × 16 int32): 32-bit, then 64-bit interleaves within 128-bit
// lanes, then two rounds of 128-bit lane shuffles
static inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4) {  // r[i + c], 128-bit lane l: column 4l + c of rows i..i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88), r[4 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88), r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xDD);
  }
}

// unpack_row for 16 whole rows at once (four groups of 4 in the layout): each row's unit widened
// to int16 (its int32 lane j then is its pair j; int8 activations: the low nibbles' 32 bytes, then
// the high ones', lane j a quad), the 16 rows transposed into the panel's order, where a scalar
// store per lane and row cost as much as the tiles' work on a block of rows
template <Format F, Acts A>
static void unpack16(const Weights& w, int64_t n0, int32_t* out) {
  const int64_t units = w.row_bytes / 32;
  const uint8_t* q = w.q + n0 * w.row_bytes;
  const __m512i low = _mm512_set1_epi16(0x0F);
  const __m256i low8 = _mm256_set1_epi8(0x0F);
  __m512i r[16], h[16];
  for (int64_t u = 0; u < units; ++u) {
    for (int i = 0; i < 16; ++i) {
      const __m256i c = _mm256_loadu_si256((const __m256i*)unit<4>(q + (i / 4) * 4 * w.row_bytes, i % 4, u));
      if constexpr (A == Acts::I8) {
        const __m256i lo = _mm256_and_si256(c, low8), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low8);
        r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      } else if constexpr (F == Format::INT4) {
        const __m512i v = _mm512_cvtepu8_epi16(c);
        r[i] = _mm512_and_si512(v, low), h[i] = _mm512_srli_epi16(v, 4);
      } else {
        r[i] = _mm512_cvtepi8_epi16(c);
      }
    }
    transpose16(r);
    int32_t* o = out + (F == Format::INT4 && A == Acts::I16 ? 32 : 16) * u * L;
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512((void*)(o + j * L), r[j]);
    if constexpr (F == Format::INT4 && A == Acts::I16) {
      transpose16(h);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512((void*)(o + (16 + j) * L), h[j]);
    }
  }
}
#endif

// Weight rows n0.. (up to L of them) into the panel
template <Format F, Acts A>
static void unpack(const Weights& w, int64_t n0, Panel& p) {
  const int64_t blocks = w.K / 32, per_group = blocks / w.G, rows = std::min<int64_t>(L, w.N - n0);
  p.s.assign(blocks * L, 0.f);
  p.o.assign(w.G * L, 0.f);
#if defined(QUILL_AVX512)
  const bool whole = n0 + L <= w.N - w.N % 4;  // four whole groups of the layout
#else
  const bool whole = false;
#endif
  if (whole) {
#if defined(QUILL_AVX512)
    p.w.resize(w.K / UNIT<A> * L);
    unpack16<F, A>(w, n0, p.w.data());
#endif
  } else {
    p.w.assign(w.K / UNIT<A> * L, 0);
  }
  for (int64_t i = 0; i < rows; ++i) {
    if (!whole) unpack_row<F, A>(w, n0 + i, i, p.w.data());
    for (int64_t g = 0; g < w.G; ++g) {
      const float s = half_to_float(w.s[(n0 + i) * w.G + g]);
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) p.s[b * L + i] = s;
      p.o[g * L + i] = w.o ? half_to_float(w.o[(n0 + i) * w.G + g]) : symmetric_offset(w.format) * s;
    }
  }
}

// A block of activation rows in the tiles' order (the kernel then reads one pointer at fixed
// offsets, where twelve row pointers and their steps spilled the registers): the tile of rows
// t0..t0 + n (n ≤ TILE) starts at row t0's offsets, with q[p·n + m] row m's inputs UNIT·p.. as one
// int32 (two int16 or four int8), step[b·n + m] row m's step of block b, sum[g·n + m] its sum of group g
struct XBlock {
  std::vector<int32_t> q;
  std::vector<float> step, sum;
};

template <Acts A>
static void pack_block(const Rounded& r, int64_t m0, int64_t m1, int64_t K, int64_t G, XBlock& xb) {
  const int64_t pairs = K / UNIT<A>, blocks = K / 32, rows = m1 - m0;
  xb.q.resize(rows * pairs), xb.step.resize(rows * blocks), xb.sum.resize(rows * G);
  for (int64_t t0 = 0; t0 < rows; t0 += Lanes::TILE) {
    const int64_t n = std::min<int64_t>(Lanes::TILE, rows - t0);
    for (int64_t m = 0; m < n; ++m) {
      const int16_t* q = r.q.data() + (m0 + t0 + m) * K;
      int32_t* out = xb.q.data() + t0 * pairs + m;
      if constexpr (A == Acts::I16) {
        for (int64_t p = 0; p < pairs; ++p) std::memcpy(out + p * n, q + 2 * p, 4);
      } else {  // codes in [-127, 127]: their low bytes
        for (int64_t p = 0; p < pairs; ++p) {
          const int8_t b[4] = {int8_t(q[4 * p]), int8_t(q[4 * p + 1]), int8_t(q[4 * p + 2]), int8_t(q[4 * p + 3])};
          std::memcpy(out + p * n, b, 4);
        }
      }
      for (int64_t b = 0; b < blocks; ++b) xb.step[t0 * blocks + b * n + m] = r.step[(m0 + t0 + m) * blocks + b];
      for (int64_t g = 0; g < G; ++g) xb.sum[t0 * G + g * n + m] = r.sum[(m0 + t0 + m) * G + g];
    }
  }
}

// y[m·N + i] (m < T, i < lanes) for the panel and a tile of T activation rows (x, xs, xg: its
// codes, steps and sums in XBlock's order)
template <Acts A, int T>
static void tile(const Panel& p, const int32_t* x, const float* xs, const float* xg, int64_t K, int64_t G, float* y, int64_t N,
                 int64_t lanes) {
  constexpr int64_t U = PER_BLOCK<A>;
  const int64_t blocks = K / 32, per_group = blocks / G;
  typename Lanes::Floats acc[T];
  for (int m = 0; m < T; ++m) acc[m] = Lanes::zero();
  int64_t g = 0, left = per_group;
  for (int64_t b = 0; b < blocks; ++b) {
    const int32_t *wb = p.w.data() + U * b * L, *xb = x + U * b * T;
    typename Lanes::Ints d[T];
    for (int m = 0; m < T; ++m) d[m] = A == Acts::I16 ? Lanes::dot(wb, xb + m) : Lanes::dot8(wb, xb + m);
#pragma GCC unroll 16
    for (int j = 1; j < U; ++j) {
      const typename Lanes::Ints wj = Lanes::load(wb + j * L);
      for (int m = 0; m < T; ++m) d[m] = A == Acts::I16 ? Lanes::dot_add(d[m], wj, xb + j * T + m) : Lanes::dot8_add(d[m], wj, xb + j * T + m);
    }
    const typename Lanes::Floats s = Lanes::load(p.s.data() + b * L);
    for (int m = 0; m < T; ++m) acc[m] = Lanes::scaled(acc[m], d[m], s, xs[b * T + m]);
    if (--left == 0) {  // the group's offsets: o·Σx
      const typename Lanes::Floats o = Lanes::load(p.o.data() + g * L);
      for (int m = 0; m < T; ++m) acc[m] = Lanes::fma(o, xg[g * T + m], acc[m]);
      ++g, left = per_group;
    }
  }
  for (int m = 0; m < T; ++m) Lanes::store(y + m * N, acc[m], lanes);
}

// The panel against the block's rows, TILE at a time, then the rest in one smaller tile (rows t0..)
template <Acts A, int T = Lanes::TILE>
static void tiles(const Panel& p, const XBlock& xb, int64_t t0, int64_t rows, int64_t K, int64_t G, float* y, int64_t N, int64_t lanes) {
  for (; t0 + T <= rows; t0 += T)
    tile<A, T>(p, xb.q.data() + t0 * K / UNIT<A>, xb.step.data() + t0 * K / 32, xb.sum.data() + t0 * G, K, G, y + t0 * N, N, lanes);
  if constexpr (T > 1) {
    if (t0 < rows) tiles<A, T - 1>(p, xb, t0, rows, K, G, y, N, lanes);
  }
}

template <Format F, Acts A>
static void gemm(const Weights& w, const Rounded& r, int64_t M, float* y, int64_t n0, int64_t n1) {
  Panel p;
  XBlock xb;
  for (int64_t m0 = 0; m0 < M; m0 += M_BLOCK) {
    const int64_t m1 = std::min(M, m0 + M_BLOCK);
    pack_block<A>(r, m0, m1, w.K, w.G, xb);
    for (int64_t n = n0; n < n1; n += L) {
      unpack<F, A>(w, n, p);
      tiles<A>(p, xb, 0, m1 - m0, w.K, w.G, y + m0 * w.N + n, w.N, std::min(L, n1 - n));
    }
  }
}

void gemm_columns(const Weights& w, const Rounded& r, int64_t M, float* y, int64_t n0, int64_t n1) {
  if (w.format == Format::INT4 && r.levels == INT8_LEVELS)
    gemm<Format::INT4, Acts::I8>(w, r, M, y, n0, n1);
  else if (w.format == Format::INT4)
    gemm<Format::INT4, Acts::I16>(w, r, M, y, n0, n1);
  else  // int8 weights: int16 pairs at either rounding (signed codes times signed activations)
    gemm<Format::INT8, Acts::I16>(w, r, M, y, n0, n1);
}
#else
void gemm_columns(const Weights& w, const Rounded& r, int64_t M, float* y, int64_t n0, int64_t n1) { gemv_columns(w, r, M, y, n0, n1); }
#endif
