"""llama.cpp's quantized GGUF blocks as quill's groups of 32 (w = code·scale + offset per group).

`quill import-gguf` keeps a file's quantization through this mapping instead of dequantizing to
fp32: Q4_0, Q4_1 and Q4_K become int4 codes, Q8_0 and the 5- and 6-bit types int8 codes, each with
an fp16 scale and offset per 32 weights of a row. Q4_0, Q4_1, Q8_0, Q5_0 and Q5_1 map exactly
(code·scale + offset in float32 equals gguf.quants.dequantize, ggml's reference, as numbers: only
Q4_0's 0·d with d < 0 comes out +0, not −0). The K-quants' products d·sc and dmin·m are rounded to
fp16, exact only where they fit, and `Groups.exact` says whether every group of the tensor did;
Q6_K's 16-weight sub-blocks with unequal scales share one int8 scale, so their codes are rounded.

Pure numpy, vectorized over the blocks of a chunk of rows; chunks bound the temporaries (an 8B
model's 525M-weight embedding never exists in fp32 here). The block layouts are ggml's
(ggml-common.h), read as gguf.quants reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

GROUP = 32  # quill's group: weights of a row sharing one scale and offset
CHUNK = 1 << 20  # weights mapped at a time: the temporaries stay a few MB, in cache

# ggml type → (weights per block, bytes per block), as gguf.GGML_QUANT_SIZES has them (a test checks)
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
EXACT_TYPES: tuple[str, ...] = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1")
ROUNDED_TYPES: dict[str, str] = {
    "Q4_K": "sub-block scale d·sc and min dmin·m rounded to fp16",
    "Q5_K": "sub-block scale d·sc and offset 16·d·sc−dmin·m rounded to fp16",
    "Q6_K": "16-weight halves with unequal scales share one int8 scale: ≤ 1/8 of the larger's 6-bit step",
}


@dataclass(frozen=True)
class Groups:
    """A tensor's weights as quill's groups of 32: w = codes·scale + offset per group."""

    bits: int  # 4 or 8
    codes: np.ndarray  # (rows, cols): uint8 in [0, 15] (bits 4) or int8 (bits 8)
    scale: np.ndarray  # (rows, cols // 32) float16
    offset: np.ndarray  # (rows, cols // 32) float16
    exact: bool  # True where codes·scale + offset (in float32) equals ggml's dequantization (as numbers: a zero's sign aside)


def to_groups(raw: np.ndarray, qtype: str, rows: int, cols: int) -> Groups | None:
    """raw: the tensor's bytes as the GGUF file holds them (uint8, flat or (rows, bytes_per_row)),
    qtype a gguf.GGMLQuantizationType name. None for types this module does not map (F32, F16,
    BF16, Q2_K, Q3_K, IQ*...: the caller keeps or requantizes those). ValueError for a byte count
    that does not fit the shape, or a scale or offset that does not fit fp16."""
    if qtype not in MAPPERS:
        return None
    block, size = BLOCKS[qtype]
    blocks = _blocks(raw, qtype, rows, cols)  # (rows, cols // block, size)
    bits = 4 if qtype in ("Q4_0", "Q4_1", "Q4_K") else 8
    codes = np.empty((rows, cols), dtype=np.uint8 if bits == 4 else np.int8)
    scale = np.empty((rows, cols // GROUP), dtype=np.float16)
    offset = np.empty((rows, cols // GROUP), dtype=np.float16)
    per, exact, step = block // GROUP, True, max(1, CHUNK // max(cols, 1))
    for r in range(0, rows, step):  # a chunk of rows at a time, every block of it at once
        b, c, s, o = (a[r : r + step] for a in (blocks, codes, scale, offset))
        n = b.shape[0] * b.shape[1]  # blocks in the chunk
        exact &= MAPPERS[qtype](b.reshape(n, size), c.reshape(n, block), s.reshape(n, per), o.reshape(n, per))
    return Groups(bits, codes, scale, offset, bool(exact))


def dequantize(g: Groups) -> np.ndarray:
    """(rows, cols) float32 codes·scale + offset: a multiply then an add, each rounded, as ggml's reference does."""
    rows, cols = g.codes.shape
    out = np.multiply(g.codes.reshape(rows, -1, GROUP), g.scale[..., None], dtype=np.float32)
    np.add(out, g.offset[..., None], out=out)
    return out.reshape(rows, cols)


