"""Prefix-LM (bidirectional prefix attention): the mask rule, the model, the training draws."""

import pytest
import torch

from quillgpt.checkpoint import load_checkpoint
from quillgpt.config import ModelConfig
from quillgpt.data.prefix_batches import PrefixLengths, mask_prefix_targets, separator_id
from quillgpt.errors import QuillError
from quillgpt.model.gpt import GPT
from quillgpt.model.variants.prefix import prefix_mask

V = 19


def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, block_size=16, n_layer=2, n_head=4, n_embd=16, attention="prefix")
    return ModelConfig(**{**base, **kw})


def brute_force(q_pos, k_pos, P, span):
    B, T, S = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    out = torch.zeros(B, 1, T, S, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for s in range(S):
                i, j = int(q_pos[b, t]), int(k_pos[b, s])
                causal = 0 <= j <= i and j > i - span
                both = 0 <= i < P[b] and 0 <= j < P[b]
                out[b, 0, t, s] = causal or both or i == j
    return out


def test_prefix_mask_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    pad = torch.tensor([0, 2, 0])
    q_pos = torch.arange(9)[None] - pad[:, None]  # left padding: negative positions
    P = torch.tensor([4, 3, 0])
    assert torch.equal(prefix_mask(q_pos, q_pos, P, 16), brute_force(q_pos, q_pos, P, 16))
    k_pos = torch.randint(-3, 12, (3, 14), generator=g)  # e.g. a cache's keys; decoding queries
    q_pos = torch.tensor([[9], [10], [3]])
    assert torch.equal(prefix_mask(q_pos, k_pos, P, 16), brute_force(q_pos, k_pos, P, 16))


def test_the_prefix_sees_both_ways_and_the_rest_only_left():
    torch.manual_seed(0)
    model = GPT(cfg()).eval()
    idx = torch.randint(V, (1, 10))
    P = torch.tensor([5])
    base, _ = model(idx, all_logits=True, prefix_len=P)
    right = idx.clone()
    right[0, 4] = (right[0, 4] + 1) % V  # the prefix's last token
    changed, _ = model(right, all_logits=True, prefix_len=P)
    assert not torch.allclose(changed[0, :4], base[0, :4])  # earlier prefix tokens see it
    later = idx.clone()
    later[0, 7] = (later[0, 7] + 1) % V  # after the prefix: only later tokens see it
    changed, _ = model(later, all_logits=True, prefix_len=P)
    assert torch.allclose(changed[0, :7], base[0, :7], atol=1e-6)
    causal, _ = model(idx, all_logits=True)
    assert torch.allclose(model(idx, all_logits=True, prefix_len=torch.tensor([1]))[0], causal, atol=1e-6)


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_fused_equals_math_and_cached_decoding_equals_recompute(pos):
    torch.manual_seed(0)
    model = GPT(cfg(pos=pos)).eval()
    math_model = GPT(cfg(pos=pos, attn_impl="math")).eval()
    math_model.load_state_dict(model.state_dict())
    idx = torch.randint(V, (3, 12))
    P = torch.tensor([0, 4, 9])
    fused, _ = model(idx, all_logits=True, prefix_len=P)
    assert torch.allclose(fused, math_model(idx, all_logits=True, prefix_len=P)[0], atol=1e-5)
    # the prompt (first 6 tokens, all prefix) prefilled at once, then one token at a time
    full, _ = model(idx, all_logits=True, prefix_len=torch.tensor([6] * 3))
    cache = model.make_cache(3)
    first, _ = model(idx[:, :6], pos=torch.arange(6), cache=cache, all_logits=True, prefix_len=torch.tensor([6] * 3))
    steps = [model(idx[:, t : t + 1], pos=torch.tensor([t]), cache=cache)[0] for t in range(6, 12)]
    assert torch.allclose(torch.cat([first, *steps], 1), full, atol=1e-5)


def test_training_targets_count_only_after_the_prefix():
    y = torch.arange(10, 16).repeat(3, 1)  # (3, 6)
    out = mask_prefix_targets(y, torch.tensor([0, 1, 4]))
    assert out[0].tolist() == y[0].tolist() and out[1].tolist() == y[1].tolist()
    assert out[2].tolist() == [-1, -1, -1, 13, 14, 15]  # position 3 (the prefix's last) predicts token 4


def test_prefix_lengths_are_seeded_resumable_and_in_range():
    c = cfg(prefix_max=6)
    a, b = PrefixLengths(c, seed=3), PrefixLengths(c, seed=3)
    x = torch.zeros(64, 16, dtype=torch.long)
    first = a.draw(x)
    assert 0 <= first.min() and first.max() <= 6 and len(set(first.tolist())) > 3
    state = a.state_dict()
    nxt = a.draw(x)
    b.draw(x)
    b.load_state_dict(state)
    assert torch.equal(b.draw(x), nxt)
    assert PrefixLengths(cfg(), seed=0).high == 8  # default: block_size / 2


def test_a_separator_sets_the_prefix():
    lengths = PrefixLengths(cfg(prefix_sep="="), seed=0, sep_id=7)
    x = torch.tensor([[1, 2, 7, 3, 7, 4], [1, 1, 1, 1, 1, 1]])
    P = lengths.draw(x)
    assert P[0] == 3 and 0 <= P[1] <= 8  # ends after the first "="; no separator: drawn
    assert separator_id(cfg(prefix_sep="="), lambda s: [7]) == 7
    with pytest.raises(QuillError, match="prefix_sep"):
        separator_id(cfg(prefix_sep="=>"), lambda s: [7, 8])


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"window": 4}, "model.window"),
        ({"attention": "causal", "prefix_max": 3}, "model.prefix_max"),
        ({"prefix_max": 17}, "model.prefix_max"),
    ],
)
def test_impossible_combinations_name_both_keys(kw, key):
    with pytest.raises(QuillError, match=key):
        cfg(**kw).validate()


