"""The prompt cache: the structure alone (LRU order, the byte bound, the longest prefix, nothing
on a different id), then in the engine: a prompt whose prefix is cached continues exactly as with
the cache off (greedy, fp32, every attention variant; prompts sharing a system prompt, a second
turn extending the first's prompt and reply; int8 rows), prefilling only the rest; rows added
together (a burst sharing a system prompt) read what the first of them left, identical prompts
still in one forward, logprob rows bit for bit; the models and rows whose KV cannot be reused are
left alone, and say so."""

import pytest
import torch
from support import V, random_model

from quillgpt import native
from quillgpt.config import ModelConfig
from quillgpt.inference.engine import SHARED_MIN, Engine, Prompt, RowFailed, RowToken
from quillgpt.inference.prompt_cache import ID_BYTES, PromptCache, as_ids, common_prefix, default_budget
from quillgpt.model.gpt import GPT
from quillgpt.quant import quantize
from quillgpt.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=3)
SYSTEM = [(5 * i + 3) % V for i in range(5)]  # a "system prompt" every conversation starts with
LONG = [(3 * i + 1) % V for i in range(SHARED_MIN + 1)]  # one long enough for a burst's rows to wait for


def kv(n: int, value: float = 0.0) -> torch.Tensor:
    """An entry's KV of n positions: 2 layers, 1 head of 4 (2·2·4·4 = 64 bytes a position)."""
    return torch.full((2, 2, 1, n, 4), value)


def entry_bytes(n: int) -> int:
    return n * (64 + ID_BYTES)


# --- the structure ------------------------------------------------------------------------------


