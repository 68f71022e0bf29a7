"""Infini-attention against its equations (Munkhdalai et al. 2024) computed by hand on small tensors."""

import math

import pytest
import torch

from quillgpt.checkpoint import load_checkpoint
from quillgpt.config import ModelConfig
from quillgpt.errors import QuillError
from quillgpt.model.gpt import GPT
from quillgpt.model.variants.infini import InfiniAttention, SegmentState, gate_values, infini_attend, retrieve, sigma, write

V = 23


def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, block_size=12, n_layer=2, n_head=4, n_embd=16, attention="infini", segment_size=4)
    return ModelConfig(**{**base, **kw})


def elu1(x: float) -> float:
    return x + 1.0 if x > 0 else math.exp(x)


def test_sigma_is_elu_plus_one():
    x = torch.tensor([-3.0, -0.5, 0.0, 0.7, 4.0])
    assert torch.allclose(sigma(x), torch.tensor([elu1(v) for v in x.tolist()]))


def _hand_memory(ks, vs, update):
    """M, z after writing segments ks[s], vs[s] (lists of (L, d) tensors), as scalar loops."""
    d = ks[0].shape[1]
    M = [[0.0] * d for _ in range(d)]
    z = [0.0] * d
    for k, v in zip(ks, vs):
        sk = [[elu1(a) for a in row] for row in k.tolist()]
        vv = v.tolist()
        if update == "delta":  # v − σ(k)M/(σ(k)z), with 0 for an empty memory
            old = []
            for row in sk:
                den = sum(row[i] * z[i] for i in range(d))
                old.append([sum(row[i] * M[i][j] for i in range(d)) / den if den > 0 else 0.0 for j in range(d)])
            vv = [[vv[t][j] - old[t][j] for j in range(d)] for t in range(len(vv))]
        for t, row in enumerate(sk):
            for i in range(d):
                z[i] += row[i]
                for j in range(d):
                    M[i][j] += row[i] * vv[t][j]
    return torch.tensor(M), torch.tensor(z)


@pytest.mark.parametrize("update", ["linear", "delta"])
def test_write_and_retrieve_equal_the_equations(update):
    g = torch.Generator().manual_seed(0)
    L, d = 3, 4
    ks = [torch.randn(L, d, generator=g) for _ in range(3)]
    vs = [torch.randn(L, d, generator=g) for _ in range(3)]
    mem, norm = torch.zeros(1, 1, d, d), torch.zeros(1, 1, d)
    for s in range(3):
        mem, norm = write(mem, norm, ks[s][None, None], vs[s][None, None], update)
        M, z = _hand_memory(ks[: s + 1], vs[: s + 1], update)
        assert torch.allclose(mem[0, 0], M, atol=1e-5) and torch.allclose(norm[0, 0], z, atol=1e-5)
    q = torch.randn(2, d, generator=g)
    got = retrieve(sigma(q)[None, None], mem, norm)[0, 0]
    M, z = _hand_memory(ks, vs, update)
    for t, row in enumerate(q.tolist()):
        sq = [elu1(a) for a in row]
        den = sum(sq[i] * z[i].item() for i in range(d))
        want = [sum(sq[i] * M[i][j].item() for i in range(d)) / den for j in range(d)]
        assert torch.allclose(got[t], torch.tensor(want), atol=1e-5)


def test_delta_rewrite_of_a_stored_value_adds_nothing():
    """Delta rule: writing (k, v) again where the memory already returns v for k leaves M as is."""
    k, v = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)
    mem, norm = write(torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4), k, v, "delta")
    assert torch.allclose(retrieve(sigma(k), mem, norm), v, atol=1e-5)  # one key: exact recall
    mem2, _ = write(mem, norm, k, v, "delta")
    assert torch.allclose(mem2, mem, atol=1e-5)