def test_eval_scores_the_tokens_after_the_prefix():
    import numpy as np
    import torch.nn.functional as F

    from quillgpt.evaluate.scores import evaluate_tokens, evaluate_windows
    from quillgpt.model.variants.prefix import eval_prefix_len

    torch.manual_seed(0)
    model = GPT(cfg()).eval()
    tokens = np.random.default_rng(0).integers(0, V, 60)
    starts = np.array([0, 7, 30])
    got = evaluate_windows(model, tokens, starts)
    P = eval_prefix_len(model.config)  # 4: targets from position 3 on
    x = torch.from_numpy(tokens[starts[:, None] + np.arange(16)])
    y = torch.from_numpy(tokens[starts[:, None] + np.arange(1, 17)])
    logits, _ = model(x, all_logits=True, prefix_len=torch.tensor([P] * 3))
    want = F.cross_entropy(logits[:, P - 1 :].flatten(0, 1), y[:, P - 1 :].flatten(), reduction="sum")
    assert got.tokens == 3 * (16 - P + 1) and got.nats == pytest.approx(want.item(), rel=1e-5)
    # sliding pass, stride 4: each window's context is its prefix (window 2 starts at 4, scores 16..19)
    slid = evaluate_tokens(model, tokens[:21], stride=4)
    x2, y2 = torch.from_numpy(tokens[4:20])[None], torch.from_numpy(tokens[5:21])[None]
    l2, _ = model(x2, all_logits=True, prefix_len=torch.tensor([13]))  # skip 12 → inputs 0..12
    l1, _ = model(torch.from_numpy(tokens[:16])[None], all_logits=True, prefix_len=torch.tensor([1]))
    want = F.cross_entropy(l1[0], torch.from_numpy(tokens[1:17]), reduction="sum") + F.cross_entropy(
        l2[0, 12:], y2[0, 12:], reduction="sum"
    )
    assert slid.tokens == 20 and slid.nats == pytest.approx(want.item(), rel=1e-5)


def test_attention_view_shows_the_square_prompt_block():
    from quillgpt.data.tokenizer_files import build_tokenizer
    from quillgpt.evaluate import attention_views as viz

    tok = build_tokenizer("char", text="abcdefghij")
    torch.manual_seed(0)
    model = GPT(cfg(vocab_size=tok.vocab_size)).eval()
    attn = viz.attention_weights(model, tok, "abcde")
    assert attn.prefix == 5
    w = attn.weights[0]  # (H, 5, 5): the whole prompt is the prefix, every query sees every key
    assert (w > 0).all() and torch.allclose(w.sum(-1), torch.ones(4, 5))
    assert viz.visible(4, 2).tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    text = viz.render_text(attn.tokens, attn.weights, [0], [0], top_k=5, prefix=attn.prefix)
    assert text.splitlines()[1].count("@") == 5  # query 0 lists keys to its right too


