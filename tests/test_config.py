"""Config: YAML → typed dataclasses, overrides, and one clear error per mistake."""

import re
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
        [
            "train.max_iters=200",
            "model.n_layer=2",
            "train.learning_rate=3e-4",
            "model.window=null",
            "train.resume=auto",
            "train.compile=true",
            "data.path=some/file.txt",
        ],
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
        (["model.block_size=0"], "model.block_size must be between 1 and"),
        (["model.n_layer=10000000"], "model.n_layer must be between 1 and 1,024"),
        (["model.window=0"], "model.window must be between 1 and"),
        (["model.vocab_size=1099511627776"], "model.vocab_size must be between 1 and"),
        (["model.n_layer=1e999"], "model.n_layer must be int"),
        (["model.n_layer=" + "9" * 400], "model.n_layer must be between -2**62 and 2**62"),
        (["train.learning_rate=nan"], "train.learning_rate must be a finite number, got 'nan'"),
        (["train.learning_rate=.nan"], "train.learning_rate must be a finite number, got nan"),
        (["train.grad_clip=.inf"], "train.grad_clip must be a finite number, got inf"),
        (["train.weight_decay=-.inf"], "train.weight_decay must be a finite number"),
        (["model.dropout=1e999"], "model.dropout must be a finite number"),
        (["model.rope_theta=" + "9" * 400], "model.rope_theta must be a finite number"),
        (["train.seed=-1"], "train.seed must be between 0 and 4294967295"),
        (["train.seed=4294967296"], "train.seed must be between 0 and 4294967295"),
        (["data.bpe_vocab_size=1099511627776"], "data.bpe_vocab_size must be between 257"),
        (["train.time_budget=" + "9" * 400], "train.time_budget must be a positive duration"),
        (["model.n_layer=" + "[" * 5000], "nested too deeply"),
        (["model.x" + "y" * 10_000 + "=1"], "unknown config key model.xyyy"),
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


def test_long_values_are_cut_in_messages():
    for override in ["train.max_iters=" + "x" * 100_000, "model." + "k" * 100_000 + "=1", "model.a\nb=1"]:
        with pytest.raises(QuillError) as err:
            load_config(None, [override])
        assert len(str(err.value)) < 600 and "\n" not in str(err.value), str(err.value)[:300]


BOMB = (
    "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))
    + "model: {n_layer: *i}\n"
)


def test_alias_bomb_is_refused_quickly(tmp_path):
    """400 bytes that expand to 9**9 values: refused while parsing, not printed in an error."""
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    with pytest.raises(QuillError, match="expands to more than 100,000 values through its aliases"):
        load_config(path)
    with pytest.raises(QuillError, match="expands to more than"):
        load_config(None, ["model.n_layer=" + BOMB.replace("\n", ", ").join("{}")])


def test_aliases_within_bounds_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("model: &m {n_layer: 2, n_head: 2, n_embd: 32}\ntrain: {max_iters: 3}\n")
    assert load_config(path).model.n_layer == 2


def test_recursive_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("model: &m {n_layer: *m}\n")
    with pytest.raises(QuillError, match="refers to itself"):
        load_config(path)


def test_file_errors(tmp_path):
    with pytest.raises(QuillError, match="nope.yaml does not exist .pass --config"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(QuillError, match="cannot read --config /proc/self/mem: Input/output error"):
        load_config("/proc/self/mem")
    with pytest.raises(QuillError, match="File name too long"):
        load_config(tmp_path / ("x" * 300 + ".yaml"))
    with pytest.raises(QuillError, match="is a directory"):
        load_config(tmp_path)
    with pytest.raises(QuillError, match="/dev/zero is a device, not a file"):
        load_config("/dev/zero")
    endless = tmp_path / "big.yaml"
    endless.write_bytes(b"#" * (16 * 2**20 + 1))
    with pytest.raises(QuillError, match="larger than 16,777,216 bytes"):
        load_config(endless)
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


def test_configs_built_in_python_are_checked_for_finite_numbers():
    from quillgpt.config import ModelConfig, TrainConfig

    for cfg, message in [
        (ModelConfig(dropout=float("nan")), "model.dropout must be a finite number, got nan"),
        (TrainConfig(grad_clip=float("nan")), "train.grad_clip must be a finite number, got nan"),
        (TrainConfig(learning_rate=float("inf")), "train.learning_rate must be a finite number"),
    ]:
        with pytest.raises(QuillError, match=message):
            cfg.validate()


def test_defaults_validate():
    config_from_dict({}).validate()
    assert Config().model.kv_heads == Config().model.n_head


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("5m", 300), ("1.5h", 5400), ("42", 42)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


def test_a_leading_tilde_in_a_path_is_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(
        None,
        [
            "data.path=~/corpus.txt",
            "data.out_dir=~/data",
            "train.out_dir=~/runs/a",
            "train.init_from=~/runs/base",
            "data.tokenizer=~/tok.json",
        ],
    )
    assert cfg.data.path == f"{tmp_path}/corpus.txt" and cfg.train.init_from == f"{tmp_path}/runs/base"
    assert cfg.data.out_dir == f"{tmp_path}/data" and cfg.data.tokenizer == f"{tmp_path}/tok.json"
    assert load_config(None, ["data.path=a~b"]).data.path == "a~b"  # only a leading ~


def test_a_shape_key_under_init_from_says_the_architecture_comes_from_the_base_run():
    """model.n_embd=128 against the default n_head fails validation; with train.init_from the
    message says why the key cannot apply, not how to make it divisible."""
    with pytest.raises(QuillError, match=r"train.init_from=base takes its architecture from the base run.*model.n_embd \(128\)"):
        load_config(None, ["train.init_from=base", "model.n_embd=128"])
    with pytest.raises(QuillError, match=r"^model.n_embd \(128\) must be divisible"):
        load_config(None, ["model.n_embd=128"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train:\n  max_iters: " + "1" * 5000, "an integer of 5,000 digits is too long"),
        ("train:\n  max_iters: 0x" + "f" * 5000, "is too long for any config value"),
        ("data:\n  path: !!binary aGVsbG8=", "a !!binary value (bytes)"),
        ("train:\n  max_iters: 1:30", "train.max_iters must be int, got '1:30'"),
        ("train:\n  learning_rate: 1:30.5", "train.learning_rate must be float, got '1:30.5'"),
    ],
)
def test_yaml_tags_and_numbers_a_config_cannot_mean_are_refused(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(QuillError, match=re.escape(message)) as e:
        load_config(path)
    assert "\n" not in str(e.value)


def test_sexagesimal_looking_text_stays_text_and_huge_override_integers_name_their_key():
    assert load_config(None, ["data.path=1:30"]).data.path == "1:30"  # YAML 1.1 would make it 90
    with pytest.raises(QuillError, match=r"train\.max_iters must be int"):
        load_config(None, ["train.max_iters=" + "9" * 5000])
