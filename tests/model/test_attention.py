"""Fused attention against the textbook per-head form, GQA/MQA against repeated-K/V MHA,
masks against brute force, RoPE against complex rotation."""

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import VARIANTS, V, random_model, rel_err
from torch import nn

from quillgpt.config import ModelConfig
from quillgpt.model.attention import (
    CausalSelfAttention,
    HeadNorm,
    apply_rope,
    attend,
    attend_one,
    attention_mask,
    mask_to_bias,
    rope_cos_sin,
    rope_inv_freq,
)
from quillgpt.model.gpt import GPT
from quillgpt.model.kv_cache import EMPTY_POS, KVCache

BLOCK = 16


# --- the reference: one Head module per head, concatenated, projected -------------------------


class Head(nn.Module):
    """One head of causal self-attention: softmax(QK^T/√d_k)·V under a lower-triangular mask."""

    def __init__(self, n_embd: int, head_size: int, bias: bool):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=bias)
        self.query = nn.Linear(n_embd, head_size, bias=bias)
        self.value = nn.Linear(n_embd, head_size, bias=bias)
        self.register_buffer("tril", torch.tril(torch.ones(BLOCK, BLOCK)))

    def forward(self, x):
        B, T, C = x.shape
        k, q, v = self.key(x), self.query(x), self.value(x)  # (B, T, hs)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, T)
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        return F.softmax(wei, dim=-1) @ v


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head: int, n_embd: int, bias: bool):
        super().__init__()
        self.heads = nn.ModuleList(Head(n_embd, n_embd // n_head, bias) for _ in range(n_head))
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


def reference_from(attn: CausalSelfAttention) -> MultiHeadAttention:
    """Copy the fused weights' slices into per-head layers (head h reads K/V head h // group)."""
    H, KV, hd = attn.n_head, attn.kv_heads, attn.head_dim
    ref = MultiHeadAttention(H, H * hd, bias=attn.c_attn.bias is not None)
    W, b = attn.c_attn.weight, attn.c_attn.bias
    with torch.no_grad():
        for h, head in enumerate(ref.heads):
            g = h // (H // KV)
            rows = {
                "query": slice(h * hd, (h + 1) * hd),
                "key": slice((H + g) * hd, (H + g + 1) * hd),
                "value": slice((H + KV + g) * hd, (H + KV + g + 1) * hd),
            }
            for name, sl in rows.items():
                getattr(head, name).weight.copy_(W[sl])
                if b is not None:
                    getattr(head, name).bias.copy_(b[sl])
        ref.proj.load_state_dict(attn.c_proj.state_dict())
    return ref


def make_attn(**kw) -> CausalSelfAttention:
    torch.manual_seed(0)
    attn = CausalSelfAttention(ModelConfig(vocab_size=10, block_size=BLOCK, n_head=4, n_embd=32, **kw)).eval()
    with torch.no_grad():  # non-trivial weights and biases, so a wrong slice cannot hide
        for p in attn.parameters():
            p.normal_(0, 0.3)
    return attn


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_attention_equals_per_head_reference(impl, bias):
    attn = make_attn(attn_impl=impl, bias=bias)
    x = torch.randn(3, BLOCK, 32)
    for T in (BLOCK, 5, 1):
        torch.testing.assert_close(attn(x[:, :T])[0], reference_from(attn)(x[:, :T]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("n_kv_head", [2, 1], ids=["gqa", "mqa"])
def test_gqa_and_mqa_equal_mha_with_repeated_kv_heads(impl, n_kv_head):
    gqa = make_attn(attn_impl=impl, n_kv_head=n_kv_head)
    mha = make_attn(attn_impl=impl)
    H, KV, hd = 4, n_kv_head, 8
    assert gqa.c_attn.weight.shape == ((H + 2 * KV) * hd, 32)

    def repeat(t):  # [q | k (KV heads) | v (KV heads)] → [q | k (H heads) | v (H heads)]
        q, k, v = t.split([H * hd, KV * hd, KV * hd])
        rep = lambda z: z.view(KV, hd, *z.shape[1:]).repeat_interleave(H // KV, dim=0).reshape(H * hd, *z.shape[1:])
        return torch.cat([q, rep(k), rep(v)])

    with torch.no_grad():
        mha.c_attn.weight.copy_(repeat(gqa.c_attn.weight))
        mha.c_attn.bias.copy_(repeat(gqa.c_attn.bias))
        mha.c_proj.load_state_dict(gqa.c_proj.state_dict())
    x = torch.randn(2, BLOCK, 32)
    torch.testing.assert_close(gqa(x)[0], mha(x)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gqa(x)[0], reference_from(gqa)(x), atol=1e-5, rtol=1e-5)


def brute_force_mask(q_pos: list[int], k_pos: list[int], span: int) -> torch.Tensor:
    return torch.tensor([[(0 <= kp <= qp and qp - kp < span) or kp == qp for kp in k_pos] for qp in q_pos])


@pytest.mark.parametrize("window", [1, 3, 5, BLOCK, 100])
def test_window_mask_equals_brute_force(window):
    pos = torch.arange(BLOCK)[None]
    got = attention_mask(pos, pos, window)[0, 0]
    expected = torch.tensor([[i - window < j <= i for j in range(BLOCK)] for i in range(BLOCK)])
    assert torch.equal(got, expected)


def test_padding_mask_hides_pads_and_never_empties_a_row():
    q_pos = torch.tensor([[-2, -1, 0, 1, 2], [0, 1, 2, 3, 4]])
    k_pos = torch.tensor([[-2, -1, 0, 1, 2, -(2**62)], [0, 1, 2, 3, 4, -(2**62)]])  # + an empty cache slot
    got = attention_mask(q_pos, k_pos, span=3)
    for r in range(2):
        assert torch.equal(got[r, 0], brute_force_mask(q_pos[r].tolist(), k_pos[r].tolist(), 3))
    assert got.any(-1).all()  # every query sees something, so softmax has no NaN row


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("window", [1, 3, 6])
def test_windowed_attention_equals_brute_force_loops(impl, window):
    B, H, T, hd = 2, 4, BLOCK, 8
    q, k, v = torch.randn(3, B, H, T, hd).unbind(0)
    pos = torch.arange(T)[None].expand(B, T)
    mask = attention_mask(pos, pos, window)
    for m in (mask, mask_to_bias(mask, torch.float32)):
        y, _ = attend(q, k, v, m, impl)
        expected = torch.empty_like(q)
        for i in range(T):  # each query over exactly its window, nothing masked
            lo = max(0, i - window + 1)
            w = (q[:, :, i : i + 1] @ k[:, :, lo : i + 1].transpose(-2, -1) / math.sqrt(hd)).softmax(-1)
            expected[:, :, i] = (w @ v[:, :, lo : i + 1])[:, :, 0]
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_math_path_returns_causal_softmax_weights():
    q, k, v = torch.randn(3, 2, 4, 7, 8).unbind(0)
    y, w = attend(q, k, v, None, "math")
    assert w.shape == (2, 4, 7, 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 7))
    assert (w.triu(1) == 0).all()
    torch.testing.assert_close(y, w @ v)
    torch.testing.assert_close(y, attend(q, k, v, None, "sdpa")[0], atol=1e-5, rtol=1e-5)


def test_bf16_attention_on_cpu_is_the_fp32_computation_rounded_once():
    """On CPU, bf16 attention runs in fp32 (torch's bf16 kernels are slow there): under autocast,
    output and gradients are the fp32 ones rounded to bf16, and fp32 = the plain formula."""
    q, k, v = (t.bfloat16().requires_grad_() for t in torch.randn(3, 2, 4, BLOCK, 8).unbind(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = attend(q, k, v, None, "sdpa")
    y.sum().backward()
    fp32 = {impl: [t.detach().float().requires_grad_() for t in (q, k, v)] for impl in ("sdpa", "math")}
    for impl, qkv in fp32.items():
        y32, _ = attend(*qkv, None, impl)
        y32.sum().backward()
        if impl == "sdpa":
            assert y.dtype == torch.bfloat16 and torch.equal(y, y32.bfloat16())
    for got, fast, plain in zip((q, k, v), fp32["sdpa"], fp32["math"]):
        assert torch.equal(got.grad, fast.grad.bfloat16())
        torch.testing.assert_close(fast.grad, plain.grad, atol=1e-5, rtol=1e-5)


def test_qk_norm_under_bf16_autocast_keeps_the_fused_kernel_and_the_formula():
    """bf16 q with the fp32 gain: no mixed-dtype fallback (it warns), and the result is
    x / rms(x) · gain to bf16 rounding, with the gradient reaching the fp32 gain."""
    norm = HeadNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    x = torch.randn(2, 4, BLOCK, 8).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = norm(x)
    plain = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), plain.detach(), atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32


def test_rope_equals_complex_rotation_and_is_relative():
    hd, theta = 8, 10000.0
    x = torch.randn(2, 3, 5, hd)  # (B, H, T, hd)
    pos = torch.tensor([0, 1, 7, 100, 5000])
    cos, sin = rope_cos_sin(pos, rope_inv_freq(hd, theta))
    got = apply_rope(x, cos, sin)
    # reference: the pair (x_i, x_{i+d/2}) is a complex number turned by pos·θ^(-2i/d)
    freqs = theta ** (-torch.arange(0, hd, 2).double() / hd)
    z = torch.complex(x[..., : hd // 2].double(), x[..., hd // 2 :].double())
    z = z * torch.polar(torch.ones(5, hd // 2, dtype=torch.float64), pos[:, None].double() * freqs)
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], -1).float(), atol=1e-4, rtol=1e-4)
    # q·k depends on the distance only: shifting both positions by 37 changes nothing
    q, k = torch.randn(2, hd)

    def dot(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([pq]), rope_inv_freq(hd, theta))
        ck, sk = rope_cos_sin(torch.tensor([pk]), rope_inv_freq(hd, theta))
        return (apply_rope(q[None], cq, sq) * apply_rope(k[None], ck, sk)).sum()

    torch.testing.assert_close(dot(10, 3), dot(47, 40), atol=1e-5, rtol=1e-5)


def test_cache_smaller_than_span_refuses_to_drop_visible_keys():
    cache = KVCache(1, 1, 1, 4, capacity=3, span=8, device="cpu", dtype=torch.float32)
    cache.plan(torch.arange(3)[None])
    with pytest.raises(ValueError, match="full"):
        cache.plan(torch.tensor([[3]]))
    cache.reset()
    assert (cache.pos == EMPTY_POS).all()  # a refused write left nothing behind, and reset forgets all


# --- on CUDA (pytest -m cuda; skipped without a GPU) ------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_sdpa_equals_math_attention_on_cuda(dtype):
    """The flash kernel, forced (it raises rather than fall back), against the math path in
    float64 on the same inputs, forward and backward, at a shape it runs: head dim 64, 256 keys."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator("cuda").manual_seed(0)
    q, k, v, dy = (torch.randn(2, 6, 256, 64, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        y, _ = attend(*leaves, None)
        grads = torch.autograd.grad(y, leaves, dy)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = attend(*ref_leaves, None, impl="math")
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.double())
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert rel_err(y, ref) < tol
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < tol


@pytest.mark.cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sdpa_model_equals_math_model_on_cuda_in_bf16(variant):
    """The whole model under bf16 autocast on CUDA, attn_impl sdpa (whichever kernel CUDA picks:
    GQA, windows and RoPE included) against the math model with the same weights in float64: no
    further from it than the math model under the same autocast (the bf16 rounding of 2 layers)."""
    sdpa = random_model(variant).cuda()
    plain = GPT(dataclasses.replace(sdpa.config, attn_impl="math")).cuda().eval()
    plain.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, V, (3, BLOCK), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got, _ = sdpa(ids, all_logits=True)
            rounded, _ = plain(ids, all_logits=True)
        want, _ = plain.double()(ids, all_logits=True)
    assert rel_err(got, want) < max(2 * rel_err(rounded, want), 1e-3)


@pytest.mark.parametrize("kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bias", "broadcast"])
def test_attend_one_equals_attend_for_one_query_per_row(kv, mask_kind):
    """The compiled CPU decode step's attention (products and sums) against attend's SDPA."""
    torch.manual_seed(0)
    R, H, S, hd = 3, 4, 11, 8
    q, k, v = torch.randn(R, H, 1, hd), torch.randn(R, kv, S, hd), torch.randn(R, kv, S, hd)
    mask = None
    if mask_kind != "none":
        mask = torch.rand(1 if mask_kind == "broadcast" else R, 1, 1, S) > 0.3  # broadcast: one mask for all rows
        mask[..., 0] = True  # every row sees a key
        mask = mask_to_bias(mask, torch.float32) if mask_kind == "bias" else mask
    want, _ = attend(q, k, v, mask)
    torch.testing.assert_close(attend_one(q, k, v, mask), want, rtol=1e-5, atol=1e-5)
