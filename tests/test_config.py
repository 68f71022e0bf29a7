"""Config: YAML → typed dataclasses, overrides, and one clear error per mistake."""

from pathlib import Path

import pytest

from quillgpt.config import (
    Config,
    config_from_dict,
    load_config,
    parse_duration,
    save_config,
)
from quillgpt.errors import QuillError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["shakespeare_char", "shakespeare_char_cpu", "shakespeare_gpt2"])
def test_shipped_recipes_load(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert cfg.model.n_embd % cfg.model.n_head == 0


def test_overrides_are_typed_like_yaml():
    cfg = load_config(
        ROOT / "configs" / "shakespeare_char_cpu.yaml",
        ["train.max_iters=200", "model.n_layer=2", "train.learning_rate=3e-4",
         "model.window=null", "train.resume=auto", "train.compile=true", "data.path=some/file.txt"],
    )
    assert cfg.train.max_iters == 200 and isinstance(cfg.train.max_iters, int)
    assert cfg.model.n_layer == 2
    assert cfg.train.learning_rate == pytest.approx(3e-4)
    assert cfg.model.window is None
    assert cfg.train.resume == "auto"
    assert cfg.train.compile is True
    assert cfg.data.path == "some/file.txt"


def test_yaml_scientific_notation_and_int_for_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  learning_rate: 1e-3\n  min_lr: 0\n")
    cfg = load_config(path)
    assert cfg.train.learning_rate == 1e-3 and isinstance(cfg.train.min_lr, float)


def test_round_trip_through_saved_yaml(tmp_path):
    cfg = load_config(None, ["model.n_kv_head=2", "model.pos=rope", "train.time_budget=5m"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.n_layr=2"], "did you mean 'n_layer'"),
        (["modle.n_layer=2"], "did you mean 'model'"),
        (["model.n_head=5"], "must be divisible by model.n_head"),
        (["model.n_kv_head=4"], "must divide model.n_head"),
        (["model.block_size=0"], "model.block_size must be at least 1"),
        (["model.pos=alibi"], "model.pos must be learned | rope"),
        (["model.n_layer=two"], "model.n_layer must be int"),
        (["model.n_layer=2.5"], "model.n_layer must be int"),
        (["model.dropout=1.5"], "model.dropout must be in [0, 1)"),
        (["train.resume=maybe"], "train.resume must be bool or auto"),
        (["train.compile=3"], "train.compile must be bool"),
        (["train.min_lr=1", "train.learning_rate=0.1"], "min_lr"),
        (["train.time_budget=soon"], "train.time_budget must be a positive duration"),
        (["train.device=tpu"], "train.device must be"),
        (["data.val_fraction=1.5"], "data.val_fraction"),
        (["sample.top_p=0"], "sample.top_p must be in (0, 1]"),
        (["sample.temperature=-1"], "sample.temperature must be ≥ 0"),
        (["max_iters=3"], "must be section.key"),
        (["train.max_iters"], "must look like section.key=value"),
    ],
)
def test_each_mistake_is_one_clear_error(overrides, message):
    with pytest.raises(QuillError) as err:
        load_config(None, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_file_errors(tmp_path):
    with pytest.raises(QuillError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(QuillError, match="not valid YAML"):
        load_config(bad)
    notmap = tmp_path / "list.yaml"
    notmap.write_text("- a\n- b\n")
    with pytest.raises(QuillError, match="must be a YAML mapping"):
        load_config(notmap)
    section = tmp_path / "section.yaml"
    section.write_text("model: 3\n")
    with pytest.raises(QuillError, match="model must be a mapping"):
        load_config(section)


def test_defaults_validate():
    config_from_dict({}).validate()
    assert Config().model.kv_heads == Config().model.n_head


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("5m", 300), ("1.5h", 5400), ("42", 42)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds
