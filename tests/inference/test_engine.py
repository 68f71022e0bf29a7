"""The engine against the recompute reference: every attention variant, greedy and seeded, past
block_size; rows that finish early and rows that join a running batch give exactly the tokens
they give alone; the static cache never changes shape; row bookkeeping and bad input."""

import os
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import BLOCK, PROMPTS, VARIANTS, V, random_model, rel_err

from quillgpt.config import ModelConfig
from quillgpt.errors import QuillError
from quillgpt.inference.engine import Engine, Prompt, RowFailed, Rows
from quillgpt.inference.generate import generate_tokens
from quillgpt.model.gpt import GPT
from quillgpt.quant import quantize
from quillgpt.quant.int8 import Int8Linear
from quillgpt.quant.int8_kernels import KERNELS
from quillgpt.quant.plan import KernelPlan
from quillgpt.sampling_params import SamplingParams

variants = pytest.mark.parametrize("variant", list(VARIANTS))
GREEDY = SamplingParams(max_new_tokens=30)
SEEDED = SamplingParams(max_new_tokens=30, temperature=1.0, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.2, seed=7)


def alone(model, prompt, params, stop_ids=()) -> list[int]:
    """The row's tokens in an engine of its own."""
    engine = Engine(model, 1)
    out = [engine.add(prompt, params, stop_ids)]
    while engine.active_rows():
        out += engine.step()
    assert out[-1].finish is not None and all(t.finish is None for t in out[:-1])
    return [t.token for t in out]


def tokens(model, params, use_cache):
    steps = list(generate_tokens(model, PROMPTS, params=params, use_cache=use_cache))
    return torch.stack(steps, 1).tolist()


@variants
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_engine_equals_recompute_past_block_size(variant, params):
    model = random_model(variant)
    cached = tokens(model, params, use_cache=True)  # 22 + 30 tokens: past block_size (16)
    assert cached == tokens(model, params, use_cache=False)
    assert len({t for row in cached for t in row}) > 5  # not a degenerate loop


def agreement_bound(model, kernel: str) -> float:
    """How far apart (‖Δ‖/‖z‖) the cached and the recompute path's next-token logits z may be
    for the same tokens, one int8 kernel running every input size.

    The two paths run the same arithmetic on different row counts (the decode step: 3 rows; the
    recompute forward: 3 × context rows), so the CPU's matmul blocks their fp32 sums differently
    (AVX2, AVX-512 and AMX builds block differently again): two orders of a length-K sum differ
    by at most 2·K·2⁻²⁴·Σ|xᵢwᵢ| (γ_K each), and Σ|xᵢwᵢ| ≤ √K·‖x‖‖w‖ ≈ √K·|y| for these random
    weights: 2·K^1.5·2⁻²⁴ of a stage's output. A "/bf16" kernel also rounds its input and its
    output to bf16 (8 significant bits, u = 2⁻⁸); values that differ at all may round one bf16
    step apart, a step being at most 2u of the value: up to 4u more per stage.
    A stage is one matmul deep: per block the attention's input projections, its output
    projection, the MLP's input projection(s) and its output projection; then the head:
    S = 4·n_layer + 1. A pre-norm block passes a relative difference of its input on at first
    order unchanged in size (the norm divides the scale out, the residual adds), so the stages'
    differences add: S·(4u + 2·K^1.5·2⁻²⁴): 0.14 for bf16 (2 layers, K = 128), 1.6e-3 for fp32.
    Measured on an AMD EPYC (AVX-512 BF16): 0 for the bf16 kernels, 2e-6 for dequant/model; a
    bug (a wrong position, a stale cache row) moves the logits by about their own size."""
    fan_in = max(m.in_features for m in model.modules() if isinstance(m, Int8Linear))
    u = 2.0**-8 if KERNELS[kernel].bf16 else 0.0
    stages = 4 * model.config.n_layer + 1
    return stages * (4 * u + 2 * fan_in**1.5 * 2.0**-24)


