"""GGUF blocks → quill's groups of 32 against gguf.quants.dequantize (ggml's reference) on random
blocks of every mapped type: bit for bit where exact, within the fp16 rounding of each group's
scale and offset where not (the tolerance derived from that arithmetic), bad input refused."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from quillgpt.interop import gguf_blocks  # noqa: E402
from quillgpt.interop.gguf_blocks import EXACT_TYPES, ROUNDED_TYPES, Groups, dequantize, rounding_cost, to_groups  # noqa: E402

SHAPES = [(3, 256), (5, 512)]
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def random_raw(qtype: str, rows: int, cols: int, rng, d: tuple[float, float] = (1e-4, 0.1)) -> np.ndarray:
    """(rows, bytes per row) of random blocks: gguf.quants quantizes the legacy types; K-quant
    blocks are random bytes with random sane fp16 super-block scales (gguf cannot quantize them)."""
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in K_TYPES:
        a = rng.normal(size=(rows, cols)) * rng.uniform(0.01, 1.0, size=(rows, 1)) + rng.normal(size=(rows, 1))
        return gguf.quants.quantize(a.astype(np.float32), kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in (208,) if qtype == "Q6_K" else (0, 2):  # d (and dmin)
        raw[..., at : at + 2] = rng.uniform(*d, size=(rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])


def per_weight(a: np.ndarray, cols: int) -> np.ndarray:
    """A per-group (rows, cols // 32) array spread over its 32 weights, in float64."""
    return np.repeat(a.astype(np.float64), 32, axis=1)[:, :cols]


def fp16_rounding_bound(g: Groups, got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|code·s + o − w| ≤ |code|·½ulp(s) + ½ulp(o) (code·s is exact in float32), plus the float32
    rounding of ours and of ggml's result (half a float32 ulp each)."""
    cols = g.codes.shape[1]
    half_ulp = lambda h: per_weight(np.spacing(np.abs(h)), cols) / 2  # noqa: E731 (fp16 spacing)
    f32 = (np.spacing(np.abs(got)).astype(np.float64) + np.spacing(np.abs(want))) / 2
    return np.abs(g.codes.astype(np.float64)) * half_ulp(g.scale) + half_ulp(g.offset) + f32


def test_layout_table_is_ggml_s():
    for qtype, sizes in gguf_blocks.BLOCKS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]] == sizes
    assert set(EXACT_TYPES) | set(ROUNDED_TYPES) == set(gguf_blocks.BLOCKS) and not set(EXACT_TYPES) & set(ROUNDED_TYPES)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", EXACT_TYPES)
def test_exact_types_equal_ggml_bit_for_bit(qtype, shape):
    raw = random_raw(qtype, *shape, np.random.default_rng(0))
    g = to_groups(raw, qtype, *shape)
    assert g.exact and g.bits == (4 if qtype in ("Q4_0", "Q4_1") else 8)
    np.testing.assert_array_equal(dequantize(g), reference(raw, qtype))
    assert rounding_cost(g, reference(raw, qtype)) == 0.0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
def test_rounded_types_within_their_fp16_rounding(qtype, shape):
    raw = random_raw(qtype, *shape, np.random.default_rng(1))
    g = to_groups(raw, qtype, *shape)
    got, want = dequantize(g), reference(raw, qtype)
    assert np.all(np.abs(got.astype(np.float64) - want) <= fp16_rounding_bound(g, got, want))
    assert g.exact == np.array_equal(got, want)  # `exact` tells the truth
    assert 0 < rounding_cost(g, want) < 2**-11 * 16  # at most 16 codes' worth of fp16's relative rounding


@pytest.mark.parametrize("d", [(1e-4, 0.1), (2**-24, 2**-21)])  # ordinary, and subnormal fp16 d and scales
@pytest.mark.parametrize("shape", SHAPES)
def test_q6_k_within_half_its_int8_step(shape, d):
    raw = random_raw("Q6_K", *shape, np.random.default_rng(2), d)
    g = to_groups(raw, "Q6_K", *shape)
    got, want = dequantize(g), reference(raw, "Q6_K")
    # code = round(w / s), the quotient computed in float32 (≤ 2⁻¹⁶ of a step off), then both results' float32 rounding
    step = per_weight(np.abs(g.scale), shape[1])
    bound = step * (0.5 + 2**-16) + (np.spacing(np.abs(got)).astype(np.float64) + np.spacing(np.abs(want))) / 2
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound)
    assert not g.exact and 0 < rounding_cost(g, want) < 1 / 127


