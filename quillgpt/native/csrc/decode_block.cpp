// Pre-norm decoder blocks' decode step in one call (quillgpt/inference/native_decoder.py says when it runs):
// x (R, C) one token per row → x + attn(norm1(x)), then + mlp(norm2(x)), block after block, with
// the four linears in the kernels' int8 or 4-bit layout (quill.h's Weights, read by gemv_columns).
// One OpenMP region runs all the blocks: the threads split each linear's output columns and the
// attention's heads, and meet at a barrier between phases, where the op-by-op step pays a kernel
// launch (and, eager, Python) for each of ~15 ops a block.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include "quill.h"

// A cached key or value element as float: the cache holds float32, or float16 (its bits, Half) for
// half the bytes a step reads
static inline float kv_float(float x) { return x; }
static inline float kv_float(Half x) { return half_to_float(x); }

// softmax(q·kᵀ/√hd + bias)·v for one query head over S keys (rows ks apart), p: S floats of scratch
template <class T>
static void attend_head(const float* q, const T* k, const T* v, int64_t ks, const float* bias, int64_t S, int64_t hd, float* p,
                        float* y) {
  const float scale = 1.f / std::sqrt(float(hd));
  float m = -INFINITY;
  for (int64_t s = 0; s < S; ++s) {
    if (bias && bias[s] == -INFINITY) {
      p[s] = -INFINITY;
      continue;
    }
    const T* kr = k + s * ks;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < hd; ++d) acc += q[d] * kv_float(kr[d]);
    p[s] = acc * scale + (bias ? bias[s] : 0.f);
    m = std::max(m, p[s]);
  }
  float l = 0.f;
#pragma omp simd reduction(+ : l)
  for (int64_t s = 0; s < S; ++s) {
    p[s] = exp_le0(p[s] - m);
    l += p[s];
  }
  for (int64_t d = 0; d < hd; ++d) y[d] = 0.f;
  for (int64_t s = 0; s < S; ++s) {
    const float ps = p[s];
    if (ps == 0.f) continue;
    const T* vr = v + s * ks;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) y[d] += ps * kv_float(vr[d]);
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int64_t d = 0; d < hd; ++d) y[d] *= inv;
}

// attend_head in this build's vector registers where it has them for hd (quill.h's attend_lanes)
template <class T>
static void attend(const float* q, const T* k, const T* v, int64_t ks, const float* bias, int64_t S, int64_t hd, float* p, float* y) {
  if (!attend_lanes(q, k, v, ks, bias, S, hd, p, y)) attend_head(q, k, v, ks, bias, S, hd, p, y);
}

// y = norm(x) over n values: RMSNorm (b null, layer false) or LayerNorm; w, b may be null (no gain, no bias)
static void norm(const float* x, float* y, int64_t n, const float* w, const float* b, bool layer, float eps) {
  float mean = 0.f, sq = 0.f;
  if (layer) {
    for (int64_t i = 0; i < n; ++i) mean += x[i];
    mean /= float(n);
  }
  for (int64_t i = 0; i < n; ++i) sq += (x[i] - mean) * (x[i] - mean);
  const float inv = 1.f / std::sqrt(sq / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * inv * (w ? w[i] : 1.f) + (b ? b[i] : 0.f);
}

// x rotated by RoPE in place: pairs (x[i], x[i + hd/2]) by the angles whose cos, sin are given (hd each)
static void rope(float* x, const float* cos, const float* sin, int64_t hd) {
  const int64_t h = hd / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    x[i] = a * cos[i] - b * sin[i];
    x[i + h] = b * cos[i + h] + a * sin[i + h];
  }
}

enum Act : int64_t { GELU_TANH = 0, RELU2 = 1, SWIGLU = 2 };