def drawn(model, params, use_cache: bool) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Each prompt's tokens and the raw (V,) logits each was drawn from (row i is prompt i)."""
    logits, real = {}, Rows._draw

    def recording(self, step_logits, rows, first=0):
        for i, r in enumerate(rows):
            if r is not None:
                logits.setdefault(r, []).append(step_logits[i].float().clone())
        return real(self, step_logits, rows, first)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Rows, "_draw", recording)
        toks = tokens(model, params, use_cache)
    assert [len(logits.get(r, ())) for r in range(len(toks))] == [len(row) for row in toks]  # every draw seen
    return toks, [logits[r] for r in range(len(toks))]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kernel", ["int8pack_mm/bf16", "dequant/bf16", "dequant/model"])
@pytest.mark.parametrize("variant", ["mha-learned", "rope-window-gqa", "rmsnorm-swiglu"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_int8_engine_equals_int8_recompute(variant, params, kernel):
    """One kernel for every input size: the decode step (3 rows) and the recompute forward
    (3 × context rows) give the same logits after the same tokens, to the arithmetic's rounding
    (agreement_bound). That is what can be promised, not equal tokens: where two logits tie to
    the rounding (greedy) or a draw falls on the edge between two tokens (seeded), the paths may
    part (an Intel Xeon with AMX parted at token 21). So the logits are compared at every step
    up to and including the first where the tokens differ, after which the rows' inputs differ."""
    model = quantize(random_model(variant), "int8", kernel=kernel)
    bound = agreement_bound(model, kernel)
    cached, cached_logits = drawn(model, params, use_cache=True)
    recomputed, recomputed_logits = drawn(model, params, use_cache=False)
    for row, (a, b) in enumerate(zip(cached, recomputed)):
        parted = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a) - 1)
        for i in range(parted + 1):
            assert rel_err(cached_logits[row][i], recomputed_logits[row][i]) <= bound, (row, i, a[: i + 1], b[: i + 1])
    assert len({t for row in cached for t in row}) > 5


@variants
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_rows_joining_and_leaving_a_running_batch_give_their_tokens_alone(variant, params):
    """Row 1 finishes early; a new prompt takes its slot while rows 0 and 2 keep decoding."""
    model = random_model(variant)
    jobs = [  # (prompt, max_new_tokens, steps of the batch before it joins)
        (PROMPTS[2], 30, 0),
        (PROMPTS[0], 6, 0),
        (PROMPTS[1], 25, 3),
        ([5, 6, 7, 8], 12, 8),
    ]
    jobs = [(p, replace(params, max_new_tokens=n, seed=7 + i), at) for i, (p, n, at) in enumerate(jobs)]
    engine, got, rows = Engine(model, 3), {}, {}
    step = 0
    while len(got) < len(jobs) or engine.active_rows():
        for j, (p, sp, at) in enumerate(jobs):
            if j not in got and at <= step and engine.free_rows():
                t = engine.add(p, sp)
                got[j], rows[t.row] = [t.token], j
        for t in engine.step():
            got[rows[t.row]].append(t.token)
        step += 1
    assert 3 in got and rows  # the late job ran in a reused slot
    for j, (p, sp, _) in enumerate(jobs):
        assert got[j] == alone(model, p, sp), j


# prompts 0 and 1 have 10 tokens, 2 and 3 have 3: two prefills of two rows each
ONE_LENGTH = [PROMPTS[1], [(3 * i + 1) % V for i in range(10)], PROMPTS[0], [2, 7, 1]]


def prefix_model():
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, attention="prefix")).eval()