def test_empty_memory_retrieves_zero_without_nan_gradients():
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    out = retrieve(sigma(q), torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4))
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def _reference(q, k, v, beta, L, update):
    """The paper's loop over segments, with a hand-written causal softmax inside each: (B, H, T, hd)."""
    B, H, T, d = q.shape
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # query head h reads kv head h // G
    mem, norm = torch.zeros(B, H, d, d), torch.zeros(B, H, d)
    gate = torch.sigmoid(beta).view(1, H, 1, 1)
    out = []
    for s in range(0, T, L):
        qs, ks, vs = q[:, :, s : s + L], k[:, :, s : s + L], v[:, :, s : s + L]
        n = qs.shape[2]
        scores = qs @ ks.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        a_dot = scores.softmax(-1) @ vs
        sq, sk = sigma(qs), sigma(ks)
        den = sq @ norm[..., None]
        a_mem = torch.where(den > 0, (sq @ mem) / den.clamp(min=1e-30), torch.zeros(()))
        out.append(gate * a_mem + (1 - gate) * a_dot)
        if n == L:  # only finished segments are written
            if update == "delta":
                den_k = sk @ norm[..., None]
                vs = vs - torch.where(den_k > 0, (sk @ mem) / den_k.clamp(min=1e-30), torch.zeros(()))
            mem, norm = mem + sk.transpose(-1, -2) @ vs, norm + sk.sum(2)
    return torch.cat(out, 2)  # (a memory per query head: heads of a group hold equal copies)


@pytest.mark.parametrize("update", ["linear", "delta"])
@pytest.mark.parametrize("kv", [4, 2])
@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_infini_attend_equals_the_loop_over_segments(update, kv, impl):
    g = torch.Generator().manual_seed(1)
    B, H, T, d, L = 2, 4, 11, 8, 4  # 2 full segments and a partial one
    q, k, v = (torch.randn(B, h, T, d, generator=g) for h in (H, kv, kv))
    beta = torch.randn(H, generator=g)
    y, state, _ = infini_attend(q, k, v, SegmentState.empty(B, kv, d, k), beta, L, update, impl)
    assert torch.allclose(y, _reference(q, k, v, beta, L, update), atol=1e-5)
    assert state.k.shape[2] == T % L  # the unfinished segment is carried, not written


