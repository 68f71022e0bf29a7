"""GPT: names and init, causality, sdpa = math, KV cache = full forward, padding invariance,
cache memory, parameter/FLOP accounting, and that every variant learns."""

import pytest
import torch
from support import BLOCK, VARIANTS, V

from quillgpt.config import ModelConfig
from quillgpt.model.gpt import GPT
from quillgpt.model.kv_cache import shared_prefix_len

ROPE = [k for k, v in VARIANTS.items() if v.get("pos") == "rope"]
variants = pytest.mark.parametrize("variant", list(VARIANTS))


def config(variant: str = "mha-learned", **kw) -> ModelConfig:
    base = dict(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32)
    return ModelConfig(**{**base, **VARIANTS[variant], **kw})


def random_model(variant: str = "mha-learned", seed: int = 0, **kw) -> GPT:
    """A model with larger random weights than GPT-2's init, so logits are far from uniform."""
    torch.manual_seed(seed)
    model = GPT(config(variant, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_gain = ".ln_" in name and name.endswith("weight")
            p.normal_(1.0 if is_gain else 0.0, 0.3 if p.dim() > 1 else 0.1)
    return model.eval()


def test_vocab_size_is_required():
    with pytest.raises(ValueError, match="vocab_size"):
        GPT(ModelConfig())


def test_parameter_names_and_shapes_follow_hf_gpt2():
    model = GPT(config())
    C = 32
    expected = {
        "transformer.wte.weight": (V, C),
        "transformer.wpe.weight": (BLOCK, C),
        "transformer.ln_f.weight": (C,),
        "transformer.ln_f.bias": (C,),
        "lm_head.weight": (V, C),
    }
    for i in range(2):
        for name, shape in {
            "ln_1": (C,),
            "ln_2": (C,),
            "attn.c_attn": (3 * C, C),
            "attn.c_proj": (C, C),
            "mlp.c_fc": (4 * C, C),
            "mlp.c_proj": (C, 4 * C),
        }.items():
            expected[f"transformer.h.{i}.{name}.weight"] = shape
            expected[f"transformer.h.{i}.{name}.bias"] = shape[:1]
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected
    assert model.lm_head.weight is model.transformer.wte.weight

    gqa = GPT(config("rmsnorm-swiglu", n_kv_head=1))
    names = set(gqa.state_dict())
    assert "transformer.wpe.weight" not in names and not any(n.endswith(".bias") for n in names)
    block = gqa.transformer.h[0]
    assert block.attn.c_attn.weight.shape == ((4 + 2 * 1) * 8, C)
    assert block.mlp.c_fc.weight.shape == (2 * gqa.config.hidden_dim, C)
    assert gqa.lm_head.weight is not gqa.transformer.wte.weight


def test_gpt2_init():
    torch.manual_seed(0)
    n_layer = 4
    model = GPT(ModelConfig(vocab_size=500, block_size=64, n_layer=n_layer, n_head=4, n_embd=128))
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(0.02 / (2 * n_layer) ** 0.5, rel=0.1), name
        elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
            assert p.std().item() == pytest.approx(0.02, rel=0.1), name
        elif name.endswith("bias"):
            assert (p == 0).all(), name
        else:
            assert (p == 1).all(), name  # norm gains


def test_logits_and_loss():
    model = random_model()
    idx, targets = torch.randint(0, V, (2, 9)), torch.randint(0, V, (2, 9))
    last, loss = model(idx)
    full, _ = model(idx, all_logits=True)
    assert loss is None and last.shape == (2, 1, V) and full.shape == (2, 9, V)
    torch.testing.assert_close(last[:, 0], full[:, -1])
    targets[0, :4] = -1  # ignored positions
    logits, loss = model(idx, targets)
    keep = targets != -1
    expected = torch.nn.functional.cross_entropy(full[keep], targets[keep])
    torch.testing.assert_close(logits, full)
    torch.testing.assert_close(loss, expected)


@variants
def test_causality(variant):
    model = random_model(variant)
    idx = torch.randint(0, V, (2, BLOCK))
    changed = idx.clone()
    changed[:, 9] = (idx[:, 9] + 1) % V
    a, _ = model(idx, all_logits=True)
    b, _ = model(changed, all_logits=True)
    torch.testing.assert_close(a[:, :9], b[:, :9], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 9], b[:, 9])


@variants
def test_sdpa_equals_math(variant):
    sdpa = random_model(variant)
    math = GPT(config(variant, attn_impl="math")).eval()
    math.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, V, (2, BLOCK))
    pos = torch.arange(BLOCK)[None] - torch.tensor([[0], [6]])  # second row left-padded by 6
    for kw in ({}, {"pos": pos}):
        torch.testing.assert_close(sdpa(idx, all_logits=True, **kw)[0], math(idx, all_logits=True, **kw)[0], atol=1e-5, rtol=1e-5)


