"""The modern small-GPT options (ReLU², QK-norm, logit soft-capping, zero-init output projections,
Muon): each equals its formula, is off by default, trains, and resumes bit for bit."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from support import interrupt_after

import quillgpt.train.schedule as schedule
from quillgpt.checkpoint import load_checkpoint
from quillgpt.config import ModelConfig, TrainConfig, load_config
from quillgpt.errors import QuillError
from quillgpt.interop.gpt2 import gpt2_incompatibilities
from quillgpt.metrics_log import read_metrics
from quillgpt.model.attention import CausalSelfAttention
from quillgpt.model.gpt import GPT, MLP, ReLUSquared
from quillgpt.train.loop import train
from quillgpt.train.optim import Muon, MuonAdamW, build_optimizer, newton_schulz

ROOT = Path(__file__).resolve().parents[2]
V = 37
CPU = torch.device("cpu")


def model_config(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": V, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, **kw})


def randomized(model: GPT, seed: int = 0) -> GPT:
    """Large random weights (gains around 1), so every term of a formula matters."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = name.endswith("norm.weight") or ".ln_" in name and name.endswith("weight")
            p.normal_(1.0 if gain else 0.0, 0.3)
    return model.eval()


def test_defaults_keep_the_classic_gpt():
    cfg = ModelConfig()
    assert (cfg.mlp, cfg.qk_norm, cfg.logit_softcap, cfg.zero_init_proj) == ("gelu", False, None, False)
    assert TrainConfig().optimizer == "adamw"
    attn = GPT(model_config()).transformer.h[0].attn
    assert attn.q_norm is None and attn.k_norm is None


def test_relu2_mlp_is_relu_squared():
    mlp = MLP(model_config(mlp="relu2")).eval()
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    expected = mlp.c_proj(F.relu(mlp.c_fc(x)) ** 2)
    torch.testing.assert_close(mlp(x), expected)
    assert mlp.c_fc.out_features == 4 * 32


def test_relu2_backward_is_autograds():
    """ReLUSquared's hand-written backward against autograd's through relu(h).square(), h = 0 included."""
    h = torch.cat([torch.randn(40, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)]).requires_grad_()
    grad = torch.randn(43, dtype=torch.float64)
    (ours,) = torch.autograd.grad(ReLUSquared.apply(h), h, grad)
    (ref,) = torch.autograd.grad(F.relu(h).square(), h, grad)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert torch.autograd.gradcheck(ReLUSquared.apply, (torch.randn(20, dtype=torch.float64, requires_grad=True),))


def test_qk_norm_normalises_each_heads_queries_and_keys():
    cfg = model_config(qk_norm=True, bias=False)
    attn = CausalSelfAttention(cfg).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        attn.q_norm.weight.normal_(1.0, 0.5)
        attn.k_norm.weight.normal_(1.0, 0.5)
    x = torch.randn(2, 7, 32)
    B, T, H, hd = 2, 7, 4, 8
    q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in attn.c_attn(x).split(32, dim=2))

    def rms_norm(t, gain):  # per head: t / sqrt(mean over the head's dims of t² + eps) · gain
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * gain

    q, k = rms_norm(q, attn.q_norm.weight), rms_norm(k, attn.k_norm.weight)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    expected = attn.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 32))
    torch.testing.assert_close(attn(x)[0], expected, atol=1e-5, rtol=1e-5)