@pytest.mark.parametrize("variant", ["mha-learned", "rope-window-gqa", "rmsnorm-swiglu", "prefix"])
def test_add_all_prefills_prompts_of_one_length_together_and_each_row_gets_its_tokens_alone(variant, monkeypatch):
    model = prefix_model() if variant == "prefix" else random_model(variant)
    params = [replace(SEEDED, seed=7 + i, max_new_tokens=6) for i in range(len(ONE_LENGTH))]  # a prefix-LM's room
    engine = Engine(model, 5)
    engine.add(PROMPTS[0], replace(GREEDY, max_new_tokens=6))  # row 0 busy: the new rows are 1-4
    prefills, real = [], engine.prefill_rows
    monkeypatch.setattr(engine, "prefill_rows", lambda rs, ids, start=0: prefills.append(list(rs)) or real(rs, ids, start))
    firsts = engine.add_all([Prompt(p, sp) for p, sp in zip(ONE_LENGTH, params)])
    assert prefills == [[1, 2], [3, 4]] and [t.row for t in firsts] == [1, 2, 3, 4]
    got = {t.row: [t.token] for t in firsts}
    while engine.active_rows():
        for t in engine.step():
            if t.row in got:
                got[t.row].append(t.token)
    for r, p, sp in zip(got, ONE_LENGTH, params):
        assert got[r] == alone(model, p, sp), r


def test_add_all_checks_every_prompt_before_claiming_a_row_and_a_failed_prefill_is_its_row_alone(monkeypatch):
    model = random_model()
    engine = Engine(model, 4)
    with pytest.raises(QuillError, match="outside"):
        engine.add_all([Prompt(PROMPTS[0], GREEDY), Prompt([1, V], GREEDY)])
    with pytest.raises(ValueError, match="5 prompts and 4 of 4 rows free"):
        engine.add_all([Prompt(PROMPTS[0], GREEDY)] * 5)
    assert engine.free_rows() == 4
    real, prefills = engine.prefill_rows, []

    def failing(rs, ids, start=0):  # any prefill that holds the last prompt raises
        prefills.append(list(rs))
        if ONE_LENGTH[3] in ids:
            raise RuntimeError("injected prefill failure")
        return real(rs, ids, start)

    monkeypatch.setattr(engine, "prefill_rows", failing)
    firsts = engine.add_all([Prompt(p, GREEDY) for p in ONE_LENGTH])
    assert prefills == [[0, 1], [2, 3], [2], [3]]  # the failed batch again row by row
    assert [t.finish for t in firsts] == [None, None, None, "error"] and isinstance(firsts[3].error, RowFailed)
    assert engine.active_rows() == [0, 1, 2]
    got = [[t.token] for t in firsts[:3]]
    while engine.active_rows():
        for t in engine.step():
            got[t.row].append(t.token)
    assert got == [alone(model, p, GREEDY) for p in ONE_LENGTH[:3]]


def test_stop_ids_finish_a_row_with_its_stop_token():
    model = random_model()
    free = alone(model, PROMPTS[1], GREEDY)
    stop = free[4]
    first = free.index(stop)
    engine = Engine(model, 2)
    engine.add(PROMPTS[0], GREEDY)
    out = [engine.add(PROMPTS[1], GREEDY, stop_ids=[stop])]
    while out[-1].finish is None:
        out.append(next(t for t in engine.step() if t.row == out[0].row))
    assert [t.token for t in out] == free[: first + 1] and out[-1].finish == "eot"  # one finish vocabulary (engine.FINISH_REASONS)
    assert engine.active_rows() == [0] and engine.free_rows() == 1


def test_rows_finish_at_max_new_tokens_and_release_is_idempotent():
    model = random_model("rope")
    engine = Engine(model, 2)
    first = engine.add(PROMPTS[0], SamplingParams(max_new_tokens=1))
    assert first.finish == "length" and engine.active_rows() == []
    engine.add(PROMPTS[0], SamplingParams(max_new_tokens=3))
    r = engine.add(PROMPTS[1], SamplingParams(max_new_tokens=3)).row
    with pytest.raises(ValueError, match="no free row"):
        engine.add(PROMPTS[2], GREEDY)
    engine.release(r)
    engine.release(r)
    assert engine.free_rows() == 1 and engine.active_rows() == [0]
    assert [t.finish for t in engine.step()] == [None]
    assert [t.finish for t in engine.step()] == ["length"] and engine.step() == []


def test_static_cache_keeps_its_buffers_and_shapes():
    model = random_model("rope-window-gqa")
    engine = Engine(model, 2)
    k, shape = [t.data_ptr() for t in engine.cache.k], [t.shape for t in engine.cache.k]
    engine.add(PROMPTS[2], GREEDY)
    for _ in range(2 * BLOCK):
        engine.step()
    assert [t.data_ptr() for t in engine.cache.k] == k and [t.shape for t in engine.cache.k] == shape


