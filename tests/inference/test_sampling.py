"""SamplingParams validation (every float finite and in range, named by its field), the logit
filters on hand-computed cases, and per-row draws that do not depend on the other rows."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quillgpt.errors import QuillError
from quillgpt.inference.sampling import (
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    sample_next,
    sample_rows,
)
from quillgpt.sampling_params import InvalidParam, SamplingParams

INF = float("inf")
NAN = float("nan")


# --- validation ---------------------------------------------------------------------------------

BAD = [
    ("temperature", NAN, "must be ≥ 0"),
    ("temperature", INF, "must be ≥ 0"),
    ("temperature", -0.5, "must be ≥ 0"),
    ("top_p", NAN, r"must be in \(0, 1\]"),
    ("top_p", 0.0, r"\(0, 1\]"),
    ("top_p", 1.5, r"\(0, 1\]"),
    ("min_p", NAN, r"must be in \[0, 1\)"),
    ("min_p", 1.0, r"\[0, 1\)"),
    ("min_p", -INF, r"\[0, 1\)"),
    ("repetition_penalty", NAN, "must be > 0"),
    ("repetition_penalty", INF, "> 0"),
    ("repetition_penalty", 0.0, "> 0"),
    ("top_k", 0, "at least 1"),
    ("top_k", 2.5, "whole number"),
    ("max_new_tokens", -1, "must be ≥ 0"),
    ("max_new_tokens", 10**30, "must be at most"),
    ("max_new_tokens", True, "whole number"),
    ("seed", -1, "must be ≥ 0"),
    ("seed", 2**64, "at most"),
    ("temperature", "hot", "a number"),
    ("stop", ("",), "must not be empty"),
]


@pytest.mark.parametrize("param,value,match", BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_bad_values_name_the_field(param, value, match):
    with pytest.raises(InvalidParam, match=match) as info:
        SamplingParams(**{param: value})
    err = info.value
    assert isinstance(err, QuillError) and err.param == param and str(err).startswith(param + " ")
    assert err.message("--" + param.replace("_", "-")).startswith("--" + param.replace("_", "-") + " must")


def test_good_values_are_kept_and_normalised():
    p = SamplingParams(max_new_tokens=0, temperature=2, top_k=3, top_p=1, min_p=0, repetition_penalty=1e-3, seed=0, stop=["a", "bc"])
    assert p.temperature == 2.0 and isinstance(p.temperature, float) and p.stop == ("a", "bc")
    assert SamplingParams(stop="x").stop == ("x",) and SamplingParams().greedy and not p.greedy


@settings(max_examples=200, deadline=None, database=None)
@given(st.sampled_from(["temperature", "top_p", "min_p", "repetition_penalty"]), st.floats(allow_nan=True, allow_infinity=True))
def test_any_float_is_accepted_only_when_finite_and_in_range(param, value):
    ok = {
        "temperature": lambda t: t >= 0,
        "top_p": lambda p: 0 < p <= 1,
        "min_p": lambda p: 0 <= p < 1,
        "repetition_penalty": lambda r: r > 0,
    }[param]
    if math.isfinite(value) and ok(value):
        assert getattr(SamplingParams(**{param: value}), param) == value
    else:
        with pytest.raises(InvalidParam):
            SamplingParams(**{param: value})


@settings(max_examples=60, deadline=None, database=None)
@given(st.floats(min_value=1e-300, max_value=1e300), st.floats(min_value=1e-300, max_value=1e300))
def test_extreme_valid_settings_always_draw_a_token(temperature, penalty):
    logits = torch.tensor([[3.0, -2.0, 0.5, 80.0]])
    seen = torch.tensor([[True, True, False, False]])
    params = SamplingParams(temperature=temperature, repetition_penalty=penalty, top_p=0.9, min_p=0.1)
    lg = apply_repetition_penalty(logits, seen, penalty)
    tok = sample_next(lg, params, torch.Generator().manual_seed(0))
    assert tok.shape == (1,) and 0 <= int(tok) < 4


# --- logit filters ------------------------------------------------------------------------------


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, 3.0]]
    assert apply_repetition_penalty(logits, seen, 1.0) is logits


def test_temperature():
    assert apply_temperature(torch.tensor([[2.0, -1.0]]), 0.5).tolist() == [[4.0, -2.0]]


def test_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [5.0, 2.0, 2.0, 1.0]])
    assert apply_top_k(logits, 2).tolist() == [[-INF, 3.0, 2.0, -INF], [5.0, 2.0, 2.0, -INF]]  # ties kept
    assert apply_top_k(logits, 1).tolist() == [[-INF, 3.0, -INF, -INF], [5.0, -INF, -INF, -INF]]
    assert apply_top_k(logits, 4) is logits and apply_top_k(logits, None) is logits


def test_top_p():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = probs.log()
    kept = lambda p: torch.isfinite(apply_top_p(logits, p)).int().tolist()
    assert kept(0.45) == [[0, 1, 0, 0]]
    assert kept(0.7) == [[0, 1, 0, 1]]
    assert kept(0.85) == [[1, 1, 0, 1]]
    assert kept(0.99) == [[1, 1, 1, 1]]
    assert apply_top_p(logits, 1.0) is logits
    torch.testing.assert_close(apply_top_p(logits, 0.7)[0, [1, 3]], logits[0, [1, 3]])


def test_min_p():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    kept = lambda m: torch.isfinite(apply_min_p(logits, m)).int().tolist()
    assert kept(0.2) == [[1, 1, 0, 1]]  # threshold 0.1
    assert kept(0.5) == [[0, 1, 0, 1]]  # threshold 0.25
    assert apply_min_p(logits, 0.0) is logits


def test_sample_next():
    logits = torch.tensor([[0.7, 0.2, 0.1]]).log().expand(4000, 3)
    assert (sample_next(logits, SamplingParams()) == 0).all()  # temperature 0: argmax
    draw = lambda seed, **kw: sample_next(logits, SamplingParams(temperature=1.0, **kw), torch.Generator().manual_seed(seed))
    assert (draw(0, top_k=1) == 0).all()
    assert torch.equal(draw(0), draw(0)) and not torch.equal(draw(0), draw(1))
    freq = torch.bincount(draw(0), minlength=3) / 4000
    assert freq.tolist() == pytest.approx([0.7, 0.2, 0.1], abs=0.03)
    nucleus = torch.bincount(draw(0, top_p=0.75), minlength=3) / 4000  # keeps 0.7 and 0.2
    assert nucleus.tolist() == pytest.approx([0.7 / 0.9, 0.2 / 0.9, 0.0], abs=0.03)


def test_sample_rows_draws_each_row_from_its_own_stream():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    hot = SamplingParams(temperature=1.5)
    gen = lambda s: torch.Generator().manual_seed(s)
    together = sample_rows(logits, [hot, None, hot], [gen(1), None, gen(2)])
    assert int(together[1]) == int(logits[1].argmax())  # an idle row: argmax
    assert int(together[2]) == int(sample_rows(logits[2:], [hot], [gen(2)])[0])  # = the row alone
    seen = torch.zeros(1, 50, dtype=torch.bool)
    pen = SamplingParams(repetition_penalty=1.3)
    tok = int(sample_rows(logits[:1], [pen], [None], seen)[0])
    assert seen[0].nonzero().flatten().tolist() == [tok]


def test_the_config_section_is_sampling_params_and_names_its_key():
    from dataclasses import fields

    from quillgpt.config import SampleConfig, load_config

    assert {f.name for f in fields(SampleConfig)} <= {f.name for f in fields(SamplingParams)}
    assert load_config(None, ["sample.top_k=5"]).sample.params() == SamplingParams(max_new_tokens=500, temperature=0.8, top_k=5, seed=1337)
    for override in ("sample.temperature=.nan", "sample.repetition_penalty=.inf", "sample.top_p=0"):
        with pytest.raises(QuillError, match="sample." + override.split("=")[0].split(".")[1]):
            load_config(None, [override])


# --- every filter keeps the most likely token, in any dtype ---------------------------------------

TINY = [5e-324, 1e-320, 1e-300, 1e-46, 1e-45, 1.2e-38, 1e-30, 1e-8]
NEAR_ONE = [1 - 1e-16, 1 - 1e-9, 1 - 1e-7, 0.99999]
LOGIT = st.one_of(st.floats(-30, 30), st.sampled_from([0.0, 1e4, -1e4, 3e38, -3e38, 65000.0, -65000.0]))


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(
    values=st.lists(LOGIT, min_size=1, max_size=12),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    top_p=st.one_of(st.sampled_from(TINY + NEAR_ONE + [1.0]), st.floats(5e-324, 1.0)),
    min_p=st.one_of(st.sampled_from([0.0] + TINY + NEAR_ONE), st.floats(0.0, 1.0, exclude_max=True)),
    top_k=st.one_of(st.none(), st.integers(1, 14)),
    temperature=st.one_of(st.sampled_from([1e-300, 1e-46, 1e-8, 1.0, 1e30, 1e300]), st.floats(1e-300, 1e300)),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_filter_keeps_the_most_likely_token_and_a_draw_always_has_one(values, dtype, top_p, min_p, top_k, temperature, seed):
    """The nucleus of any p > 0 holds the top token, whatever p rounds to in the logits' dtype
    (1e-46 and 5e-324 are 0 in float32): every filter keeps it, and sample_next always draws a
    token the filters kept, never raising."""
    logits = torch.tensor([values], dtype=torch.float32).clamp(-3e38, 3e38).to(dtype)
    top = int(logits.argmax())
    for kept in (apply_top_p(logits, top_p), apply_min_p(logits, min_p), apply_top_k(logits, top_k)):
        assert kept[0, top] == logits[0, top]
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k)
    tok = int(sample_next(logits, params, torch.Generator().manual_seed(seed))[0])
    assert 0 <= tok < len(values)
    if top_p < 1e-45 or top_k == 1:  # a nucleus of one token: the most likely one after the temperature
        scaled = apply_temperature(logits - logits.max(), min(max(temperature, torch.finfo(dtype).tiny), torch.finfo(dtype).max))
        assert scaled[0, tok] == scaled.max()  # (a huge temperature may tie every token)


@pytest.mark.parametrize("top_p", [1e-46, 5e-324])
def test_the_issue_top_p_values_give_the_greedy_token(top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=0)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    assert torch.equal(sample_rows(logits, [params] * 4, gens), logits.argmax(-1))
