"""Generation with the KV cache (the engine) = recompute = the definition (per row, unpadded),
past block_size too; seeded sampling (row i: seed + i); stop ids; bad input.
Text layer: stop strings across token boundaries, UTF-8 streaming of characters split across
GPT-2 tokens, batched text = text alone, empty prompts, stats."""

import io
import json
import re
import string

import pytest
import torch
from support import BLOCK, PROMPTS, VARIANTS, V, random_model

from quillgpt.config import Config, ModelConfig, SampleConfig
from quillgpt.data.tokenizer import CharTokenizer
from quillgpt.errors import QuillError
from quillgpt.inference.driver import StopStrings, TextStream, encode_prompt
from quillgpt.inference.generate import Generation, generate_text, generate_tokens, open_sample, stream_text
from quillgpt.inference.sampling import apply_repetition_penalty
from quillgpt.model.gpt import GPT
from quillgpt.runs import LoadOptions, write_run

INF = float("inf")
variants = pytest.mark.parametrize("variant", list(VARIANTS))


def run(model, prompts, n, **kw) -> list[list[int]]:
    steps = list(generate_tokens(model, prompts, n, **kw))
    return torch.stack(steps, dim=1).tolist() if steps else [[] for _ in prompts]


# --- generation ---------------------------------------------------------------------------------


def reference_greedy(model: GPT, prompt: list[int], n: int, penalty: float = 1.0) -> list[int]:
    """The semantics by definition, one unpadded row, no cache: learned positions see the last
    block_size tokens (positions from 0); RoPE runs the whole stream (each layer banded)."""
    seq = list(prompt)
    for _ in range(n):
        ctx = seq[-BLOCK:] if model.config.pos == "learned" else seq
        logits = model(torch.tensor([ctx]))[0][:, -1]
        seen = torch.zeros(1, V, dtype=torch.bool)
        seen[0, seq] = True
        seq.append(int(apply_repetition_penalty(logits, seen, penalty).argmax()))
    return seq[len(prompt) :]


@variants
def test_greedy_cache_equals_recompute_equals_definition_past_block_size(variant):
    model = random_model(variant)
    n = 40  # every prompt runs past block_size (16)
    expected = [reference_greedy(model, p, n) for p in PROMPTS]
    assert run(model, PROMPTS, n, use_cache=True) == expected  # left-padded batch
    assert run(model, PROMPTS, n, use_cache=False) == expected
    assert run(model, PROMPTS[:1], n) == expected[:1]  # a batch of one
    assert len({t for row in expected for t in row}) > 5  # not a degenerate loop


def test_repetition_penalty_covers_prompt_and_generated_tokens():
    model = random_model("rope")
    expected = [reference_greedy(model, p, 20, penalty=1.5) for p in PROMPTS[:2]]
    assert run(model, PROMPTS[:2], 20, repetition_penalty=1.5) == expected
    assert expected != [reference_greedy(model, p, 20) for p in PROMPTS[:2]]


@pytest.mark.parametrize("variant", ["mha-learned", "rope-window-gqa"])
def test_seeded_sampling_is_reproducible_with_and_without_cache(variant):
    model = random_model(variant)
    kw = dict(temperature=1.0, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.2)
    sample = lambda seed, **more: run(model, PROMPTS, 30, seed=seed, **kw, **more)
    first = sample(7)
    assert sample(7) == first
    assert sample(7, use_cache=False) == first
    assert sample(8) != first
    assert run(model, PROMPTS[1:2], 30, seed=8, **kw) == first[1:2]  # row i: seed + i, as alone


def test_stop_ids_end_rows_and_then_iteration():
    model = random_model()
    free = run(model, PROMPTS, 30)
    stop = free[0][3]
    got = run(model, PROMPTS, 30, stop_ids=[stop])
    firsts = [row.index(stop) if stop in row else None for row in free]
    length = 30 if None in firsts else max(firsts) + 1
    assert all(len(row) == length for row in got)
    for row, free_row, first in zip(got, free, firsts):
        if first is None:
            assert row == free_row[:length]
        else:  # the row's own tokens up to its stop id, then that id again
            assert row == free_row[: first + 1] + [stop] * (length - first - 1)
    assert firsts[0] == free[0].index(stop) and any(f is not None for f in firsts)


