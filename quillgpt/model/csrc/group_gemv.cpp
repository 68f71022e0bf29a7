#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <utility>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
// QUILL_AVX512: the AVX-512 branches below, on an AVX-512BW/VL build, or on an AVX2 one through the
// scalar stand-ins of avx512_emulated.h (QUILL_GEMV_ISA=avx512-emulated: tests only, slow)
#if defined(QUILL_EMULATE_AVX512)
#include "avx512_emulated.h"
#define QUILL_AVX512
#elif defined(__AVX512BW__) && defined(__AVX512VL__)
#define QUILL_AVX512
#endif

constexpr int64_t MAX_BLOCKS = 1024;  // K up to 32,768 inputs
// rows_dot asks for the weight bytes this far ahead: the hardware's prefetch alone left a SmolLM2
// token's weights streaming at ~14 GB/s (int8) and ~15 (int4); 8 KB ahead, ~17 and ~21 (4 to 16 KB
// measured alike; none of it faults past the end). int8 asks for them into L2 (_MM_HINT_T1): over
// one 115 MB layer, 39 GB/s on two cores against 22 into L1, where int4, which reads half the bytes
// a weight, measured 29 into L1 against 26 into L2 (T2 as T1, NTA as T0). The AVX2 build does the same
// (on a Zen 3 core, 2 threads, int8 into L2: ~15 G weights/s from L3 where into L1 gave 11-14)
constexpr int64_t PREFETCH = 8192;

// The weights' layout (group_gemv.py's interleave): a row is 32-byte units (int8: a block of 32
// weights; 4-bit: a pair of blocks), and rows go in fours: in a group of 4 rows, unit u of row r
// is at 32·(4u + r) bytes from the group's start, so the kernel that reads 4 rows at once reads one
// sequential stream. The last N % 4 rows follow one by one, as they are. Row after row, 4 streams
// 576 bytes apart, a SmolLM2 token's int8 linears ran at ~0.8x: hardware prefetch barely learns a
// stream 9 lines long. Unit u of row r of a group of R rows (R = 1: a row of its own):
template <int R>
static inline const uint8_t* unit(const uint8_t* group, int r, int64_t u) {
  return group + 32 * (R * u + r);
}

#if defined(__x86_64__)
// The weight bytes [p, p + bytes) PREFETCH ahead, a line at a time
template <bool FOUR>
static inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char*)(p + PREFETCH + off), FOUR ? _MM_HINT_T0 : _MM_HINT_T1);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
static float sum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#endif

// One fp16 value (its bits) to float, and n floats to fp16 (round to nearest even)
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return float(c10::Half(h, c10::Half::from_bits()));
#endif
}

static void floats_to_halves(const float* f, uint16_t* h, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i*)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) h[i] = _cvtss_sh(f[i], _MM_FROUND_TO_NEAREST_INT);
#else
  for (; i < n; ++i) h[i] = c10::Half(f[i]).x;
#endif
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

// c[b] = s of block b's group times the step of block b's activations
static void block_scales(float* c, const uint16_t* s16, const float* xs, int64_t groups, int64_t per_group) {
#if defined(QUILL_AVX512)
  if (per_group == 1) {  // 16 blocks at a time
    for (int64_t b = 0; b < groups; b += 16) {
      const __mmask16 m = groups - b >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - b)) - 1);
      __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, s16 + b));
      _mm512_mask_storeu_ps(c + b, m, _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(m, xs + b)));
    }
    return;
  }
#elif defined(__AVX2__) && defined(__F16C__)
  if (per_group == 1) {  // 8 at a time: the generic loop below, per_group unknown at compile time,
    int64_t b = 0;       // cost more than a 576-wide row's dot product on AVX2
    for (; b + 8 <= groups; b += 8)
      _mm256_storeu_ps(c + b, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s16 + b))), _mm256_loadu_ps(xs + b)));
    for (; b < groups; ++b) c[b] = _cvtsh_ss(s16[b]) * xs[b];
    return;
  }
#endif
  float s[MAX_BLOCKS];
  halves_to_float(s16, s, groups);
  for (int64_t g = 0, b = 0; g < groups; ++g)
    for (int64_t j = 0; j < per_group; ++j, ++b) c[b] = s[g] * xs[b];
}