// A row of c_fc's output f (F) → a row of c_proj's input a (hidden); sigmoid and tanh through exp_le0 of a
// value ≤ 0, so the loops vectorize (a scalar std::exp an element was a large share of a token)
static void activate(const float* row, float* out, int64_t F, int64_t act) {
  const int64_t hidden = act == SWIGLU ? F / 2 : F;
  if (act == SWIGLU) {
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) {  // silu(g)·u, sigmoid(g) = 1 / (1 + e^-g) or e^g / (1 + e^g)
      const float g = row[i], e = exp_le0(-std::fabs(g));
      out[i] = g * (g >= 0.f ? 1.f : e) / (1.f + e) * row[hidden + i];
    }
  } else if (act == RELU2) {
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) out[i] = row[i] > 0.f ? row[i] * row[i] : 0.f;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) {  // GELU (tanh approximation), tanh|z| = (1 - e^-2|z|) / (1 + e^-2|z|)
      const float g = row[i], z = 0.7978845608028654f * (g + 0.044715f * g * g * g), e = exp_le0(-2.f * std::fabs(z));
      const float t = (1.f - e) / (1.f + e);
      out[i] = 0.5f * g * (1.f + (z >= 0.f ? t : -t));
    }
  }
}

// y (R, N) = x (R, K) · Wᵀ + b, the columns split over the region's threads (a barrier at the end)
static void linear_in_region(const Weights& w, const float* bias, const Rounded& xr, int64_t R, float* y) {
  const int64_t chunks = (w.N + 15) / 16;
#pragma omp for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = 16 * c, n1 = std::min(w.N, n0 + 16);
    gemv_columns(w, xr, R, y, n0, n1);
    if (bias)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t n = n0; n < n1; ++n) y[r * w.N + n] += bias[n];
  }
}

struct Shape {
  int64_t R, C, H, KV, hd, S, F, cap;
  Format formats[5];  // of c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj (alike in every layer), and the head's
};

// n floats to a cache (float32, or half: float16) at element `at`
static void store_kv(void* cache, bool half, int64_t at, const float* x, int64_t n) {
  if (half)
    floats_to_halves(x, static_cast<Half*>(cache) + at, n);
  else
    std::memcpy(static_cast<float*>(cache) + at, x, n * sizeof(float));
}

// One layer's parameters as read from its tensors (layer_of checks them)
struct Layer {
  std::vector<Weights> w;            // c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
  std::vector<const float*> bias;    // the four linears' (null: none)
  std::vector<const float*> nw;      // ln_1 w, b, ln_2 w, b, q_norm w, k_norm w (null: none)
  void *kc, *vc;                     // this layer's cache (rows, KV, cap, hd), float32 or (half) float16
  bool half;
};

// What every layer shares in one step: the rows' slots, RoPE angles and mask, the norms' form
struct Step {
  const int64_t* slots;
  const float *cos, *sin, *mask;  // cos, sin (R, hd) or null; mask (R, S) additive or null
  float eps;
  bool layer_norm;
  int64_t act;
};

// The step's buffers, the calling thread's, kept across calls: allocating and zeroing them a call
// (and x.clone() through the dispatcher) cost a measurable share of a block
struct Scratch {
  std::vector<float> h, qkv, att, f, a;
  Rounded xr;
};

static Scratch& scratch_for(const Shape& d) {
  thread_local Scratch s;
  s.h.resize(d.R * std::max(d.C, d.H * d.hd));
  s.qkv.resize(d.R * (d.H + 2 * d.KV) * d.hd);
  s.att.resize(d.R * d.H * d.hd);
  s.f.resize(d.R * d.F);
  s.a.resize(d.R * d.F);
  round_room(d.R, std::max({d.C, d.H * d.hd, d.F}), s.xr);
  return s;
}

// sc.xr = round_x(norm(x)), norm (w, b) of the blocks' kind, the rows split over the threads; sc.h
// holds norm(x). Every row-wise phase splits the rows alike (schedule static), so a thread may go
// on from one to the next without a barrier (nowait) where each reads only its own rows.
static void norm_rounded(const float* x, const Shape& d, const float* w, const float* b, int64_t G, const Step& st, Scratch& sc) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < d.R; ++r) {
    norm(x + r * d.C, sc.h.data() + r * d.C, d.C, w, b, st.layer_norm, st.eps);
    round_row(sc.h.data(), r, d.C, G, sc.xr);
  }
}

// x += h row by row, each thread its rows, no barrier after: the next phase, norm_rounded, reads
// only the rows its thread added
static void add_rows(float* x, const float* h, int64_t R, int64_t C) {
#pragma omp for schedule(static) nowait
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = r * C; i < (r + 1) * C; ++i) x[i] += h[i];
}

