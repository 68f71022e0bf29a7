"""The I/O boundary: every OSError on a user's path becomes one QuillError naming the path and
the reason, and nothing is written where it must not be."""

import os
import stat

import pytest

from quillgpt.errors import QuillError
from quillgpt.files import (
    atomic_write_text,
    check_output_file,
    owner,
    probe_writable,
    read_bytes,
    read_text,
    write_file,
)

LONG = "n" * 300


@pytest.mark.parametrize(
    "name, message",
    [
        ("missing", "--x {p} does not exist (make one)"),
        ("directory", "--x {p} is a directory; pass a file"),
        ("device", "--x /dev/zero is a device, not a file; pass a file"),
        ("fifo", "--x {p} is a FIFO (named pipe), not a file; pass a file"),
        ("eio", "cannot read --x /proc/self/mem: Input/output error"),
        ("too_long", "cannot read --x {p}: File name too long"),
        ("too_big", "--x {p} is larger than 10 bytes; is it the right file?"),
    ],
)
def test_read_bytes_refusals_name_the_path_and_the_reason(tmp_path, name, message):
    path = {
        "missing": tmp_path / "nope",
        "directory": tmp_path,
        "device": "/dev/zero",
        "eio": "/proc/self/mem",
        "too_long": tmp_path / LONG,
        "too_big": tmp_path / "big",
        "fifo": tmp_path / "fifo",
    }[name]
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"x" * 11)
    with pytest.raises(QuillError) as e:
        read_bytes(path, "--x", hint=" (make one)", limit=10)
    assert str(e.value) == message.format(p=str(path)[:78] + "..." + str(path)[-78:] if len(str(path)) > 160 else path)


def test_read_within_limit_and_utf8(tmp_path):
    (tmp_path / "ok").write_bytes("héllo".encode())
    assert read_bytes(tmp_path / "ok", limit=6) == "héllo".encode()
    assert read_text(tmp_path / "ok") == "héllo"
    (tmp_path / "latin1").write_bytes("héllo".encode("latin-1"))
    with pytest.raises(QuillError, match=r"latin1 is not UTF-8 text \(invalid byte at offset 1\)"):
        read_text(tmp_path / "latin1", "--text")


