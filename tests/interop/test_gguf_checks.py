"""Hostile GGUF files (interop/gguf_checks.py): tensors that disagree with the metadata, counts and
ranges that lie, damaged quantization blocks. Each is one line naming the file, the tensor or field
and what is wrong, exit 2, and nothing written; none imports into a run that cannot load."""

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from quillgpt.cli import main  # noqa: E402
from quillgpt.interop import gguf_write  # noqa: E402
from quillgpt.interop.gguf_import import import_gguf  # noqa: E402
from quillgpt.interop.gguf_write import export_gguf  # noqa: E402
from tests.interop.test_gguf import make_run  # noqa: E402

Q8 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32


def rewritten(src: Path, dst: Path, change: Callable[[str, np.ndarray, object], tuple | None]) -> Path:
    """A copy of a GGUF file whose tensors pass through `change(name, array, type)`: None drops the
    tensor, else (name, array, type) is written (several: a list of them)."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf_write._writer(dst, arch)
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        out = change(t.name, np.array(t.data), t.tensor_type)
        for name, a, kind in [] if out is None else out if isinstance(out, list) else [out]:
            if kind == F32:
                w.add_tensor(name, a.astype(np.float32))
            else:
                w.add_tensor(name, a, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """An untied llama-shaped run exported as f32 and as q8_0."""
    root = tmp_path_factory.mktemp("gguf_checks")
    make_run(root / "run", "llama", tie_embeddings=False)
    return {kind: export_gguf(root / "run", root / f"{kind}.gguf", kind=kind, which="latest").path for kind in ("f32", "q8_0")}


def refused(tmp_path, capsys, path: Path, message: str, *flags: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["import-gguf", str(path), "--out", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert message in err and str(path.name) in err, err
    assert not (tmp_path / "out").exists()


def reshaped(target: str, rows: int = 0, cols: int = 0):
    """A change giving tensor `target` `rows` more rows and `cols` more columns (negative: fewer)."""

    def change(name, a, kind):
        if name != target:
            return name, a, kind
        if kind == F32:
            a = np.resize(a, (a.shape[0] + rows, a.shape[1] + cols) if a.ndim == 2 else (a.shape[0] + cols,))
        else:  # Q8_0 bytes: a row is blocks of 34 bytes, 32 weights each
            a = np.resize(a, (a.shape[0] + rows, a.shape[1] + cols // 32 * 34))
        return name, a, kind

    return change


MISSHAPEN = {
    "token_embd fewer rows": ("token_embd.weight", -1, 0),
    "attn_q fewer rows": ("blk.0.attn_q.weight", -32, 0),
    "attn_k more columns": ("blk.1.attn_k.weight", 0, 32),
    "attn_v more rows": ("blk.0.attn_v.weight", 16, 0),
    "attn_output fewer columns": ("blk.0.attn_output.weight", 0, -32),
    "ffn_gate more rows": ("blk.0.ffn_gate.weight", 8, 0),
    "ffn_up fewer rows": ("blk.1.ffn_up.weight", -8, 0),
    "ffn_down more columns": ("blk.0.ffn_down.weight", 0, 32),
    "output more rows": ("output.weight", 3, 0),
}


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
@pytest.mark.parametrize("case", list(MISSHAPEN))
def test_a_tensor_of_the_wrong_shape_is_named(tmp_path, capsys, files, kind, case):
    target, rows, cols = MISSHAPEN[case]
    bad = rewritten(files[kind], tmp_path / "bad.gguf", reshaped(target, rows, cols))
    refused(tmp_path, capsys, bad, f"tensor {target} is ")


@pytest.mark.parametrize("target", ["output_norm.weight", "blk.1.attn_norm.weight", "blk.0.ffn_norm.weight"])
def test_a_norm_of_the_wrong_length_is_named(tmp_path, capsys, files, target):
    bad = rewritten(files["q8_0"], tmp_path / "bad.gguf", reshaped(target, cols=5))
    refused(tmp_path, capsys, bad, f"tensor {target} is ")


def test_a_missing_tensor_is_named(tmp_path, capsys, files):
    bad = rewritten(files["q8_0"], tmp_path / "bad.gguf", lambda n, a, k: None if n == "blk.1.ffn_down.weight" else (n, a, k))
    refused(tmp_path, capsys, bad, "missing blk.1.ffn_down.weight")


def test_an_extra_tensor_is_named(tmp_path, capsys, files):
    def change(n, a, k):
        return [(n, a, k), ("blk.0.attn_extra.weight", a, k)] if n == "output_norm.weight" else (n, a, k)

    refused(tmp_path, capsys, rewritten(files["f32"], tmp_path / "bad.gguf", change), "blk.0.attn_extra.weight")


def field_at(path: Path, key: str) -> tuple[bytearray, int]:
    """The file's bytes and the offset of metadata field `key`'s value (after its key and type)."""
    r = gguf.GGUFReader(path)
    f = r.fields[key]
    return bytearray(path.read_bytes()), f.offset + sum(p.nbytes for p in f.parts[:3])


def test_a_huge_array_count_is_one_line_not_memory(tmp_path, capsys, files):
    data, at = field_at(files["f32"], "tokenizer.ggml.tokens")
    data[at + 4 : at + 12] = (1 << 62).to_bytes(8, "little")  # after the item type: the count
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    refused(tmp_path, capsys, tmp_path / "bad.gguf", "tokenizer.ggml.tokens's array count says 4,611,686,018,427,387,904 entries")


def test_a_huge_string_length_is_one_line(tmp_path, capsys, files):
    data, at = field_at(files["f32"], "general.name")
    data[at : at + 8] = (1 << 62).to_bytes(8, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    refused(tmp_path, capsys, tmp_path / "bad.gguf", "the length of the value of general.name")


def tensor_field(path: Path, name: str) -> tuple[bytearray, int, int]:
    """The file's bytes, and the offsets of tensor `name`'s first dim and of its data offset."""
    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == name)
    parts = t.field.parts  # name length, name, n_dims, dims, type, offset
    dims_at = t.field.offset + sum(p.nbytes for p in parts[:3])
    return bytearray(path.read_bytes()), dims_at, dims_at + parts[3].nbytes + parts[4].nbytes


def test_overlapping_tensors_are_named(tmp_path, capsys, files):
    data, _, offset_at = tensor_field(files["f32"], "blk.0.attn_k.weight")
    _, _, q_offset_at = tensor_field(files["f32"], "blk.0.attn_q.weight")
    data[offset_at : offset_at + 8] = data[q_offset_at : q_offset_at + 8]
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    refused(tmp_path, capsys, tmp_path / "bad.gguf", "overlap in the file")


def test_a_row_that_is_not_whole_blocks_is_named(tmp_path, capsys, files):
    data, dims_at, _ = tensor_field(files["q8_0"], "blk.0.attn_q.weight")
    data[dims_at : dims_at + 8] = (48).to_bytes(8, "little")  # 48 weights: not whole 32-weight blocks
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    refused(tmp_path, capsys, tmp_path / "bad.gguf", "tensor blk.0.attn_q.weight is Q8_0 with rows of 48 weights")


def bad_scale(target: str, block: int, value: float = np.nan):
    """A change setting the fp16 scale of Q8_0 block `block` of tensor `target` to `value`."""

    def change(name, a, kind):
        if name == target:
            flat = a.reshape(-1, 34)
            flat[block, 0:2] = np.array([value], dtype=np.float16).view(np.uint8)
        return name, a, kind

    return change


@pytest.mark.parametrize("flags", [(), ("--dequantize",)])
def test_a_damaged_quantization_block_is_damage_not_divergence(tmp_path, capsys, files, flags):
    bad = rewritten(files["q8_0"], tmp_path / "bad.gguf", bad_scale("blk.1.attn_q.weight", 17))
    refused(tmp_path, capsys, bad, "tensor blk.1.attn_q.weight: block 17 has a non-finite scale (Q8_0): the file is damaged", *flags)


def test_a_float_tensor_holding_nan_is_damage_not_divergence(tmp_path, capsys, files):
    def change(name, a, kind):
        if name == "blk.0.ffn_up.weight":
            a[3, 4] = np.inf
        return name, a, kind

    bad = rewritten(files["f32"], tmp_path / "bad.gguf", change)
    refused(tmp_path, capsys, bad, "tensor blk.0.ffn_up.weight (F32) holds NaN or infinite values: the file is damaged")
    with pytest.raises(SystemExit):
        main(["import-gguf", str(bad), "--out", str(tmp_path / "out")])
    assert "diverged" not in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["block", "float"])
def test_a_damaged_file_forced_over_a_run_leaves_that_run_as_it_was(tmp_path, capsys, files, damage):
    """With --force over an existing run, damage in the file's last tensors is found before the
    first byte is written (a new --out is removed on failure; an old run must not be half replaced)."""
    import_gguf(files["q8_0"], tmp_path / "run")
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    if damage == "block":
        bad = rewritten(files["q8_0"], tmp_path / "bad.gguf", bad_scale("blk.1.ffn_down.weight", 3, np.inf))
    else:
        bad = rewritten(files["q8_0"], tmp_path / "bad.gguf", lambda n, a, k: (n, a * np.inf if n == "output_norm.weight" else a, k))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["import-gguf", str(bad), "--out", str(tmp_path / "run"), "--force"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "the file is damaged" in err and len(err.splitlines()) == 1, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == before