def rounding_cost(g: Groups, reference: np.ndarray) -> float:
    """max |dequantize(g) − reference| / max |reference| (reference: gguf.quants.dequantize of the same bytes)."""
    got = dequantize(g)
    return relative_error(got, np.asarray(reference, dtype=np.float32).reshape(got.shape))


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got − want| / max |want| (the error itself where want is all zeros)."""
    top = float(np.abs(want).max(initial=0.0))
    err = float(np.abs(got - want).max(initial=0.0))
    return err / top if top > 0 else err


def _blocks(raw: np.ndarray, qtype: str, rows: int, cols: int) -> np.ndarray:
    """raw as (rows, blocks per row, bytes per block), a view where raw is contiguous."""
    block, size = BLOCKS[qtype]
    if raw.dtype != np.uint8:
        raise ValueError(f"{qtype} tensor: raw bytes must be uint8, got {raw.dtype}")
    if rows < 0 or cols < 0 or cols % block:
        raise ValueError(f"{qtype} tensor of {rows}×{cols}: a row is not a whole number of {block}-weight blocks")
    want = rows * (cols // block) * size
    if raw.size != want:
        raise ValueError(f"{qtype} tensor of {rows}×{cols}: {raw.size} bytes, expected {want}")
    return raw.reshape(rows, cols // block, size)


def _half(b: np.ndarray, at: int, qtype: str) -> np.ndarray:
    """The fp16 at byte `at` of each block, (n, 1); a non-finite one (a damaged file) raises."""
    h = np.ascontiguousarray(b[:, at : at + 2]).view(np.float16)
    if not np.isfinite(h).all():
        raise ValueError(f"{qtype} tensor: a block's fp16 scale is {h[~np.isfinite(h)][0]} (a damaged file?)")
    return h


def _fp16(x: np.ndarray, qtype: str, what: str, outward: bool = False) -> tuple[np.ndarray, bool]:
    """x (exact in its float32 or float64) rounded to fp16 (to nearest, or `outward`: never toward
    0), and whether every value was exact. A value beyond fp16's range raises instead of becoming inf."""
    with np.errstate(over="ignore", invalid="ignore"):
        h = x.astype(np.float16)
        if outward:
            h = np.where(np.abs(h) < np.abs(x), np.nextafter(h, np.copysign(np.inf, x).astype(np.float16)), h)
    bad = ~np.isfinite(h)
    if bad.any():
        raise ValueError(f"{qtype} tensor: a group's {what} is {x[bad][0]:.6g}, beyond fp16's range (±65504)")
    return h, bool(np.array_equal(h, x))


def _nibbles(qs: np.ndarray, out: np.ndarray, width: int) -> None:
    """Each run of `width` bytes → its `width` low nibbles, then its `width` high nibbles (ggml's order)."""
    q = qs.reshape(qs.shape[0], -1, 1, width)
    o = out.view(np.uint8).reshape(out.shape[0], -1, 2, width)
    np.bitwise_and(q[:, :, 0], np.uint8(0x0F), out=o[:, :, 0])
    np.right_shift(q[:, :, 0], np.uint8(4), out=o[:, :, 1])


def _fifth_bit(hi: np.ndarray, out: np.ndarray) -> None:
    """Adds 16 to each code whose fifth bit (hi: 0 or 1, in the weights' order) is set."""
    o = out.view(np.uint8)
    o |= hi.reshape(o.shape) << np.uint8(4)


