"""The family table: each record is what the converters read, a new Llama-shaped family is one
record (no code), and export picks the record whose features a run has."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_support import make_hf_model  # noqa: E402

from quillgpt.config import ModelConfig  # noqa: E402
from quillgpt.interop import families  # noqa: E402
from quillgpt.interop.convert import import_hf  # noqa: E402
from quillgpt.interop.families import LLAMA, MISTRAL, QWEN2, QWEN3, export_family, family_of_config  # noqa: E402
from quillgpt.interop.llama import llama_incompatibilities  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402


def modern(**extra) -> ModelConfig:
    return ModelConfig(
        vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, **extra
    )


@pytest.mark.parametrize(
    "extra, qwen_tokenizer, want",
    [
        ({}, False, LLAMA),
        ({"qkv_bias": True}, False, LLAMA),  # attention_bias, o_proj's bias zero
        ({"qkv_bias": True}, True, QWEN2),
        ({"qk_norm": True}, False, QWEN3),
        ({"qk_norm": True, "qkv_bias": True}, False, QWEN3),
        ({"window": 8}, False, MISTRAL),
        ({"window": 8, "qkv_bias": True}, False, None),
        ({"window": 8, "qk_norm": True}, True, None),
    ],
)
def test_export_picks_the_record_with_the_runs_features(extra, qwen_tokenizer, want):
    cfg = modern(**extra)
    assert export_family(cfg, qwen_tokenizer) == want
    refused = llama_incompatibilities(cfg)
    assert bool(refused) == (want is None)
    if refused:
        assert "window" in refused[0] and "no Llama-family model" in refused[0]


def test_every_record_has_a_unique_name_in_each_format_it_is_read_from():
    assert len({f.model_type for f in families.FAMILIES}) == len(families.FAMILIES)
    assert set(families.EXPORT_ORDER) == set(families.LLAMA_FAMILY)
    assert family_of_config({}) == families.GPT2  # GPT-2 files older than model_type
    assert family_of_config({"model_type": "qwen3"}) == QWEN3


def test_a_new_llama_shaped_family_is_one_record(tmp_path, monkeypatch):
    """A family the table did not have, added as a record and nothing else: its config.json (here a
    Llama's under another model_type) imports with the record's features, and the model is
    transformers' on the same weights."""
    hf_dir = make_hf_model(tmp_path / "hf", "llama3", attention_bias=False)
    config = json.loads((hf_dir / "config.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    config["model_type"] = "newllama"
    (hf_dir / "config.json").write_text(json.dumps(config))
    record = dataclasses.replace(LLAMA, model_type="newllama", architecture="NewLlamaForCausalLM", name="NewLlama", gguf_arch="newllama")
    monkeypatch.setitem(families.BY_MODEL_TYPE, "newllama", record)
    done = import_hf(hf_dir, tmp_path / "run")
    assert done.architecture == "NewLlamaForCausalLM"
    ids = torch.tensor([[3, 17, 9, 40, 2, 11, 5, 8]])
    with torch.no_grad():
        got = load_run(tmp_path / "run", which="latest").model(ids, all_logits=True)[0]
        torch.testing.assert_close(got, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_a_records_defaults_are_what_an_import_fills_in(tmp_path, monkeypatch):
    """A config.json without max_position_embeddings or rms_norm_eps gets the record's values."""
    hf_dir = make_hf_model(tmp_path / "hf", "llama3", attention_bias=False)
    config = json.loads((hf_dir / "config.json").read_text())
    for key in ("max_position_embeddings", "rms_norm_eps"):
        config.pop(key)
    (hf_dir / "config.json").write_text(json.dumps(config))
    record = dataclasses.replace(LLAMA, max_positions=96, rms_norm_eps=1e-5)
    monkeypatch.setitem(families.BY_MODEL_TYPE, "llama", record)
    model = import_hf(hf_dir, tmp_path / "run").model
    assert (model.block_size, model.norm_eps) == (96, 1e-5)


def test_the_gguf_table_is_the_family_records():
    """interop/gguf_family's table is derived from the records: each llama.cpp architecture reads
    as the first record that names it, and records sharing one agree on what llama.cpp computes."""
    from quillgpt.interop import gguf_family

    assert {a: g.family for a, g in gguf_family.FAMILIES.items()} == {
        "gpt2": families.GPT2,
        "llama": LLAMA,  # Mistral writes "llama" too, and a GGUF states no window: it reads back as Llama
        "qwen2": QWEN2,
        "qwen3": QWEN3,
        "gemma3": families.GEMMA3,
    }
    for f in families.FAMILIES:
        g = gguf_family.FAMILIES[f.gguf_arch]
        assert (f.codec, f.gguf_permuted_qk) == (g.family.codec, g.permuted_qk), f.name
    assert gguf_family.FAMILIES["llama"].permuted_qk and not gguf_family.FAMILIES["qwen2"].permuted_qk