def test_logit_softcap_is_c_tanh_of_the_logits_and_bounds_them():
    c = 2.0
    capped = randomized(GPT(model_config(logit_softcap=c)))
    plain = GPT(model_config()).eval()
    plain.load_state_dict(capped.state_dict())
    idx = torch.randint(0, V, (3, 16))
    raw, _ = plain(idx, all_logits=True)
    logits, _ = capped(idx, all_logits=True)
    torch.testing.assert_close(logits, c * torch.tanh(raw / c))
    assert raw.abs().max() > c > logits.abs().max()
    # the loss is on the capped logits
    _, loss = capped(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(loss, F.cross_entropy(logits[:, :-1].reshape(-1, V), idx[:, 1:].reshape(-1)))


@pytest.mark.parametrize("options", [{"logit_softcap": 3.0, "qk_norm": True, "pos": "rope", "mlp": "relu2"}, {"qk_norm": True}])
def test_kv_cache_and_decode_step_equal_the_full_forward(options):
    """The cache path and the engine's decode step see the same options (cap, QK-norm, ReLU²)."""
    model = randomized(GPT(model_config(**options)))
    idx = torch.randint(0, V, (2, 16))
    full, _ = model(idx, all_logits=True)
    cache = model.make_cache(2)
    prefill, _ = model(idx[:, :10], pos=torch.arange(10), cache=cache, all_logits=True)
    torch.testing.assert_close(prefill, full[:, :10], atol=1e-5, rtol=1e-5)
    for t in range(10, 16):
        step = model.decode(idx[:, t], torch.full((2,), t), cache)
        torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)


def test_zero_init_projections_start_every_block_as_the_identity():
    torch.manual_seed(0)
    model = GPT(model_config(zero_init_proj=True)).eval()
    projections = [p for n, p in model.named_parameters() if n.endswith("c_proj.weight")]
    assert len(projections) == 4 and all(not p.any() for p in projections)
    assert all(p.std() > 0 for n, p in model.named_parameters() if n.endswith(("c_attn.weight", "c_fc.weight")))
    idx = torch.randint(0, V, (2, 16))
    tr = model.transformer
    embeddings = tr.wte(idx) + tr.wpe(torch.arange(16))
    torch.testing.assert_close(model._hidden(idx, None, None, need_weights=False)[0], tr.ln_f(embeddings))
    default = GPT(model_config())
    assert all(p.std() > 0 for n, p in default.named_parameters() if n.endswith("c_proj.weight"))


def test_muon_takes_exactly_the_hidden_matrices():
    model = GPT(model_config(tie_embeddings=False, mlp="relu2", qk_norm=True))
    opt = build_optimizer(model, TrainConfig(optimizer="muon", learning_rate=1e-3, muon_lr=0.02), CPU)
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert muon == {f"transformer.h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert adamw == set(names.values()) - muon
    assert {"transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight", "transformer.h.0.attn.q_norm.weight"} <= adamw
    (group,) = opt.muon.param_groups
    assert group["lr_mult"] * 1e-3 == pytest.approx(0.02)  # the loop sets lr × lr_mult: muon_lr at peak
    assert group["lr"] * group["weight_decay"] == pytest.approx(1e-3 * 0.1)  # same shrink per step as AdamW's
    assert len(opt.param_groups) == len(opt.adamw.param_groups) + 1


NS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's default Newton–Schulz coefficients


def muon_steps_beside_torchs(weights: list[torch.Tensor]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Copies of `weights` after three steps with the same random gradients: quill's Muon (bf16
    Newton–Schulz) and torch.optim.Muon."""
    ours = [torch.nn.Parameter(w.clone()) for w in weights]
    ref = [torch.nn.Parameter(w.clone()) for w in weights]
    opt_ours = Muon(ours, torch.bfloat16, lr=0.02, weight_decay=0.1, momentum=0.9)
    opt_ref = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, momentum=0.9)
    for _ in range(3):
        for a, b in zip(ours, ref):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_ref.step()
    return ours, ref


def test_muon_step_equals_torchs_muon_in_bfloat16_and_orthogonalises_in_float32():
    torch.manual_seed(0)
    weights = [torch.randn(24, 8), torch.randn(8, 24)]
    ours, ref = muon_steps_beside_torchs(weights)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    g = torch.randn(16, 48)
    o32 = newton_schulz(g, NS, 5, 1e-7, torch.float32)
    assert o32.dtype == torch.float32
    singular = torch.linalg.svdvals(o32)
    assert singular.min() > 0.5 and singular.max() < 1.3  # ≈ orthogonal (Muon's NS is loose by design)
    o16 = newton_schulz(g, NS, 5, 1e-7, torch.bfloat16)
    torch.testing.assert_close(o32, o16.float(), atol=0.05, rtol=0.05)


def test_muon_batches_same_shaped_matrices_as_torchs_muon_does_them_one_by_one():
    """Muon's Newton–Schulz runs once per shape on the stacked matrices: the batched path against
    torch.optim.Muon's per-matrix loop (both in bfloat16, so they differ by summation order only)."""
    torch.manual_seed(1)
    weights = [torch.randn(24, 8) for _ in range(3)] + [torch.randn(8, 24) for _ in range(2)] + [torch.randn(8, 8)]
    ours, ref = muon_steps_beside_torchs(weights)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)  # a step moves each weight by ~lr = 0.02
    stacked = torch.stack([w.grad for w in ours[:3]])
    batched = newton_schulz(stacked, NS, 5, 1e-7, torch.float32)
    for i in range(3):
        torch.testing.assert_close(batched[i], newton_schulz(stacked[i], NS, 5, 1e-7, torch.float32), atol=1e-6, rtol=1e-5)
        assert not torch.equal(batched[i], batched[(i + 1) % 3])  # each matrix its own result