def _tiny_run(shakespeare_path, tmp_path, out, *extra):
    from pathlib import Path

    from quillgpt.config import load_config

    root = Path(__file__).resolve().parents[2]
    return load_config(
        root / "configs" / "shakespeare_char_cpu.yaml",
        [
            f"data.path={shakespeare_path}",
            f"data.out_dir={tmp_path / 'data'}",
            f"train.out_dir={tmp_path / out}",
            "model.n_layer=2",
            "model.n_head=2",
            "model.n_embd=32",
            "model.block_size=16",
            "model.attention=prefix",
            "train.batch_size=4",
            "train.max_iters=6",
            "train.eval_interval=3",
            "train.eval_iters=2",
            "train.log_interval=1",
            "train.warmup_iters=2",
            "train.device=cpu",
            "train.dtype=float32",
            *extra,
        ],
    )


def test_quill_train_prefix_lm_resumes_bit_identically(shakespeare_path, tmp_path, monkeypatch):
    """Per-row prefix draws are part of the checkpoint: interrupted + resumed = straight through."""
    import os
    import signal

    import quillgpt.train.loop as train_mod
    from quillgpt.metrics_log import read_metrics

    straight = train_mod.train(_tiny_run(shakespeare_path, tmp_path, "a", "model.prefix_sep=,"), progress=False)
    original, calls = train_mod.train_step, {"n": 0}

    def step_then_interrupt(*args, **kwargs):
        out = original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(train_mod, "train_step", step_then_interrupt)
    assert train_mod.train(_tiny_run(shakespeare_path, tmp_path, "b", "model.prefix_sep=,"), progress=False).step == 2
    monkeypatch.undo()
    resumed = train_mod.train(_tiny_run(shakespeare_path, tmp_path, "b", "model.prefix_sep=,", "train.resume=true"), progress=False)
    assert resumed.step == straight.step == 6
    a, b = (load_checkpoint(tmp_path / r / "ckpt.pt") for r in "ab")
    assert "prefix" in a["sampler"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    la, lb = (read_metrics(tmp_path / r / "metrics.jsonl") for r in "ab")
    assert [r["train_loss"] for r in la] == [r["train_loss"] for r in lb]


def test_generation_must_fit_block_size():
    from quillgpt.inference.engine import check_room

    def check_fits(c, prompt_len, max_new_tokens):
        check_room(GPT(c), prompt_len, max_new_tokens)

    check_fits(cfg(), 10, 6)  # 16 = block_size: fine
    too_long = r"prompt \(10 tokens\) \+ max_new_tokens \(7\) exceeds block_size \(16\); lower --max-new-tokens to 6"
    with pytest.raises(QuillError, match=too_long):
        check_fits(cfg(), 10, 7)
    with pytest.raises(QuillError, match="shorten the prompt"):
        check_fits(cfg(), 17, 1)
    check_fits(cfg(attention="causal"), 100, 100)  # other variants crop or slide as before


def _sharp(model: GPT) -> GPT:
    """Sharpened attention, so that what a token may see decides the tokens sampled."""
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(8)
            block.attn.c_proj.weight.mul_(20)  # attention, not the embedding, dominates the stream
        model.lm_head.weight.mul_(10)  # (tied with wte) and confident logits
    return model.eval()


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_cached_generation_equals_recompute_and_uses_the_prefix(pos):
    from quillgpt.inference.generate import generate_tokens

    torch.manual_seed(0)
    model = _sharp(GPT(cfg(pos=pos)))
    causal = GPT(cfg(pos=pos, attention="causal")).eval()
    causal.load_state_dict(model.state_dict())
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]  # different lengths: left padding in the recompute

    def run(m, use_cache):
        return torch.stack(list(generate_tokens(m, prompts, 9, temperature=1.0, seed=5, use_cache=use_cache)), 1)

    cached = run(model, True)
    assert torch.equal(cached, run(model, False))
    assert not torch.equal(cached, run(causal, True))  # the bidirectional prompt changes what comes out


@pytest.mark.parametrize("use_cache", [True, False])
def test_past_block_size_is_refused_not_cropped(use_cache):
    from quillgpt.inference.generate import generate_tokens

    model = GPT(cfg()).eval()
    with pytest.raises(QuillError, match=r"prompt \(7 tokens\) \+ max_new_tokens \(10\) exceeds block_size \(16\)"):
        list(generate_tokens(model, [[1] * 7], 10, use_cache=use_cache))
    assert len(list(generate_tokens(model, [[1] * 7], 9, use_cache=use_cache))) == 9  # exactly fills it


def test_gpt2_export_refuses_both_variants():
    from quillgpt.interop.gpt2 import gpt2_incompatibilities

    assert gpt2_incompatibilities(cfg(bias=True)) == ["model.attention=prefix: GPT-2 has causal attention only"]
    infini = cfg(attention="infini", segment_size=4)
    assert gpt2_incompatibilities(infini) == ["model.attention=infini: GPT-2 has causal attention only"]