@pytest.mark.parametrize("update", ["linear", "delta"])
def test_chunks_in_any_split_equal_one_call(update):
    """State carried across calls: feeding 11 tokens as 3 + 1 + 5 + 2 = feeding them at once."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 11, 4, generator=g) for _ in range(3))
    beta = torch.randn(2, generator=g)
    whole, _, _ = infini_attend(q, k, v, SegmentState.empty(1, 2, 4, k), beta, 4, update)
    state, parts, t = SegmentState.empty(1, 2, 4, k), [], 0
    for m in (3, 1, 5, 2):
        y, state, _ = infini_attend(q[:, :, t : t + m], k[:, :, t : t + m], v[:, :, t : t + m], state, beta, 4, update)
        parts.append(y)
        t += m
    assert torch.allclose(torch.cat(parts, 2), whole, atol=1e-6)


VARIANTS = {
    "learned-linear": {},
    "rope-delta": {"pos": "rope", "memory_update": "delta"},
    "gqa-rope": {"pos": "rope", "n_kv_head": 2},
    "mqa-math": {"n_kv_head": 1, "attn_impl": "math"},
    "qk-norm-rope": {"pos": "rope", "qk_norm": True},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_model_forward_equals_segment_by_segment_and_token_by_token(name):
    torch.manual_seed(0)
    model = GPT(cfg(**VARIANTS[name])).eval()
    idx = torch.randint(V, (2, 30))  # longer than block_size: segments go on for ever
    full, _ = model(idx, all_logits=True)
    for step in (4, 1, 3):  # segment by segment, token by token, and across boundaries
        cache, parts = model.make_cache(2), []
        for t in range(0, 30, step):
            n = min(step, 30 - t)
            logits, _ = model(idx[:, t : t + n], pos=torch.arange(t, t + n), cache=cache, all_logits=True)
            parts.append(logits)
        assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5), step


def test_qk_norm_composes_with_infini_attention():
    """Infini-attention uses self-attention's projections, QK-norm included: its gains change the
    output, and q, k are normed per head exactly as causal attention norms them."""
    torch.manual_seed(0)
    layer = InfiniAttention(cfg(qk_norm=True)).eval()
    x = torch.randn(2, 12, 16)
    before, _ = layer(x)
    q, k, _ = layer.qkv(x, None)
    assert torch.allclose(q.pow(2).mean(-1), torch.ones(()), atol=1e-2)  # unit RMS per head (gains 1, eps aside)
    with torch.no_grad():
        layer.q_norm.weight.mul_(3.0)
    assert not torch.allclose(layer(x)[0], before)


def test_gradients_flow_through_the_memory_across_segments():
    torch.manual_seed(0)
    layer = InfiniAttention(cfg())
    x = torch.randn(1, 12, 16, requires_grad=True)
    y, _ = layer(x)
    y[:, 8:].sum().backward()  # the third segment only
    assert x.grad[:, :4].abs().sum() > 0  # reached the first segment: only the memory connects them
    assert layer.beta.grad.abs().sum() > 0


def test_a_long_run_stays_finite():
    """Training steps at a high lr over 8 segments, then 10,000 tokens (1,250 segments) through the cache."""
    torch.manual_seed(0)
    model = GPT(cfg(block_size=64, segment_size=8, memory_update="delta"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(4):
        idx = torch.randint(V, (4, 65))
        _, loss = model(idx[:, :-1], idx[:, 1:])
        assert math.isfinite(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    cache = model.make_cache(1)
    with torch.inference_mode():
        for t in range(0, 10_000, 1000):
            logits, _ = model(torch.randint(V, (1, 1000)), pos=torch.arange(t, t + 1000), cache=cache)
            assert torch.isfinite(logits).all()
    assert torch.isfinite(cache.mem).all() and cache.seen == 10_000


def test_gates_are_sigmoid_beta_per_head():
    model = GPT(cfg())
    with torch.no_grad():
        model.transformer.h[1].attn.beta.copy_(torch.tensor([0.0, 2.0, -1.0, 5.0]))
    gates = gate_values(model)
    assert len(gates) == 2 and torch.allclose(gates[0], torch.full((4,), 0.5))
    assert torch.allclose(gates[1], torch.sigmoid(torch.tensor([0.0, 2.0, -1.0, 5.0])))


def test_attention_maps_are_block_diagonal_by_segment():
    model = GPT(cfg()).eval()
    maps = model.attention_maps(torch.randint(V, (1, 12)))
    w = maps[0][0]  # (H, T, T)
    assert torch.allclose(w.sum(-1), torch.ones(4, 12))
    seg = torch.arange(12) // 4
    outside = (seg[:, None] != seg[None, :]) | (torch.arange(12)[None] > torch.arange(12)[:, None])
    assert w[:, outside].abs().max() == 0


@pytest.mark.parametrize(
    "kw, keys",
    [
        ({"segment_size": None}, "model.segment_size"),
        ({"segment_size": 5}, "model.segment_size"),
        ({"window": 4}, "model.window"),
        ({"attention": "causal"}, "model.segment_size"),
        ({"attention": "causal", "segment_size": None, "memory_update": "delta"}, "model.memory_update"),
    ],
)
def test_impossible_combinations_name_both_keys(kw, keys):
    with pytest.raises(QuillError, match=keys) as e:
        cfg(**kw).validate()
    assert "model.attention" in str(e.value)


def test_attention_view_reports_each_heads_gate():
    from quillgpt.data.tokenizer_files import build_tokenizer
    from quillgpt.evaluate import attention_views as viz

    tok = build_tokenizer("char", text="abcdefghij")
    model = GPT(cfg(vocab_size=tok.vocab_size)).eval()
    with torch.no_grad():
        model.transformer.h[0].attn.beta.fill_(1.0)
    attn = viz.attention_weights(model, tok, "abcdefgh")
    assert torch.allclose(attn.gates[0], torch.full((4,), torch.sigmoid(torch.tensor(1.0)).item()))
    assert "layer 0: 0.73 0.73 0.73 0.73" in viz.format_gates(attn.gates)


def test_quill_train_gives_the_gates_their_own_lr_and_no_decay(shakespeare_path, tmp_path):
    from pathlib import Path

    from quillgpt.config import load_config
    from quillgpt.model.variants.infini import GATE_LR_MULT
    from quillgpt.train.loop import train
    from quillgpt.train.optim import build_optimizer

    root = Path(__file__).resolve().parents[2]
    c = load_config(
        root / "configs" / "shakespeare_char_cpu.yaml",
        [
            f"data.path={shakespeare_path}",
            f"data.out_dir={tmp_path / 'data'}",
            f"train.out_dir={tmp_path / 'run'}",
            "model.n_layer=2",
            "model.n_head=2",
            "model.n_embd=32",
            "model.block_size=16",
            "model.attention=infini",
            "model.segment_size=4",
            "train.batch_size=4",
            "train.max_iters=6",
            "train.eval_interval=6",
            "train.eval_iters=2",
            "train.warmup_iters=0",
            "train.device=cpu",
            "train.dtype=float32",
            "train.lr_schedule=constant",
            "train.learning_rate=1e-3",
            "train.min_lr=0",
        ],
    )
    result = train(c, progress=False)
    assert result.last_val_loss is not None and math.isfinite(result.last_val_loss)
    model = GPT(c.model)
    gate_group = build_optimizer(model, c.train, torch.device("cpu")).param_groups[-1]
    assert gate_group["weight_decay"] == 0.0 and gate_group["lr_mult"] == GATE_LR_MULT
    assert {id(p) for p in gate_group["params"]} == {id(b.attn.beta) for b in model.transformer.h}
    beta = load_checkpoint(tmp_path / "run" / "ckpt.pt")["model"]["transformer.h.0.attn.beta"]
    # Adam moves a parameter by about its lr per step: 6 steps at 10 × 1e-3 ≈ 0.06, not 0.006
    assert beta.abs().max() > 6 * 1e-3 * 2


@pytest.mark.parametrize("kw", [{}, {"pos": "rope", "memory_update": "delta", "n_kv_head": 2}])
def test_cached_generation_equals_recompute_segment_by_segment(kw):
    from quillgpt.inference.generate import generate_tokens

    torch.manual_seed(0)
    model = GPT(cfg(**kw))
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(8)
            block.attn.beta.fill_(2.0)  # read mostly from memory
    model.eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9]]  # rows of different lengths, no padding in the memory

    def run(use_cache):
        return torch.stack(list(generate_tokens(model, prompts, 26, temperature=1.0, seed=2, use_cache=use_cache)), 1)

    assert torch.equal(run(True), run(False))  # 33 tokens: 8 segments of 4, past block_size (12)


def test_a_long_generation_keeps_constant_memory():
    """Token by token through the engine: the row's state stays memory + one segment's K/V."""
    from quillgpt.inference.engine import Engine
    from quillgpt.sampling_params import SamplingParams

    torch.manual_seed(0)
    model = GPT(cfg(n_layer=1)).eval()
    engine = Engine(model, 1)
    engine.add([1, 2, 3], SamplingParams(max_new_tokens=800, temperature=1.0, seed=0))
    cache = engine._rows[0].cache
    sizes = (cache.kv_bytes, cache.memory_bytes)
    assert sizes == (2 * 1 * 4 * 4 * 4 * 4, 1 * 4 * (4 * 4 + 4) * 4)  # k+v (layers,rows,heads,segment,hd) fp32; M, z
    steps = 1
    while engine.active_rows():
        engine.step()
        steps += 1
        assert (cache.kv_bytes, cache.memory_bytes) == sizes and cache.n < 4
    assert steps == 800 and cache.seen == 802 and torch.isfinite(cache.mem).all()


def test_the_demo_configs_load():
    from pathlib import Path

    from quillgpt.config import load_config

    root = Path(__file__).resolve().parents[2]
    infini = load_config(root / "configs" / "infini_demo.yaml").model
    prefix = load_config(root / "configs" / "prefix_demo.yaml").model
    assert (infini.attention, infini.segment_size, infini.memory_update) == ("infini", 32, "delta")
    assert (prefix.attention, prefix.prefix_max) == ("prefix", 32)


def test_the_memory_stays_fp32_under_bf16_autocast():
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, 2, 8, 16, generator=g).bfloat16() for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, state, _ = infini_attend(k, k, v, SegmentState.empty(1, 2, 16, k), torch.zeros(2), 4, "delta")
    mem, norm = torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16)
    for s in (0, 4):
        mem, norm = write(mem, norm, k[:, :, s : s + 4].float(), v[:, :, s : s + 4].float(), "delta")
    assert state.mem.dtype == torch.float32 and torch.allclose(state.mem, mem, atol=1e-5)