def test_bad_input():
    model = random_model()
    engine = Engine(model, 1)
    for prompt, match in (([], "empty"), ([1, V], "outside")):
        with pytest.raises(QuillError, match=match):
            engine.add(prompt, GREEDY)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add([1], {"temperature": 0})
    assert engine.free_rows() == 1
    with pytest.raises(ValueError, match="eval"):
        Engine(model.train(), 1)


def test_learned_positions_past_block_size_refuse_a_cache_forward_clearly():
    model = random_model()
    cache = model.make_cache(1)
    model(torch.zeros(1, BLOCK, dtype=torch.long), pos=torch.arange(BLOCK), cache=cache)
    with pytest.raises(ValueError, match="past block_size 16.*crop the context"):
        model(torch.zeros(1, 1, dtype=torch.long), pos=torch.tensor([BLOCK]), cache=cache)


def test_too_many_rows_for_memory_is_one_clear_line():
    model = random_model()
    with pytest.raises(QuillError, match=r"KV cache for 1000000000000 row\(s\) needs .* GiB.*--num-samples"):
        Engine(model, 10**12, memory_fix="generate fewer rows at once (--num-samples)")
    with pytest.raises(QuillError, match=r"needs .* GiB.*: make fewer rows at once"):
        Engine(model, 10**12)  # the library's own words name no flag


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_huge_max_new_tokens_allocates_nothing_by_count(use_cache):
    """-n 10**11 must start at once (bounded buffers), not reserve memory for 10**11 tokens."""
    steps = generate_tokens(random_model("rope"), PROMPTS, 10**11, use_cache=use_cache)
    first = [next(steps) for _ in range(3)]
    steps.close()
    assert all(t.shape == (3,) for t in first)


@pytest.mark.skipif(
    not os.environ.get("QUILL_TEST_COMPILE"),
    reason="torch.compile takes ~1 min on CPU: set QUILL_TEST_COMPILE=1 (scripts/bench.py --suite sample checks it at the bench shape)",
)
@pytest.mark.parametrize("variant", ["mha-learned", "rope-window-gqa", "int8-channel", "int8", "int4"])
def test_compiled_decode_equals_eager(variant):
    if variant.startswith("int"):  # int8: compiled, grouped_sum in fp32, as the fp32 dequantized kernel
        kernel = {"int8-channel": "int8pack_mm/bf16", "int8": "dequant/model"}.get(variant)
        model = quantize(random_model(), variant, kernel=kernel)
    else:
        model = random_model(variant)
    params = replace(GREEDY, max_new_tokens=100)
    eager = torch.stack(list(generate_tokens(model, PROMPTS, params=params, compile=False)), 1)
    compiled = torch.stack(list(generate_tokens(model, PROMPTS, params=params, compile=True)), 1)
    assert torch.equal(compiled, eager)
    engine = Engine(model, 1, compile=True)
    engine.add(PROMPTS[0], replace(GREEDY, max_new_tokens=3))
    engine.step()
    assert engine.compiled and engine.compile_s > 0  # the first call's time: compiling (the stats line's)


def test_a_step_runs_the_rows_up_to_the_last_busy_one_and_each_row_decodes_as_alone(monkeypatch):
    """One request on a many-row engine (a server's) costs a one-row step, not max_rows: the step
    runs rows 0..last busy; rows joining and leaving keep their tokens (each as it decodes alone)."""
    model = random_model("rope-window-gqa")
    params = replace(GREEDY, max_new_tokens=8, repetition_penalty=1.3)
    alone = [torch.stack(list(generate_tokens(model, [p], params=params)))[:, 0].tolist() for p in PROMPTS[:2]]
    engine, widths = Engine(model, 8), []
    decode = model.decode
    monkeypatch.setattr(model, "decode", lambda idx, *a, **k: widths.append(len(idx)) or decode(idx, *a, **k))
    got = {0: [engine.add(PROMPTS[0], params).token]}
    got[0] += [t.token for t in engine.step()]
    got[1] = [engine.add(PROMPTS[1], params).token]
    for _ in range(7):
        for t in engine.step():
            got[t.row].append(t.token)
    assert widths == [1] + [2] * 7  # after row 0 ends (its 8th token) row 1 is alone, in row 1: still 2 rows
    assert got == {0: alone[0], 1: alone[1]}