@variants
def test_prefill_then_decode_equals_full_forward(variant):
    model = random_model(variant)
    idx = torch.randint(0, V, (2, BLOCK))
    full, _ = model(idx, all_logits=True)
    for chunks in ([7] + [1] * 9, [4, 5] + [1] * 7):  # one prefill; a prefill then a second chunk
        cache = model.make_cache(2)
        outs, t = [], 0
        for n in chunks:
            outs.append(model(idx[:, t : t + n], pos=torch.arange(t, t + n), cache=cache, all_logits=True)[0])
            t += n
        torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ROPE)
def test_rope_ring_buffer_equals_banded_forward_past_block_size(variant):
    """RoPE beyond block_size: every layer sees the last min(window, block) positions; the
    cache rolls in place and reproduces a forward over the whole stream."""
    model = random_model(variant)
    idx = torch.randint(0, V, (2, 3 * BLOCK))
    full, _ = model(idx, all_logits=True)
    cache = model.make_cache(2)
    keys = [k.data_ptr() for k in cache.k]
    outs = [model(idx[:, :10], pos=torch.arange(10), cache=cache, all_logits=True)[0]]
    outs += [model(idx[:, t : t + 1], pos=torch.tensor([t]), cache=cache)[0] for t in range(10, 3 * BLOCK)]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)
    assert [k.data_ptr() for k in cache.k] == keys and cache.capacity == min(model.config.window or BLOCK, BLOCK)


def test_learned_positions_refuse_more_than_block_size():
    with pytest.raises(ValueError, match="block_size"):
        random_model()(torch.zeros(1, BLOCK + 1, dtype=torch.long))


@variants
def test_left_padding_never_changes_a_row(variant):
    model = random_model(variant)
    lengths = [BLOCK - 3, 8, 3]
    rows = [torch.randint(0, V, (n,)) for n in lengths]
    W = max(lengths)
    idx = torch.stack([torch.cat([torch.full((W - len(r),), 5), r]) for r in rows])  # pad token 5
    pos = torch.arange(W)[None] - torch.tensor([[W - n] for n in lengths])
    nxt = torch.randint(0, V, (3, 3))  # three decode steps after the prompts

    batch, _ = model(idx, pos=pos, all_logits=True)
    cache = model.make_cache(3)
    model(idx, pos=pos, cache=cache)
    steps = [model(nxt[:, i : i + 1], pos=pos[:, -1:] + 1 + i, cache=cache)[0] for i in range(3)]
    for r, row in enumerate(rows):
        alone, _ = model(row[None], all_logits=True)
        torch.testing.assert_close(batch[r, W - len(row) :], alone[0], atol=1e-5, rtol=1e-5)
        alone_steps, _ = model(torch.cat([row, nxt[r]])[None], all_logits=True)
        for i in range(3):
            torch.testing.assert_close(steps[i][r, 0], alone_steps[0, len(row) + i], atol=1e-5, rtol=1e-5)