// Σ_g o_g · Σx over group g: the offsets' share of a row's dot product
static float offsets_dot(const uint16_t* o16, const float* xg, int64_t groups) {
#if defined(QUILL_AVX512)
  __m512 off = _mm512_setzero_ps();  // 16 groups at a time (a scalar chain cost ~4 cycles a group)
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 m = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
    off = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, o16 + g)), _mm512_maskz_loadu_ps(m, xg + g), off);
  }
  return _mm512_reduce_add_ps(off);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  __m256 off = _mm256_setzero_ps();  // 8 groups at a time
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    off = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o16 + g))), _mm256_loadu_ps(xg + g), off);
  float total = sum8(off);
  for (; g < groups; ++g) total += _cvtsh_ss(o16[g]) * xg[g];
  return total;
#else
  float o[MAX_BLOCKS], total = 0.f;
  halves_to_float(o16, o, groups);
  for (int64_t g = 0; g < groups; ++g) total += o[g] * xg[g];
  return total;
#endif
}

// One row of W (K int8 weights, block b's 32 at q + stride·b; per-group fp16 scale s and offset o)
// dotted with one activation row rounded to int16 per block of 32 (xq, the step of each block xs,
// the float sum of each group xg): the plain loop, where neither AVX2 nor AVX-512 is built
// (rows_dot below does it with them).
static float row_dot(const uint8_t* q, int64_t stride, const uint16_t* s16, const uint16_t* o16, const int16_t* xq,
                     const float* xs, const float* xg, int64_t groups, int64_t per_group) {
  float c[MAX_BLOCKS];
  const int64_t blocks = groups * per_group;
  block_scales(c, s16, xs, groups, per_group);
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t d = 0;
    const int8_t* w = reinterpret_cast<const int8_t*>(q + stride * b);
    for (int64_t i = 0; i < 32; ++i) d += int32_t(w[i]) * int32_t(xq[32 * b + i]);
    total += float(d) * c[b];
  }
  return total + offsets_dot(o16, xg, groups);
}

// The same dot for 4-bit codes in [0, 15], 64 to the 32 bytes at q + stride·p: byte j of pair p
// holds code 64p + j in its low nibble and code 64p + 32 + j in its high one, so one 32-byte load, a
// mask and a shift give two whole blocks of 32 in order (K a multiple of 64).
static float row_dot4(const uint8_t* q, int64_t stride, const uint16_t* s16, const uint16_t* o16, const int16_t* xq,
                      const float* xs, const float* xg, int64_t groups, int64_t per_group) {
  float c[MAX_BLOCKS];
  const int64_t pairs = groups * per_group / 2;
  block_scales(c, s16, xs, groups, per_group);
  float total = 0.f;
  for (int64_t p = 0; p < pairs; ++p) {
    int32_t d0 = 0, d1 = 0;
    const uint8_t* w = q + stride * p;
    for (int64_t j = 0; j < 32; ++j) {
      d0 += int32_t(w[j] & 15) * int32_t(xq[64 * p + j]);
      d1 += int32_t(w[j] >> 4) * int32_t(xq[64 * p + 32 + j]);
    }
    total += float(d0) * c[2 * p] + float(d1) * c[2 * p + 1];
  }
  return total + offsets_dot(o16, xg, groups);
}

