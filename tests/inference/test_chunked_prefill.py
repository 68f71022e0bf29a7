"""Chunked prefill = one-shot prefill: a prompt run through the engine in pieces of PREFILL_CHUNK
tokens gives the logits of one forward over it (to float32 rounding) and the same tokens after,
over every attention variant, batched rows, a prompt after a cached prefix, and int8 / int4 models."""

import pytest
import torch
from support import BLOCK, PROMPTS, VARIANTS, V, random_model, rel_err

import quillgpt.inference.engine as engine_module
from quillgpt.config import ModelConfig
from quillgpt.inference.engine import Engine, Prompt
from quillgpt.model.gpt import GPT
from quillgpt.quant import quantize
from quillgpt.quant.int4 import Bf16Linear
from quillgpt.sampling_params import SamplingParams

CHUNK = 4  # small, so prompts of a few chunks stay within the tiny models' block_size (16)
ONE_SHOT = 10**6
GREEDY = SamplingParams(max_new_tokens=12)
# 13 tokens: three chunks and a one-token rest; a second row of the same length for batched prefills
LONG = [[(5 * i + 3) % V for i in range(13)], [(3 * i + 1) % V for i in range(13)]]
OPTIONS = {**VARIANTS, "qknorm-rope": {"qk_norm": True, "pos": "rope", "norm": "rmsnorm"}}
OPTIONS["local-global"] = {"pos": "rope", "window": 5, "global_every": 2, "local_rope_theta": 100.0}


def model_of(variant: str, n_embd: int = 32) -> GPT:
    """support.random_model's decisive weights over any of OPTIONS (and Infini-attention)."""
    torch.manual_seed(0)
    options = {"attention": "infini", "segment_size": 8} if variant == "infini" else OPTIONS[variant]
    model = GPT(ModelConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=4, n_embd=n_embd, **options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0, 0.3 if p.dim() > 1 else 0.1)
    return model.eval()


def float32_bound(logits: torch.Tensor) -> float:
    """How far chunked and one-shot logits may differ: the same sums blocked differently (a chunk's
    matmuls have fewer rows; its attention runs over cached keys + its own instead of one
    sequence), each rounding a few eps relative, compounded over the layers. Measured ~5 eps of
    the logits' scale (AVX-512); bound 100 eps (~1e-5 relative), far under any token's margin."""
    return 100 * torch.finfo(torch.float32).eps * float(logits.abs().max())


def activation_step(model: GPT) -> float:
    """The coarsest step a quantized model's kernels round their activations to, relative: bf16's
    2⁻⁸ (int4pack_mm, a bf16 head), else int16's 1/32767 of a block's largest value (group_gemv,
    group_gemv4, the int8 head; and above fp32's rounding)."""
    bf16 = any(isinstance(m, Bf16Linear) or getattr(m, "kernel", None) == "int4pack_mm" for m in model.modules())
    return 2.0**-8 if bf16 else 1 / 32767


def prefill(engine: Engine, chunk: int, monkeypatch, rs: list[int], ids: list[list[int]], start: int = 0) -> tuple[torch.Tensor, list[int]]:
    """engine.prefill_rows in pieces of `chunk` tokens: its logits and the piece lengths run."""
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", chunk)
    pieces, real = [], engine._forward
    monkeypatch.setattr(engine, "_forward", lambda idx, *a: pieces.append(idx.shape[1]) or real(idx, *a))
    with torch.inference_mode():
        logits = engine.prefill_rows(rs, ids, start)
    monkeypatch.undo()
    return logits, pieces


def continuation(model: GPT, chunk: int, monkeypatch, prompts: list[list[int]], **engine_kw) -> list[list[int]]:
    """Greedy tokens of prompts added together (rows of one length prefill as one batch)."""
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", chunk)
    engine = Engine(model, len(prompts), **engine_kw)
    got = {t.row: [t.token] for t in engine.add_all([Prompt(p, GREEDY) for p in prompts])}
    while engine.active_rows():
        for t in engine.step():
            got[t.row].append(t.token)
    monkeypatch.undo()
    return [got[r] for r in sorted(got)]