def shared_prefix_batch(P: int, widths: list[int], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that share their first P tokens, then differ, right-padded, scored after the prefix."""
    torch.manual_seed(1)
    prefix, T = torch.randint(1, V, (P,)), max(widths)
    x = torch.full((len(widths), T), pad)
    y = torch.full((len(widths), T), -1)
    for r, w in enumerate(widths):
        tail = torch.randint(1, V, (w - P,))
        tail[0] = 1 + (tail[0] + r) % (V - 1)  # rows differ right after the prefix
        x[r, :w] = torch.cat([prefix, tail])
        y[r, P + 1 : w - 1] = x[r, P + 2 : w]  # the tokens after the first past the prefix
    return x, y


@variants
def test_a_shared_prefix_gives_the_same_loss_and_gradients(variant):
    """share_prefix runs the rows' common first tokens once: the loss and every gradient equal
    the full batch's (each row runs its own copy)."""
    model = random_model(variant).train()
    x, y = shared_prefix_batch(9, [BLOCK, BLOCK - 3, 12])
    assert shared_prefix_len(x, y) == 9
    grads = []
    for share in (False, True):
        model.zero_grad()
        _, loss = model(x, y, scored_only=True, share_prefix=share)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (full, g_full), (shared, g_shared) = grads
    torch.testing.assert_close(shared, full, atol=1e-6, rtol=1e-6)
    for n, g in g_full.items():
        torch.testing.assert_close(g_shared[n], g, atol=1e-5, rtol=1e-5)


def test_a_shared_prefix_under_activation_checkpointing_gives_the_same_gradients():
    """Recomputing a block in backward runs its PrefixKV store again: the gradients still equal."""
    from torch.distributed._composable import checkpoint

    x, y = shared_prefix_batch(9, [BLOCK, BLOCK - 3, 12])
    grads = []
    for share, recompute in ((False, False), (True, True)):
        model = random_model("rope-window-gqa").train()
        for block in model.transformer.h if recompute else []:
            checkpoint(block)
        model(x, y, scored_only=True, share_prefix=share)[1].backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-5, rtol=1e-5)


def test_a_shared_prefix_is_only_taken_where_it_is_exact():
    x, y = shared_prefix_batch(9, [BLOCK, BLOCK - 3, 12])
    y2 = y.clone()
    y2[1, 4] = 3  # a scored target inside the common tokens ends the prefix there
    assert shared_prefix_len(x, y2) == 4
    assert shared_prefix_len(x[:1], y[:1]) == 10  # one row: up to its first scored target
    model = random_model("rope").train()
    assert model._shareable_prefix(x, y2) == 0  # shorter than MIN_SHARED_PREFIX
    assert model._shareable_prefix(x[:1], y[:1]) == 0  # one row
    assert model._shareable_prefix(x, y) == 9
    assert random_model("rope", dropout=0.1).train()._shareable_prefix(x, y) == 0  # one dropout mask for all rows


@variants
def test_kv_cache_memory(variant):
    model = random_model(variant)
    cfg = model.config
    capacity = min(cfg.window or BLOCK, BLOCK)
    per_token = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_size  # keys + values, every layer
    assert model.make_cache(3).nbytes == 3 * capacity * per_token * 4
    assert model.make_cache(3, dtype=torch.bfloat16).nbytes == 3 * capacity * per_token * 2
    assert [k.shape for k in model.make_cache(1, capacity=100).k] == [(1, cfg.kv_heads, 100, cfg.head_size)] * cfg.n_layer
    mha = random_model(variant, n_kv_head=None)
    assert mha.make_cache(3).nbytes == model.make_cache(3).nbytes * cfg.n_head // cfg.kv_heads


def test_num_params_and_flops():
    C, L = 32, 2
    per_layer = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C)
    core = L * per_layer + 2 * C  # blocks + ln_f
    tied = GPT(config())
    assert tied.num_params(non_embedding=False) == V * C + BLOCK * C + core  # wte counted once
    assert tied.num_params() == V * C + core  # minus wpe; wte stays (it is also the head)
    untied = GPT(config(tie_embeddings=False))
    assert untied.num_params(non_embedding=False) == 2 * V * C + BLOCK * C + core
    assert untied.num_params() == V * C + core  # minus wpe and the wte lookup
    assert tied.flops_per_token() == 6 * tied.num_params() + 12 * L * 4 * 8 * BLOCK
    windowed = GPT(config("window"))
    assert windowed.flops_per_token() == 6 * windowed.num_params() + 12 * L * 4 * 8 * 5


@pytest.mark.parametrize("variant", ["mha-learned", "window", "rope-window-gqa"])
def test_attention_maps(variant):
    model = random_model(variant)
    maps = model.attention_maps(torch.randint(0, V, (2, 12)))
    assert len(maps) == 2
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    outside = (j > i) | (i - j >= (model.config.window or BLOCK))
    for w in maps:
        assert w.shape == (2, 4, 12, 12)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 12))
        assert (w[..., outside] == 0).all()