def test_warm_compiles_a_graph_per_width_before_any_row_and_rows_decode_as_eager():
    """Engine.warm (quill serve --compile compiles before it listens): a graph for each power-of-two
    width up to max_rows, so rows' steps compile nothing and run the narrowest graph that holds them;
    their tokens are the eager engine's (warm's steps over idle rows leave no trace); a busy engine
    refuses to warm; an eager one has nothing to warm."""
    model = random_model("rope-window-gqa")
    params = replace(GREEDY, max_new_tokens=12)
    assert Engine(model, 3).warm() == 0.0
    engine = Engine(model, 3, compile=True)
    compile_s = engine.warm()
    assert compile_s > 0 and engine._compiled_widths == {1, 2, 3} and engine.warm() == compile_s
    tokens = {0: [engine.add(PROMPTS[0], params).token]}
    tokens[0] += [t.token for t in engine.step()]  # one row: the one-row graph
    tokens[1] = [engine.add(PROMPTS[1], params).token]
    for _ in range(10):
        for t in engine.step():
            tokens[t.row].append(t.token)
    assert engine.compile_s == compile_s  # the rows' steps ran warm graphs
    eager = torch.stack(list(generate_tokens(model, PROMPTS[:2], params=params)), 1).tolist()
    assert tokens[0] == eager[0] and tokens[1] == eager[1][:11]
    with pytest.raises(RuntimeError, match="every row idle"):
        _busy(model, params).warm()


def _busy(model: GPT, params: SamplingParams) -> Engine:
    engine = Engine(model, 1, compile=True)
    engine.add(PROMPTS[0], params)
    return engine


RECIPE_OPTIONS = {"relu2-qknorm-softcap-rope": {"mlp": "relu2", "qk_norm": True, "logit_softcap": 5.0, "pos": "rope"}}