def first_logprobs(model: GPT, chunk: int, monkeypatch, prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """The (n, V) log-softmax of the prompts' next-token logits from one add_all (rows of one length
    prefill as one batch; a float32 cache), and the piece lengths the prefills ran."""
    engine = Engine(model, len(prompts), cache_dtype=torch.float32)
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", chunk)
    pieces, real = [], engine._forward
    monkeypatch.setattr(engine, "_forward", lambda idx, *a: pieces.append(idx.shape[1]) or real(idx, *a))
    firsts = engine.add_all([Prompt(p, SamplingParams(max_new_tokens=1), logprobs=V) for p in prompts])
    monkeypatch.undo()
    return torch.tensor([[lp for _, lp in sorted(t.logprob.top)] for t in firsts]), pieces


@pytest.mark.parametrize("variant", [*OPTIONS, "infini"])
def test_a_chunked_prefill_gives_the_one_shot_logits(variant, monkeypatch):
    """Infini-attention's rows prefill one at a time (each its own cache), the others as one batch;
    its segment (8) ends inside a chunk."""
    model = model_of(variant)
    T, prefills = min(13, model.context() or 13), 2 if variant == "infini" else 1  # a window: its receptive field
    one, pieces = first_logprobs(model, ONE_SHOT, monkeypatch, LONG)
    assert pieces == [T] * prefills
    chunked, pieces = first_logprobs(model, CHUNK, monkeypatch, LONG)
    assert pieces == ([CHUNK] * (T // CHUNK) + [T % CHUNK]) * prefills and T % CHUNK
    torch.testing.assert_close(chunked, one, rtol=0, atol=float32_bound(one))


@pytest.mark.parametrize("variant", [*OPTIONS, "infini"])
def test_chunked_rows_continue_with_the_one_shot_tokens(variant, monkeypatch):
    """Batched rows of one length, in the engine's default cache dtype (float16 where the native
    step runs: the earlier chunks' keys are read rounded, as the decode step reads them)."""
    model = model_of(variant)
    one = continuation(model, ONE_SHOT, monkeypatch, LONG)
    assert continuation(model, CHUNK, monkeypatch, LONG) == one
    assert len({t for row in one for t in row}) > 3  # not a degenerate loop


@pytest.mark.parametrize("variant", ["mha-learned", "rope", "rope-window-gqa"])
def test_a_cropped_prompt_and_a_learned_position_refill_run_in_chunks_with_the_one_shot_tokens(variant, monkeypatch):
    """PROMPTS[2] (22 tokens) is past block_size: learned positions crop it to its last 16 and refill
    every step; RoPE keeps its receptive field at absolute positions (a ring past the window)."""
    model = random_model(variant)
    one = continuation(model, ONE_SHOT, monkeypatch, [PROMPTS[2]])
    assert continuation(model, CHUNK, monkeypatch, [PROMPTS[2]]) == one


def test_a_prefix_lm_prefills_in_one_forward(monkeypatch):
    """Its whole prompt attends both ways: a chunk's keys would depend on the chunks after it."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, attention="prefix")).eval()
    engine = Engine(model, 1)
    _, pieces = prefill(engine, CHUNK, monkeypatch, [0], [LONG[0][:10]])
    assert pieces == [10]


@pytest.mark.parametrize("variant", ["mha-learned", "rope-window-gqa", "qknorm-rope"])
def test_a_chunked_prefill_after_cached_positions_gives_the_one_shot_logits(variant, monkeypatch):
    """start > 0: the rest of a prompt after the positions a row holds (a prompt cache's prefix)."""
    model = model_of(variant)
    one, _ = prefill(Engine(model, 1, cache_dtype=torch.float32), ONE_SHOT, monkeypatch, [0], [LONG[0]])
    engine = Engine(model, 1, cache_dtype=torch.float32)
    prefill(engine, ONE_SHOT, monkeypatch, [0], [LONG[0][:3]])
    chunked, pieces = prefill(engine, CHUNK, monkeypatch, [0], [LONG[0][3:]], start=3)
    assert pieces == [4, 4, 2]
    torch.testing.assert_close(chunked, one, rtol=0, atol=float32_bound(one))


@pytest.mark.parametrize("variant", ["mha-learned", "rope", "gqa"])  # (a window crops 13 tokens: no cache)
def test_a_prompt_cache_hit_prefills_the_rest_in_chunks_with_the_one_shot_tokens(variant, monkeypatch):
    model = random_model(variant)
    system, prompt = LONG[0][:3], LONG[0]
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", CHUNK)
    engine = Engine(model, 1, prompt_cache=10**6)
    engine.add(system, SamplingParams(max_new_tokens=1))  # leaves its 3 tokens' KV
    first = engine.add(prompt, GREEDY)
    assert first.cached == 3 and engine.prefilled == 3 + 10
    got = [first.token]
    while engine.active_rows():
        got += [t.token for t in engine.step()]
    monkeypatch.undo()
    assert got == continuation(model, ONE_SHOT, monkeypatch, [prompt])[0]


@pytest.mark.parametrize(
    "scheme, kernel",
    [("int8", "dequant/model"), ("int8", "group_gemv"), ("int8-channel", "group_gemv"), ("int4", None)],
)
@pytest.mark.parametrize("variant", ["mha-learned", "rmsnorm-swiglu"])
def test_a_quantized_model_prefills_in_chunks_with_the_one_shot_logits_and_tokens(variant, scheme, kernel, monkeypatch):
    """One kernel for every row count (int8's plan, measured, may take a bf16 kernel at one and an
    fp32 one at another). A chunk's inputs differ from the one-shot run's by float32 rounding,
    which a kernel's rounded activations may turn into one step of that rounding in a value: at
    most 2 steps for each of the 4·n_layer + 1 matmuls deep. n_embd 64: int4 takes group_gemv4
    (int16 activations) where it builds, else int4pack_mm and a bf16 head."""
    model = quantize(model_of(variant, n_embd=64), scheme, kernel=kernel)
    one, _ = prefill(Engine(model, 2, cache_dtype=torch.float32), ONE_SHOT, monkeypatch, [0, 1], LONG)
    chunked, pieces = prefill(Engine(model, 2, cache_dtype=torch.float32), CHUNK, monkeypatch, [0, 1], LONG)
    assert pieces == [4, 4, 4, 1]
    assert rel_err(chunked, one) < (4 * model.config.n_layer + 1) * 2 * activation_step(model)
    assert continuation(model, CHUNK, monkeypatch, LONG) == continuation(model, ONE_SHOT, monkeypatch, LONG)
