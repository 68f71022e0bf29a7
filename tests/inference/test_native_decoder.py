"""The native decoder (inference/native_decoder.py) against the op-by-op step it replaces: the
same model, cache and tokens, with the model's own GPT.decode as the plain computation."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch._dynamo.utils import counters

from quillgpt import native, quant
from quillgpt.config import ModelConfig
from quillgpt.inference import native_decoder
from quillgpt.inference.engine import Engine
from quillgpt.inference.native_decoder import Decoder
from quillgpt.model.gpt import GPT
from quillgpt.quant import plan
from quillgpt.sampling_params import SamplingParams

needs_kernel = pytest.mark.skipif(not native.available(), reason=f"group_gemv did not build here: {native.why_not()}")

SHAPES = {  # every norm, activation, bias, position and mask form the block takes
    "llama": dict(norm="rmsnorm", mlp="swiglu", pos="rope", n_head=4, n_kv_head=2, qk_norm=True, bias=False),
    "gpt2": dict(norm="layernorm", mlp="gelu", pos="learned", n_head=4, bias=True),
    "window": dict(norm="rmsnorm", mlp="relu2", pos="rope", n_head=4, window=8, bias=False),
    # head sizes 64 and 128 attend in vector registers (csrc attend_lanes, AVX2 or AVX-512); 32 in the portable loop
    "llama-hd64": dict(norm="rmsnorm", mlp="swiglu", pos="rope", n_head=2, n_kv_head=1, bias=False),
    "gpt2-hd128": dict(norm="layernorm", mlp="gelu", pos="learned", n_head=1, bias=True),
}


def model(shape: str, scheme: str, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    m = GPT(ModelConfig(n_layer=2, n_embd=128, block_size=64, vocab_size=97, **SHAPES[shape])).eval()
    # int8 fixed to group_gemv: a plan measured on a busy machine (or test_group_gemv's slow
    # emulated build) might pick another kernel at these rows, and the blocks would not be native
    return quant.quantize(m, scheme, kernel=None if scheme.startswith("int4") else "group_gemv")


def greedy(
    m: GPT, steps: int, starts: list[int], masked: bool = True, cache_dtype: torch.dtype | None = None, native: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (steps, R, V) and tokens of greedy decoding, each row from its own start position,
    through a Decoder of m (native=False: m.decode, op by op)."""
    step = Decoder(m) if native else m.decode
    cache = m.make_cache(len(starts), 64, dtype=cache_dtype)
    idx, pos = torch.tensor([5, 17, 60][: len(starts)]), torch.tensor(starts)
    logits = []
    with torch.no_grad():
        for t in range(steps):
            lg = step(idx, pos + t, cache, masked=masked)
            logits.append(lg)
            idx = lg.argmax(-1)
    out = torch.stack(logits)
    return out, out.argmax(-1)