def test_common_prefix():
    def common(a, b):
        return common_prefix(as_ids(a), as_ids(b))

    assert common([1, 2, 3], [1, 2, 4]) == 2
    assert common([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common([5], [1, 2]) == 0
    assert common([], [1]) == 0
    assert common(range(1000), [*range(999), 7]) == 999


def test_lookup_finds_the_longest_shared_prefix_and_never_matches_past_a_different_id():
    cache = PromptCache(budget=10**6)
    cache.insert([1, 2, 3, 4], kv(4, 1.0))
    cache.insert([1, 2, 9], kv(3, 2.0))
    entry, n = cache.lookup([1, 2, 3, 4, 5])
    assert n == 4 and entry.ids.tolist() == [1, 2, 3, 4]
    entry, n = cache.lookup([1, 2, 9, 9])
    assert n == 3 and float(entry.kv[0, 0, 0, 0, 0]) == 2.0
    assert cache.lookup([1, 2, 3, 4, 5], most=2)[1] == 2  # the engine keeps the last token to run
    assert cache.lookup([2, 2, 3, 4]) == (None, 0)  # a different first id: nothing
    assert cache.stats.lookups == 4 and cache.stats.hits == 3 and cache.stats.cached_tokens == 4 + 3 + 2


def test_an_entry_that_extends_another_replaces_it_and_a_covered_one_is_not_stored_twice():
    cache = PromptCache(budget=10**6)
    cache.insert([1, 2], kv(2))
    cache.insert([1, 2, 3, 4], kv(4))  # turn 2's prompt + reply starts with turn 1's
    assert len(cache) == 1 and cache.nbytes == entry_bytes(4)
    assert cache.covers([1, 2, 3]) and not cache.covers([1, 2, 5])


def test_lru_eviction_keeps_the_byte_budget():
    cache = PromptCache(budget=entry_bytes(10))
    cache.insert([1] * 4, kv(4))
    cache.insert([2] * 4, kv(4))
    cache.lookup([1, 1, 1, 1, 7])  # [1]*4 is now the most recently used
    cache.insert([3] * 4, kv(4))  # 12 positions > 10: the least recently used ([2]*4) goes
    assert cache.lookup([2, 2, 2, 2])[0] is None and cache.lookup([1, 1, 1, 1])[1] == 4
    assert cache.nbytes == entry_bytes(8) <= cache.budget and cache.stats.evictions == 1
    assert not cache.insert([4] * 11, kv(11))  # larger than the whole budget: refused, nothing evicted
    assert len(cache) == 2


def test_the_entry_count_is_bounded_too():
    cache = PromptCache(budget=10**9, max_entries=3)
    for t in range(5):
        cache.insert([t], kv(1))
    assert len(cache) == 3 and cache.lookup([0])[0] is None and cache.lookup([4])[1] == 1


def test_an_entrys_kv_must_match_its_ids():
    with pytest.raises(ValueError, match="3 positions for 2 ids"):
        PromptCache(budget=10**6).insert([1, 2], kv(3))


def test_the_default_budget_is_64k_tokens_or_a_quarter_of_the_free_memory():
    assert default_budget(1000, None) == 65_536 * (1000 + ID_BYTES)
    assert default_budget(1000, 4 * 10**6) == 10**6


# --- in the engine ------------------------------------------------------------------------------


def run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """A row's tokens alone in `engine`, and how many of its prompt's tokens came from the cache."""
    out = [engine.add(prompt, params)]
    while engine.active_rows():
        out += engine.step()
    return [t.token for t in out], out[0].cached


def conversation(engine: Engine) -> list[tuple[list[int], int, int]]:
    """Prompts sharing SYSTEM then differing, and a second and third turn each extending the turn
    before (its prompt, its reply, a new message; within block_size): (tokens, cached, tokens
    prefilled) of each."""
    prompts = [SYSTEM + [1, 2, 3], SYSTEM + [4, 5], SYSTEM + [1, 2, 3, 9]]
    out = []
    for p in prompts:
        before = engine.prefilled
        toks, cached = run(engine, p)
        out.append((toks, cached, engine.prefilled - before))
    turn, reply = prompts[1], out[1][0]
    for message in ([7], [9]):
        turn = turn + reply + message
        before = engine.prefilled
        reply, cached = run(engine, turn)
        out.append((reply, cached, engine.prefilled - before))
    return out


@pytest.mark.parametrize("variant", ["mha-learned", "gqa", "mqa", "rope", "rmsnorm-swiglu"])
def test_a_cached_prefix_continues_exactly_as_uncached_prefilling_only_the_rest(variant):
    model = random_model(variant)
    off = conversation(Engine(model, 2))
    on_engine = Engine(model, 2, prompt_cache=10**6)
    on = conversation(on_engine)
    assert [t for t, _, _ in on] == [t for t, _, _ in off]
    assert [c for _, c, _ in off] == [0] * 5
    cached = [c for _, c, _ in on]
    assert cached[:3] == [0, len(SYSTEM), len(SYSTEM) + 3]  # the shared system prompt, then the longer match
    # the turn before's prompt and reply but its last token (drawn, never run)
    assert cached[3:] == [len(SYSTEM) + 2 + 2, len(SYSTEM) + 2 + 3 + 1 + 2]
    for (_, c, prefilled), (_, _, whole) in zip(on, off):
        assert prefilled == whole - c  # only the suffix ran
    stats = on_engine.prompt_cache.stats
    assert stats.hits == 4 and stats.cached_tokens == sum(cached)
    assert on_engine.prompt_cache.nbytes <= on_engine.prompt_cache.budget


def together(engine: Engine, prompts: list[Prompt]) -> tuple[list[RowToken], list[list[RowToken]]]:
    """Prompts added in one add_all and run to their end: their first RowTokens and each one's tokens."""
    firsts = engine.add_all(prompts)
    out = {f.row: [f] for f in firsts}
    while engine.active_rows():
        for t in engine.step():
            out[t.row].append(t)
    return firsts, [out[f.row] for f in firsts]


def tokens(rows: list[list[RowToken]]) -> list[list[int]]:
    return [[t.token for t in row] for row in rows]


def test_rows_in_one_batch_each_get_their_own_prefix():
    model = random_model("rope")
    engine = Engine(model, 3, prompt_cache=10**6)
    run(engine, SYSTEM + [1, 2])
    prompts = [SYSTEM + [1, 2, 5], SYSTEM + [3], [4, 4, 4]]
    firsts, out = together(engine, [Prompt(p, GREEDY) for p in prompts])
    assert [f.cached for f in firsts] == [len(SYSTEM) + 2, len(SYSTEM), 0]
    assert tokens(out) == [run(Engine(model, 1), p)[0] for p in prompts]


# a burst: users sharing a system prompt of SHARED_MIN tokens or more arrive at once (distinct
# endings, by their first id; the 2nd and 4th are one prompt, as a request's n choices)
BURST = [LONG + e for e in ([2], [5, 6], [8, 9, 10], [5, 6])]


def prefill_sizes(engine: Engine, monkeypatch) -> list[int]:
    """The rows of each prefill forward the engine runs from now on."""
    sizes, prefill_rows = [], engine.prefill_rows
    monkeypatch.setattr(engine, "prefill_rows", lambda rs, ids, start=0: sizes.append(len(rs)) or prefill_rows(rs, ids, start))
    return sizes


def check_burst(model: GPT, monkeypatch) -> None:
    """BURST in one add_all on a cold cache: the first prompt prefills whole, then the others read
    the system prompt it left and prefill only their endings (the identical two in one forward);
    every row's tokens are those of its prompt alone without a cache."""
    engine = Engine(model, len(BURST), prompt_cache=10**6)
    sizes = prefill_sizes(engine, monkeypatch)
    firsts, out = together(engine, [Prompt(p, GREEDY) for p in BURST])
    assert tokens(out) == [run(Engine(model, 1), p)[0] for p in BURST]
    assert [f.cached for f in firsts] == [0] + [len(LONG)] * 3
    assert engine.prefilled == len(LONG) + sum(len(p) - len(LONG) for p in BURST)  # the system prompt ran once
    assert sizes == [1, 2, 1]  # the first prompt; the identical two together; the third


@pytest.mark.parametrize("variant", ["mha-learned", "gqa", "mqa", "rope", "rmsnorm-swiglu"])
def test_rows_added_together_read_the_prefix_an_earlier_one_of_them_left(variant, monkeypatch):
    check_burst(random_model(variant), monkeypatch)


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_a_burst_past_a_sliding_window_waits_for_no_entry(pos, monkeypatch):
    """A window of SHARED_MIN + 1 keys, which each prompt of the burst shares: the ring overwrites
    a longer prompt's first keys, so it leaves no entry, and the rows prefill at once as without
    the cache."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=V, block_size=16, n_layer=2, n_head=2, n_embd=16, window=SHARED_MIN + 1, pos=pos)
    model = GPT(config).eval()
    engine = Engine(model, len(BURST), prompt_cache=10**6)
    rounds, ready = [], engine._ready
    monkeypatch.setattr(engine, "_ready", lambda claimed, waiting: rounds.append(len(waiting)) or ready(claimed, waiting))
    firsts, out = together(engine, [Prompt(p, GREEDY) for p in BURST])
    assert rounds == [len(BURST)] and [f.cached for f in firsts] == [0] * len(BURST)
    assert tokens(out) == [run(Engine(model, 1), p)[0] for p in BURST]


def test_a_burst_with_logprob_rows_keeps_their_logprobs_bit_for_bit(monkeypatch):
    """Rows asking for logprobs read nothing and never wait (they lead: the others read what they leave)."""
    model = random_model("rope")
    prompts = [Prompt(BURST[0], GREEDY, logprobs=3), Prompt(BURST[1], GREEDY, logprobs=3), Prompt(BURST[2], GREEDY)]
    engine = Engine(model, 3, prompt_cache=10**6)
    sizes = prefill_sizes(engine, monkeypatch)
    firsts, out = together(engine, prompts)
    _, plain = together(Engine(model, 3), prompts)  # the cache off
    assert tokens(out) == tokens(plain) and [f.cached for f in firsts] == [0, 0, len(LONG)]
    assert sizes == [1, 1, 1]  # the logprob rows first (two lengths), then the third after a lookup
    for p, row, plain_row in zip(prompts[:2], out, plain):
        assert [t.logprob for t in row] == [t.logprob for t in plain_row]  # every token's, bit for bit
        assert row[0].logprob == Engine(model, 1).add(p.ids, GREEDY, logprobs=3).logprob  # as alone


def test_a_failed_prefill_in_a_burst_fails_its_row_alone_and_a_retried_group_reads_anew(monkeypatch):
    """The first prompt's prefill raises: it fails alone and leaves nothing; the identical two
    then prefill whole together, which raises once after writing their rows, and again one by one;
    the third reads the system prompt they left."""
    model = random_model("rope")
    engine = Engine(model, len(BURST), prompt_cache=10**6)
    calls, prefill_rows = [], engine.prefill_rows

    def flaky(rs, ids, start=0):
        calls.append(len(rs))
        if len(calls) == 1:
            raise RuntimeError("a forward that raises")
        logits = prefill_rows(rs, ids, start)
        if len(rs) > 1 and calls.count(len(rs)) == 1:
            raise RuntimeError("a batched forward that raises once it has written its rows")
        return logits

    monkeypatch.setattr(engine, "prefill_rows", flaky)
    firsts, out = together(engine, [Prompt(p, GREEDY) for p in BURST])
    assert firsts[0].finish == "error" and calls == [1, 2, 1, 1, 1]
    assert tokens(out[1:]) == [run(Engine(model, 1), p)[0] for p in BURST[1:]]
    assert [f.cached for f in firsts[1:]] == [0, len(LONG), 0]
    assert engine.free_rows() == len(BURST)


def quantized_model(scheme: str) -> GPT:
    """A GQA RoPE model quantized to `scheme`, whose decode step runs natively over a float16 cache."""
    torch.manual_seed(0)
    shape = dict(norm="rmsnorm", mlp="swiglu", pos="rope", n_head=4, n_kv_head=2, bias=False)
    model = GPT(ModelConfig(n_layer=2, n_embd=128, block_size=64, vocab_size=V, **shape)).eval()
    return quantize(model, scheme, kernel=None if scheme == "int4" else "group_gemv")


@pytest.mark.skipif(not native.available(), reason=f"group_gemv did not build here: {native.why_not()}")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_rows_of_the_native_step_read_their_float16_cache_alike(scheme):
    """The native decode step's float16 KV cache: an entry holds its float16 keys, which a suffix
    prefill attends over as every decode step does (an uncached prefill attends over its own
    float32 keys): the same greedy tokens here; logits may differ by float16 rounding."""
    model = quantized_model(scheme)
    engine = Engine(model, 2, prompt_cache=10**6)
    assert engine.decoder.native and engine.cache_dtype == torch.float16
    on = conversation(engine)
    assert [t for t, _, _ in on] == [t for t, _, _ in conversation(Engine(model, 2))]
    assert sum(c for _, c, _ in on) > 0 and engine.prompt_cache.nbytes > 0


@pytest.mark.skipif(not native.available(), reason=f"group_gemv did not build here: {native.why_not()}")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_rows_added_together_read_each_others_prefix_alike(scheme, monkeypatch):
    check_burst(quantized_model(scheme), monkeypatch)


def test_a_row_asking_for_logprobs_reads_nothing_so_they_stay_bit_for_bit():
    model = random_model("rope")
    engine = Engine(model, 1, prompt_cache=10**6)
    run(engine, SYSTEM + [1, 2])
    plain = Engine(model, 1).add(SYSTEM + [1, 2, 3], GREEDY, logprobs=3)
    first = engine.add(SYSTEM + [1, 2, 3], GREEDY, logprobs=3)
    assert first.cached == 0 and first.logprob == plain.logprob
    engine.release(first.row)
    assert engine.add(SYSTEM + [1, 2, 3, 4], GREEDY).cached > 0  # and it left its KV


def test_a_budget_smaller_than_a_row_keeps_the_start_that_fits():
    model = random_model("rope")
    per_token = 2 * model.config.n_layer * model.config.kv_heads * model.config.head_size * 4 + ID_BYTES
    engine = Engine(model, 1, prompt_cache=5 * per_token)
    run(engine, SYSTEM + [1, 2])
    assert engine.prompt_cache.nbytes <= 5 * per_token
    assert run(engine, SYSTEM + [3])[1] == 5


@pytest.mark.parametrize("variant", ["window", "rope-window-gqa"])
def test_rows_past_a_sliding_window_leave_nothing_behind(variant):
    """The ring of a window's keys has overwritten the row's first positions: nothing to keep."""
    model = random_model(variant)
    engine = Engine(model, 1, prompt_cache=10**6)
    tokens, cached = run(engine, SYSTEM + [1, 2])
    assert cached == 0 and len(engine.prompt_cache) == 0
    assert tokens == run(Engine(model, 1), SYSTEM + [1, 2])[0]


def test_a_learned_position_row_past_block_size_leaves_nothing_and_a_cropped_prompt_reads_nothing():
    model = random_model("mha-learned")
    engine = Engine(model, 1, prompt_cache=10**6)
    run(engine, SYSTEM + [1, 2], SamplingParams(max_new_tokens=12))  # 7 + 12 > block_size 16: refilled
    cfg = model.config
    per_token = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_size * 4 + ID_BYTES
    assert len(engine.prompt_cache) == 1 and engine.prompt_cache.covers(SYSTEM + [1, 2])  # the prompt, from its prefill
    assert engine.prompt_cache.nbytes == 7 * per_token
    long = SYSTEM + [1, 2] + list(range(10))  # 17 > 16: cropped to its last 16 tokens
    assert run(engine, long)[1] == 0


def test_a_failed_row_leaves_nothing(monkeypatch):
    model = random_model("rope")
    engine = Engine(model, 1, prompt_cache=10**6)
    monkeypatch.setattr(engine, "prefill_rows", lambda *a, **k: torch.full((1, V), float("nan")))
    with pytest.raises(RowFailed):
        engine.add(SYSTEM, GREEDY)
    assert len(engine.prompt_cache) == 0 and engine.free_rows() == 1


@pytest.mark.parametrize(
    "settings, why",
    [({"attention": "prefix"}, "prefix-LM"), ({"attention": "infini", "segment_size": 4}, "memory of its own")],
)
def test_models_whose_keys_cannot_be_reused_have_no_prompt_cache_and_say_why(settings, why):
    model = GPT(ModelConfig(vocab_size=V, block_size=16, n_layer=1, n_head=2, n_embd=16, **settings)).eval()
    engine = Engine(model, 1, prompt_cache=None)
    assert engine.prompt_cache is None and why in engine.prompt_cache_summary()["note"]


def test_off_by_default_in_the_engine_and_a_summary_either_way():
    model = random_model()
    assert Engine(model, 1).prompt_cache_summary() == {"enabled": False, "note": "off"}
    summary = Engine(model, 1, prompt_cache=10**6).prompt_cache_summary()
    assert summary["enabled"] and summary["budget_bytes"] == 10**6 and summary["entries"] == 0