def test_k_quants_are_exact_where_their_products_fit_fp16():
    """Power-of-two d and dmin make d·sc and dmin·m fit fp16; Q6_K's two half scales need no rounding
    where the larger is at most 4 times their gcd (equal, opposite, one zero, 2:3, −128:−32...)."""
    rng = np.random.default_rng(3)
    for qtype in K_TYPES:
        raw = random_raw(qtype, 3, 512, rng).reshape(3, 2, -1)
        for at in (208,) if qtype == "Q6_K" else (0, 2):
            raw[..., at : at + 2] = np.array([2.0**-10], dtype=np.float16).view(np.uint8)
        if qtype == "Q6_K":
            pairs = np.array([(7, 7), (12, -12), (6, 9), (-8, 2), (0, 5), (0, 0), (4, -16), (-128, -32)], dtype=np.int8)
            raw[..., 192:208] = pairs.reshape(-1).view(np.uint8)
        raw = raw.reshape(3, -1)
        g = to_groups(raw, qtype, 3, 512)
        assert g.exact, qtype
        np.testing.assert_array_equal(dequantize(g), reference(raw, qtype))


@pytest.mark.parametrize("qtype", list(gguf_blocks.BLOCKS))
def test_codes_in_range_and_typed(qtype):
    g = to_groups(random_raw(qtype, 3, 256, np.random.default_rng(4)), qtype, 3, 256)
    assert g.codes.shape == (3, 256) and g.scale.shape == g.offset.shape == (3, 8)
    assert g.scale.dtype == g.offset.dtype == np.float16
    if g.bits == 4:
        assert g.codes.dtype == np.uint8 and g.codes.max() <= 15
    else:
        assert g.codes.dtype == np.int8


def test_types_not_mapped_are_none():
    for qtype in ("F32", "F16", "BF16", "Q2_K", "Q3_K", "IQ4_NL"):
        assert to_groups(np.zeros(4096, dtype=np.uint8), qtype, 4, 256) is None


def test_flat_and_row_shaped_bytes_and_chunks_agree(monkeypatch):
    raw = random_raw("Q4_K", 5, 512, np.random.default_rng(5))
    whole = to_groups(raw, "Q4_K", 5, 512)
    monkeypatch.setattr(gguf_blocks, "CHUNK", 256)  # a row at a time
    for g in (to_groups(raw.reshape(-1), "Q4_K", 5, 512), to_groups(raw, "Q4_K", 5, 512)):
        for name in ("codes", "scale", "offset"):
            np.testing.assert_array_equal(getattr(g, name), getattr(whole, name))


def test_wrong_byte_count_or_shape_is_refused():
    raw = random_raw("Q8_0", 3, 256, np.random.default_rng(6))
    with pytest.raises(ValueError, match="Q8_0 tensor of 3×256: 782 bytes, expected 816"):
        to_groups(raw.reshape(-1)[:-34], "Q8_0", 3, 256)
    with pytest.raises(ValueError, match="whole number"):
        to_groups(raw, "Q8_0", 3 * 256 // 48, 48)


@pytest.mark.parametrize(("qtype", "at", "d"), [("Q4_0", 0, 10000.0), ("Q4_K", 0, 60000.0), ("Q6_K", 208, 60000.0)])
def test_scale_or_offset_beyond_fp16_raises(qtype, at, d):
    """Q4_0's −8·d past 65504, a K-quant's d·sc: refused by name instead of becoming inf."""
    raw = random_raw(qtype, 3, 256, np.random.default_rng(7))
    raw[1, at : at + 2] = np.array([d], dtype=np.float16).view(np.uint8)
    if qtype == "Q4_K":
        raw[1, 4] = 63  # the first sub-block's scale
    if qtype == "Q6_K":
        raw[1, 192:194] = 100
    with pytest.raises(ValueError, match=qtype):
        to_groups(raw, qtype, 3, 256)