@needs_kernel
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32-cache", "fp16-cache"])
def test_native_step_equals_the_op_by_op_step(shape: str, scheme: str, cache_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    m = model(shape, scheme)
    assert all(native_decoder.fits(b) for b in m.transformer.h) and Decoder(m).native
    calls = []
    real = native_decoder.decode_stack
    monkeypatch.setattr(native_decoder, "decode_stack", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast, fast_tokens = greedy(m, 24, [0, 3, 9], cache_dtype=cache_dtype)  # rows at different positions; the window's band wraps
    assert len(calls) == 24  # every step ran its blocks in one native call
    # the op-by-op step reads a float16 cache as float32 too
    plain, plain_tokens = greedy(m, 24, [0, 3, 9], cache_dtype=cache_dtype, native=False)
    assert len(calls) == 24
    assert torch.equal(fast_tokens, plain_tokens)
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=2e-4)  # group_gemv's int16 rounding of a slightly different input


@needs_kernel
def test_a_block_that_does_not_fit_decodes_the_model_op_by_op_until_a_new_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """One block's linears left float: the decoder is not native (no stack call) and equals op by
    op; the model fitting again, a decoder built after runs the stack."""
    torch.manual_seed(3)
    m = GPT(ModelConfig(n_layer=2, n_embd=128, block_size=64, vocab_size=97, **SHAPES["llama"])).eval()
    keep = copy.deepcopy(m.transformer.h[1].mlp)
    quant.quantize(m, "int8")
    quantized = m.transformer.h[1].mlp
    m.transformer.h[1].mlp = keep  # float linears: this block decodes op by op
    calls = []
    real = native_decoder.decode_stack
    monkeypatch.setattr(native_decoder, "decode_stack", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert not Decoder(m).native and native_decoder.cache_dtype(m) == torch.float32
    fast, _ = greedy(m, 6, [0, 4])
    assert calls == []
    plain, _ = greedy(m, 6, [0, 4], native=False)
    torch.testing.assert_close(fast, plain, rtol=0, atol=0)
    m.transformer.h[1].mlp = quantized  # fits again: a new decoder runs the stack
    greedy(m, 2, [0])
    assert calls == [1, 1]


@needs_kernel
def test_the_head_ends_the_native_call_unless_it_soft_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The final norm and the head run inside the stack's call (no GPT.head call); a soft-capped
    head is left to GPT.head, after the native blocks. Both equal the op-by-op step."""
    for softcap in (None, 2.0):
        torch.manual_seed(4)
        cfg = ModelConfig(n_layer=2, n_embd=128, block_size=64, vocab_size=97, logit_softcap=softcap, **SHAPES["gpt2"])
        m = quant.quantize(GPT(cfg).eval(), "int8")
        heads = []
        real = m.head
        monkeypatch.setattr(m, "head", lambda x, heads=heads, real=real: heads.append(1) or real(x))
        fast, _ = greedy(m, 5, [0, 2])
        assert len(heads) == (0 if softcap is None else 5)
        plain, _ = greedy(m, 5, [0, 2], native=False)
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=2e-4)


@needs_kernel
@pytest.mark.parametrize("shape", ["llama", "gpt2", "llama-hd64"])
def test_the_unmasked_step_is_one_call_from_the_token_ids(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """masked=False (every row sees every slot so far): decode_tokens also embeds the tokens, makes
    the RoPE angles and records the positions; the same logits, tokens and cache positions as op by
    op, RoPE and learned positions, one row and two."""
    m = model(shape, "int4", seed=1)
    calls = []
    real = native_decoder.decode_tokens
    monkeypatch.setattr(native_decoder, "decode_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    for starts in ([0], [5, 5]):
        fast, fast_tokens = greedy(m, 6, starts, masked=False)
        plain, plain_tokens = greedy(m, 6, starts, masked=False, native=False)
        assert torch.equal(fast_tokens, plain_tokens)
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=2e-4)
    assert len(calls) == 12
    cache, step = m.make_cache(1, 8), Decoder(m)
    with torch.no_grad():
        for p in range(10):  # past the capacity: slot p % 8, its position recorded there
            step(torch.tensor([3]), torch.tensor([p]), cache, n_keys=min(p + 1, 8), masked=False)
    assert cache.pos[0].tolist() == [8, 9, 2, 3, 4, 5, 6, 7]


@needs_kernel
def test_a_bad_token_or_position_is_an_error_not_a_read_out_of_bounds() -> None:
    m = model("gpt2", "int8")  # learned positions: 64 of them
    cache, step = m.make_cache(1, 64), Decoder(m)
    with pytest.raises(RuntimeError, match="vocabulary"):
        step(torch.tensor([97]), torch.tensor([0]), cache, masked=False)
    with pytest.raises(RuntimeError, match="pos"):
        step(torch.tensor([1]), torch.tensor([64]), cache, masked=False)


@needs_kernel
def test_argmax_finite_is_the_first_maximum_and_flags_rows_that_are_not_finite() -> None:
    native.available()
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    logits[0, [7, 500]] = 9.0  # a tie: the first
    logits[1, 3] = float("nan")
    logits[2, 999] = float("inf")
    logits[3, 0] = float("-inf")  # one logit -inf: not finite either (the step's sum says so)
    logits[4, :] = 1e36  # each finite, their sum past float's range
    got = native_decoder.argmax_finite(logits)
    assert got is not None and got.dtype == torch.long and got.shape == (2, 6)
    assert got[1].tolist() == [0, 1, 1, 1, 1, 0]
    assert got[0, 0] == 7 and got[0, 2] == 999 and torch.equal(got[0, 5], logits[5].argmax())
    assert native_decoder.argmax_finite(logits.double()) is None  # not float32: the engine's torch ops


def test_fits_only_quantized_blocks_of_causal_attention() -> None:
    torch.manual_seed(0)
    float_model = GPT(ModelConfig(n_layer=1, n_embd=64, n_head=2, block_size=32, vocab_size=50)).eval()
    assert not native_decoder.fits(float_model.transformer.h[0])  # nn.Linear: no group_gemv layout
    infini = GPT(ModelConfig(n_layer=1, n_embd=64, n_head=2, block_size=32, vocab_size=50, attention="infini", segment_size=16)).eval()
    assert not native_decoder.fits(quant.quantize(infini, "int8").transformer.h[0])  # its own attention and memory


@needs_kernel
def test_a_decoder_gathers_each_batch_sizes_arguments_once() -> None:
    m = model("llama", "int8")
    step = Decoder(m)
    first = step.stack(1)
    assert first is not None and step.stack(1) is first  # kept
    assert first[0][0][0] is m.transformer.h[0].attn.c_attn.native_weights(1)[0]  # the layer's own tensors
    assert step.stack(3) is not first and step.stack(3) is not None
    float_model = GPT(ModelConfig(n_layer=1, n_embd=128, n_head=4, block_size=32, vocab_size=50)).eval()
    assert not Decoder(float_model).native and not Decoder(m, native_step=False).native


@needs_kernel
def test_a_bad_slot_is_an_error_not_a_write_out_of_bounds() -> None:
    m = model("llama", "int8")
    stack, cache = Decoder(m).stack(1), m.make_cache(1, 16)
    x = torch.randn(1, 128)
    inputs = (x, None, None, (torch.tensor([0]), torch.tensor([16])))
    with pytest.raises(RuntimeError, match="slot"):
        native_decoder.decode_stack(x, stack, inputs, cache, None)


@needs_kernel
@pytest.mark.skipif(not os.environ.get("QUILL_TEST_COMPILE"), reason="torch.compile takes ~1 min on CPU: set QUILL_TEST_COMPILE=1")
def test_the_compiled_step_is_one_graph_for_every_key_count() -> None:
    """The key count reaches decode_block as a SymInt: were it a plain int, every step (one more
    key) would compile anew (~15 s each on SmolLM2), and the step's tokens would still be right."""
    m = model("llama", "int4", seed=2)
    params = SamplingParams(max_new_tokens=20)
    prompt = [3, 1, 4, 1, 5]

    def tokens(compile: bool) -> list[int]:
        engine = Engine(m, 1, compile=compile)
        out = [engine.add(prompt, params).token]
        out += [t.token for t in engine.step()]  # the compiled step's first call compiles it
        graphs = counters["stats"]["unique_graphs"]
        while engine.active_rows():
            out += [t.token for t in engine.step()]
        assert counters["stats"]["unique_graphs"] == graphs  # no recompiles as the keys grow
        return out

    assert tokens(compile=True) == tokens(compile=False)


@needs_kernel
def test_a_natively_decoded_model_caches_in_float16_and_decodes_as_with_float32() -> None:
    """cache_dtype: float16 where the step runs natively (half the bytes attention reads), the
    model's own dtype elsewhere; decoding over it agrees with a float32 cache to float16's rounding."""
    m = model("llama", "int4")
    assert native_decoder.cache_dtype(m) == torch.float16 and Engine(m, 2).cache.k[0].dtype == torch.float16
    assert m.make_cache(2).k[0].dtype == torch.float32  # the model itself knows nothing of the native step
    assert native_decoder.cache_dtype(GPT(ModelConfig(n_layer=1, n_embd=64, n_head=2, block_size=16, vocab_size=97))) == torch.float32
    assert native_decoder.cache_dtype(m, native_step=False) == torch.float32
    assert Engine(m, 2, native=False).cache.k[0].dtype == torch.float32
    assert Engine(m, 2, cache_dtype=torch.float32).cache.k[0].dtype == torch.float32  # a stated choice
    half, half_tokens = greedy(m, 24, [0, 3, 9], cache_dtype=torch.float16)
    full, full_tokens = greedy(m, 24, [0, 3, 9], cache_dtype=torch.float32)
    assert torch.equal(half_tokens, full_tokens)
    torch.testing.assert_close(half, full, rtol=0, atol=2e-3)


@needs_kernel
@pytest.mark.parametrize("scheme", ["int8", "int8-channel"])
def test_two_loads_under_different_load_give_the_same_cache_dtype(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache's dtype follows the model's structure, never a kernel timing: a plan measured with
    group_gemv fastest and one measured with it slowest (a busy machine) give the same cache."""
    dtypes, cfg = [], ModelConfig(n_layer=1, n_embd=128, block_size=32, vocab_size=50, **SHAPES["llama"])
    for gemv_ms in (0.1, 9.0):
        ms = lambda kernels, gemv_ms=gemv_ms: {"float": 1.0, **{k: gemv_ms if k == "group_gemv" else 1.0 for k in kernels}}
        monkeypatch.setattr(plan, "_timings", lambda pairs, kernels, m, ms=ms, **budget: ms(kernels))
        m = quant.quantize(GPT(cfg).eval(), scheme)
        assert (quant.plan_of(m).pick(1) == "group_gemv") == (gemv_ms < 1)
        dtypes.append((native_decoder.cache_dtype(m), Engine(m, 1).cache.k[0].dtype))
    assert dtypes[0] == dtypes[1] == (torch.float16, torch.float16)
