"""Gemma 3 (Gemma3ForCausalLM, model_type gemma3_text) against transformers on the same weights:
a scaled-down random model (tests/hf_support.py) with every layer feature in play — windowed
layers and a global one with their own RoPE (the global one linearly scaled), GQA, head_dim,
query_pre_attn_scalar, sandwich norms, (1 + w) norms, the scaled embedding, GeGLU, a tied head."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_support  # noqa: E402
from hf_support import CORPUS, assert_export_round_trip, make_hf_model  # noqa: E402

from quillgpt.errors import QuillError  # noqa: E402
from quillgpt.inference.generate import generate_tokens  # noqa: E402
from quillgpt.interop.convert import import_hf  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402

TEXT = CORPUS[0] + " " + CORPUS[2]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(HF directory, transformers' model in float32, quill run directory)."""
    root = tmp_path_factory.mktemp("gemma3")
    hf_dir = make_hf_model(root / "hf", "gemma3")
    import_hf(hf_dir, root / "run")
    return hf_dir, transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), root / "run"


def ids_of(hf_dir, text=TEXT):
    return hf_support.ids_of(hf_dir, text)


def test_the_import_has_gemmas_layer_keys(gemma):
    cfg = load_run(gemma[2], which="latest").config.model
    assert (cfg.mlp, cfg.embed_scale, cfg.sandwich_norm, cfg.qk_norm, cfg.tie_embeddings) == ("geglu", True, True, True, True)
    assert (cfg.window, cfg.global_every, cfg.local_rope_theta, cfg.rope_theta) == (8, 3, 10000.0, 1e6)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.attn_scale, cfg.head_dim) == ("linear", 2.0, 24**-0.5, 16)


def test_logits_equal_transformers_to_float32_rounding(gemma):
    """The bound is float32's rounding, not a tolerance picked to pass: against transformers in
    float64 (the exact function), quill in float32 errs no more than 2× what transformers in float32
    does, and quill in float64 (its RoPE rotates in float32 by design) less than that error."""
    hf_dir, hf, run_dir = gemma
    model = load_run(run_dir, which="latest").model
    ids = torch.tensor([ids_of(hf_dir)])
    assert 3 * 8 < ids.shape[1] <= 160  # several windows long, within block_size: the band and both RoPE bases in play
    with torch.no_grad():
        hf32, quill32 = hf(ids).logits[0], model(ids, all_logits=True)[0][0]
        hf64 = hf.double()(ids).logits[0]
        quill64 = model.double()(ids, all_logits=True)[0][0]
    hf.float()
    hf_err = (hf32.double() - hf64).abs().max().item()  # transformers' own float32 rounding
    assert 0 < hf_err < 1e-4
    assert (quill32.double() - hf64).abs().max().item() <= 2 * hf_err
    assert (quill32.double() - hf32.double()).abs().max().item() <= 2 * hf_err
    assert (quill64 - hf64).abs().max().item() <= hf_err
    assert torch.equal(quill32.argmax(-1), hf32.argmax(-1))


def test_greedy_ids_equal_transformers_past_the_window(gemma):
    hf_dir, hf, run_dir = gemma
    model = load_run(run_dir, which="latest").model
    prompt = ids_of(hf_dir, "ROMEO: But, soft!")
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = torch.stack(list(generate_tokens(model, [prompt], 60))).T[0].tolist()
    assert got == want[0, len(prompt) :].tolist()


def test_export_hf_round_trip(gemma, tmp_path):
    """export-hf writes Gemma3ForCausalLM (norms back to w for 1 + w): transformers computes the
    same logits from it, and importing it again gives the same run, bit for bit."""
    hf_dir, hf, run_dir = gemma
    assert hf.config.architectures[0] == "Gemma3ForCausalLM"
    assert_export_round_trip(run_dir, hf_dir, hf, tmp_path, tol=0)


def test_the_pre_transformers_5_config_form_imports_the_same(gemma, tmp_path):
    """rope_theta + rope_scaling (global), rope_local_base_freq, sliding_window_pattern instead of layer_types."""
    hf_dir, _, run_dir = gemma
    config = json.loads((hf_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.pop("layer_types")
    config.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=1e4, sliding_window_pattern=3)
    (hf_dir / "config.json").write_text(json.dumps(config))
    try:
        assert import_hf(hf_dir, tmp_path / "old").model == load_run(run_dir, which="latest").config.model
    finally:
        config.update(rope_parameters=rope, layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"])
        for key in ("rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern"):
            config.pop(key)
        (hf_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_activation="silu"), "hidden_activation='silu'"),
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(layer_types=["full_attention", "sliding_attention"] * 2), "every k-th layer global"),
        (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
        (dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]), "model_type is 'gemma3'"),
    ],
)
def test_what_quill_cannot_compute_is_refused_in_one_line(gemma, tmp_path, change, message):
    hf_dir = make_hf_model(tmp_path / "hf", "gemma3")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(QuillError, match=message) as e:
        import_hf(hf_dir, tmp_path / "run")
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_chat_and_serve_first_lines_say_why_the_decode_step_runs_op_by_op(gemma, monkeypatch):
    """With --quantize, quill chat's and quill serve's first lines name Gemma's features the native
    decode step lacks, as sample's stats line does (native_decoder.op_by_op_note)."""
    pytest.importorskip("fastapi")
    from quillgpt.inference.chat_session import open_chat
    from quillgpt.runs import LoadOptions
    from quillgpt.serve import server

    run_dir = gemma[2]
    why = "decode step op by op (the native one lacks model.mlp=geglu, model.sandwich_norm, model.embed_scale"
    _, header = open_chat(run_dir, LoadOptions(quantize="int8", which="latest"))
    assert why in header and header.endswith("; /reset, /stats, /quit, /help")
    assert why not in open_chat(run_dir, LoadOptions(which="latest"))[1]  # float weights: no native step to miss
    lines: list[str] = []
    monkeypatch.setattr(server, "_run_until_stopped", lambda app, sock, drain_s: sock.close())
    server.serve(run_dir, which="latest", port=0, device="cpu", quantize="int8", max_batch=1, announce=lines.append)
    assert lines[0].startswith(f"serving {run_dir}") and why in lines[0]