@pytest.mark.parametrize(
    "options",
    [{"mlp": "relu2"}, {"qk_norm": True}, {"logit_softcap": 5.0}, {"zero_init_proj": True}, {"tie_embeddings": False}, "muon"],
    ids=["relu2", "qk_norm", "softcap", "zero_init", "untied", "muon"],
)
def test_each_option_learns_a_batch(options):
    torch.manual_seed(0)
    model = GPT(model_config(**({} if options == "muon" else options)))
    tc = TrainConfig(optimizer="muon" if options == "muon" else "adamw", learning_rate=3e-3)
    opt = build_optimizer(model, tc, CPU)
    idx = torch.randint(0, V, (8, 17))
    losses = []
    for _ in range(30):
        for g in opt.param_groups:
            g["lr"] = tc.learning_rate * g.get("lr_mult", 1.0)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def tiny_overrides(shakespeare_path, data_dir, out_dir, *extra):
    return [
        f"data.path={shakespeare_path}",
        f"data.out_dir={data_dir}",
        f"train.out_dir={out_dir}",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.batch_size=4",
        "train.eval_iters=2",
        "train.log_interval=1",
        "train.warmup_iters=2",
        "train.device=cpu",
        *extra,
    ]


ALL_OPTIONS = [
    "train.optimizer=muon",
    "model.mlp=relu2",
    "model.qk_norm=true",
    "model.logit_softcap=10",
    "model.zero_init_proj=true",
    "model.tie_embeddings=false",
    "model.pos=rope",
    "model.norm=rmsnorm",
]