@pytest.mark.parametrize("variant", [*VARIANTS, *RECIPE_OPTIONS])
@pytest.mark.parametrize("all_slots", [False, True], ids=["filled-slots", "all-slots"])
def test_decode_step_gives_the_forward_logits(variant, all_slots):
    """GPT.decode (the lean one-token path the engine runs: Block.decode, no nn.Module calls)
    against the plain full forward, position by position, past a sliding window's ring."""
    torch.manual_seed(0)
    options = {**VARIANTS, **RECIPE_OPTIONS}[variant]
    model = GPT(ModelConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32, **options))
    with torch.no_grad():  # decisive weights, as random_model
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name or ".ln_" in name else 0.0, 0.3 if p.dim() > 1 else 0.1)
    model.eval()
    ids = torch.randint(0, V, (2, BLOCK))
    with torch.no_grad():
        full, _ = model(ids, all_logits=True)  # (2, BLOCK, V)
        cache = model.make_cache(2)
        model(ids[:, :6], pos=torch.arange(6), cache=cache)
        for t in range(6, BLOCK):
            n_keys = None if all_slots else min(cache.capacity, t + 1)
            got = model.decode(ids[:, t], torch.full((2,), t), cache, n_keys)  # (2, V)
            torch.testing.assert_close(got, full[:, t], atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", ["mha-learned", "rope-window-gqa"])
def test_int8_decode_step_gives_the_int8_forward_logits_whichever_kernels_run(variant):
    """A measured plan may run the one-row decode step and a long forward through different
    kernels (int8pack_mm, dequantize + bf16 matmul): their logits agree to bf16 rounding."""
    model = random_model(variant)
    quantize(model, "int8", kernel="dequant/model")
    plan = KernelPlan((2, 64), ("int8pack_mm/bf16", "dequant/bf16"))
    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.plan = plan
    ids = torch.randint(0, V, (2, BLOCK))
    with torch.no_grad():
        full, _ = model(ids, all_logits=True)  # (2, BLOCK, V): 32 rows, dequant/bf16
        cache = model.make_cache(2)
        model(ids[:, :6], pos=torch.arange(6), cache=cache)
        for t in range(6, BLOCK):
            got = model.decode(ids[:, t], torch.full((2,), t), cache)  # (2, V): 2 rows, int8pack_mm
            torch.testing.assert_close(got, full[:, t], atol=0.03 * full[:, t].abs().max().item(), rtol=0)


@pytest.mark.parametrize("variant", ["mha-learned", "window", "rope-window-gqa", "rmsnorm-swiglu"])
def test_decode_without_a_mask_equals_the_masked_step_when_rows_share_a_length(variant):
    """Rows of one length hold the same latest positions (a ring once past a window), all visible
    to their new token: the engine then skips the mask (masked=False); the logits are the same."""
    model = random_model(variant)
    ids = torch.randint(0, V, (2, BLOCK))
    with torch.no_grad():
        caches = [model.make_cache(2), model.make_cache(2)]
        for cache in caches:
            model(ids[:, :3], pos=torch.arange(3), cache=cache)
        for t in range(3, BLOCK):
            n_keys = min(caches[0].capacity, t + 1)
            pos = torch.full((2,), t)
            masked = model.decode(ids[:, t], pos, caches[0], n_keys)
            unmasked = model.decode(ids[:, t], pos, caches[1], n_keys, masked=False)
            torch.testing.assert_close(unmasked, masked, atol=1e-5, rtol=1e-5)


# --- a failing row is that row's failure -------------------------------------------------------

HOSTILE = [
    GREEDY,
    SEEDED,
    SamplingParams(max_new_tokens=30, temperature=1.0, top_p=1e-46, seed=3),
    SamplingParams(max_new_tokens=30, temperature=1e-300, top_p=5e-324, min_p=1 - 1e-16, top_k=1, seed=4),
]


class Faults:
    """Wraps an engine's forwards: the next prefill or step raises, or gives one row NaN logits."""

    def __init__(self, engine):
        self.prefill, self.step = None, None  # "raise", or ("nan", row) / "nan" (the prefill's row)
        first, shared = engine._first_logits, engine._step_logits

        def first_logits(rs, rows, ids):
            fault, self.prefill = self.prefill, None
            if fault == "raise":
                raise RuntimeError("injected prefill failure")
            logits = first(rs, rows, ids)
            return logits * float("nan") if fault == "nan" else logits

        def step_logits(active, width):
            fault, self.step = self.step, None
            if fault == "raise":
                raise RuntimeError("injected decode failure")
            logits = shared(active, width)
            if fault is not None and fault[1] < width:  # (a row past the step's width is idle: no logits)
                logits = logits.clone()
                logits[fault[1]] = float("inf") if fault[1] % 2 else float("nan")
            return logits

        engine._first_logits, engine._step_logits = first_logits, step_logits


JOB = st.tuples(
    st.integers(0, len(PROMPTS) - 1),
    st.integers(0, len(HOSTILE) - 1),
    st.integers(1, 8),
    st.integers(0, 6),
    st.sampled_from([None, None, "raise", "nan"]),
)
STEP_FAULT = st.tuples(st.integers(0, 12), st.sampled_from(["raise", "nan"]), st.integers(0, 4))


@settings(max_examples=25, deadline=None, database=None, derandomize=True)
@given(
    jobs=st.lists(JOB, min_size=1, max_size=5),
    step_faults=st.lists(STEP_FAULT, max_size=3),
    use_cache=st.booleans(),
    variant=st.sampled_from(["mha-learned", "rope", "infini"]),
    rows=st.integers(1, 3),
)
def test_a_failing_row_never_touches_the_others_or_later_rows(jobs, step_faults, use_cache, variant, rows):
    """Rows join a running batch with hostile settings (top_p below float32's smallest value...);
    prefills raise or give NaN, steps raise or give one row NaN/inf logits. A failed row ends
    (RowFailed, or finish "error") and is released; every other row gets its tokens alone, and
    the engine serves a new row afterwards as if nothing had happened."""
    from quillgpt.inference.generate import make_engine

    model = infini_model() if variant == "infini" else random_model(variant)
    solo = lambda p, sp: alone_in(make_engine(model, 1, use_cache), p, sp)  # noqa: E731
    engine = make_engine(model, rows, use_cache)
    faults = Faults(engine)
    plan = [(PROMPTS[p], replace(HOSTILE[h], max_new_tokens=n), at, fault) for p, h, n, at, fault in jobs]
    got, failed, slot_of, waiting = {}, set(), {}, list(range(len(plan)))
    for step in range(40):
        for j in [j for j in waiting if plan[j][2] <= step]:
            if not engine.free_rows():
                break
            waiting.remove(j)
            faults.prefill = plan[j][3]
            if plan[j][3] is not None:
                with pytest.raises(RowFailed):
                    engine.add(plan[j][0], plan[j][1])
                failed.add(j)
                continue
            t = engine.add(plan[j][0], plan[j][1])
            got[j] = [t.token]
            if t.finish is None:
                slot_of[t.row] = j
        for at, kind, which in step_faults:
            if at == step and slot_of:
                faults.step = "raise" if kind == "raise" else ("nan", sorted(slot_of)[which % len(slot_of)])
        expect_failed = set(slot_of.values()) if faults.step == "raise" else ({slot_of[faults.step[1]]} if faults.step else set())
        for t in engine.step():
            j = slot_of[t.row]
            if t.finish == "error":
                assert j in expect_failed and isinstance(t.error, RowFailed) and t.token == -1
                failed.add(j)
                del got[j]
            else:
                assert j not in expect_failed
                got[j].append(t.token)
            if t.finish is not None:
                del slot_of[t.row]
        assert sorted(slot_of) == engine.active_rows() and engine.free_rows() == rows - len(slot_of)
        if not waiting and not slot_of:
            break
    assert not waiting and engine.free_rows() == rows
    for j, tokens in got.items():
        assert j not in failed and tokens == solo(plan[j][0], plan[j][1]), j
    after = engine.add(PROMPTS[2], SEEDED)  # the engine goes on: a new row gets its tokens alone
    out = [after.token]
    while engine.active_rows():
        out += [t.token for t in engine.step()]
    assert out == solo(PROMPTS[2], SEEDED)


def infini_model():
    """Infini-attention (no static cache: the engine steps its rows one by one)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32, attention="infini", segment_size=4)
    return GPT(cfg).eval()


def alone_in(engine, prompt, params) -> list[int]:
    out = [engine.add(prompt, params)]
    while engine.active_rows():
        out += engine.step()
    return [t.token for t in out]


# --- on CUDA (pytest -m cuda; skipped without a GPU) ------------------------------------------


@pytest.fixture
def no_tf32(monkeypatch):
    """fp32 matmuls in full fp32 (train() switches TF32 on for the whole process)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["mha-learned", "rope-window-gqa", "rmsnorm-swiglu"])