#if defined(QUILL_AVX512)
// AVX-512: R weight rows at once (row_dot's or row_dot4's sum for each): R independent fma chains,
// each block of x loaded once for all of them. One row at a time left ~60 cycles a row of latency
// (the chain, the horizontal sum) that no other work hid: over cached 576-wide rows one core ran
// 15.6 G weights/s a row at a time, 22.6 four at a time.
template <bool FOUR, int R>
static void rows_dot(const uint8_t* q, const uint16_t* s16, const uint16_t* o16, int64_t groups,
                     int64_t per_group, const int16_t* xq, const float* xs, const float* xg, float* y) {
  const int64_t blocks = groups * per_group;
  float c[R][MAX_BLOCKS];
  for (int r = 0; r < R; ++r) block_scales(c[r], s16 + r * groups, xs, groups, per_group);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  auto add = [&](int r, __m512i w, __m512i x, int64_t b) {  // 32 products as 16 pair sums, times c[b]
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(w, x)), _mm512_set1_ps(c[r][b]), acc[r]);
  };
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    const __m512i x0 = _mm512_loadu_si512((const void*)(xq + 32 * b));
    const __m512i x1 = _mm512_loadu_si512((const void*)(xq + 32 * b + 32));
    prefetch_ahead<FOUR>(unit<R>(q, 0, FOUR ? b / 2 : b), (FOUR ? 32 : 64) * R);  // what this pass reads
    for (int r = 0; r < R; ++r) {
      if constexpr (FOUR) {  // 64 codes in 32 bytes: low nibbles block b, high nibbles block b + 1
        const __m256i v = _mm256_loadu_si256((const __m256i*)unit<R>(q, r, b / 2));
        add(r, _mm512_cvtepu8_epi16(_mm256_and_si256(v, low)), x0, b);
        add(r, _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low)), x1, b + 1);
      } else {
        add(r, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)unit<R>(q, r, b))), x0, b);
        add(r, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)unit<R>(q, r, b + 1))), x1, b + 1);
      }
    }
  }
  if constexpr (!FOUR) {  // an odd block count (int4 rows are whole pairs)
    if (b < blocks) {
      const __m512i x0 = _mm512_loadu_si512((const void*)(xq + 32 * b));
      for (int r = 0; r < R; ++r) add(r, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)unit<R>(q, r, b))), x0, b);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[r]) + offsets_dot(o16 + r * groups, xg, groups);
}
#define QUILL_ROWS_DOT

// AVX-512, several activation rows (a decode batch): a group of 4 weight rows against MB activation
// rows at once, the 16 int32 lanes being (weight row r, pair j) rather than 16 pairs of one row.
// rows_dot, run once per activation row, widens each weight block again for every row and pays a
// convert and an fma per block per weight row; here block b's 128 bytes (4 rows) are loaded and
// widened once for all MB rows, and each activation row costs 4 pair-dots (vpdpwssd), one convert
// and one fma per block of 4 weight rows. Lane (r, j) of chunk c is pair j of positions 8c..8c+7 of
// row r: the qwords of the 4 rows' units are regrouped so that chunk c holds those 8 bytes of each
// row, and the matching 8 activations are one 128-bit broadcast.
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
template <bool FOUR>
static inline void chunks_of(const uint8_t* unit4, __m512i w[4]) {
  const __m512i a = _mm512_loadu_si512((const void*)unit4), b = _mm512_loadu_si512((const void*)(unit4 + 64));
  const __m512i p01 = _mm512_permutex2var_epi64(a, _mm512_loadu_si512((const void*)CHUNKS01), b);
  const __m512i p23 = _mm512_permutex2var_epi64(a, _mm512_loadu_si512((const void*)CHUNKS23), b);
  const __m256i h[4] = {_mm512_castsi512_si256(p01), _mm512_extracti64x4_epi64(p01, 1), _mm512_castsi512_si256(p23),
                        _mm512_extracti64x4_epi64(p23, 1)};
  for (int c = 0; c < 4; ++c) w[c] = FOUR ? _mm512_cvtepu8_epi16(h[c]) : _mm512_cvtepi8_epi16(h[c]);
}

