// The vector kernels: the AVX-512 and AVX2 builds' gemv_columns and attend_lanes (quill.h), one
// source for both instruction sets through a small vector type each (Avx512, Avx2 below). The
// activations are rounded to int16 per block of 32 (generic.cpp's round_x) and multiplied with the
// weight codes in integer pairs (vpmaddwd: 32 weights in one instruction on AVX-512, two on AVX2);
// each block's int32 pair sums are scaled into a float accumulator by s·step, and the offsets add
// o·Σx per group. No horizontal sum until the row's end.
#include "quill.h"
#if defined(QUILL_VECTOR)
#if defined(QUILL_EMULATE_AVX512)
#include "avx512_emulated.h"
#endif
#include <immintrin.h>

// The weights are asked for this far ahead of the kernels' reads, into L2: the hardware's prefetch
// alone left the weights streaming well below the memory's speed. (INT4 asked for L1 until its
// weights sat in huge pages; since, L2 streamed a fifth faster: docs/kernels.md.)
constexpr int64_t PREFETCH = 8192;

// The weight bytes [p, p + bytes) PREFETCH ahead, a line at a time
template <Format F>
static inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char*)(p + PREFETCH + off), _MM_HINT_T1);
}

#if defined(QUILL_AVX512)
// AVX-512: 16 float lanes; a block of 32 weights widened to int16 in one register, times the
// block's 32 activations (read once a pass for every weight row) as 16 pair sums
struct Avx512 {
  static constexpr int LANES = 16;
  using Floats = __m512;
  using Block = __m512i;  // 32 weights as int16
  using X = __m512i;      // 32 activations as int16
  struct Blocks {
    Block low, high;
  };
  static Floats set1(float x) { return _mm512_set1_ps(x); }
  static Floats load(const float* p) { return _mm512_loadu_ps(p); }
  static Floats load(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static void store(float* p, Floats v) { _mm512_storeu_ps(p, v); }
  static Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
  static Floats fma(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(Floats v) { return _mm512_reduce_add_ps(v); }
  static X load_x(const int16_t* x) { return _mm512_loadu_si512((const void*)x); }
  static Block int8_block(const uint8_t* w) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)w)); }
  static Blocks int4_blocks(const uint8_t* w) {  // low nibbles: the first block, high: the second
    const __m256i v = _mm256_loadu_si256((const __m256i*)w), low = _mm256_set1_epi8(0x0F);
    return {_mm512_cvtepu8_epi16(_mm256_and_si256(v, low)), _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low))};
  }
  static Floats add_block(Floats acc, Block w, X x, float c) {  // acc + (the 32 products as 16 pair sums)·c
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(w, x)), _mm512_set1_ps(c), acc);
  }

  // c[b] = s of block b's group times the step of block b's activations: 16 blocks at a time where
  // a group is one block
  static void block_scales(float* c, const Half* s16, const float* xs, int64_t groups, int64_t per_group) {
    if (per_group != 1) return block_scales_any(c, s16, xs, groups, per_group);
    for (int64_t b = 0; b < groups; b += 16) {
      const __mmask16 m = groups - b >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - b)) - 1);
      __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, s16 + b));
      _mm512_mask_storeu_ps(c + b, m, _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(m, xs + b)));
    }
  }

  // Σ_g o_g · Σx over group g, the offsets' share of a row's dot product: 16 groups at a time (a
  // scalar chain is one dependent add a group)
  static float offsets_dot(const Half* o16, const float* xg, int64_t groups) {
    __m512 off = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 m = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
      off = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, o16 + g)), _mm512_maskz_loadu_ps(m, xg + g), off);
    }
    return _mm512_reduce_add_ps(off);
  }

  // Several activation rows (a decode batch): rows4_batch below, from this many rows
  static constexpr int64_t BATCH_FROM = 2;
  template <Format F>
  static void batch4(const uint8_t* group, const Half* s16, const Half* o16, int64_t G, int64_t per_group, const int16_t* xq,
                     const float* xs, const float* xg, int64_t K, int64_t MB, float* y, int64_t N);
};
using Vec = Avx512;

