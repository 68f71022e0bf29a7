// Scalar stand-ins for the AVX-512 intrinsics the kernels use (x86.cpp), so its AVX-512 branch
// builds and runs, slowly, on an AVX2 machine: QUILL_GEMV_ISA=avx512-emulated, for
// tests/native/test_kernels.py to check it against the plain computation where no AVX-512 CPU is
// at hand. Each does what Intel's manual says of its intrinsic, lane by lane (masked loads read only
// the lanes in the mask); reduce_add sums in another order, so the last bits may differ.
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
namespace emu {
struct m512 { float v[16]; };
struct m512i { unsigned char b[64]; };
template <class T> inline T lane(const m512i& a, int i) { T t; std::memcpy(&t, a.b + sizeof(T) * i, sizeof(T)); return t; }
template <class T> inline void put(m512i& a, int i, T t) { std::memcpy(a.b + sizeof(T) * i, &t, sizeof(T)); }
inline m512 setzero_ps() { m512 r; for (float& x : r.v) x = 0.f; return r; }
inline m512 set1_ps(float f) { m512 r; for (float& x : r.v) x = f; return r; }
inline m512 loadu_ps(const float* p) { m512 r; std::memcpy(r.v, p, 64); return r; }
inline void storeu_ps(float* p, m512 a) { std::memcpy(p, a.v, 64); }
inline m512 mul_ps(m512 a, m512 b) { for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i]; return a; }
inline m512 fmadd_ps(m512 a, m512 b, m512 c) { for (int i = 0; i < 16; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return c; }
inline float reduce_add_ps(m512 a) { double s = 0; for (float x : a.v) s += x; return float(s); }
inline m512i loadu_si512(const void* p) { m512i r; std::memcpy(r.b, p, 64); return r; }
inline m512i cvtepi8_epi16(__m256i a) { int8_t t[32]; _mm256_storeu_si256((__m256i*)t, a); m512i r; for (int i = 0; i < 32; ++i) put<int16_t>(r, i, t[i]); return r; }
inline m512i cvtepu8_epi16(__m256i a) { uint8_t t[32]; _mm256_storeu_si256((__m256i*)t, a); m512i r; for (int i = 0; i < 32; ++i) put<int16_t>(r, i, t[i]); return r; }
inline m512i madd_epi16(m512i a, m512i b) {
  m512i r;
  for (int i = 0; i < 16; ++i)
    put<int32_t>(r, i, int32_t(lane<int16_t>(a, 2 * i)) * lane<int16_t>(b, 2 * i) + int32_t(lane<int16_t>(a, 2 * i + 1)) * lane<int16_t>(b, 2 * i + 1));
  return r;
}
inline m512 cvtepi32_ps(m512i a) { m512 r; for (int i = 0; i < 16; ++i) r.v[i] = float(lane<int32_t>(a, i)); return r; }
inline m512 cvtph_ps(__m256i a) { uint16_t h[16]; _mm256_storeu_si256((__m256i*)h, a); m512 r; for (int i = 0; i < 16; ++i) r.v[i] = _cvtsh_ss(h[i]); return r; }
inline __m256i maskz_loadu_epi16(__mmask16 m, const void* p) {
  int16_t t[16] = {0};
  for (int i = 0; i < 16; ++i) if ((m >> i) & 1) std::memcpy(t + i, (const char*)p + 2 * i, 2);
  return _mm256_loadu_si256((const __m256i*)t);
}
inline m512 maskz_loadu_ps(__mmask16 m, const float* p) { m512 r = setzero_ps(); for (int i = 0; i < 16; ++i) if ((m >> i) & 1) r.v[i] = p[i]; return r; }
inline void mask_storeu_ps(float* p, __mmask16 m, m512 a) { for (int i = 0; i < 16; ++i) if ((m >> i) & 1) p[i] = a.v[i]; }
inline m512i dpwssd_epi32(m512i acc, m512i a, m512i b) {  // acc + madd_epi16(a, b), lane by lane (wrapping)
  m512i d = madd_epi16(a, b);
  for (int i = 0; i < 16; ++i) put<int32_t>(acc, i, int32_t(uint32_t(lane<int32_t>(acc, i)) + uint32_t(lane<int32_t>(d, i))));
  return acc;
}
inline m512i permutex2var_epi64(m512i a, m512i idx, m512i b) {
  m512i r;
  for (int i = 0; i < 8; ++i) {
    const int64_t j = lane<int64_t>(idx, i) & 15;
    put<int64_t>(r, i, j < 8 ? lane<int64_t>(a, int(j)) : lane<int64_t>(b, int(j - 8)));
  }
  return r;
}
inline __m256i castsi512_si256(m512i a) { return _mm256_loadu_si256((const __m256i*)a.b); }
inline __m256i extracti64x4_epi64(m512i a, int i) { return _mm256_loadu_si256((const __m256i*)(a.b + 32 * (i & 1))); }
inline m512i broadcast_i32x4(__m128i a) { m512i r; for (int i = 0; i < 4; ++i) _mm_storeu_si128((__m128i*)(r.b + 16 * i), a); return r; }
inline m512 castps128_ps512(__m128 a) { m512 r = setzero_ps(); _mm_storeu_ps(r.v, a); return r; }  // upper lanes: undefined in Intel's, zero here
inline m512 permutexvar_ps(m512i idx, m512 a) { m512 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[lane<int32_t>(idx, i) & 15]; return r; }
inline m512i set1_epi32(int v) { m512i r; for (int i = 0; i < 16; ++i) put<int32_t>(r, i, v); return r; }
inline m512i set1_epi16(short v) { m512i r; for (int i = 0; i < 32; ++i) put<int16_t>(r, i, v); return r; }
inline m512i srli_epi16(m512i a, unsigned n) { for (int i = 0; i < 32; ++i) put<uint16_t>(a, i, n > 15 ? 0 : uint16_t(lane<uint16_t>(a, i) >> n)); return a; }
inline m512i and_si512(m512i a, m512i b) { for (int i = 0; i < 64; ++i) a.b[i] &= b.b[i]; return a; }
inline m512 add_ps(m512 a, m512 b) { for (int i = 0; i < 16; ++i) a.v[i] += b.v[i]; return a; }
inline m512 permute_ps(m512 a, int imm) { m512 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[(i & ~3) + ((imm >> (2 * (i & 3))) & 3)]; return r; }
inline __m128 castps512_ps128(m512 a) { return _mm_loadu_ps(a.v); }
inline m512i unpacklo_epi32(m512i a, m512i b) {  // per 128-bit lane: a0 b0 a1 b1
  m512i r;
  for (int l = 0; l < 4; ++l) for (int k = 0; k < 2; ++k) put<int32_t>(r, 4 * l + 2 * k, lane<int32_t>(a, 4 * l + k)), put<int32_t>(r, 4 * l + 2 * k + 1, lane<int32_t>(b, 4 * l + k));
  return r;
}
inline m512i unpackhi_epi32(m512i a, m512i b) {  // a2 b2 a3 b3
  m512i r;
  for (int l = 0; l < 4; ++l) for (int k = 0; k < 2; ++k) put<int32_t>(r, 4 * l + 2 * k, lane<int32_t>(a, 4 * l + 2 + k)), put<int32_t>(r, 4 * l + 2 * k + 1, lane<int32_t>(b, 4 * l + 2 + k));
  return r;
}
inline m512i unpacklo_epi64(m512i a, m512i b) { m512i r; for (int l = 0; l < 4; ++l) put<int64_t>(r, 2 * l, lane<int64_t>(a, 2 * l)), put<int64_t>(r, 2 * l + 1, lane<int64_t>(b, 2 * l)); return r; }
inline m512i unpackhi_epi64(m512i a, m512i b) { m512i r; for (int l = 0; l < 4; ++l) put<int64_t>(r, 2 * l, lane<int64_t>(a, 2 * l + 1)), put<int64_t>(r, 2 * l + 1, lane<int64_t>(b, 2 * l + 1)); return r; }
inline m512i shuffle_i32x4(m512i a, m512i b, int imm) {  // 128-bit lanes: two of a, then two of b
  m512i r;
  for (int l = 0; l < 4; ++l) std::memcpy(r.b + 16 * l, (l < 2 ? a : b).b + 16 * ((imm >> (2 * l)) & 3), 16);
  return r;
}
inline void storeu_si512(void* p, m512i a) { std::memcpy(p, a.b, 64); }
inline m512i setzero_si512() { m512i r; std::memset(r.b, 0, 64); return r; }
inline m512i castsi256_si512(__m256i a) { m512i r; std::memset(r.b, 0, 64); _mm256_storeu_si256((__m256i*)r.b, a); return r; }  // upper half: undefined in Intel's
inline m512i inserti64x4(m512i a, __m256i b, int i) { _mm256_storeu_si256((__m256i*)(a.b + 32 * (i & 1)), b); return a; }
inline m512i dpbusd_epi32(m512i acc, m512i a, m512i b) {  // acc + Σ of 4 products u8(a) · s8(b) per lane (wrapping)
  for (int i = 0; i < 16; ++i) {
    int32_t d = 0;
    for (int t = 0; t < 4; ++t) d += int32_t(a.b[4 * i + t]) * int32_t(int8_t(b.b[4 * i + t]));
    put<int32_t>(acc, i, int32_t(uint32_t(lane<int32_t>(acc, i)) + uint32_t(d)));
  }
  return acc;
}
}  // namespace emu
#define __m512 emu::m512
#define __m512i emu::m512i
#define _mm512_setzero_ps emu::setzero_ps
#define _mm512_set1_ps emu::set1_ps
#define _mm512_loadu_ps emu::loadu_ps
#define _mm512_storeu_ps emu::storeu_ps
#define _mm512_mul_ps emu::mul_ps
#define _mm512_fmadd_ps emu::fmadd_ps
#define _mm512_reduce_add_ps emu::reduce_add_ps
#define _mm512_loadu_si512 emu::loadu_si512
#define _mm512_cvtepi8_epi16 emu::cvtepi8_epi16
#define _mm512_cvtepu8_epi16 emu::cvtepu8_epi16
#define _mm512_madd_epi16 emu::madd_epi16
#define _mm512_cvtepi32_ps emu::cvtepi32_ps
#define _mm512_cvtph_ps emu::cvtph_ps
#define _mm256_maskz_loadu_epi16 emu::maskz_loadu_epi16
#define _mm512_maskz_loadu_ps emu::maskz_loadu_ps
#define _mm512_mask_storeu_ps emu::mask_storeu_ps
#define _mm512_store_ps emu::storeu_ps
#define _mm512_dpwssd_epi32 emu::dpwssd_epi32
#define _mm512_permutex2var_epi64 emu::permutex2var_epi64
#define _mm512_castsi512_si256 emu::castsi512_si256
#define _mm512_extracti64x4_epi64 emu::extracti64x4_epi64
#define _mm512_broadcast_i32x4 emu::broadcast_i32x4
#define _mm512_castps128_ps512 emu::castps128_ps512
#define _mm512_permutexvar_ps emu::permutexvar_ps
#define _mm512_set1_epi16 emu::set1_epi16
#define _mm512_set1_epi32 emu::set1_epi32
#define _mm512_setzero_si512 emu::setzero_si512
#define _mm512_castsi256_si512 emu::castsi256_si512
#define _mm512_inserti64x4 emu::inserti64x4
#define _mm512_dpbusd_epi32 emu::dpbusd_epi32
#define _mm512_unpacklo_epi32 emu::unpacklo_epi32
#define _mm512_unpackhi_epi32 emu::unpackhi_epi32
#define _mm512_unpacklo_epi64 emu::unpacklo_epi64
#define _mm512_unpackhi_epi64 emu::unpackhi_epi64
#define _mm512_shuffle_i32x4 emu::shuffle_i32x4
#define _mm512_storeu_si512 emu::storeu_si512
#define _mm512_srli_epi16 emu::srli_epi16
#define _mm512_and_si512 emu::and_si512
#define _mm512_add_ps emu::add_ps
#define _mm512_permute_ps emu::permute_ps
#define _mm512_castps512_ps128 emu::castps512_ps128
