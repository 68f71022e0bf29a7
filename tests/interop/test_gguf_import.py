"""import-gguf keeping a file's quantization is streamed: its peak memory is about the largest
tensor, never the model in fp32, and loading the run it writes holds about the run's own bytes."""

import json
import subprocess
import sys

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from quillgpt.interop import gguf_write  # noqa: E402
from quillgpt.interop.gguf_write import export_gguf  # noqa: E402
from tests.interop.test_gguf import make_run  # noqa: E402
from tests.support import ROOT  # noqa: E402

PEAK = """
import json, sys
def rss(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024
def reset():  # the peak (VmHWM) back to the current RSS: each phase measured from where it starts
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss("VmRSS")
from quillgpt.interop.gguf_import import import_gguf
from quillgpt.runs import load_run
import_gguf(sys.argv[3], sys.argv[2] + "-warm")  # a tiny file first: the modules an import loads, before the baseline
before = reset()
import_gguf(sys.argv[1], sys.argv[2])
imported = rss("VmHWM") - before
before = reset()
run = load_run(sys.argv[2], which="latest")
print(json.dumps({"import": imported, "load": rss("VmHWM") - before}))
"""


def q4_0_file(tmp_path, n_embd=1024, n_layer=8, name="q4"):
    """A Q4_0 GGUF of a model whose fp32 weights are many times the import's memory bound."""

    def add(writer, name, a, _kind):
        if a.ndim == 1:
            writer.add_tensor(name, a)
        else:
            writer.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q4_0), raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    mp = pytest.MonkeyPatch()
    mp.setattr(gguf_write, "_add_tensor", add)
    try:
        make_run(tmp_path / name, "llama", n_embd=n_embd, n_head=8, mlp_hidden=2 * n_embd, n_layer=n_layer)
        return export_gguf(tmp_path / name, tmp_path / f"{name}.gguf", which="latest").path
    finally:
        mp.undo()


def test_import_and_load_peak_memory_is_bounded_by_the_largest_tensor_not_the_model(tmp_path):
    path, tiny = q4_0_file(tmp_path), q4_0_file(tmp_path, 64, 1, "tiny")
    f = gguf.GGUFReader(path)
    fp32 = 4 * sum(t.n_elements for t in f.tensors)
    bound = 2 * 4 * 2 * max(t.n_elements for t in f.tensors if "ffn_gate" in t.name)  # twice the largest layer (gate | up) in fp32
    out = subprocess.run(
        [sys.executable, "-c", PEAK, str(path), str(tmp_path / "back"), str(tiny)], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    run_bytes = (tmp_path / "back" / "weights.safetensors").stat().st_size
    assert fp32 > 8 * bound  # the model in fp32 is many times the bound below
    assert m["import"] < bound  # streamed: a layer's bytes, codes and scales at a time (each ¼ of its fp32 or less)
    assert m["load"] < run_bytes + bound  # the run's bytes as stored, no float copy of a layer


@pytest.mark.parametrize("dequantize", [False, True])
def test_an_import_the_memory_or_disk_cannot_take_is_refused_before_it_starts(tmp_path, monkeypatch, dequantize):
    from quillgpt.errors import QuillError
    from quillgpt.interop import gguf_import

    path = q4_0_file(tmp_path, 64, 1, "small")
    monkeypatch.setattr(gguf_import, "available_bytes", lambda device: 1000)
    with pytest.raises(QuillError, match=r"GB of memory (\(.*\) )?but 0.0 GB is free") as e:
        gguf_import.import_gguf(path, tmp_path / "out", dequantize=dequantize)
    assert not (tmp_path / "out").exists() and "\n" not in str(e.value)
    if not dequantize:
        monkeypatch.setattr(gguf_import, "available_bytes", lambda device: None)
        monkeypatch.setattr(gguf_import.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
        with pytest.raises(QuillError, match="on disk but"):
            gguf_import.import_gguf(path, tmp_path / "out")
        assert not (tmp_path / "out").exists()