// The attention half in the region: q/k/v, QK-norm and RoPE, the cache write at each row's slot,
// each head over the first S slots, the output projection added to x
static void attention_half(float* x, const Shape& d, const Layer& L, const Step& st, Scratch& sc) {
  const int64_t R = d.R, C = d.C, H = d.H, KV = d.KV, hd = d.hd, cap = d.cap, width = (H + 2 * KV) * hd;
  std::vector<float>&h = sc.h, &qkv = sc.qkv, &att = sc.att;
  const std::vector<const float*>& nw = L.nw;
  norm_rounded(x, d, nw[0], nw[1], L.w[0].G, st, sc);
  linear_in_region(L.w[0], L.bias[0], sc.xr, R, qkv.data());
#pragma omp for schedule(static)
  for (int64_t r = 0; r < R; ++r) {  // per head: QK-norm, RoPE; k and v to the cache
    float* row = qkv.data() + r * width;
    for (int64_t j = 0; j < H + KV; ++j) {
      float* head = row + j * hd;
      if (nw[4]) norm(head, head, hd, j < H ? nw[4] : nw[5], nullptr, false, st.eps);
      if (st.cos) rope(head, st.cos + r * hd, st.sin + r * hd, hd);
    }
    for (int64_t j = 0; j < KV; ++j) {
      const int64_t at = ((r * KV + j) * cap + st.slots[r]) * hd;
      store_kv(L.kc, L.half, at, row + (H + j) * hd, hd);
      store_kv(L.vc, L.half, at, row + (H + KV + j) * hd, hd);
    }
  }
  thread_local std::vector<float> p;  // this thread's scores
  p.resize(d.S);
#pragma omp for schedule(static)
  for (int64_t i = 0; i < R * H; ++i) {
    const int64_t r = i / H, j = i % H, kv = j / (H / KV);
    const int64_t base = (r * KV + kv) * cap * hd;
    const float *q = qkv.data() + r * width + j * hd, *bias = st.mask ? st.mask + r * d.S : nullptr;
    auto over = [&](const auto* kc, const auto* vc) { attend(q, kc + base, vc + base, hd, bias, d.S, hd, p.data(), att.data() + i * hd); };
    if (L.half)
      over(static_cast<const Half*>(L.kc), static_cast<const Half*>(L.vc));
    else
      over(static_cast<const float*>(L.kc), static_cast<const float*>(L.vc));
  }
#pragma omp for schedule(static)
  for (int64_t r = 0; r < R; ++r) round_row(att.data(), r, H * hd, L.w[1].G, sc.xr);
  linear_in_region(L.w[1], L.bias[1], sc.xr, R, h.data());
  add_rows(x, h.data(), R, C);
}

// The MLP half in the region: x += c_proj(act(c_fc(norm2(x))))
static void mlp_half(float* x, const Shape& d, const Layer& L, const Step& st, Scratch& sc) {
  const int64_t R = d.R, C = d.C, hidden = st.act == SWIGLU ? d.F / 2 : d.F;
  std::vector<float>&h = sc.h, &f = sc.f, &a = sc.a;
  norm_rounded(x, d, L.nw[2], L.nw[3], L.w[2].G, st, sc);
  linear_in_region(L.w[2], L.bias[2], sc.xr, R, f.data());
#pragma omp for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    activate(f.data() + r * d.F, a.data() + r * hidden, d.F, st.act);
    round_row(a.data(), r, hidden, L.w[3].G, sc.xr);
  }
  linear_in_region(L.w[3], L.bias[3], sc.xr, R, h.data());
  add_rows(x, h.data(), R, C);
}

// The head in the region: logits (R, N) = head(norm(x)), the final norm of the blocks' kind
struct Head {
  Weights w;
  const float *nw, *nb, *bias;
};

static void head_in_region(const float* x, const Shape& d, const Head& hd, const Step& st, Scratch& sc, float* logits) {
  norm_rounded(x, d, hd.nw, hd.nb, hd.w.G, st, sc);
  linear_in_region(hd.w, hd.bias, sc.xr, d.R, logits);
}

static const float* floats_or_null(const at::Tensor& t, int64_t n, const char* what) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, what, ": float32, ", n, " values");
  return t.data_ptr<float>();
}

