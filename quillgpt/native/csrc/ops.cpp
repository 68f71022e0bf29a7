// The ops torch sees, declared once: their schemas and their CPU kernels (torch.compile's fake
// kernels are Python's, quillgpt/native/ops.py), and the checks that turn tensors into Weights.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "quill.h"

Format format_of(int64_t value) {
  TORCH_CHECK(value == int64_t(Format::INT8) || value == int64_t(Format::INT4), "a linear's format must be 0 (int8) or 1 (4-bit codes), got ",
              value);
  return Format(value);
}

// The weights of q, s, o, checked: (N, K) int8 codes or (N, K / 2) uint8 pairs of 4-bit ones as the
// format says, s and o (N, G) fp16 (o empty: none kept, quill.h's symmetric form)
Weights weights_of(const at::Tensor& q, const at::Tensor& s, const at::Tensor& o, int64_t K, Format format) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "q: contiguous (N, K) int8 or (N, K / 2) uint8");
  const int64_t N = q.size(0), row_bytes = q.size(1);
  if (format == Format::INT4) {
    TORCH_CHECK(q.scalar_type() == at::kByte && 2 * row_bytes == K && K % 64 == 0, "int4: q (N, K / 2) uint8, K a multiple of 64");
  } else {
    TORCH_CHECK(q.scalar_type() == at::kChar && row_bytes == K, "int8: q (N, K) int8, K must match");
  }
  TORCH_CHECK(K % 32 == 0 && K / 32 <= MAX_BLOCKS, "K must be a multiple of 32 and at most 32,768");
  TORCH_CHECK(s.scalar_type() == at::kHalf && s.is_contiguous() && s.dim() == 2 && s.size(0) == N, "s: (N, G) float16");
  const bool offsets = o.numel() > 0;  // empty: the format's symmetric form (quill.h)
  TORCH_CHECK(!offsets || (o.sizes() == s.sizes() && o.scalar_type() == at::kHalf && o.is_contiguous()), "o: as s, or empty");
  const int64_t G = s.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 32 == 0, "the group must be a multiple of 32");
  return {reinterpret_cast<const uint8_t*>(q.data_ptr()), reinterpret_cast<const Half*>(s.data_ptr<at::Half>()),
          offsets ? reinterpret_cast<const Half*>(o.data_ptr<at::Half>()) : nullptr, N, K, G, row_bytes, format};
}

// (M, N) float32 from x (M, K) float32 and weight rows of the format's codes
static at::Tensor gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const at::Tensor& o, Format format,
                       float levels = INT16_LEVELS) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous (M, K) float32");
  const int64_t M = x.size(0), K = x.size(1);
  const Weights w = weights_of(q, s, o, K, format);
  Rounded r;
  r.levels = levels;
  round_room(M, K, r);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) round_row(xp, m, K, w.G, r);
  });
  auto y = at::empty({M, w.N}, x.options());
  float* yp = y.data_ptr<float>();
  auto columns = M >= GEMM_ROWS ? gemm_columns : gemv_columns;  // each thread a contiguous range of weight rows
  at::parallel_for(0, (w.N + 15) / 16, 1, [&](int64_t c0, int64_t c1) { columns(w, r, M, yp, 16 * c0, std::min(w.N, 16 * c1)); });
  return y;
}

// x (M, K) float32, q (N, K) int8 in the layout of quill.h, s and o (N, K / group) float16 -> (M, N) float32
at::Tensor group_gemv(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor o) { return gemv(x, q, s, o, Format::INT8); }

// x (M, K) float32, q (N, K / 2) uint8 (4-bit codes, two a byte, in the layout of quill.h), s and o as group_gemv's
at::Tensor group_gemv4(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor o) { return gemv(x, q, s, o, Format::INT4); }

// group_gemv4 with x rounded to int8 per 32 (a step of max|x|/127), asked for by name: its
// many-rows kernel multiplies bytes (vpdpbusd), twice the products an instruction
at::Tensor group_gemv4_x8(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor o) { return gemv(x, q, s, o, Format::INT4, INT8_LEVELS); }

TORCH_LIBRARY(quill, m) {
  m.def("group_gemv(Tensor x, Tensor q, Tensor s, Tensor o) -> Tensor");
  m.def("group_gemv4(Tensor x, Tensor q, Tensor s, Tensor o) -> Tensor");
  m.def("group_gemv4_x8(Tensor x, Tensor q, Tensor s, Tensor o) -> Tensor");
  m.def(
      "decode_blocks(Tensor x, Tensor[] lin, Tensor[] norms, Tensor[] head, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, "
      "Tensor cos, Tensor sin, Tensor mask, SymInt[] ints, float eps) -> Tensor");
  m.def(
      "decode_tokens(Tensor idx, Tensor pos, Tensor(c!) key_pos, Tensor[] embed, Tensor inv_freq, Tensor[] lin, Tensor[] norms, "
      "Tensor[] head, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, SymInt[] ints, float eps) -> Tensor");
  m.def("argmax_finite(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(quill, CPU, m) {
  m.impl("group_gemv", &group_gemv);
  m.impl("group_gemv4", &group_gemv4);
  m.impl("group_gemv4_x8", &group_gemv4_x8);
  m.impl("decode_blocks", &decode_blocks);
  m.impl("decode_tokens", &decode_tokens);
  m.impl("argmax_finite", &argmax_finite);
}