def test_yields_one_int64_tensor_per_step():
    model = random_model()
    steps = list(generate_tokens(model, PROMPTS, 4))
    assert len(steps) == 4 and all(s.shape == (3,) and s.dtype == torch.long for s in steps)
    assert list(generate_tokens(model, PROMPTS, 0)) == []


def test_bad_input():
    model = random_model()
    for prompts, match in (([], "no prompts"), ([[1], []], "prompt 1 is empty"), ([[1, V]], "outside")):
        with pytest.raises(QuillError, match=match):
            next(generate_tokens(model, prompts, 3))
    with pytest.raises(QuillError, match="temperature"):
        next(generate_tokens(model, [[1]], 3, temperature=-1.0))
    with pytest.raises(ValueError, match="eval"):
        next(generate_tokens(model.train(), [[1]], 3))


def test_first_token_is_the_models_argmax():
    model = random_model("window")
    logits = model(torch.tensor([PROMPTS[1]]))[0][0, -1]
    assert run(model, PROMPTS[1:2], 1) == [[int(logits.argmax())]]


@pytest.mark.parametrize("variant", ["mha-learned", "rope-window-gqa"])
def test_bf16_weights_keep_cache_equal_to_recompute(variant):
    model = random_model(variant)
    got = run(model, PROMPTS, 20, dtype=torch.bfloat16)
    assert got == run(model, PROMPTS, 20, dtype=torch.bfloat16, use_cache=False)
    assert next(model.parameters()).dtype == torch.float32  # a converted copy ran, not the model
    first = model.to(torch.bfloat16)(torch.tensor([PROMPTS[1]]))[0][0, -1]  # bf16 weights, not autocast
    assert got[1][0] == int(first.float().argmax())


# --- text ---------------------------------------------------------------------------------------

CHARS = "\n " + string.digits[:9] + string.ascii_lowercase  # V = 37 characters, sorted
TEXT_PROMPTS = ["ab", "hello\nworld", "the quick brown fox jumps over"]  # the last is > block (16)


@pytest.fixture(scope="module")
def gpt2(byte_bpe):
    """A byte-level BPE as GPT-2's (conftest's byte_bpe), made without GPT-2's files."""
    return byte_bpe


def forced_model(targets: list[int], vocab_size: int) -> GPT:
    """A GPT whose greedy output is `targets`, whatever the tokens: blocks are the identity
    (zero output projections), token embeddings are zero, and position p's one-hot embedding
    selects targets[p] in the (untied) head. Lets a test choose the exact token stream."""
    n = len(targets) + 1
    cfg = ModelConfig(vocab_size=vocab_size, block_size=n, n_layer=1, n_head=1, n_embd=n, tie_embeddings=False)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name in ("ln_1", "ln_2"):
            getattr(model.transformer.h[0], name).weight.fill_(1.0)
        model.transformer.ln_f.weight.fill_(1.0)
        model.transformer.wpe.weight.copy_(torch.eye(n))
        for pos, t in enumerate(targets):
            model.lm_head.weight[t, pos] += 1.0
    return model.eval()


def test_stop_strings_hold_back_only_possible_starts():
    s = StopStrings(["\n\n", "END"])
    assert s.push("ab\n") == "ab"  # "\n" may begin "\n\n"
    assert s.push("c") == "\nc"  # it did not
    assert s.push("E") == "" and s.push("N") == ""
    assert s.push("x") == "ENx" and not s.stopped
    assert s.push("yy\n") == "yy" and s.push("\nzz") == "" and s.stopped
    assert s.push("more") == ""
    earliest = StopStrings(["cd", "b"])
    assert earliest.push("abcd") == "a"
    tail = StopStrings(["xyz"])
    assert tail.push("axy") == "a" and tail.flush() == "xy"
    with pytest.raises(QuillError, match="empty"):
        StopStrings([""])