// Layer l's parameters: lin[16 l, 16 l + 16), norms[6 l, 6 l + 6), its caches; checked against d
// (d.F is set from layer 0's c_fc)
static Layer layer_of(const std::vector<at::Tensor>& lin, const std::vector<at::Tensor>& norms, const at::Tensor& k,
                      const at::Tensor& v, int64_t l, Shape& d, int64_t act) {
  const at::Tensor* t = lin.data() + 16 * l;
  TORCH_CHECK(k.dim() == 4 && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf) && k.is_contiguous() &&
                  v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() && v.is_contiguous() && k.size(0) >= d.R && k.size(1) == d.KV &&
                  k.size(2) == d.cap && k.size(3) == d.hd,
              "k_caches, v_caches: contiguous (rows >= R, kv_heads, capacity, hd) float32 or float16, alike in every layer");
  Layer L{{}, {}, {}, k.data_ptr(), v.data_ptr(), k.scalar_type() == at::kHalf};
  const int64_t hidden = act == SWIGLU ? t[8].size(0) / 2 : t[8].size(0);
  const int64_t ins[4] = {d.C, d.H * d.hd, d.C, hidden};
  for (int i = 0; i < 4; ++i) {
    L.w.push_back(weights_of(t[4 * i], t[4 * i + 1], t[4 * i + 2], ins[i], d.formats[i]));
    L.bias.push_back(floats_or_null(t[4 * i + 3], L.w.back().N, "a linear's bias"));
  }
  if (l == 0) d.F = L.w[2].N;
  TORCH_CHECK(L.w[0].N == (d.H + 2 * d.KV) * d.hd && L.w[1].N == d.C && L.w[2].N == d.F && L.w[3].N == d.C,
              "decode_blocks: the linears' shapes do not match the blocks'");
  const int64_t sizes[6] = {d.C, d.C, d.C, d.C, d.hd, d.hd};
  for (int i = 0; i < 6; ++i) L.nw.push_back(floats_or_null(norms[6 * l + i], sizes[i], "a norm's weight"));
  return L;
}

// The head's parameters from [norm w, b or empty, q, s, o, bias or empty]; none from an empty list
static Head head_of(const std::vector<at::Tensor>& head, const Shape& d) {
  TORCH_CHECK(head.empty() || head.size() == 6, "head: none, or the norm's w, b and the linear's q, s, o, bias");
  if (head.empty()) return Head{};
  const Weights w = weights_of(head[2], head[3], head[4], d.C, d.formats[4]);
  return {w, floats_or_null(head[0], d.C, "the final norm's weight"), floats_or_null(head[1], d.C, "the final norm's bias"),
          floats_or_null(head[5], w.N, "the head's bias")};
}

// The shape every layer shares, from x's (R, C), the first cache and ints (n_head, kv_heads, S, ...,
// the linears' formats; the head's where one is given)
static Shape shape_of(int64_t R, int64_t C, const std::vector<at::Tensor>& k_caches, const std::vector<int64_t>& ints, bool head) {
  TORCH_CHECK(ints.size() == (head ? 10u : 9u), "ints: n_head, kv_heads, S, layer_norm, act, the four linears' formats and the head's (if given)");
  TORCH_CHECK(!k_caches.empty() && k_caches[0].dim() == 4, "k_caches: (rows, kv_heads, capacity, hd)");
  Shape d{R, C, ints[0], ints[1], k_caches[0].size(3), ints[2], 0, k_caches[0].size(2), {}};
  for (size_t i = 5; i < ints.size(); ++i) d.formats[i - 5] = format_of(ints[i]);
  TORCH_CHECK(d.KV >= 1 && d.H % d.KV == 0 && d.S >= 1 && d.S <= d.cap && d.hd % 2 == 0, "decode_blocks: bad heads or slots");
  return d;
}