// A group of 4 weight rows against MB activation rows at once, the 16 int32 lanes being (weight row
// r, pair j) rather than 16 pairs of one row. rows_dot, run once per activation row, widens each
// weight block again for every row and pays a convert and an fma per block per weight row; here
// block b's 128 bytes (4 rows) are loaded and widened once for all MB rows, and each activation row
// costs 4 pair-dots (vpdpwssd), one convert and one fma per block of 4 weight rows. Lane (r, j) of
// chunk c is pair j of positions 8c..8c+7 of row r: the qwords of the 4 rows' units are regrouped
// so that chunk c holds those 8 bytes of each row, and the matching 8 activations are one 128-bit
// broadcast.
#if defined(QUILL_EMULATE_AVX512) || defined(__AVX512VNNI__)
static inline __m512i dot_pairs(__m512i acc, __m512i w, __m512i x) { return _mm512_dpwssd_epi32(acc, w, x); }
#else
static inline __m512i dot_pairs(__m512i acc, __m512i w, __m512i x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); }
#endif

alignas(64) static const int64_t CHUNKS01[8] = {0, 4, 8, 12, 1, 5, 9, 13};  // qword q of rows 0-3, q = 0 then 1
alignas(64) static const int64_t CHUNKS23[8] = {2, 6, 10, 14, 3, 7, 11, 15};
alignas(64) static const int32_t SPREAD4[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
alignas(64) static const int32_t FIRSTS4[16] = {0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12};

// The 4 chunks of a unit per row (32 bytes each, 4 groups): w[c] = bytes 8c..8c+7 of rows 0..3, widened
template <Format F>
static inline void chunks_of(const uint8_t* unit4, __m512i w[4]) {
  const __m512i a = _mm512_loadu_si512((const void*)unit4), b = _mm512_loadu_si512((const void*)(unit4 + 64));
  const __m512i p01 = _mm512_permutex2var_epi64(a, _mm512_loadu_si512((const void*)CHUNKS01), b);
  const __m512i p23 = _mm512_permutex2var_epi64(a, _mm512_loadu_si512((const void*)CHUNKS23), b);
  const __m256i h[4] = {_mm512_castsi512_si256(p01), _mm512_extracti64x4_epi64(p01, 1), _mm512_castsi512_si256(p23),
                        _mm512_extracti64x4_epi64(p23, 1)};
  for (int c = 0; c < 4; ++c) w[c] = F == Format::INT4 ? _mm512_cvtepu8_epi16(h[c]) : _mm512_cvtepi8_epi16(h[c]);
}

// v4[g][r] = the fp16 value h[r·G + g] of the 4 rows, side by side for each g (a 4x4 transpose per
// 4 groups, where a scalar convert per value was a large share of a batch's instructions)
static void side_by_side4(const Half* h, int64_t G, float (*v4)[4]) {
  alignas(16) float f[4][MAX_BLOCKS];
  for (int r = 0; r < 4; ++r) halves_to_float(h + r * G, f[r], G);
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) {
    __m128 a = _mm_loadu_ps(f[0] + g), b = _mm_loadu_ps(f[1] + g), c = _mm_loadu_ps(f[2] + g), d = _mm_loadu_ps(f[3] + g);
    _MM_TRANSPOSE4_PS(a, b, c, d);
    _mm_store_ps(v4[g], a), _mm_store_ps(v4[g + 1], b), _mm_store_ps(v4[g + 2], c), _mm_store_ps(v4[g + 3], d);
  }
  for (; g < G; ++g)
    for (int r = 0; r < 4; ++r) v4[g][r] = f[r][g];
}