def test_stop_string_across_char_tokens():
    tok = CharTokenizer(CHARS)
    stream = TextStream(tok, stop=["\n\n"])
    pieces = [stream.push(t) for t in tok.encode("ab\ncd\n\nef")]
    assert pieces == ["a", "b", "", "\nc", "d", "", ""] + ["", ""]
    assert stream.text == "ab\ncd" and stream.stopped and stream.done and stream.finish() == ""


def test_stop_string_split_across_bpe_tokens(gpt2):
    ids = gpt2.encode("hello world, hello moon")
    assert gpt2.decode(ids[:1]) == "hello" and gpt2.decode(ids[1:2]) == " world"
    stream = TextStream(gpt2, stop=["lo wo"])
    assert [stream.push(t) for t in ids[:2]] == ["hel", ""]
    assert stream.text == "hel" and stream.stopped


UNICODE = "héllo 😀 世界 日本語のテキスト 👋🏽 🦄"


def test_utf8_streaming_never_cuts_a_character(gpt2):
    ids = gpt2.encode(UNICODE)
    naive = [gpt2.decode([t]) for t in ids]
    assert sum("\ufffd" in piece for piece in naive) >= 6  # the case is real: chars span tokens
    stream = TextStream(gpt2)
    pieces = [stream.push(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == UNICODE and not any("\ufffd" in piece for piece in pieces)
    cut = TextStream(gpt2)  # generation ending mid-character: one U+FFFD, nothing else lost
    head = "héllo ".encode()
    k = next(k for k in range(len(ids)) if len(gpt2.decode_bytes(ids[:k])) > len(head))  # into 😀
    into = gpt2.decode_bytes(ids[:k])[len(head) :]
    assert gpt2.decode_bytes(ids[:k]).startswith(head) and "😀".encode()[: len(into)] == into != "😀".encode()
    assert "".join(cut.push(t) for t in ids[:k]) == "héllo "  # and the first bytes of 😀
    assert cut.finish() == "\ufffd"


def test_generation_streams_utf8_and_ends_at_end_of_text(gpt2):
    ids = gpt2.encode(UNICODE)
    model = forced_model(ids + [gpt2.eot_id] + ids[:3], gpt2.vocab_size)
    for use_cache in (True, False):
        pieces = list(stream_text(model, gpt2, "", len(ids) + 4, use_cache=use_cache))
        assert "".join(pieces) == UNICODE and not any("\ufffd" in piece for piece in pieces)
    texts, stats = generate_text(model, gpt2, "", len(ids) + 4)
    assert texts == [UNICODE] and stats.finish == ["eot"] and stats.new_tokens == [len(ids) + 1]
    assert stats.prompt_tokens == [1] and stats.steps == len(ids) + 1  # prompt: <|endoftext|>
    texts, stats = generate_text(model, gpt2, "", 8, stop=["llo"])
    upto = next(k for k in range(1, len(ids) + 1) if "llo" in gpt2.decode(ids[:k]))  # the token that completes it
    assert texts == ["hé"] and stats.finish == ["stop"] and stats.new_tokens == [upto]


@variants
def test_batched_text_equals_alone_and_cache_equals_recompute(variant):
    model, tok = random_model(variant), CharTokenizer(CHARS)
    alone = [generate_text(model, tok, p, 30)[0][0] for p in TEXT_PROMPTS]  # 30 + prompt > block
    assert generate_text(model, tok, TEXT_PROMPTS, 30)[0] == alone
    assert generate_text(model, tok, TEXT_PROMPTS, 30, use_cache=False)[0] == alone
    assert alone[0] == tok.decode(run(model, [tok.encode("ab")], 30)[0])


def test_seeded_text_sampling_is_reproducible():
    model, tok = random_model("rope"), CharTokenizer(CHARS)
    kw = dict(temperature=1.0, top_k=10)
    first = generate_text(model, tok, TEXT_PROMPTS, 25, seed=3, **kw)[0]
    assert generate_text(model, tok, TEXT_PROMPTS, 25, seed=3, **kw)[0] == first
    assert generate_text(model, tok, TEXT_PROMPTS, 25, seed=4, **kw)[0] != first


def test_empty_prompt_starts_from_newline_or_first_id(gpt2):
    assert encode_prompt(CharTokenizer("\t\nxy"), "") == [1]  # the newline's id
    assert encode_prompt(CharTokenizer("xyz"), "") == [0]  # no newline: the first id
    assert encode_prompt(gpt2, "") == [gpt2.eot_id]
    model, tok = random_model(), CharTokenizer(CHARS)
    assert generate_text(model, tok, "", 10)[0] == generate_text(model, tok, "\n", 10)[0]


def test_prompt_with_characters_outside_the_vocabulary_names_them():
    with pytest.raises(QuillError, match=r"3 character\(s\).*'A', 'é' \(2×\)"):
        encode_prompt(CharTokenizer(CHARS), "Aé bé")
    assert encode_prompt(CharTokenizer(CHARS), "a b") == CharTokenizer(CHARS).encode("a b")


def test_generation_stats_and_zero_tokens():
    model, tok = random_model(), CharTokenizer(CHARS)
    gen = Generation(model, tok, ["ab", "hello"], 12)
    steps = list(gen)
    assert len(steps) == 12 and all(len(p) == 2 for p in steps)
    assert ["".join(p[r] for p in steps) for r in range(2)] == gen.texts
    st = gen.stats
    assert st.prompt_tokens == [2, 5] and st.new_tokens == [12, 12] and st.finish == ["length"] * 2
    assert st.total_s > 0 and st.prefill_ms > 0 and st.tokens_per_s == pytest.approx(24 / st.total_s)
    assert "24 new tokens" in st.line() and "prompts 2/5 tokens" in st.line()
    assert generate_text(model, tok, "ab", 0)[0] == [""]
    with pytest.raises(QuillError, match="top_p"):
        Generation(model, tok, ["ab"], 5, top_p=0.0)


def test_compile_time_is_on_the_stats_line_and_not_in_tokens_per_s():
    from quillgpt.inference.generate import GenerationStats

    stats = GenerationStats(prompt_tokens=[4], new_tokens=[30], steps=30, prefill_ms=2.0, total_s=4.0, compile_s=3.0)
    assert stats.tokens_per_s == 30.0 and "compile 3.0 s (not in tokens/s)" in stats.line()
    assert "29.1 tokens/s after the first" in stats.line()  # 29 tokens after the first in 4 - 3 - 0.002 s
    eager = GenerationStats(prompt_tokens=[4], new_tokens=[30], steps=30, total_s=4.0)
    assert eager.tokens_per_s == 7.5 and "compile" not in eager.line()


def test_prompt_and_decode_speeds_are_apart_and_a_prompt_past_the_context_says_what_happens():
    """A long prompt's prefill is its own figure, not a slow decode; a prompt longer than the
    context says what the model reads of it (learned positions: cropped; RoPE: a window)."""
    from quillgpt.inference.generate import GenerationStats

    slow = GenerationStats(prompt_tokens=[8501], new_tokens=[20], steps=20, prefill_ms=73816.3, total_s=74.0)
    line = slow.line()
    assert "20 new tokens, 103.4 tokens/s after the first, prefill 73816.3 ms (115 prompt tokens/s)" in line, line
    for variant, word in (("mha-learned", "cropped"), ("rope", "sliding window")):
        model = random_model(variant)
        gen = Generation(model, CharTokenizer(CHARS), ["ab" * BLOCK], 3, temperature=0.0)
        list(gen)
        assert f"the prompt ({2 * BLOCK} tokens) is past the model's {BLOCK}-token context" in gen.stats.line()
        assert word in gen.stats.line()
    short = Generation(random_model("rope"), CharTokenizer(CHARS), ["ab"], 3, temperature=0.0)
    list(short)
    assert "past the model" not in short.stats.line()


def test_join_all_refuses_a_key_already_generating_before_it_claims_a_row():
    from quillgpt.inference.driver import Join, TextBatch
    from quillgpt.inference.engine import Engine, Prompt
    from quillgpt.sampling_params import SamplingParams

    batch = TextBatch(Engine(random_model(), 3))
    params = SamplingParams(max_new_tokens=4)
    batch.join("a", PROMPTS[0], params)
    for keys in (["b", "a"], ["c", "c"]):
        with pytest.raises(ValueError, match="already generating"):
            batch.join_all([Join(k, Prompt(PROMPTS[1], params)) for k in keys])
    assert batch.free() == 2 and len(batch) == 1
    pieces = batch.join_all([Join(k, Prompt(PROMPTS[1], params)) for k in ("b", "c")])
    assert [p.key for p in pieces] == ["b", "c"] and batch.free() == 0


# --- open_sample: quill sample's generation ----------------------------------------------------

SAMPLE_SETTINGS = ["max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop"]


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    """A run directory holding random_model with the CHARS vocabulary, step 3."""
    model, run = random_model(), tmp_path_factory.mktemp("sample") / "run"
    run.mkdir()
    write_run(run, Config(model=model.config), CharTokenizer(CHARS), model.state_dict(), step=3)
    return run, model


def test_open_sample_is_generate_text_on_the_loaded_run_and_says_so_as_json(sample_run):
    run, model = sample_run
    flags = {"max_new_tokens": 5, "temperature": 0.0}
    sample = open_sample(run, "ab", LoadOptions(which="latest"), samples=2, flags=flags, stop=("zz",))
    got = json.loads(sample.to_json())
    expected, _ = generate_text(model, CharTokenizer(CHARS), ["ab"], samples=2, params=SampleConfig().params(**flags, stop=("zz",)))
    assert got["samples"] == expected == sample.generation.texts and (got["step"], got["prompt"]) == (3, "ab")
    assert list(got["settings"]) == [*SAMPLE_SETTINGS, "kv_cache", "compiled", "device", "dtype", "quantize", "int8_kernel"]
    assert {k: got["settings"][k] for k in ("stop", "kv_cache", "device", "dtype", "quantize")} == {
        "stop": ["zz"],
        "kv_cache": True,
        "device": "cpu",
        "dtype": "float32",
        "quantize": "none",
    }
    assert got["stats"]["prompt_tokens"] == [2, 2] and got["checkpoint"] == str(run / "ckpt.pt")
    how = r"\(kv cache, cpu, \d+ threads? \(OMP_NUM_THREADS\), float32; load \d+\.\d s, not in tokens/s\)"
    pattern = r"prompt 2 tokens x 2 samples, \d+ new tokens, .*" + how
    assert re.fullmatch(pattern, sample.stats_line())


def test_sample_writes_each_sample_under_its_header_after_its_prompt(sample_run):
    run, _ = sample_run
    for stream in (True, False):
        sample = open_sample(run, "ab", LoadOptions(which="latest"), samples=2, flags={"max_new_tokens": 4}, use_cache=False)
        out = io.StringIO()
        sample.write(out, echo=True, stream=stream)
        texts = sample.generation.texts
        assert out.getvalue() == "".join(f"--- sample {i} ---\nab{t}" + ("" if t.endswith("\n") else "\n") for i, t in enumerate(texts, 1))
        assert "no kv cache" in sample.stats_line()


def test_open_sample_refuses_bad_flags_before_loading(tmp_path):
    with pytest.raises(QuillError, match="--num-samples must be at least 1, got 0"):
        open_sample(tmp_path / "missing", "", LoadOptions(), samples=0)
    with pytest.raises(QuillError, match="--stop"):
        open_sample(tmp_path / "missing", "", LoadOptions(), stop=("",))
    with pytest.raises(QuillError, match="--top-p"):
        open_sample(tmp_path / "missing", "", LoadOptions(), flags={"top_p": 2.0})