def test_cuda_cached_logits_equal_recompute(variant, dtype, no_tf32):
    """On CUDA, a prompt's prefill and then one-token decode steps over the static cache give the
    logits the full forward (what recompute runs) gives at every position, past a window's ring:
    to rounding in fp32, to bf16's rounding (‖Δ‖/‖ref‖ < 1e-2) with bf16 weights and cache."""
    model = random_model(variant).to("cuda", dtype)
    ids = torch.randint(0, V, (2, BLOCK), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        full, _ = model(ids, all_logits=True)  # (2, BLOCK, V)
        cache = model.make_cache(2)
        prefill, _ = model(ids[:, :6], pos=torch.arange(6, device="cuda"), cache=cache, all_logits=True)
        steps = [model.decode(ids[:, t], torch.full((2,), t, device="cuda"), cache) for t in range(6, BLOCK)]
    cached = torch.cat([prefill, torch.stack(steps, 1)], 1)
    assert rel_err(cached, full) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["mha-learned", "rope-window-gqa"])
def test_cuda_compiled_decode_equals_eager(variant, no_tf32):
    """The compiled decode step on CUDA (torch.compile mode reduce-overhead: CUDA graphs) gives
    the eager engine's greedy tokens, past block_size."""
    model = random_model(variant).cuda()
    params = replace(GREEDY, max_new_tokens=40)
    eager = torch.stack(list(generate_tokens(model, PROMPTS, params=params, compile=False)), 1)
    compiled = torch.stack(list(generate_tokens(model, PROMPTS, params=params, compile=True)), 1)
    assert compiled.device.type == "cuda"
    assert torch.equal(compiled, eager)