// x0 (R, C) through the layers (and the head): the shared part of decode_blocks and decode_tokens
static at::Tensor run_blocks(const float* x0, Shape d, const at::TensorOptions& opts, const std::vector<at::Tensor>& lin,
                                const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& head,
                                const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches, const Step& st) {
  const int64_t n = int64_t(k_caches.size());
  TORCH_CHECK(int64_t(lin.size()) == 16 * n && int64_t(norms.size()) == 6 * n && int64_t(v_caches.size()) == n,
              "decode_blocks: per layer 16 linear tensors, 6 norms, a k and a v cache");
  for (int64_t r = 0; r < d.R; ++r) TORCH_CHECK(st.slots[r] >= 0 && st.slots[r] < d.S, "slots: each row's slot must be among the S attended");
  std::vector<Layer> layers;
  for (int64_t l = 0; l < n; ++l) layers.push_back(layer_of(lin, norms, k_caches[l], v_caches[l], l, d, st.act));
  const Head hd = head_of(head, d);
  auto y = at::empty({d.R, d.C}, opts);
  auto logits = head.empty() ? y : at::empty({d.R, hd.w.N}, opts);
  float *yp = y.data_ptr<float>(), *lp = logits.data_ptr<float>();
  std::memcpy(yp, x0, d.R * d.C * sizeof(float));
  Scratch& sc = scratch_for(d);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    for (const Layer& L : layers) {
      attention_half(yp, d, L, st, sc);
      mlp_half(yp, d, L, st, sc);
    }
    if (!head.empty()) head_in_region(yp, d, hd, st, sc, lp);
  }
  return logits;
}

// x (R, C) float32 through L pre-norm blocks → a new tensor: the hidden states, or with head
// [norm w, b or empty, q, s, o, bias or empty] the logits (R, N) of head(norm(hidden)). lin: per
// layer 4 × (q, s, o, bias or empty) for c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj; norms: per
// layer ln_1 w, b, ln_2 w, b, q_norm w, k_norm w (empty: none); k_caches, v_caches: per layer
// (rows, KV, capacity, hd) float32; slots (R,) where each row's new key goes; cos, sin (R, hd) or
// empty (no RoPE); mask (R, S) additive or empty (every slot visible); ints: n_head, kv_heads, S
// (slots attended), layer_norm (0/1), act (GELU_TANH, RELU2, SWIGLU), then the Format of c_attn,
// attn.c_proj, mlp.c_fc and mlp.c_proj, alike in every layer, and the head's where head is given.
// One OpenMP region runs them all.
at::Tensor decode_blocks(at::Tensor x, std::vector<at::Tensor> lin, std::vector<at::Tensor> norms,
                            std::vector<at::Tensor> head, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, at::Tensor slots,
                            at::Tensor cos, at::Tensor sin, at::Tensor mask, std::vector<int64_t> ints, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous (R, C) float32");
  const Shape d = shape_of(x.size(0), x.size(1), k_caches, ints, !head.empty());
  const int64_t R = d.R;
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == R, "slots: (R,) int64");
  const Step st{slots.data_ptr<int64_t>(), floats_or_null(cos, R * d.hd, "cos"), floats_or_null(sin, R * d.hd, "sin"),
                floats_or_null(mask, R * d.S, "mask"), float(eps), ints[3] != 0, ints[4]};
  TORCH_CHECK((st.cos == nullptr) == (st.sin == nullptr), "cos and sin: both or neither");
  return run_blocks(x.data_ptr<float>(), d, x.options(), lin, norms, head, k_caches, v_caches, st);
}

// What decode_tokens computes before the blocks, where GPT.decode's preamble is many small torch
// ops, slow with the caches cold from the last step's weights: each row's slot pos % cap
// (its position recorded in key_pos), its embedding wte[idx] (+ wpe[pos]), its RoPE cos and sin
struct Tokens {
  std::vector<float> x, cos, sin;
  std::vector<int64_t> slots;
};

