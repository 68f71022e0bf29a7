"""config.json read as untrusted input: a field of the wrong type or range, or a config that
contradicts its weights, stops import-hf with one QuillError naming the file and the field, and
nothing is written."""

from __future__ import annotations

import json
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