// v4[g][r] = the fp16 value h[r·G + g] of the 4 rows, side by side for each g (a 4x4 transpose per 4
// groups: one scalar convert per value was ~12% of an int8 (per 32) batch's instructions over 384-wide
// rows, counted, not timed)
static void side_by_side4(const uint16_t* h, int64_t G, float (*v4)[4]) {
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

// y[m·N + r] (m < MB, r < 4) for the 4 weight rows at group and the activation rows at xq (K apart)
template <bool FOUR, int MB>
static void rows4_batch(const uint8_t* group, const uint16_t* s16, const uint16_t* o16, int64_t G, int64_t per_group,
                        const int16_t* xq, const float* xs, const float* xg, int64_t K, float* y, int64_t N) {
  const int64_t blocks = G * per_group;
  alignas(64) float s4[MAX_BLOCKS][4], o4[MAX_BLOCKS][4];  // group g's scale and offset of rows 0..3, side by side
  side_by_side4(s16, G, s4);
  side_by_side4(o16, G, o4);
  const __m512i spread = _mm512_loadu_si512((const void*)SPREAD4), low = _mm512_set1_epi16(0x0F);
  __m512 acc[MB], gacc[MB];  // over all groups, and over the blocks of the current group
  for (int m = 0; m < MB; ++m) acc[m] = gacc[m] = _mm512_setzero_ps();
  int64_t g = 0, left = per_group;  // the current group, and its blocks still to come (no division a block)
  // block b against every activation row: w, its 4 chunks, each times the step of the activation
  // row's block; at the group's end, times the 4 rows' scales (one fma a block rather than a mul and
  // an fma where a group spans several blocks: per-channel int8 is one group)
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
  if constexpr (FOUR) {
    for (int64_t p = 0; p < blocks / 2; ++p) {  // a unit: blocks 2p (low nibbles) and 2p + 1 (high)
      prefetch_ahead<true>(unit<4>(group, 0, p), 128);
      chunks_of<true>(unit<4>(group, 0, p), w);
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
      prefetch_ahead<false>(unit<4>(group, 0, b), 128);
      chunks_of<false>(unit<4>(group, 0, b), w);
      block(w, b);
    }
  }
  // y[m, 0..3]: each row's 4 lanes summed within their 128 bits (its sum lands in lane 4r), plus
  // the offsets' share of the 4 rows at once, 4 groups a 512-bit fma (lanes (group, row)). A
  // reduce_add and an offsets_dot per (row, r), 32 of each for 8 rows, cost as much as the blocks'
  // work over a 384-wide row.
  const __m512i firsts = _mm512_loadu_si512((const void*)FIRSTS4);
  const float* o = o4[0];
  for (int m = 0; m < MB; ++m) {
    __m512 off4 = _mm512_setzero_ps();
    for (int64_t g4 = 0; g4 < G; g4 += 4) {
      const int64_t n = G - g4 < 4 ? G - g4 : 4;
      const __m512 xv = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), xg + m * G + g4));
      off4 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(__mmask16((1u << (4 * n)) - 1), o + 4 * g4), xv, off4);
    }
    alignas(64) float f[16];
    _mm512_store_ps(f, off4);
    const __m128 off = _mm_add_ps(_mm_add_ps(_mm_load_ps(f), _mm_load_ps(f + 4)), _mm_add_ps(_mm_load_ps(f + 8), _mm_load_ps(f + 12)));
    __m512 t = _mm512_add_ps(acc[m], _mm512_permute_ps(acc[m], 0xB1));  // lanes (0+1, 1+0, 2+3, 3+2) of each 4
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));                   // + (2+3, 3+2, 0+1, 1+0)
    _mm_storeu_ps(y + m * N, _mm_add_ps(_mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, t)), off));
  }
}
#define QUILL_ROWS4_BATCH
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: rows_dot as on AVX-512, a block of 32 as two halves of 16 int16 (vpmaddwd is 256 bits here).
// 4-bit codes come in 16 bytes at a time, each widened to int16 once: low nibbles block b, high ones b + 1.
// On a Zen 3 core over 576-wide rows, ~1.2x one row at a time (int8 16.4 -> 19.9 G weights/s).
template <bool FOUR, int R>
static void rows_dot(const uint8_t* q, const uint16_t* s16, const uint16_t* o16, int64_t groups,
                     int64_t per_group, const int16_t* xq, const float* xs, const float* xg, float* y) {
  const int64_t blocks = groups * per_group;
  float c[R][MAX_BLOCKS];
  for (int r = 0; r < R; ++r) block_scales(c[r], s16 + r * groups, xs, groups, per_group);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi16(0x0F);
  auto add = [&](int r, __m256i w0, __m256i w1, int64_t b) {  // block b's 32 weights as int16, two halves
    const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)(xq + 32 * b))),
                                       _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(xq + 32 * b + 16))));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(c[r][b]), acc[r]);
  };
  auto int8_block = [&](const uint8_t* w) {  // 32 int8 weights, sign-extended in two halves
    return std::make_pair(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)w)), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 16))));
  };
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    prefetch_ahead<FOUR>(unit<R>(q, 0, FOUR ? b / 2 : b), (FOUR ? 32 : 64) * R);  // what this pass reads
    for (int r = 0; r < R; ++r) {
      if constexpr (FOUR) {  // each byte widened once: its low nibble for block b, its high one for b + 1
        const uint8_t* w = unit<R>(q, r, b / 2);
        const __m256i h0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)w));
        const __m256i h1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(w + 16)));
        add(r, _mm256_and_si256(h0, low), _mm256_and_si256(h1, low), b);
        add(r, _mm256_srli_epi16(h0, 4), _mm256_srli_epi16(h1, 4), b + 1);
      } else {
        auto [w0, w1] = int8_block(unit<R>(q, r, b));
        auto [w2, w3] = int8_block(unit<R>(q, r, b + 1));
        add(r, w0, w1, b);
        add(r, w2, w3, b + 1);
      }
    }
  }
  if constexpr (!FOUR) {  // an odd block count (int4 rows are whole pairs)
    if (b < blocks) {
      for (int r = 0; r < R; ++r) {
        auto [w0, w1] = int8_block(unit<R>(q, r, b));
        add(r, w0, w1, b);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r] = sum8(acc[r]) + offsets_dot(o16 + r * groups, xg, groups);
}
#define QUILL_ROWS_DOT
#endif

// x rounded per block of 32 to int16 (q), each block's step, and each group's float sum
struct Rounded {
  std::vector<int16_t> q;  // small buffers, no tensors (each costs a dispatch)
  std::vector<float> step, sum;
};

// Row m of x (M, K) rounded into r, whose buffers hold at least M·K values: the decode block rounds
// its rows in parallel, each thread its own
static void round_row(const float* x, int64_t m, int64_t K, int64_t G, Rounded& r) {
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
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
#pragma omp simd
    for (int i = 0; i < 32; ++i) q[i] = int16_t(std::nearbyint(v[i] * inv));
    r.step[m * blocks + b] = amax / 32767.f;
    sum[b / per_group] += total;
  }
}

