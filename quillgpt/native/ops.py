"""The library's ops (declared once, in csrc/ops.cpp) as Python calls them, and their fake kernels:
the output's shape for torch.compile, which calls each op as one extern kernel."""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def group_gemv(x: Tensor, q: Tensor, s: Tensor, o: Tensor) -> Tensor:
    """(M, K) float32 x · Wᵀ for W = q·s + o per group of K / s.shape[1] inputs (a multiple of 32),
    q int8 in interleave's layout, s and o float16: (M, N) float32. available() must have returned
    True (it loads the library that defines the op)."""
    return torch.ops.quill.group_gemv(x.contiguous(), q, s, o)


def group_gemv4(x: Tensor, q: Tensor, s: Tensor, o: Tensor) -> Tensor:
    """group_gemv for 4-bit codes: W = q·s + o per group with q in [0, 15] packed by pack4 (K a
    multiple of 64); (M, K) float32 x → (M, N) float32."""
    return torch.ops.quill.group_gemv4(x.contiguous(), q, s, o)


def group_gemv4_x8(x: Tensor, q: Tensor, s: Tensor, o: Tensor) -> Tensor:
    """group_gemv4 with x rounded to int8 per 32 (a step of max|x|/127, llama.cpp's Q8_1 × Q4_1),
    asked for by name: from 65 rows its GEMM multiplies bytes (`vpdpbusd`), twice the products an
    instruction of int16's; the same sums at any row count (fewer rows: int16 arithmetic on the
    int8 codes)."""
    return torch.ops.quill.group_gemv4_x8(x.contiguous(), q, s, o)


def decode_blocks(
    x: Tensor,
    lin: list[Tensor],
    norms: list[Tensor],
    head: list[Tensor],
    k_caches: list[Tensor],
    v_caches: list[Tensor],
    slots: Tensor,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor,
    ints: list[int],
    eps: float,
) -> Tensor:
    """x (R, C) float32 through pre-norm decoder blocks in one call, each row's key and value
    written to its slot of the caches: the hidden states, or the logits where `head` holds the final
    norm and the head; csrc/decode_block.cpp says what each argument holds (ints ends in each
    linear's Format)."""
    return torch.ops.quill.decode_blocks(x, lin, norms, head, k_caches, v_caches, slots, cos, sin, mask, ints, eps)


def decode_tokens(
    idx: Tensor,
    pos: Tensor,
    key_pos: Tensor,
    embed: list[Tensor],
    inv_freq: Tensor,
    lin: list[Tensor],
    norms: list[Tensor],
    head: list[Tensor],
    k_caches: list[Tensor],
    v_caches: list[Tensor],
    ints: list[int],
    eps: float,
) -> Tensor:
    """decode_blocks from token ids (R,) at positions pos: their embedding, cache slots and RoPE
    angles made in the same call, every slot of the first S visible to every row."""
    return torch.ops.quill.decode_tokens(idx, pos, key_pos, embed, inv_freq, lin, norms, head, k_caches, v_caches, ints, eps)


def argmax_finite(logits: Tensor) -> Tensor:
    """(n, V) contiguous float32 logits → (2, n) int64: each row's argmax (its first maximum), and 1
    where the row is not finite (a NaN or infinite logit, or a sum past float's range)."""
    return torch.ops.quill.argmax_finite(logits)


@functools.cache
def register_fakes() -> None:
    """The ops' fake kernels, once: torch takes them only for an op the loaded library defined."""
    for name in ("quill::group_gemv", "quill::group_gemv4", "quill::group_gemv4_x8"):
        torch.library.register_fake(name, _gemv_fake)
    torch.library.register_fake("quill::decode_blocks", _decode_blocks_fake)
    torch.library.register_fake("quill::decode_tokens", _decode_tokens_fake)
    torch.library.register_fake("quill::argmax_finite", _argmax_finite_fake)


def _gemv_fake(x: Tensor, q: Tensor, s: Tensor, o: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


def _decode_blocks_fake(x, lin, norms, head, k_caches, v_caches, slots, cos, sin, mask, ints, eps):  # noqa: ANN001, ANN202
    return x.new_empty((x.shape[0], head[2].shape[0]) if head else x.shape)


def _decode_tokens_fake(idx, pos, key_pos, embed, inv_freq, lin, norms, head, k_caches, v_caches, ints, eps):  # noqa: ANN001, ANN202
    return embed[0].new_empty((idx.shape[0], head[2].shape[0] if head else embed[0].shape[1]))


def _argmax_finite_fake(logits):  # noqa: ANN001, ANN202
    return logits.new_empty((2, logits.shape[0]), dtype=torch.long)
