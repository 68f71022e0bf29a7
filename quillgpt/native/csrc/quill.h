// QuillGPT's native library: the types its files share and what each defines for the others. One
// library for one instruction set, the compiler's target (quillgpt/native/build.py picks -march):
//   generic.cpp       the portable code: x rounded to int16, fp16 conversions, the plain kernels
//   x86.cpp           the AVX2 and AVX-512 kernels (where this build targets either)
//   gemm.cpp          the kernel for many activation rows (a prompt's forward), GEMM-blocked
//   decode_block.cpp  pre-norm decoder blocks' decode step in one call, the greedy draw
//   ops.cpp           the ops torch sees, declared once (TORCH_LIBRARY), and the weights' checks
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

using Half = uint16_t;  // an fp16 value's bits

// One fp16 value (its bits) to float: F16C's convert where the build has it, torch's Half otherwise
#if defined(__F16C__)
#include <immintrin.h>
inline float half_to_float(Half h) { return _cvtsh_ss(h); }
#else
#include <c10/util/Half.h>
inline float half_to_float(Half h) { return float(c10::Half(h, c10::Half::from_bits())); }
#endif

// The vector kernels this build has: QUILL_AVX512 on AVX-512BW/VL, or on AVX2 through the scalar
// stand-ins of avx512_emulated.h (QUILL_EMULATE_AVX512: tests only, slow); QUILL_AVX2 on AVX2 with
// FMA and F16C; neither: the portable loops of generic.cpp alone
#if defined(QUILL_EMULATE_AVX512) || (defined(__AVX512BW__) && defined(__AVX512VL__))
#define QUILL_AVX512 1
#define QUILL_VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUILL_AVX2 1
#define QUILL_VECTOR 1
#endif

constexpr int64_t MAX_BLOCKS = 1024;  // K up to 32,768 inputs

// How a linear's weight codes are stored (quillgpt/native's Format mirrors it): INT8, one int8 code
// a weight; INT4, codes in [0, 15], two a byte (pack4's layout: byte j of each 32 holds code
// 64p + j in its low nibble and 64p + 32 + j in its high one)
enum class Format : int64_t { INT8 = 0, INT4 = 1 };

// The weights' layout (quillgpt/native's interleave): a row is 32-byte units (INT8: a block of 32
// weights; INT4: a pair of blocks), and rows go in fours: in a group of 4 rows, unit u of row r is at
// 32·(4u + r) bytes from the group's start, so the kernel that reads 4 rows at once reads one
// sequential stream (hardware prefetch barely learns 4 short streams). The last N % 4 rows follow
// one by one, as they are. Unit u of row r of a group of R rows (R = 1: a row of its own):
template <int R>
inline const uint8_t* unit(const uint8_t* group, int r, int64_t u) {
  return group + 32 * (R * u + r);
}

// One layer's weights as the kernels read them: N rows of row_bytes (K codes, or K / 2 bytes of
// 4-bit ones) in the layout above, and per row G fp16 scales and offsets: W = q·s + o per group
struct Weights {
  const uint8_t* q;
  const Half *s, *o;  // o null: no offsets kept, the format's symmetric form (symmetric_offset)
  int64_t N, K, G, row_bytes;
  Format format;
};

// A linear kept without offsets is its format's symmetric form, llama.cpp's Q4_0 or Q8_0: 4-bit
// codes centred on 8 (o = -8·s), int8 codes on 0 (o = 0). The offsets' share of a row's dot product
// is then -8 times the scales' (exact: a power of two) or nothing, and a decode step streams 2
// bytes fewer a group of 32 weights (a tenth of 4-bit weights' bytes)
constexpr float symmetric_offset(Format f) { return f == Format::INT4 ? -8.f : 0.f; }
// Row n's G offsets, null where none are kept
inline const Half* offsets_of(const Weights& w, int64_t n) { return w.o ? w.o + n * w.G : nullptr; }

// x rounded per block of 32 to int16 (q), each block's step, and each group's float sum; `levels`
// the codes' range: ±32767 (int16, every kernel's), or ±127 (int8 activations, asked for by name:
// the many-rows kernel then multiplies 4-bit weights with vpdpbusd)
constexpr float INT16_LEVELS = 32767.f, INT8_LEVELS = 127.f;
struct Rounded {
  std::vector<int16_t> q;  // small buffers, no tensors (each costs a dispatch)
  std::vector<float> step, sum;
  float levels = INT16_LEVELS;
};