// The 4 rows' sums from acc (lanes (row, pair)), each row's 4 lanes summed within their 128 bits
// (its sum lands in lane 4r), plus the offsets' share of the 4 rows at once, 4 groups a 512-bit fma
// (lanes (group, row)), where a reduce_add and an offsets_dot per (row, r) cost as much as the
// blocks' work over short rows
static __m128 rows4_sums(__m512 acc, const float (*o4)[4], const float* xg, int64_t G) {
  const __m512i spread = _mm512_loadu_si512((const void*)SPREAD4), firsts = _mm512_loadu_si512((const void*)FIRSTS4);
  __m512 off4 = _mm512_setzero_ps();
  for (int64_t g4 = 0; g4 < G; g4 += 4) {
    const int64_t n = G - g4 < 4 ? G - g4 : 4;
    const __m512 xv = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), xg + g4));
    off4 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(__mmask16((1u << (4 * n)) - 1), o4[g4]), xv, off4);
  }
  alignas(64) float f[16];
  _mm512_store_ps(f, off4);
  const __m128 off = _mm_add_ps(_mm_add_ps(_mm_load_ps(f), _mm_load_ps(f + 4)), _mm_add_ps(_mm_load_ps(f + 8), _mm_load_ps(f + 12)));
  __m512 t = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0xB1));  // lanes (0+1, 1+0, 2+3, 3+2) of each 4
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));             // + (2+3, 3+2, 0+1, 1+0)
  return _mm_add_ps(_mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, t)), off);
}

// y[m·N + r] (m < MB, r < 4) for the 4 weight rows at group and the activation rows at xq (K apart):
// block b against every activation row: w, its 4 chunks, each times the step of the activation
// row's block; at the group's end, times the 4 rows' scales (one fma a block rather than a mul and
// an fma where a group spans several blocks: per-channel int8 is one group)
template <Format F, int MB>
static void rows4_batch(const uint8_t* group, const Half* s16, const Half* o16, int64_t G, int64_t per_group, const int16_t* xq,
                        const float* xs, const float* xg, int64_t K, float* y, int64_t N) {
  const int64_t blocks = G * per_group;
  alignas(64) float s4[MAX_BLOCKS][4], o4[MAX_BLOCKS][4];  // group g's scale and offset of rows 0..3, side by side
  side_by_side4(s16, G, s4);
  if (o16)
    side_by_side4(o16, G, o4);
  else
    for (int64_t g = 0; g < G; ++g)
      for (int r = 0; r < 4; ++r) o4[g][r] = symmetric_offset(F) * s4[g][r];
  const __m512i spread = _mm512_loadu_si512((const void*)SPREAD4), low = _mm512_set1_epi16(0x0F);
  __m512 acc[MB], gacc[MB];  // over all groups, and over the blocks of the current group
  for (int m = 0; m < MB; ++m) acc[m] = gacc[m] = _mm512_setzero_ps();
  int64_t g = 0, left = per_group;  // the current group, and its blocks still to come (no division a block)
  auto block = [&](const __m512i w[4], int64_t b) {
    for (int m = 0; m < MB; ++m) {
      const int16_t* x = xq + m * K + 32 * b;
      __m512i d = _mm512_madd_epi16(w[0], _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)x)));
      for (int c = 1; c < 4; ++c) d = dot_pairs(d, w[c], _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(x + 8 * c))));
      gacc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(xs[m * blocks + b]), gacc[m]);
    }
    if (--left == 0) {
      const __m512 sv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_load_ps(s4[g++])));
      for (int m = 0; m < MB; ++m) {
        acc[m] = _mm512_fmadd_ps(gacc[m], sv, acc[m]);
        gacc[m] = _mm512_setzero_ps();
      }
      left = per_group;
    }
  };
  __m512i w[4];
  if constexpr (F == Format::INT4) {
    for (int64_t p = 0; p < blocks / 2; ++p) {  // a unit: blocks 2p (low nibbles) and 2p + 1 (high)
      prefetch_ahead<F>(unit<4>(group, 0, p), 128);
      chunks_of<F>(unit<4>(group, 0, p), w);
      __m512i hi[4];
      for (int c = 0; c < 4; ++c) {
        hi[c] = _mm512_srli_epi16(w[c], 4);
        w[c] = _mm512_and_si512(w[c], low);
      }
      block(w, 2 * p);
      block(hi, 2 * p + 1);
    }
  } else {
    for (int64_t b = 0; b < blocks; ++b) {
      prefetch_ahead<F>(unit<4>(group, 0, b), 128);
      chunks_of<F>(unit<4>(group, 0, b), w);
      block(w, b);
    }
  }
  for (int m = 0; m < MB; ++m) _mm_storeu_ps(y + m * N, rows4_sums(acc[m], o4, xg + m * G, G));
}