static void embed_tokens(const at::Tensor& idx, const at::Tensor& pos, at::Tensor& key_pos, const std::vector<at::Tensor>& embed,
                         const at::Tensor& inv_freq, const Shape& d, Tokens& t) {
  const int64_t R = d.R, C = d.C, half = d.hd / 2;
  TORCH_CHECK(idx.scalar_type() == at::kLong && pos.scalar_type() == at::kLong && idx.is_contiguous() && pos.is_contiguous() &&
                  pos.numel() == R, "idx, pos: (R,) int64");
  TORCH_CHECK(key_pos.scalar_type() == at::kLong && key_pos.is_contiguous() && key_pos.dim() == 2 && key_pos.size(0) >= R &&
                  key_pos.size(1) == d.cap, "key_pos: (rows >= R, capacity) int64");
  TORCH_CHECK(embed.size() == 1 || embed.size() == 2, "embed: wte, or wte and wpe");
  for (const auto& e : embed)
    TORCH_CHECK(e.dim() == 2 && e.size(1) == C && e.scalar_type() == at::kFloat && e.is_contiguous(), "embed: (n, C) float32");
  const float* freq = floats_or_null(inv_freq, half, "inv_freq");
  const int64_t *ip = idx.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
  int64_t* kp = key_pos.data_ptr<int64_t>();
  t.x.resize(R * C);
  t.cos.resize(R * d.hd);
  t.sin.resize(R * d.hd);
  t.slots.resize(R);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(ip[r] >= 0 && ip[r] < embed[0].size(0), "idx: a token id past the vocabulary");
    TORCH_CHECK(pp[r] >= 0 && (embed.size() == 1 || pp[r] < embed[1].size(0)), "pos: negative, or past the learned positions");
    t.slots[r] = pp[r] % d.cap;
    kp[r * d.cap + t.slots[r]] = pp[r];
    const float* row = embed[0].data_ptr<float>() + ip[r] * C;
    for (int64_t c = 0; c < C; ++c) t.x[r * C + c] = row[c] + (embed.size() == 2 ? embed[1].data_ptr<float>()[pp[r] * C + c] : 0.f);
    for (int64_t i = 0; freq && i < half; ++i) {  // rope_cos_sin: the angle pos·inv_freq in float32, both halves alike
      const float angle = float(pp[r]) * freq[i];
      t.cos[r * d.hd + i] = t.cos[r * d.hd + half + i] = std::cos(angle);
      t.sin[r * d.hd + i] = t.sin[r * d.hd + half + i] = std::sin(angle);
    }
  }
}

// GPT.decode's whole unmasked step from token ids: idx, pos (R,) int64; key_pos the cache's
// positions (rows, capacity), written at each row's slot; embed [wte] or [wte, wpe] (learned
// positions) float32; inv_freq (hd / 2,) float32 or empty (no RoPE); the rest as decode_blocks,
// every slot of the first S visible to every row.
at::Tensor decode_tokens(at::Tensor idx, at::Tensor pos, at::Tensor key_pos, std::vector<at::Tensor> embed, at::Tensor inv_freq,
                            std::vector<at::Tensor> lin, std::vector<at::Tensor> norms, std::vector<at::Tensor> head,
                            std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, std::vector<int64_t> ints, double eps) {
  TORCH_CHECK(!embed.empty() && idx.dim() == 1, "idx: (R,) int64; embed: wte, or wte and wpe");
  const Shape d = shape_of(idx.numel(), embed[0].size(-1), k_caches, ints, !head.empty());
  thread_local Tokens t;
  embed_tokens(idx, pos, key_pos, embed, inv_freq, d, t);
  const Step st{t.slots.data(), inv_freq.numel() ? t.cos.data() : nullptr, inv_freq.numel() ? t.sin.data() : nullptr, nullptr, float(eps),
                ints[3] != 0, ints[4]};
  return run_blocks(t.x.data(), d, embed[0].options(), lin, norms, head, k_caches, v_caches, st);
}

// (n, V) float32 logits → (2, n) int64: each row's argmax (its first maximum) and 1 where the row is
// not finite (a NaN or infinite logit, or a sum past float's range). The engine's greedy draw in one
// pass, where its torch ops are several, cold after a step that streamed the weights.
at::Tensor argmax_finite(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: contiguous (n, V) float32");
  const int64_t n = logits.size(0), V = logits.size(1);
  auto out = at::empty({2, n}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    const float* x = logits.data_ptr<float>() + r * V;
    float best = -INFINITY, total = 0.f;
#pragma omp simd reduction(max : best) reduction(+ : total)
    for (int64_t i = 0; i < V; ++i) {
      best = std::max(best, x[i]);
      total += x[i];
    }
    int64_t at = 0;
    while (at < V && !(x[at] == best)) ++at;
    o[r] = at < V ? at : 0;
    o[n + r] = std::isfinite(total) ? 0 : 1;
  }
  return out;
}