def test_check_output_file(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("keep")
    os.mkfifo(tmp_path / "fifo")
    cases = [
        (dict(path=src, inputs=(src,)), "is also the input"),
        (dict(path=tmp_path / "." / "in.txt", inputs=(src,)), "is also the input"),  # the same file by another name
        (dict(path=src, fresh=True), "already exists; choose another name or pass --force"),
        (dict(path=tmp_path), "is a directory; pass a file name"),
        (dict(path=tmp_path / "fifo"), "is not a regular file"),
        (dict(path=tmp_path / (LONG + ".json")), "File name too long"),
        (dict(path="/proc/x/a.png"), "is not writable"),
    ]
    for kwargs, message in cases:
        with pytest.raises(QuillError, match=message):
            check_output_file(what="-o", **kwargs)
    assert check_output_file(src, "-o", force=True) == src  # --force: the user said so
    assert check_output_file(tmp_path / "new" / "out.png", "-o") == tmp_path / "new" / "out.png"
    assert src.read_text() == "keep" and stat.S_ISFIFO((tmp_path / "fifo").stat().st_mode)


def test_probe_without_creating_leaves_nothing(tmp_path):
    target = tmp_path / "a" / "b"
    assert probe_writable(target, create=False) == target
    assert not (tmp_path / "a").exists()
    with pytest.raises(QuillError, match="File name too long"):
        probe_writable(tmp_path / LONG / "b", create=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(QuillError, match="Not a directory"):
        probe_writable(tmp_path / "file" / "b", create=False)
    with pytest.raises(QuillError, match="/proc/x/y is not writable"):
        probe_writable("/proc/x/y", "--out", create=False)


def test_writes_refuse_special_files_and_name_os_errors(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(QuillError, match="is not a regular file"):
        atomic_write_text(tmp_path / "fifo", "x")
    assert stat.S_ISFIFO((tmp_path / "fifo").stat().st_mode)
    with pytest.raises(QuillError, match=r"cannot write -o .*: File name too long"):
        write_file(tmp_path / LONG, lambda f: f.write(b"x"), "-o")
    write_file(tmp_path / "ok", lambda f: f.write(b"x"), "-o")
    assert (tmp_path / "ok").read_bytes() == b"x" and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(
    "name", ["train.bin", "val-000003.bin", "train.flags.bin", "val-000003.flags.bin", ".prepare.lock", ".prepare-state.json", "meta.json"]
)
def test_every_file_a_prepare_writes_is_the_datasets(tmp_path, name):
    """The names come from the same constants prepare writes by (a chat dataset's flag shards included)."""
    (tmp_path / "meta.json").write_text("{}")
    (tmp_path / name).write_bytes(b"\0" * 8)
    assert owner(tmp_path / name) == "dataset"
    with pytest.raises(QuillError, match="is a file of the dataset in .*pass --force"):
        check_output_file(tmp_path / name, "-o", kind="png")
    assert owner(tmp_path / "notes.bin") is None


@pytest.mark.parametrize(
    "content, why",
    [
        (b"{not json", "is not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"\xff\xfe{}", "not UTF-8"),
    ],
)
def test_read_json_refuses_bad_files_in_one_line(tmp_path, content, why):
    from quillgpt.files import read_json

    (tmp_path / "x.json").write_bytes(content)
    with pytest.raises(QuillError, match=why):
        read_json(tmp_path / "x.json", "x.json")


def test_read_json_object_wants_an_object_and_a_size_limit(tmp_path):
    from quillgpt.files import read_json, read_json_object

    (tmp_path / "list.json").write_text("[1, 2]")
    assert read_json(tmp_path / "list.json") == [1, 2]
    with pytest.raises(QuillError, match="must be a JSON object"):
        read_json_object(tmp_path / "list.json")
    (tmp_path / "big.json").write_text('{"a": "' + "x" * 2000 + '"}')
    with pytest.raises(QuillError, match="big.json"):
        read_json(tmp_path / "big.json", limit=1000)


@pytest.mark.parametrize("path", ["", " ", "\t\n"])
def test_an_empty_or_whitespace_output_path_is_refused_by_every_output_check(path, tmp_path, monkeypatch, capsys):
    """Path("") is the current directory: `-o ''` must not write there."""
    from quillgpt.cli import main
    from quillgpt.files import check_output_dir, check_output_file, output_path, probe_writable

    monkeypatch.chdir(tmp_path)
    for check in (
        lambda: output_path(path, "--out"),
        lambda: check_output_file(path, "--out"),
        lambda: check_output_dir(path, "--out", "run", {}, False),
        lambda: probe_writable(path, "--out"),
    ):
        with pytest.raises(QuillError, match=r"^--out is (empty|only whitespace); give a file or directory name$"):
            check()
    for cmd in (["merge", str(tmp_path / "nowhere")], ["import-gguf", str(tmp_path / "nowhere.gguf")]):
        with pytest.raises(SystemExit) as e:
            main([*cmd, "-o", path])
        assert e.value.code == 2
        assert "--out is" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


# --- an output onto the command's own input: refused, whatever --force says -------------------


def test_refuse_onto_inputs_follows_links(tmp_path):
    from quillgpt.files import refuse_onto_inputs

    (tmp_path / "run").mkdir()
    src = tmp_path / "run" / "best.pt"
    src.write_text("keep")
    (tmp_path / "alias").symlink_to(tmp_path / "run")
    os.link(src, tmp_path / "hard.pt")
    for out in (src, tmp_path / "run" / ".." / "run" / "best.pt", tmp_path / "alias" / "best.pt", tmp_path / "hard.pt"):
        with pytest.raises(QuillError, match=r"is also the input; write the output to another file \(this command reads it"):
            refuse_onto_inputs([tmp_path / "other", out], [tmp_path / "missing", src], "-o")
    refuse_onto_inputs([tmp_path / "run" / "ckpt.pt"], [src], "-o")  # beside it: fine
    assert src.read_text() == "keep"


def _run(directory, lora_base=None):
    """A tiny float run (or, with `lora_base`, a LoRA run of zero adapters on that base's ckpt.pt)."""
    from support import random_model

    from quillgpt.checkpoint import load_checkpoint
    from quillgpt.config import Config, LoraConfig
    from quillgpt.data.tokenizer import CharTokenizer
    from quillgpt.model.lora import adapter_shapes
    from quillgpt.runs import base_identity, write_run

    model = random_model("rmsnorm-swiglu")
    directory.mkdir(parents=True)
    cfg, tok = Config(model=model.config), CharTokenizer("\n 012345678abcdefghijklmnopqrstuvwxyz")
    if lora_base is None:
        write_run(directory, cfg, tok, model.state_dict())
        return directory
    import torch

    cfg.lora = LoraConfig(rank=2, alpha=4.0)
    cfg.train.init_from = str(lora_base.parent)
    adapters = {k: torch.zeros(s) for k, s in adapter_shapes(cfg.model, cfg.lora).items()}
    base = {"path": str(lora_base.resolve()), "checksum": base_identity(load_checkpoint(lora_base))}
    write_run(directory, cfg, tok, adapters, lora_base=base)
    return directory


def _export_gguf_onto_its_checkpoint(tmp):
    _run(tmp / "run")
    return ["export-gguf", str(tmp / "run"), "-o", str(tmp / "run" / "ckpt.pt")], tmp / "run" / "ckpt.pt"


def _export_gguf_through_a_linked_directory(tmp):
    _run(tmp / "run")
    (tmp / "alias").symlink_to(tmp / "run")
    return ["export-gguf", str(tmp / "run"), "-o", str(tmp / "alias" / "ckpt.pt")], tmp / "run" / "ckpt.pt"


def _export_gguf_of_a_single_pt(tmp):
    _run(tmp / "run")
    os.replace(tmp / "run" / "ckpt.pt", tmp / "model.pt")
    return ["export-gguf", str(tmp / "model.pt"), "-o", str(tmp / "model.pt")], tmp / "model.pt"


def _export_hf_onto_a_linked_checkpoint(tmp):
    _run(tmp / "run")
    (tmp / "hf").mkdir()
    (tmp / "hf" / "model.safetensors").symlink_to(tmp / "run" / "ckpt.pt")
    return ["export-hf", str(tmp / "run"), "-o", str(tmp / "hf")], tmp / "run" / "ckpt.pt"


def _import_hf_onto_its_own_directory(tmp):
    from hf_support import make_hf_model

    make_hf_model(tmp / "hf", "smollm2")
    return ["import-hf", str(tmp / "hf"), "-o", str(tmp / "hf")], tmp / "hf" / "tokenizer.json"


def _import_gguf_of_a_file_named_as_the_run_it_writes(tmp):
    _run(tmp / "run")
    from quillgpt.interop.gguf_write import export_gguf

    export_gguf(tmp / "run", tmp / "ckpt.pt", which="latest", force=True)
    return ["import-gguf", str(tmp / "ckpt.pt"), "-o", str(tmp)], tmp / "ckpt.pt"


def _quantize_a_run_whose_checkpoint_links_into_the_output(tmp):
    _run(tmp / "other")
    (tmp / "run").mkdir()
    (tmp / "run" / "ckpt.pt").symlink_to(tmp / "other" / "ckpt.pt")
    return ["quantize", str(tmp / "run"), "-o", str(tmp / "other"), "--quantize", "int8"], tmp / "other" / "ckpt.pt"


def _merge_onto_its_lora_checkpoint(tmp):
    _run(tmp / "base")
    _run(tmp / "lora", lora_base=tmp / "base" / "ckpt.pt")
    os.replace(tmp / "lora" / "ckpt.pt", tmp / "lora.pt")
    (tmp / "out").mkdir()
    os.link(tmp / "lora.pt", tmp / "out" / "ckpt.pt")
    return ["merge", str(tmp / "lora.pt"), "-o", str(tmp / "out")], tmp / "lora.pt"


def _export_gguf_of_a_lora_run_onto_its_base(tmp):
    _run(tmp / "base")
    _run(tmp / "lora", lora_base=tmp / "base" / "ckpt.pt")
    return ["export-gguf", str(tmp / "lora"), "-o", str(tmp / "base" / "ckpt.pt")], tmp / "base" / "ckpt.pt"


def _quantize_a_lora_run_onto_its_base(tmp):
    _run(tmp / "base")
    _run(tmp / "lora", lora_base=tmp / "base" / "ckpt.pt")
    return ["quantize", str(tmp / "lora"), "-o", str(tmp / "base"), "--quantize", "int8"], tmp / "base" / "ckpt.pt"


ONTO_INPUT = [
    _export_gguf_of_a_lora_run_onto_its_base,
    _quantize_a_lora_run_onto_its_base,
    _export_gguf_onto_its_checkpoint,
    _export_gguf_through_a_linked_directory,
    _export_gguf_of_a_single_pt,
    _export_hf_onto_a_linked_checkpoint,
    _import_hf_onto_its_own_directory,
    _import_gguf_of_a_file_named_as_the_run_it_writes,
    _quantize_a_run_whose_checkpoint_links_into_the_output,
    _merge_onto_its_lora_checkpoint,
]


@pytest.mark.parametrize("make", ONTO_INPUT, ids=lambda f: f.__name__.strip("_"))
def test_no_force_writes_over_what_the_command_reads(tmp_path, capsys, make):
    """Each command with -o and --force: an output resolving to a file it reads is one line, exit
    2, before anything is written (the input byte for byte as it was)."""
    from quillgpt.cli import main

    if "gguf" in make.__name__:
        pytest.importorskip("gguf")
    if "hf" in make.__name__:
        pytest.importorskip("transformers")
    cmd, kept = make(tmp_path)
    capsys.readouterr()
    before = kept.read_bytes()
    listing = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--force"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "is also the input" in err, err
    assert kept.read_bytes() == before and sorted(p for p in tmp_path.rglob("*")) == listing


def test_a_nul_byte_in_an_input_name_is_one_line(tmp_path):
    from quillgpt.files import input_file

    with pytest.raises(QuillError, match=r"^--x .*a\\0b has a NUL byte in its name, which no file has"):
        input_file(tmp_path / "a\0b", "--x")