template <Format F>
void Avx512::batch4(const uint8_t* group, const Half* s16, const Half* o16, int64_t G, int64_t per_group, const int16_t* xq,
                    const float* xs, const float* xg, int64_t K, int64_t MB, float* y, int64_t N) {
  using Batch = void (*)(const uint8_t*, const Half*, const Half*, int64_t, int64_t, const int16_t*, const float*, const float*, int64_t,
                         float*, int64_t);
  static const Batch batches[9] = {nullptr,           rows4_batch<F, 1>, rows4_batch<F, 2>, rows4_batch<F, 3>, rows4_batch<F, 4>,
                                   rows4_batch<F, 5>, rows4_batch<F, 6>, rows4_batch<F, 7>, rows4_batch<F, 8>};
  batches[MB](group, s16, o16, G, per_group, xq, xs, xg, K, y, N);
}
#else
// AVX2: 8 float lanes; a block of 32 weights as two halves of 16 int16 (vpmaddwd is 256 bits here),
// and so its activations
static float sum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

struct Avx2 {
  static constexpr int LANES = 8;
  using Floats = __m256;
  struct Halves {
    __m256i first, second;
  };
  using Block = Halves;  // 32 weights as int16, two halves
  using X = Halves;      // 32 activations as int16, two halves
  struct Blocks {
    Block low, high;
  };
  static Floats set1(float x) { return _mm256_set1_ps(x); }
  static Floats load(const float* p) { return _mm256_loadu_ps(p); }
  static Floats load(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static void store(float* p, Floats v) { _mm256_storeu_ps(p, v); }
  static Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
  static Floats fma(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(Floats v) { return sum8(v); }
  static X load_x(const int16_t* x) { return {_mm256_loadu_si256((const __m256i*)x), _mm256_loadu_si256((const __m256i*)(x + 16))}; }
  static Block int8_block(const uint8_t* w) {  // sign-extended in two halves
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)w)), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 16)))};
  }
  static Blocks int4_blocks(const uint8_t* w) {  // each byte widened once: low nibble, high nibble
    const __m256i h0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)w));
    const __m256i h1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(w + 16))), low = _mm256_set1_epi16(0x0F);
    return {{_mm256_and_si256(h0, low), _mm256_and_si256(h1, low)}, {_mm256_srli_epi16(h0, 4), _mm256_srli_epi16(h1, 4)}};
  }
  static Floats add_block(Floats acc, Block w, X x, float c) {  // acc + (the 32 products as 8 sums of 4)·c
    const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(w.first, x.first), _mm256_madd_epi16(w.second, x.second));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(c), acc);
  }

  // block_scales 8 at a time where a group is one block (the generic loop, per_group unknown at
  // compile time, cost more than a short row's dot product)
  static void block_scales(float* c, const Half* s16, const float* xs, int64_t groups, int64_t per_group) {
    if (per_group != 1) return block_scales_any(c, s16, xs, groups, per_group);
    int64_t b = 0;
    for (; b + 8 <= groups; b += 8)
      _mm256_storeu_ps(c + b, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s16 + b))), _mm256_loadu_ps(xs + b)));
    for (; b < groups; ++b) c[b] = _cvtsh_ss(s16[b]) * xs[b];
  }

  static float offsets_dot(const Half* o16, const float* xg, int64_t groups) {  // 8 groups at a time
    __m256 off = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) off = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o16 + g))), _mm256_loadu_ps(xg + g), off);
    float total = sum8(off);
    for (; g < groups; ++g) total += _cvtsh_ss(o16[g]) * xg[g];
    return total;
  }

  static constexpr int64_t BATCH_FROM = 0;  // no batch kernel: rows_dot for every activation row
};
using Vec = Avx2;
#endif