// Room in r for M rows of K values (K a multiple of 32, at most 32 blocks a group: G ≤ K / 32)
static void round_room(int64_t M, int64_t K, Rounded& r) {
  r.q.resize(M * K);
  r.step.resize(M * K / 32);
  r.sum.resize(M * K / 32);
}

// r = x (M, K) rounded, into r's buffers as they are
static void round_x(const float* x, int64_t M, int64_t K, int64_t G, Rounded& r) {
  round_room(M, K, r);
  for (int64_t m = 0; m < M; ++m) round_row(x, m, K, G, r);
}

// One layer's weights as the kernels read them: N rows of row_bytes (K int8 weights, or K / 2 bytes
// of 4-bit codes) in the layout above, and per row G fp16 scales and offsets (their bits)
struct Weights {
  const uint8_t* q;
  const uint16_t *s, *o;
  int64_t N, K, G, row_bytes;
  bool four;
};

#if defined(QUILL_ROWS4_BATCH)
constexpr int64_t ROWS4_BATCH_FROM = 2;  // activation rows from which rows4_batch runs instead of rows_dot
using Rows4Batch = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, const int16_t*, const float*,
                            const float*, int64_t, float*, int64_t);
template <bool FOUR>
static const Rows4Batch rows4_batch_fns[9] = {nullptr,
                                               rows4_batch<FOUR, 1>,
                                               rows4_batch<FOUR, 2>,
                                               rows4_batch<FOUR, 3>,
                                               rows4_batch<FOUR, 4>,
                                               rows4_batch<FOUR, 5>,
                                               rows4_batch<FOUR, 6>,
                                               rows4_batch<FOUR, 7>,
                                               rows4_batch<FOUR, 8>};
#endif

