"""config.json read as untrusted input: a field of the wrong type or range, or a config that
contradicts its weights, stops import-hf with one QuillError naming the file and the field, and
nothing is written."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from quillgpt.errors import QuillError
from quillgpt.interop.convert import import_hf
from quillgpt.interop.hf_config import check_fields


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_support import make_hf_model

    return make_hf_model(tmp_path_factory.mktemp("hfcfg") / "hf", "smollm2")


def edited(hf_dir, tmp_path, **changes):
    copy = tmp_path / "src"
    shutil.copytree(hf_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    for k, v in changes.items():
        if v is KeyError:
            config.pop(k, None)
        else:
            config[k] = v
    (copy / "config.json").write_text(json.dumps(config))
    return copy, config


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_size": "64"}, "hidden_size is '64', not an integer"),
        ({"hidden_size": None}, "hidden_size is None"),
        ({"num_attention_heads": 0}, "num_attention_heads=0 is out of range"),
        ({"num_attention_heads": "4"}, "num_attention_heads is '4'"),
        ({"vocab_size": None}, "vocab_size is None"),
        ({"num_hidden_layers": 10**300}, "num_hidden_layers=an integer of about 301 digits is out of range"),
        ({"rms_norm_eps": -1}, "rms_norm_eps is -1"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is 'yes', not true or false"),
    ],
)
def test_a_field_of_the_wrong_type_or_range_is_named(hf_dir, tmp_path, changes, field):
    src, _ = edited(hf_dir, tmp_path, **changes)
    with pytest.raises(QuillError, match="config.json: " + field.replace("(", r"\(")) as e:
        import_hf(src, tmp_path / "run")
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "changes",
    [
        {"head_dim": 32},
        {"intermediate_size": "+1"},
        {"vocab_size": "+7"},
        {"num_key_value_heads": 1},
        {"num_key_value_heads": KeyError},
        {"num_hidden_layers": "-1"},
    ],
)
def test_a_config_that_contradicts_its_weights_imports_nothing(hf_dir, tmp_path, changes):
    base = json.loads((hf_dir / "config.json").read_text())
    changes = {k: base[k] + int(v) if isinstance(v, str) else v for k, v in changes.items()}
    src, config = edited(hf_dir, tmp_path, **changes)
    kv = config.get("num_key_value_heads", config["num_attention_heads"])
    if "num_key_value_heads" in changes and kv == base.get("num_key_value_heads", base["num_attention_heads"]):
        pytest.skip("the tiny model already has this many key/value heads")
    with pytest.raises(QuillError, match=r"(the weights do not match its config.json|config.json)") as e:
        import_hf(src, tmp_path / "run")
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_good_fields_pass_and_nullable_ones_may_be_null():
    check_fields({"hidden_size": 64, "num_attention_heads": 4, "head_dim": None, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    with pytest.raises(QuillError, match="x.json: head_dim=0 is out of range"):
        check_fields({"head_dim": 0}, "x.json")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"rms_norm_eps": 2e64}, "rms_norm_eps is 2e+64; it must be a finite number above 0 and at most 1"),
        ({"rope_theta": "10000.0"}, "rope_theta is '10000.0'"),
        ({"rope_theta": None}, "rope_theta is None"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "rope_parameters.rope_theta is '1e4'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -4.0}}, "rope_scaling.factor is -4.0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 1e300}}, "rope_scaling.factor is 1e+300"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": -1}},
            "rope_parameters.original_max_position",
        ),
        ({"rope_parameters": 0}, "rope_parameters is 0; it must be an object"),
        ({"rope_scaling": [1, 2]}, "rope_scaling is [1, 2]; it must be an object"),
    ],
)
def test_numbers_without_bounds_and_rope_settings_are_refused_by_name(hf_dir, tmp_path, changes, field):
    src, _ = edited(hf_dir, tmp_path, **changes)
    with pytest.raises(QuillError, match="config.json: " + re.escape(field)) as e:
        import_hf(src, tmp_path / "run")
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def edited_json(hf_dir, tmp_path, name, **changes):
    """A copy of the model directory with `name` (generation_config.json, tokenizer_config.json) edited."""
    copy = tmp_path / "src"
    shutil.copytree(hf_dir, copy)
    data = json.loads((copy / name).read_text())
    data.update(changes)
    text = json.dumps(data)
    if any(isinstance(v, str) and v == "1" * 5000 for v in changes.values()):  # an integer json.dumps cannot write
        text = text.replace('"' + "1" * 5000 + '"', "1" * 5000)
    (copy / name).write_text(text)
    return copy


@pytest.mark.parametrize(
    ("name", "changes", "field"),
    [
        ("generation_config.json", {"eos_token_id": [999999, -3]}, "eos_token_id [999999, -3] has 999999, outside the tokenizer's"),
        ("generation_config.json", {"eos_token_id": [2, -3]}, "eos_token_id [2, -3] has -3, outside"),
        ("generation_config.json", {"eos_token_id": "2"}, "eos_token_id is '2'; it must be an integer or a list of integers"),
        ("generation_config.json", {"eos_token_id": []}, "eos_token_id is an empty list"),
        ("generation_config.json", {"eos_token_id": 10**400}, "eos_token_id an integer of about 401 digits has"),
        ("generation_config.json", {"eos_token_id": "1" * 5000}, "is not valid JSON (a number too long to read"),
        ("generation_config.json", {"bos_token_id": True}, "bos_token_id is True; it must be an integer"),
        ("generation_config.json", {"pad_token_id": 1.5}, "pad_token_id is 1.5; it must be an integer"),
        ("tokenizer_config.json", {"eos_token": 7}, "eos_token is 7; a special token is a non-empty string"),
        ("tokenizer_config.json", {"bos_token": {"content": ["<s>"]}}, "bos_token is {'content': ['<s>']}"),
        ("tokenizer_config.json", {"chat_template": {"a": 1}}, "chat_template is {'a': 1}; it must be a string"),
        ("tokenizer_config.json", {"chat_template": [{"name": "default"}]}, "chat_template[0] is {'name': 'default'}"),
        ("tokenizer_config.json", {"added_tokens_decoder": []}, "added_tokens_decoder is []; it must be an object"),
        ("tokenizer_config.json", {"added_tokens_decoder": {"-1": {"content": "x"}}}, "added_tokens_decoder has the id '-1'"),
        (
            "tokenizer_config.json",
            {"added_tokens_decoder": {"99999999": {"content": "x"}}},
            "added_tokens_decoder has the id '99999999'; ids are 0 to",
        ),
        ("tokenizer_config.json", {"added_tokens_decoder": {"0": "x"}}, "added_tokens_decoder[\"0\"] is 'x', not an object"),
        ("tokenizer_config.json", {"model_max_length": "big"}, "model_max_length is 'big'; it must be a number of tokens"),
        ("tokenizer_config.json", {"model_max_length": 0}, "model_max_length is 0"),
        ("tokenizer_config.json", {"additional_special_tokens": "<x>"}, "additional_special_tokens is '<x>', not a list"),
    ],
)
def test_a_bad_field_of_the_tokenizer_files_is_named(hf_dir, tmp_path, name, changes, field):
    src = edited_json(hf_dir, tmp_path, name, **changes)
    with pytest.raises(QuillError, match=re.escape(field if "JSON" in field else f"{name}: {field}")) as e:
        import_hf(src, tmp_path / "run")
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_a_tokenizer_file_that_is_not_an_object_is_refused_and_good_fields_pass(hf_dir, tmp_path):
    from quillgpt.data.hf_tokenizer_files import check_generation_config, check_tokenizer_config

    src = edited_json(hf_dir, tmp_path, "generation_config.json")
    (src / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(QuillError, match="generation_config.json is a JSON list, not an object"):
        import_hf(src, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    check_generation_config({"eos_token_id": [0, 9], "bos_token_id": 0, "pad_token_id": None}, 10, "g.json")
    check_tokenizer_config(
        {
            "eos_token": {"content": "<e>", "lstrip": False},
            "chat_template": [{"name": "default", "template": "{{ x }}"}],
            "added_tokens_decoder": {"9": {"content": "<e>"}},
            "model_max_length": 1e30,  # transformers' "no limit"
        },
        10,
        "t.json",
    )
    assert import_hf(hf_dir, tmp_path / "good").path.is_dir()  # the unedited files import


@pytest.mark.parametrize(
    ("fmt", "dtype", "shown"), [("safetensors", "float8_e4m3fn", "F8_E4M3 (fp8)"), ("bin", "float8_e5m2", "float8_e5m2 (fp8)")]
)
def test_fp8_weights_are_refused_by_name(hf_dir, tmp_path, fmt, dtype, shown):
    import safetensors.torch
    import torch

    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    tensors = safetensors.torch.load_file(src / "model.safetensors")
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[name] = tensors[name].to(getattr(torch, dtype))
    if fmt == "safetensors":
        safetensors.torch.save_file(tensors, src / "model.safetensors")
    else:
        (src / "model.safetensors").unlink()
        torch.save(tensors, src / "pytorch_model.bin")
    with pytest.raises(QuillError, match=re.escape(f"{name} is stored as {shown}, which import-hf does not convert")) as e:
        import_hf(src, tmp_path / "run")
    assert "\n" not in str(e.value) and "bf16 or fp16 release" in str(e.value) and not (tmp_path / "run").exists()