// R weight rows at once against one activation row (rounded: xq, the step of each block xs, the
// float sum of each group xg): R independent fma chains, each block of x loaded once for all of
// them, where one row at a time left the chain's latency and the horizontal sum exposed. y[r]:
// row r's sum, its offsets' share included.
template <class V, Format F, int R>
static void rows_dot(const uint8_t* q, const Half* s16, const Half* o16, int64_t groups, int64_t per_group, const int16_t* xq,
                     const float* xs, const float* xg, float* y) {
  const int64_t blocks = groups * per_group;
  float c[R][MAX_BLOCKS];
  for (int r = 0; r < R; ++r) V::block_scales(c[r], s16 + r * groups, xs, groups, per_group);
  typename V::Floats acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::set1(0.f);
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    const typename V::X x0 = V::load_x(xq + 32 * b), x1 = V::load_x(xq + 32 * b + 32);
    prefetch_ahead<F>(unit<R>(q, 0, F == Format::INT4 ? b / 2 : b), (F == Format::INT4 ? 32 : 64) * R);  // what this pass reads
    for (int r = 0; r < R; ++r) {
      if constexpr (F == Format::INT4) {  // 64 codes in 32 bytes: low nibbles block b, high nibbles block b + 1
        const auto [w0, w1] = V::int4_blocks(unit<R>(q, r, b / 2));
        acc[r] = V::add_block(acc[r], w0, x0, c[r][b]);
        acc[r] = V::add_block(acc[r], w1, x1, c[r][b + 1]);
      } else {
        acc[r] = V::add_block(acc[r], V::int8_block(unit<R>(q, r, b)), x0, c[r][b]);
        acc[r] = V::add_block(acc[r], V::int8_block(unit<R>(q, r, b + 1)), x1, c[r][b + 1]);
      }
    }
  }
  if constexpr (F == Format::INT8) {  // an odd block count (INT4 rows are whole pairs)
    if (b < blocks) {
      const typename V::X x0 = V::load_x(xq + 32 * b);
      for (int r = 0; r < R; ++r) acc[r] = V::add_block(acc[r], V::int8_block(unit<R>(q, r, b)), x0, c[r][b]);
    }
  }
  for (int r = 0; r < R; ++r) {
    y[r] = V::sum(acc[r]);
    if (o16)
      y[r] += V::offsets_dot(o16 + r * groups, xg, groups);
    else if constexpr (F == Format::INT4)  // o = -8·s (quill.h's symmetric_offset)
      y[r] += symmetric_offset(F) * V::offsets_dot(s16 + r * groups, xg, groups);
  }
}

// gemv_columns for one format: V's batch kernel where several activation rows meet a group of 4
// weight rows (AVX-512), else rows_dot for each activation row
template <class V, Format F>
static void columns(const Weights& w, const Rounded& r, int64_t M, float* y, int64_t n0, int64_t n1) {
  const int64_t blocks = w.K / 32, per_group = blocks / w.G, K = w.K, G = w.G, N = w.N;
  for (int64_t n = n0; n < n1;) {
    const int64_t rows = n + 4 <= n1 ? 4 : 1;
    const uint8_t* group = w.q + n * w.row_bytes;
    if constexpr (V::BATCH_FROM > 0) {
      if (rows == 4 && M >= V::BATCH_FROM) {  // the activation rows 8 at a time, then the rest
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
          const float *xs = r.step.data() + m0 * blocks, *xg = r.sum.data() + m0 * G;
          V::template batch4<F>(group, w.s + n * G, offsets_of(w, n), G, per_group, r.q.data() + m0 * K, xs, xg, K, std::min<int64_t>(8, M - m0),
                                y + m0 * N + n, N);
        }
        n += rows;
        continue;
      }
    }
    auto run = rows == 4 ? rows_dot<V, F, 4> : rows_dot<V, F, 1>;
    for (int64_t m = 0; m < M; ++m)
      run(group, w.s + n * G, offsets_of(w, n), G, per_group, r.q.data() + m * K, r.step.data() + m * blocks, r.sum.data() + m * G, y + m * N + n);
    n += rows;
  }
}