// Output columns [n0, n1) of y (M, N) = x·Wᵀ for x rounded by round_x: a group of 4 weight rows
// (or a last row of its own), read once, for every activation row. n0 is a multiple of 4 and n1 of
// 4 or N, so the groups are the layout's. The decode block (decode_block.cpp) calls it inside its own
// parallel region; gemv splits the columns over at::parallel_for, 16 at a time.
static void gemv_columns(const Weights& w, const Rounded& r, int64_t M, float* y, int64_t n0, int64_t n1) {
  const int64_t blocks = w.K / 32, per_group = blocks / w.G, K = w.K, G = w.G, N = w.N;
  for (int64_t n = n0; n < n1;) {
    const int64_t rows = n + 4 <= n1 ? 4 : 1;
    const uint8_t* group = w.q + n * w.row_bytes;
#if defined(QUILL_ROWS4_BATCH)
    if (rows == 4 && M >= ROWS4_BATCH_FROM) {  // the activation rows 8 at a time, then the rest
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mb = std::min<int64_t>(8, M - m0);
        const int16_t* xq = r.q.data() + m0 * K;
        const float *xs = r.step.data() + m0 * blocks, *xg = r.sum.data() + m0 * G;
        float* ym = y + m0 * N + n;
        auto run = w.four ? rows4_batch_fns<true>[mb] : rows4_batch_fns<false>[mb];
        run(group, w.s + n * G, w.o + n * G, G, per_group, xq, xs, xg, K, ym, N);
      }
      n += rows;
      continue;
    }
#endif
    for (int64_t m = 0; m < M; ++m) {
      const int16_t* xq = r.q.data() + m * K;
      const float *xs = r.step.data() + m * blocks, *xg = r.sum.data() + m * G;
#if defined(QUILL_ROWS_DOT)  // AVX-512 or AVX2
      auto run = w.four ? (rows == 4 ? rows_dot<true, 4> : rows_dot<true, 1>) : (rows == 4 ? rows_dot<false, 4> : rows_dot<false, 1>);
      run(group, w.s + n * G, w.o + n * G, G, per_group, xq, xs, xg, y + m * N + n);
#else
      for (int64_t i = 0; i < rows; ++i) {
        auto dot = w.four ? row_dot4 : row_dot;
        y[m * N + n + i] = dot(group + 32 * i, 32 * rows, w.s + (n + i) * G, w.o + (n + i) * G, xq, xs, xg, G, per_group);
      }
#endif
    }
    n += rows;
  }
}

// The weights of q, s, o, checked: (N, K) int8 or (N, K / 2) uint8 codes (FOUR), s and o (N, G) fp16
static Weights weights_of(const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& o, int64_t K, bool four) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "q: contiguous (N, K) int8 or (N, K / 2) uint8");
  const int64_t N = q.size(0), row_bytes = q.size(1);
  if (four) {
    TORCH_CHECK(q.scalar_type() == torch::kByte && 2 * row_bytes == K && K % 64 == 0, "int4: q (N, K / 2) uint8, K a multiple of 64");
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kChar && row_bytes == K, "int8: q (N, K) int8, K must match");
  }
  TORCH_CHECK(K % 32 == 0 && K / 32 <= MAX_BLOCKS, "K must be a multiple of 32 and at most 32,768");
  TORCH_CHECK(s.scalar_type() == torch::kHalf && s.is_contiguous() && s.dim() == 2 && s.size(0) == N, "s: (N, G) float16");
  TORCH_CHECK(o.sizes() == s.sizes() && o.scalar_type() == torch::kHalf && o.is_contiguous(), "o: as s");
  const int64_t G = s.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 32 == 0, "the group must be a multiple of 32");
  return {reinterpret_cast<const uint8_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>()),
          reinterpret_cast<const uint16_t*>(o.data_ptr<at::Half>()), N, K, G, row_bytes, four};
}

// (M, N) float32 from x (M, K) float32 and weight rows of K int8 weights, or (FOUR) K / 2 bytes of codes
template <bool FOUR>
static torch::Tensor gemv(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor o) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous (M, K) float32");
  const int64_t M = x.size(0), K = x.size(1);
  const Weights w = weights_of(q, s, o, K, FOUR);
  Rounded r;
  round_x(x.data_ptr<float>(), M, K, w.G, r);
  auto y = torch::empty({M, w.N}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (w.N + 15) / 16, 1, [&](int64_t c0, int64_t c1) { gemv_columns(w, r, M, yp, 16 * c0, std::min(w.N, 16 * c1)); });
  return y;
}

// x (M, K) float32, q (N, K) int8 in the layout above, s and o (N, K / group) float16 -> (M, N) float32.
torch::Tensor group_gemv(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor o) { return gemv<false>(x, q, s, o); }

// x (M, K) float32, q (N, K / 2) uint8 (4-bit codes, row_dot4's bytes in the layout above), s and o as group_gemv's.
torch::Tensor group_gemv4(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor o) { return gemv<true>(x, q, s, o); }

TORCH_LIBRARY_IMPL(quill, CPU, m) {
  m.impl("group_gemv", &group_gemv);
  m.impl("group_gemv4", &group_gemv4);
}
