"""runs.LoadOptions (the user's load flags, parsed once) and load_run's two forms."""

import pytest
import torch
from support import random_model

from quillgpt.config import Config
from quillgpt.data.tokenizer import CharTokenizer
from quillgpt.errors import QuillError
from quillgpt.runs import LoadOptions, load_run, write_run

CHARS = "\n 012345678abcdefghijklmnopqrstuvwxyz"  # 37 characters: support.V


def test_load_options_parse_checks_dtype_then_quantize_then_device():
    assert LoadOptions.parse(device="cpu") == LoadOptions(torch.device("cpu"), torch.float32, None)
    parsed = LoadOptions.parse(device="cpu", dtype="bfloat16", quantize="int8", which="latest", rows=4, compile=True)
    assert parsed == LoadOptions(torch.device("cpu"), torch.bfloat16, "int8", "latest", 4, True)
    assert (parsed.dtype_name, parsed.quantize_name, LoadOptions().quantize_name) == ("bfloat16", "int8", "none")
    assert LoadOptions.parse(device="cpu", dtype=None).dtype is None  # as saved
    with pytest.raises(QuillError, match=r"^--dtype must be float32, bfloat16 or float16, got 'x'$"):
        LoadOptions.parse(dtype="x", quantize="y", device="tpu")
    with pytest.raises(QuillError, match=r"^--quantize must be int8, .* or none, got 'y'$"):
        LoadOptions.parse(quantize="y", device="tpu")
    with pytest.raises(QuillError, match=r"^--device must be auto, cpu, cuda, cuda:N or mps, got 'tpu'"):
        LoadOptions.parse(device="tpu")


def test_load_run_takes_options_or_the_same_keywords(tmp_path):
    model = random_model()
    (tmp_path / "run").mkdir()
    write_run(tmp_path / "run", Config(model=model.config), CharTokenizer(CHARS), model.state_dict(), step=5)
    by_record = load_run(tmp_path / "run", LoadOptions(which="latest", dtype=torch.bfloat16))
    by_keywords = load_run(tmp_path / "run", which="latest", dtype=torch.bfloat16)
    assert by_record.step == by_keywords.step == 5 and by_record.model.lm_head.weight.dtype == torch.bfloat16
    for (name, a), (_, b) in zip(by_record.model.state_dict().items(), by_keywords.model.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(TypeError, match="not both"):
        load_run(tmp_path / "run", LoadOptions(), which="latest")