void gemv_columns(const Weights& w, const Rounded& r, int64_t M, float* y, int64_t n0, int64_t n1) {
  if (w.format == Format::INT4)
    columns<Vec, Format::INT4>(w, r, M, y, n0, n1);
  else
    columns<Vec, Format::INT8>(w, r, M, y, n0, n1);
}

// attend_lanes for hd = LANES·H, the query and the output in registers: the portable loop's
// horizontal sum a key and its stores of y a key cost several times more
template <class V, int H, class T>
static void attend_in(const float* q, const T* k, const T* v, int64_t ks, const float* bias, int64_t S, float* p, float* y) {
  using Floats = typename V::Floats;
  const Floats scale = V::set1(1.f / std::sqrt(float(V::LANES * H)));
  Floats qv[H], acc[H];
  for (int j = 0; j < H; ++j) qv[j] = V::mul(V::load(q + V::LANES * j), scale);
  float m = -INFINITY;
  for (int64_t s = 0; s < S; ++s) {
    if (bias && bias[s] == -INFINITY) {  // a masked slot (an empty one of the compiled step's whole cache)
      p[s] = -INFINITY;
      continue;
    }
    const T* kr = k + s * ks;
    Floats dot = V::mul(qv[0], V::load(kr));
    for (int j = 1; j < H; ++j) dot = V::fma(qv[j], V::load(kr + V::LANES * j), dot);
    p[s] = V::sum(dot) + (bias ? bias[s] : 0.f);
    m = std::max(m, p[s]);
  }
  float l = 0.f;
#pragma omp simd reduction(+ : l)
  for (int64_t s = 0; s < S; ++s) {
    p[s] = exp_le0(p[s] - m);
    l += p[s];
  }
  for (int j = 0; j < H; ++j) acc[j] = V::set1(0.f);
  for (int64_t s = 0; s < S; ++s) {
    if (p[s] == 0.f) continue;
    const Floats ps = V::set1(p[s]);
    for (int j = 0; j < H; ++j) acc[j] = V::fma(ps, V::load(v + s * ks + V::LANES * j), acc[j]);
  }
  const Floats inv = V::set1(l > 0.f ? 1.f / l : 0.f);
  for (int j = 0; j < H; ++j) V::store(y + V::LANES * j, V::mul(acc[j], inv));
}

template <class T>
static bool attend_any(const float* q, const T* k, const T* v, int64_t ks, const float* bias, int64_t S, int64_t hd, float* p, float* y) {
  if (hd == 64) return attend_in<Vec, 64 / Vec::LANES>(q, k, v, ks, bias, S, p, y), true;
  if (hd == 128) return attend_in<Vec, 128 / Vec::LANES>(q, k, v, ks, bias, S, p, y), true;
  return false;
}

bool attend_lanes(const float* q, const float* k, const float* v, int64_t ks, const float* bias, int64_t S, int64_t hd, float* p, float* y) {
  return attend_any(q, k, v, ks, bias, S, hd, p, y);
}

bool attend_lanes(const float* q, const Half* k, const Half* v, int64_t ks, const float* bias, int64_t S, int64_t hd, float* p, float* y) {
  return attend_any(q, k, v, ks, bias, S, hd, p, y);
}
#endif