def _q4_0(b: np.ndarray, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> bool:
    """w = (q − 8)·d → q·d + (−8·d): −8·d is exact in fp16 (or overflows, which raises)."""
    d = _half(b, 0, "Q4_0")
    _nibbles(b[:, 2:], codes, 16)
    scale[:] = d
    offset[:], exact = _fp16(np.float32(-8) * d.astype(np.float32), "Q4_0", "offset −8·d")
    return exact


def _q4_1(b: np.ndarray, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> bool:
    """w = q·d + m: quill's int4 form itself."""
    scale[:], offset[:] = _half(b, 0, "Q4_1"), _half(b, 2, "Q4_1")
    _nibbles(b[:, 4:], codes, 16)
    return True


def _q8_0(b: np.ndarray, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> bool:
    """w = q·d; the offset is −0.0, since x + (−0) is x for every x, a zero's sign included."""
    scale[:] = _half(b, 0, "Q8_0")
    offset[:] = -0.0
    codes[:] = b[:, 2:].view(np.int8)
    return True


def _q5_0(b: np.ndarray, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> bool:
    """w = (q − 16)·d with q's fifth bits in 4 bytes before the nibbles: codes q − 16."""
    scale[:] = _half(b, 0, "Q5_0")
    offset[:] = -0.0  # as Q8_0's
    _nibbles(b[:, 6:], codes, 16)
    _fifth_bit(np.unpackbits(b[:, 2:6], axis=1, bitorder="little"), codes)  # bit j of the 4 bytes: weight j
    codes -= np.int8(16)
    return True


def _q5_1(b: np.ndarray, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> bool:
    """w = q·d + m with q in [0, 31]: int8 codes q themselves (not q − 16, whose offset m + 16·d
    fp16 would round), so the block is quill's form as it stands."""
    scale[:], offset[:] = _half(b, 0, "Q5_1"), _half(b, 2, "Q5_1")
    _nibbles(b[:, 8:], codes, 16)
    _fifth_bit(np.unpackbits(b[:, 4:8], axis=1, bitorder="little"), codes)
    return True


def _k_scales(b: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's super-block: d·sc and dmin·m of its 8 sub-blocks, (n, 8) float64, both exact
    (fp16 × a 6-bit integer). Bytes 4..15 hold sc and m at 6 bits each: the low 6 bits of bytes
    0..3 (sc) and 4..7 (m) for sub-blocks 0..3; for 4..7 a nibble of bytes 8..11 and the top 2 bits."""
    d, dmin = _half(b, 0, qtype).astype(np.float64), _half(b, 2, qtype).astype(np.float64)
    packed = b[:, 4:16].reshape(-1, 3, 4)
    lo, mid, hi = packed[:, 0], packed[:, 1], packed[:, 2]  # (n, 4) each
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=1)
    return d * sc, dmin * mn


def _q4_k(b: np.ndarray, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> bool:
    """Sub-block of 32: w = (d·sc)·q − dmin·m, q in [0, 15]: int4 with fp16(d·sc) and fp16(−dmin·m)."""
    ds, dm = _k_scales(b, "Q4_K")
    scale[:], exact_s = _fp16(ds, "Q4_K", "scale d·sc")
    offset[:], exact_o = _fp16(-dm, "Q4_K", "min dmin·m")
    _nibbles(b[:, 16:], codes, GROUP)
    return exact_s and exact_o


def _q5_k(b: np.ndarray, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> bool:
    """As Q4_K with q's fifth bits in 32 bytes: codes q − 16, offset 16·d·sc − dmin·m (exact in
    float64 before its rounding, so the rounding of d·sc costs |q − 16| ≤ 16 of it, not q ≤ 31)."""
    ds, dm = _k_scales(b, "Q5_K")
    scale[:], exact_s = _fp16(ds, "Q5_K", "scale d·sc")
    offset[:], exact_o = _fp16(16 * ds - dm, "Q5_K", "offset 16·d·sc−dmin·m")
    _nibbles(b[:, 48:], codes, GROUP)
    hi = np.unpackbits(b[:, 16:48, None], axis=2, bitorder="little")  # (n, 32 positions, 8 sub-blocks)
    _fifth_bit(hi.transpose(0, 2, 1), codes)  # bit j of byte i: weight i of sub-block j
    codes -= np.int8(16)
    return exact_s and exact_o


def _q6_k(b: np.ndarray, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> bool:
    """Sub-blocks of 16: w = (d·sc)·(q − 32), q in [0, 63], sc int8. A group of 32 takes two
    sub-blocks; with a = the scale of larger |·|, K = |a| / gcd(sc₁, sc₂) when that is ≤ 4 (both
    halves' codes (q − 32)·sc/(a/K) are then integers in int8), else 4, and the group's scale
    is d·a/K rounded outward to fp16 (so |w / scale| ≤ 128), its codes round(w / scale): exact
    where K divides and d·a/K fits fp16, else within half a step."""
    n = b.shape[0]
    d = _half(b, 208, "Q6_K").astype(np.float64)  # (n, 1)
    sc = b[:, 192:208].view(np.int8).astype(np.int64).reshape(n, 8, 2)  # (n, group, half)
    big = np.where(np.abs(sc[..., 0]) >= np.abs(sc[..., 1]), sc[..., 0], sc[..., 1])  # (n, 8)
    ratio = np.abs(big) // np.maximum(np.gcd(sc[..., 0], sc[..., 1]), 1)
    k = np.where(big == 0, 1, np.minimum(ratio, 4))
    s, exact = _fp16(d * (big / k), "Q6_K", "scale d·sc/K", outward=True)
    scale[:], offset[:] = s, -0.0  # −0.0: as Q8_0's
    exact &= bool((ratio <= 4).all())
    # code = round((q − 32)·(d·sc)/s) per sub-block; 0 where s is 0 (so is d·a, and every w of the group)
    s32 = s.astype(np.float32).reshape(n, 8, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(s32 != 0, (d.astype(np.float32)[:, :, None] * sc.astype(np.float32)) / s32, 0).astype(np.float32)
    q = np.empty((n, 256), dtype=np.uint8)
    _nibbles(b[:, :128], q, 64)
    hi = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q |= ((hi & np.uint8(3)) << np.uint8(4)).reshape(n, 256)
    c = (q.view(np.int8) - np.int8(32)).astype(np.float32).reshape(n, 8, 2, 16) * r.reshape(n, 8, 2, 1)
    np.rint(c, out=c)
    np.clip(c, -128, 127, out=c)  # already: |w / s| ≤ 128, and +128 needs (q − 32)·4 = +128, not in [−32, 31]
    codes[:] = c.reshape(n, 256)
    return exact


MAPPERS: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], bool]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q8_0": _q8_0,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