GEMMA3 = dict(pos="rope", norm="rmsnorm", bias=False, qk_norm=True, n_kv_head=2, head_dim=16, mlp="geglu", embed_scale=True)
GEMMA3.update(sandwich_norm=True, attn_scale=0.25, window=5, global_every=3, local_rope_theta=100.0, n_layer=4, tie_embeddings=False)


def gemma_shaped_model() -> GPT:
    """A tiny Gemma 3 (every feature of its layers; its head untied: a tied one, random, repeats the
    last token), with support.random_model's decisive weights."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=V, block_size=BLOCK, n_head=4, n_embd=32, **GEMMA3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0, 0.3 if p.dim() > 1 else 0.1)
    return model.eval()


@pytest.mark.parametrize("scheme", [None, "int8"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_gemma_shaped_model_decodes_op_by_op_as_recompute_and_says_so(params, scheme):
    """Past block_size, 5-position windows on layers 0, 1, 3 and a global layer 2: the cached
    decode (which the native step declines: it falls back to GPT.decode) = recompute; a quantized
    model's stats line names the features the native step lacks."""
    from quillgpt.inference.native_decoder import step_note

    model = gemma_shaped_model() if scheme is None else quantize(gemma_shaped_model(), scheme, kernel="dequant/model")
    cached = tokens(model, params, use_cache=True)
    assert cached == tokens(model, params, use_cache=False)
    assert len({t for row in cached for t in row}) > 5
    decoder = Engine(model, 1).decoder
    assert not decoder.native
    note = step_note(decoder)
    assert note == "" if scheme is None else "decode step op by op (the native one lacks model.mlp=geglu, model.sandwich_norm" in note


@pytest.mark.parametrize(
    "feature",
    [dict(mlp="geglu"), dict(sandwich_norm=True), dict(embed_scale=True), dict(attn_scale=0.3), dict(window=8, global_every=2)],
    ids=["geglu", "sandwich_norm", "embed_scale", "attn_scale", "global_every"],
)
def test_the_native_step_declines_each_gemma_feature_and_the_model_runs_op_by_op(feature):
    """A Llama-shaped int8 model whose step runs natively stops doing so with any one of Gemma's
    features (decode_block computes none of them), and the stats line says which."""
    from quillgpt import native
    from quillgpt.inference.native_decoder import Decoder, step_note

    if not native.available():
        pytest.skip(f"group_gemv did not build here: {native.why_not()}")
    llama = dict(n_layer=2, n_embd=128, block_size=64, vocab_size=97, norm="rmsnorm", mlp="swiglu", pos="rope", n_head=4, bias=False)
    plain = quantize(GPT(ModelConfig(**llama)).eval(), "int8", kernel="group_gemv")
    assert Decoder(plain).native and step_note(Decoder(plain)) == ""
    gemma = quantize(GPT(ModelConfig(**{**llama, **feature})).eval(), "int8", kernel="group_gemv")
    decoder = Decoder(gemma)
    assert not decoder.native and f"model.{list(feature)[-1]}" in step_note(decoder)
    pos = torch.tensor([3, 9])
    cache = gemma.make_cache(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(
            decoder(torch.tensor([5, 6]), pos, cache), gemma.decode(torch.tensor([5, 6]), pos, gemma.make_cache(2, 64))
        )
