"""import-hf of a damaged HF folder: a config.json whose model_type is not a string, and an index
naming a shard with a NUL byte, are one line and exit 2 (tracebacks before), nothing written."""

import json

import pytest

pytest.importorskip("transformers")

from hf_support import make_hf_model  # noqa: E402

from quillgpt.cli import main  # noqa: E402


def _model_type(value):
    def edit(d):
        config = json.loads((d / "config.json").read_text())
        config["model_type"] = value
        (d / "config.json").write_text(json.dumps(config))

    return edit


def _nul_shard(d):
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors\x00.txt"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


DAMAGED = {
    "model_type a list": (_model_type(["llama"]), "config.json: model_type must be a string such as \"llama\", got ['llama']"),
    "model_type an object": (_model_type({"llama": 1}), "config.json: model_type must be a string"),
    "a NUL in a shard's name": (_nul_shard, "model-00001-of-00001.safetensors\\0.txt has a NUL byte in its name"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_hf_folder_is_one_line(tmp_path, capsys, case):
    edit, message = DAMAGED[case]
    edit(make_hf_model(tmp_path / "hf", "smollm2"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["import-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()