@variants
def test_every_variant_learns_tiny_shakespeare(variant, shakespeare_path):
    text = shakespeare_path.read_text(encoding="utf-8")[:20000]
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    torch.manual_seed(0)
    model = GPT(config(variant, vocab_size=len(chars), block_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        starts = torch.randint(0, len(data) - 33, (16,), generator=gen)
        x = torch.stack([data[s : s + 32] for s in starts])
        y = torch.stack([data[s + 1 : s + 33] for s in starts])
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, (first, last)


# --- Gemma 3's layer features, each against the plain computation --------------------------------

GEMMA = dict(pos="rope", norm="rmsnorm", bias=False, qk_norm=True, n_kv_head=2, head_dim=12, mlp="geglu", embed_scale=True)
GEMMA.update(sandwich_norm=True, attn_scale=0.2, window=5, global_every=3, local_rope_theta=100.0, rope_theta=1e4)
GEMMA_FEATURES = {  # each feature alone on a plain RoPE/RMSNorm model, then all of them (Gemma 3's shape)
    "geglu": dict(mlp="geglu"),
    "embed_scale": dict(embed_scale=True),
    "sandwich_norm": dict(sandwich_norm=True),
    "attn_scale": dict(attn_scale=0.2),
    "global_every": dict(window=5, global_every=3, local_rope_theta=100.0),
    "global_every-scaled": dict(window=5, global_every=2, rope_scaling="linear", rope_factor=4.0),
    "gemma3": GEMMA,
}


def gemma_model(features: dict, seed: int = 0, **kw) -> GPT:
    base = dict(pos="rope", norm="rmsnorm", bias=False, n_layer=3)
    return random_model("mha-learned", seed, **{**base, **features, **kw})


def plain_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The logits of idx (1, T) spelled out token by token from the weights, as transformers'
    Gemma3ForCausalLM computes them (its (1 + w) norms being quill's w): no shared code but rms_norm."""
    cfg, sd = model.config, {k: v.double() for k, v in model.state_dict().items()}
    C, H, KV, hd, T = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_size, idx.shape[1]

    def norm(x, name):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), sd[name], cfg.norm_eps)

    def rope(x, theta, factor):  # x (T, hd): rotate (i, i + hd/2) by t·θ^(-2i/hd)/factor
        inv = theta ** -(torch.arange(0, hd, 2).double() / hd) / factor
        ang = torch.arange(T).double()[:, None] * inv
        c, s = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        return x * c + torch.cat([-x[:, hd // 2 :], x[:, : hd // 2]], -1) * s

    x = sd["transformer.wte.weight"][idx[0]] * (C**0.5 if cfg.embed_scale else 1.0)
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        local = cfg.window is not None and (cfg.global_every is None or (i + 1) % cfg.global_every != 0)
        theta = (cfg.local_rope_theta or cfg.rope_theta) if local and cfg.global_every else cfg.rope_theta
        factor = cfg.rope_factor if cfg.rope_scaling == "linear" and not (local and cfg.global_every) else 1.0
        h = norm(x, p + "ln_1.weight")
        qkv = h @ sd[p + "attn.c_attn.weight"].T
        heads = []
        for j in range(H):
            q = qkv[:, j * hd : (j + 1) * hd]
            g = j // (H // KV)
            k = qkv[:, (H + g) * hd : (H + g + 1) * hd]
            v = qkv[:, (H + KV + g) * hd : (H + KV + g + 1) * hd]
            if cfg.qk_norm:
                q, k = norm(q, p + "attn.q_norm.weight"), norm(k, p + "attn.k_norm.weight")
            q, k = rope(q, theta, factor), rope(k, theta, factor)
            scores = (q @ k.T) * (cfg.attn_scale or hd**-0.5)
            t = torch.arange(T)
            seen = (t[None] <= t[:, None]) & ((t[None] > t[:, None] - cfg.window) if local else True)
            heads.append(scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v)
        a = torch.cat(heads, -1) @ sd[p + "attn.c_proj.weight"].T
        x = x + (norm(a, p + "ln_attn_out.weight") if cfg.sandwich_norm else a)
        gate, up = (norm(x, p + "ln_2.weight") @ sd[p + "mlp.c_fc.weight"].T).chunk(2, -1)
        act = torch.nn.functional.gelu(gate, approximate="tanh") if cfg.mlp == "geglu" else torch.nn.functional.silu(gate)
        m = (act * up) @ sd[p + "mlp.c_proj.weight"].T
        x = x + (norm(m, p + "ln_mlp_out.weight") if cfg.sandwich_norm else m)
    return norm(x, "transformer.ln_f.weight") @ sd["lm_head.weight"].T


@pytest.mark.parametrize("feature", list(GEMMA_FEATURES))
def test_gemma_features_compute_the_plain_computation(feature):
    """Each of Gemma 3's features (and all of them) = the spelled-out float64 computation, on a
    sequence longer than the window so the windowed layers' band and RoPE base matter."""
    model = gemma_model({"mlp": "swiglu", **GEMMA_FEATURES[feature]})
    idx = torch.randint(0, V, (1, BLOCK))
    logits, _ = model(idx, all_logits=True)
    torch.testing.assert_close(logits[0].double(), plain_forward(model, idx), atol=2e-4, rtol=1e-4)
    if feature != "gemma3":  # the feature changes what is computed
        plain = gemma_model({"mlp": "swiglu"})
        plain.load_state_dict(model.state_dict(), strict=False)
        assert not torch.allclose(plain(idx, all_logits=True)[0], logits, atol=1e-3)


def test_gemma_norms_under_bf16_autocast_take_their_gains_dtype(monkeypatch):
    """Training's bf16 autocast (quill finetune of Gemma 3): the attention and MLP outputs come out of
    their linears in bf16, and the sandwich norms' gains are fp32; every rms_norm gets its input and
    gain in one dtype (mixed ones fall back to a composite kernel, with a warning), and the loss
    still reaches every gain."""
    calls = []
    rms_norm = torch.nn.functional.rms_norm

    def spy(x, shape, weight=None, eps=None):
        calls.append((x.dtype, weight.dtype))
        return rms_norm(x, shape, weight, eps)

    monkeypatch.setattr(torch.nn.functional, "rms_norm", spy)
    model = gemma_model(GEMMA).train()
    idx = torch.randint(0, V, (2, BLOCK))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, targets=idx)
    loss.backward()
    assert calls and all(x == w for x, w in calls), set(calls)
    assert all(p.grad is not None for n, p in model.named_parameters() if ".ln_" in n)


@pytest.mark.parametrize("feature", ["global_every", "gemma3"])
def test_gemma_layers_through_the_cache_and_the_decode_step_equal_the_forward(feature):
    """Per-layer windows in every path: sdpa = math, prefill in chunks through the cache, the
    decode step (GPT.decode, each layer kind with its own mask and RoPE) = the full forward."""
    model = gemma_model(GEMMA_FEATURES[feature])
    math = gemma_model(GEMMA_FEATURES[feature], attn_impl="math")
    math.load_state_dict(model.state_dict())
    idx = torch.randint(0, V, (2, BLOCK))
    full, _ = model(idx, all_logits=True)
    torch.testing.assert_close(math(idx, all_logits=True)[0], full, atol=1e-5, rtol=1e-5)
    assert model.span == BLOCK and model.make_cache(2).capacity == BLOCK
    cache = model.make_cache(2)
    outs = [model(idx[:, :4], pos=torch.arange(4), cache=cache, all_logits=True)[0]]
    outs.append(model(idx[:, 4:9], pos=torch.arange(4, 9), cache=cache, all_logits=True)[0])
    for t in range(9, BLOCK):
        outs.append(model.decode(idx[:, t], torch.full((2,), t), cache)[:, None])
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_embed_scale_rounds_its_factor_to_the_weights_dtype():
    """As transformers' Gemma: √n_embd in the embedding's dtype, then the product (bf16 here)."""
    model = gemma_model({"embed_scale": True}).to(torch.bfloat16)
    idx = torch.arange(6)[None]
    factor = torch.tensor(32**0.5).to(torch.bfloat16)
    torch.testing.assert_close(model._embed(idx, None), model.transformer.wte(idx) * factor, atol=0, rtol=0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(global_every=3), "global_every must be from 2 to 1,024 with model.window set"),
        (dict(window=4, global_every=1), "global_every must be from 2"),
        (dict(local_rope_theta=100.0), "local_rope_theta"),
        (dict(window=4, global_every=2, local_rope_theta=-1.0), "local_rope_theta"),
        (dict(attn_scale=0.0), "attn_scale must be positive"),
        (dict(attn_scale=0.1, attention="infini", segment_size=8), "attn_scale"),
    ],
)
def test_gemma_keys_are_checked(bad, match):
    from quillgpt.errors import QuillError

    with pytest.raises(QuillError, match=match):
        ModelConfig(**{"vocab_size": V, "pos": "rope", **bad}).validate()