def test_all_options_train_and_resume_bit_identically(shakespeare_path, tmp_path, monkeypatch):
    data = tmp_path / "data"

    def cfg(out, *extra):
        return load_config(
            ROOT / "configs" / "shakespeare_char_cpu.yaml",
            tiny_overrides(shakespeare_path, data, out, *ALL_OPTIONS, "train.max_iters=12", "train.eval_interval=6", *extra),
        )

    straight = train(cfg(tmp_path / "a"), progress=False)
    interrupt_after(monkeypatch, 5)
    assert train(cfg(tmp_path / "b"), progress=False).step == 5
    monkeypatch.undo()
    resumed = train(cfg(tmp_path / "b", "train.resume=true"), progress=False)
    assert straight.step == resumed.step == 12
    a, b = (load_checkpoint(tmp_path / run / "ckpt.pt") for run in "ab")
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert set(a["optimizer"]) == {"adamw", "muon"}
    rows = [(r["step"], r["train_loss"], r.get("val_loss")) for r in read_metrics(tmp_path / "a" / "metrics.jsonl")]
    assert rows == [(r["step"], r["train_loss"], r.get("val_loss")) for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert rows[-1][1] < rows[0][1] - 0.2  # it learns
    with pytest.raises(QuillError, match="train.optimizer: muon → adamw"):
        train(cfg(tmp_path / "a", "train.resume=true", "train.optimizer=adamw", "train.max_iters=14"), progress=False)


def test_a_time_budget_stops_while_one_step_and_the_final_evaluation_still_fit(monkeypatch):
    """At 8.0 s of 10 (0.5 s/step, last evaluation + checkpoint took 1.0 s) one more step fits;
    at 8.6 s it does not: the run ends there, so its final evaluation and checkpoint end by 10 s."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(schedule.time, "time", lambda: clock["now"])
    t = SimpleNamespace(
        budget_s=10.0,
        budget_ended=False,
        fitted=True,
        fit_at=10,
        fit_step=10,
        horizon=10_000,
        step=16,
        first_step=0,
        t_start=1000.0,
        reserve_s=1.0,
        pace_mark=(1000.0, 0),
        cfg=SimpleNamespace(train=TrainConfig(max_iters=10_000)),
        ddp=SimpleNamespace(any=bool, world_size=1),
    )
    t.elapsed = lambda: clock["now"] - t.t_start
    clock["now"] = 1008.0
    schedule.follow_budget(t, lambda line: None)
    assert not t.budget_ended and t.horizon == 10_000
    clock["now"] = 1008.6
    schedule.follow_budget(t, lambda line: None)
    assert t.budget_ended and t.horizon == 16


def test_the_pace_leaves_out_the_first_steps_one_time_costs(monkeypatch):
    """A first step of 20 s (lazy start-up) then 0.5 s steps: the horizon is fitted to 0.5 s/step."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(schedule.time, "time", lambda: clock["now"])
    tc = TrainConfig(max_iters=10_000, warmup_iters=0, eval_interval=10_000, eval_iters=1)
    t = SimpleNamespace(
        budget_s=120.0,
        budget_ended=False,
        fitted=False,
        fit_at=10,
        fit_step=10,
        horizon=10_000,
        step=0,
        first_step=0,
        t_start=1000.0,
        reserve_s=0.0,
        pace_mark=None,
        cfg=SimpleNamespace(train=tc),
        ddp=SimpleNamespace(any=bool, broadcast_int=int, world_size=1),
    )
    t.elapsed = lambda: clock["now"] - t.t_start
    for step in range(1, 11):
        clock["now"] += 20.0 if step == 1 else 0.5
        t.step = step
        schedule.follow_budget(t, lambda line: None)
    # at 24.5 s: (120 - 24.5 - one evaluation of 2/3 step) / (0.5 s · (1 + 2/3 / 10,000)) more steps
    assert t.fitted and t.horizon == 10 + int((120 - 24.5 - 0.5 * 2 / 3) / (0.5 * (1 + 2 / 3 / 10_000)))
    assert t.horizon > 190  # with the first step's 20 s in the pace (2.45 s/step): about 50


def test_new_options_are_checked_and_gpt2_export_names_what_it_cannot_express():
    with pytest.raises(QuillError, match="logit_softcap must be positive"):
        model_config(logit_softcap=0.0).validate()
    model_config(qk_norm=True, attention="infini", segment_size=8).validate()  # composes self-attention's QK-norm
    with pytest.raises(QuillError, match="muon_lr"):
        TrainConfig(muon_lr=0.0).validate()
    problems = gpt2_incompatibilities(model_config(qk_norm=True, logit_softcap=30.0, mlp="relu2", zero_init_proj=True))
    assert [p.split("=")[0] for p in problems] == ["model.mlp", "model.qk_norm", "model.logit_softcap"]
    assert gpt2_incompatibilities(model_config(zero_init_proj=True)) == []