// e^x for x ≤ 0 (0 below -87: masked keys), 2^n·p(r) with Cephes' polynomial, written so the loops
// that call it vectorize (std::exp does not: a scalar call an element)
inline float exp_le0(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (int32_t(std::max(n, -126.f)) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return x < -87.f ? 0.f : p * two_n;
}

// generic.cpp: n fp16 values to float and back (round to nearest even); c[b] = the scale of block
// b's group times block b's step (the loop every build has)
void halves_to_float(const Half* h, float* f, int64_t n);
void floats_to_halves(const float* f, Half* h, int64_t n);
void block_scales_any(float* c, const Half* s16, const float* xs, int64_t groups, int64_t per_group);

// generic.cpp: row m of x (M, K) rounded into r, whose buffers hold at least M·K values (the decode
// block rounds its rows in parallel, each thread its own); room in r for M rows of K values; all of x
// rounded (K a multiple of 32, G groups a row)
void round_row(const float* x, int64_t m, int64_t K, int64_t G, Rounded& r);
void round_room(int64_t M, int64_t K, Rounded& r);
void round_x(const float* x, int64_t M, int64_t K, int64_t G, Rounded& r);

// This build's kernels (x86.cpp where it has vector kernels, generic.cpp otherwise). Output columns
// [n0, n1) of y (M, N) = x·Wᵀ for x rounded by round_x: a group of 4 weight rows (or a last row of
// its own), read once, for every activation row. n0 is a multiple of 4 and n1 of 4 or N, so the
// groups are the layout's. The decode block calls it inside its own parallel region; the gemv op
// splits the columns over at::parallel_for, 16 at a time.
void gemv_columns(const Weights& w, const Rounded& r, int64_t M, float* y, int64_t n0, int64_t n1);

// gemm.cpp: gemv_columns for many activation rows (the gemv op from GEMM_ROWS rows on): panels of
// weight rows unpacked once per block of activation rows, register tiles of weight rows × activation
// rows; the same sums as gemv_columns (the same rounded x). n0 a multiple of 16, n1 of 16 or N. A
// build without AVX2 runs gemv_columns.
constexpr int64_t GEMM_ROWS = 65;
void gemm_columns(const Weights& w, const Rounded& r, int64_t M, float* y, int64_t n0, int64_t n1);

// softmax(q·kᵀ/√hd + bias)·v for one query head over S keys (rows ks apart; the cache float32 or
// fp16), p: S floats of scratch, in vector registers: false where this build has no lanes for hd
// (x86.cpp takes hd 64 and 128 on AVX2 and AVX-512; the decode block's portable loop runs then)
bool attend_lanes(const float* q, const float* k, const float* v, int64_t ks, const float* bias, int64_t S, int64_t hd, float* p, float* y);
bool attend_lanes(const float* q, const Half* k, const Half* v, int64_t ks, const float* bias, int64_t S, int64_t hd, float* p, float* y);

// The ops (ops.cpp declares them to torch; decode_block.cpp defines the last three), and the check
// that turns a linear's tensors into Weights
namespace at {
class Tensor;
}
Weights weights_of(const at::Tensor& q, const at::Tensor& s, const at::Tensor& o, int64_t K, Format format);
Format format_of(int64_t value);
at::Tensor group_gemv(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor o);
at::Tensor group_gemv4(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor o);
at::Tensor group_gemv4_x8(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor o);
at::Tensor decode_blocks(at::Tensor x, std::vector<at::Tensor> lin, std::vector<at::Tensor> norms, std::vector<at::Tensor> head,
                         std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, at::Tensor slots, at::Tensor cos, at::Tensor sin,
                         at::Tensor mask, std::vector<int64_t> ints, double eps);
at::Tensor decode_tokens(at::Tensor idx, at::Tensor pos, at::Tensor key_pos, std::vector<at::Tensor> embed, at::Tensor inv_freq,
                         std::vector<at::Tensor> lin, std::vector<at::Tensor> norms, std::vector<at::Tensor> head, std::vector<at::Tensor> k_caches,
                         std::vector<at::Tensor> v_caches, std::vector<int64_t> ints, double eps);
at::Tensor argmax_finite(at::Tensor logits);
