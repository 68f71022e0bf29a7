"""How the kernels read a linear's weights: its codes' format, and the rows' layout in memory."""

from __future__ import annotations

import enum

import torch
from torch import Tensor

BLOCK = 32  # activations are rounded per block of 32 inputs; a weight group is a multiple of it


class Format(enum.IntEnum):
    """A linear's weight codes as the native library takes them (csrc/quill.h's Format)."""

    INT8 = 0  # one int8 code a weight
    INT4 = 1  # codes in [0, 15], two a byte in pack4's layout


def interleave(codes: Tensor, out: Tensor | None = None) -> Tensor:
    """(N, B) bytes a row (int8 weights or packed 4-bit codes), B a multiple of 32 → the same shape
    in the kernels' layout: the rows in groups of four, and in each group unit u (32 bytes) of row
    r at 32·(4u + r), so the four rows the kernel reads at once are one sequential stream (four
    short streams are what the hardware prefetch barely learns); the last N % 4 rows as they are.
    Written into `out` (contiguous, codes' shape and dtype) where given: one copy of the codes."""
    n, width = codes.shape
    full = n - n % 4
    out = torch.empty_like(codes, memory_format=torch.contiguous_format) if out is None else out
    out[:full].view(full // 4, width // BLOCK, 4, BLOCK).copy_(codes[:full].view(full // 4, 4, width // BLOCK, BLOCK).transpose(1, 2))
    out[full:] = codes[full:]
    return out


def deinterleave(codes: Tensor) -> Tensor:
    """interleave's inverse: the rows one after another again (a copy)."""
    n, width = codes.shape
    full = n - n % 4
    body = codes[:full].view(full // 4, width // BLOCK, 4, BLOCK).transpose(1, 2).reshape(full, width)
    return torch.cat([body, codes[full:]])


def pack4(q: Tensor, out: Tensor | None = None) -> Tensor:
    """(N, K) codes in [0, 15], K a multiple of 64 → (N, K / 2) uint8 in group_gemv4's layout: byte
    j of each 32 holds code 64p + j (low nibble) and code 64p + 32 + j (high nibble), interleaved
    (into `out` where given, as interleave's)."""
    n, k = q.shape
    pairs = q.to(torch.uint8).view(n, k // 64, 2, 32)
    return interleave((pairs[:, :, 0] | (pairs[:, :, 1] << 4)).view(n, k // 2), out)


def unpack4(packed: Tensor) -> Tensor:
    """pack4's inverse: (N, K / 2) uint8 → (N, K) uint8 codes."""
    return nibbles(deinterleave(packed))


def nibbles(rows: Tensor) -> Tensor:
    """(n, K / 2) rows of pack4's bytes, deinterleaved (rows_of) → their (n, K) uint8 codes."""
    n, half = rows.shape
    p = rows.view(n, half // 32, 1, 32)
    return torch.cat([p & 15, p >> 4], dim=2).view(n, 2 * half)


def rows_of(codes: Tensor, idx: Tensor) -> Tensor:
    """Rows `idx` (a 1-D index tensor) of interleaved (N, B) codes, each as it was before interleave:
    what an embedding lookup in a quantized table reads, without deinterleaving the whole table."""
    n, width = codes.shape
    full = n - n % 4
    out = torch.empty(len(idx), width, dtype=codes.dtype, device=codes.device)
    body, tail = idx < full, idx >= full
    blocks = codes[:full].view(full // 4, width // BLOCK, 4, BLOCK)
    i = idx[body]
    out[body] = blocks[i // 4, :, i % 4].reshape(-1, width)
    out[tail] = codes[idx[tail]]
    return out
