"""The weights file of a quantized run: written and read one tensor at a time, a safetensors file
other tools read, and every damaged or truncated byte refused in one line."""

import json
import struct

import pytest
import torch

from quillgpt.errors import QuillError
from quillgpt.tensor_file import TensorFile, TensorWriter

TENSORS = {
    "a.codes": torch.randint(0, 255, (5, 48), dtype=torch.uint8),
    "a.scale": torch.randn(5, 3).half(),
    "b.weight": torch.randn(7, 3),
    "c": torch.randn(4, 2).bfloat16(),
    "empty": torch.zeros(0, 3),
    "d": torch.randint(-128, 127, (3, 33), dtype=torch.int8),
}


def write(path, tensors=TENSORS, metadata=None):
    with TensorWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], metadata or {"k": "v"}) as w:
        for name, t in tensors.items():
            w.write(name, t)
    return path


def test_round_trip_and_the_safetensors_package_reads_it(tmp_path):
    f = TensorFile(write(tmp_path / "w.safetensors"))
    assert set(f.entries) == set(TENSORS) and f.metadata["k"] == "v"
    for name, t in TENSORS.items():
        assert f.read(name).dtype == t.dtype and torch.equal(f.read(name), t)
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(tmp_path / "w.safetensors"), framework="pt") as g:
        for name, t in TENSORS.items():
            assert torch.equal(g.get_tensor(name), t)
    header_len = struct.unpack("<Q", (tmp_path / "w.safetensors").read_bytes()[:8])[0]
    assert (8 + header_len) % 64 == 0  # the data starts aligned


def test_the_writer_takes_the_planned_layout_only(tmp_path):
    specs = [("x", torch.float32, (2, 2)), ("y", torch.float16, (3,))]
    with pytest.raises(ValueError, match="layout's next is x"):
        with TensorWriter(tmp_path / "w", specs, {}) as w:
            w.write("y", torch.zeros(3).half())
    with pytest.raises(ValueError, match="layout's next is x"):
        with TensorWriter(tmp_path / "w", specs, {}) as w:
            w.write("x", torch.zeros(2, 3))
    w = TensorWriter(tmp_path / "w", specs, {})
    w.write("x", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="never written"):
        w.close()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[:-5], "truncated"),
        (lambda b: b[:100], "no safetensors header|truncated|not JSON"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "fails its CRC check"),
        (lambda b: b[:8] + b"[" + b[9:], "not JSON"),
        (lambda b: b"", "no safetensors header"),
    ],
)
def test_a_damaged_file_is_refused_in_one_line(tmp_path, damage, message):
    path = write(tmp_path / "w.safetensors")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(QuillError, match=message) as e:
        f = TensorFile(path)
        for name in f.entries:
            f.read(name)
    assert "\n" not in str(e.value)


def test_a_file_of_another_tool_is_not_taken_for_a_run(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file({"w": torch.zeros(2)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(QuillError, match="not a quill weights file"):
        TensorFile(tmp_path / "m.safetensors")


def test_a_header_with_overlapping_or_outside_ranges_is_refused(tmp_path):
    path = write(tmp_path / "w.safetensors")
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["b.weight"]["data_offsets"][1] += 4  # claims bytes of the next tensor
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    path.write_bytes(raw[:8] + text[:n] + raw[8 + n :])
    with pytest.raises(QuillError, match="bad dtype, shape or byte range"):
        TensorFile(path)
