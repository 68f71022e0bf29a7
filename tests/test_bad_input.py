"""User mistakes: each exits with code 2 and one `error:` line naming the problem and the fix,
prints no traceback, changes no existing file, and runs no code from a file it was given.

One table (CASES), run in-process through `quillgpt.cli.main`; the real entry point and
QUILL_DEBUG=1 are checked once each in a subprocess.
"""

import hashlib
import os
import pickle
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from quillgpt.checkpoint import FORMAT, RESUME_KEYS, load_checkpoint
from quillgpt.cli import main
from quillgpt.config import load_config
from quillgpt.data.tokenizer import CharTokenizer
from quillgpt.data.tokenizer_files import load_tokenizer, save_tokenizer
from quillgpt.errors import QuillError
from quillgpt.runs import load_run
from quillgpt.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "shakespeare_char_cpu.yaml"


@pytest.fixture(autouse=True)
def without_quill_debug(monkeypatch):
    """QUILL_DEBUG=1 in a developer's shell would turn the exit-2 paths into tracebacks."""
    monkeypatch.delenv("QUILL_DEBUG", raising=False)


class RunsCommand:
    """Unpickling this runs a shell command: what a malicious checkpoint would carry."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def tiny(w, *extra):
    """Overrides for a tiny run on the prepared Tiny Shakespeare, in the existing run dir."""
    return [
        f"data.path={w.text}",
        f"data.out_dir={w.data}",
        f"train.out_dir={w.run}",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.batch_size=4",
        "train.max_iters=2",
        "train.eval_interval=2",
        "train.eval_iters=2",
        "train.device=cpu",
        *extra,
    ]


def train_cmd(w, *extra):
    """A tiny run over the existing one: with train.overwrite=true unless resuming, so each case
    shows that a mistake changes nothing even where the user allowed replacing the run."""
    again = [] if "train.resume=true" in extra else ["train.overwrite=true"]
    return ["train", "--config", str(CONFIG), "-q", *tiny(w, *extra), *again]


@pytest.fixture(scope="module")
def w(tmp_path_factory, shakespeare_path):
    """A workspace: prepared data, a trained run, and one file per kind of mistake."""
    root = tmp_path_factory.mktemp("bad_input")
    w = SimpleNamespace(root=root, text=shakespeare_path, data=root / "data", run=root / "run", f=root / "files")
    train(load_config(CONFIG, tiny(w)), progress=False)
    f = w.f
    f.mkdir()
    (f / "empty_dir").mkdir()
    (f / "dir.png").mkdir()
    w.marker = f / "CODE_RAN"
    touch = f"touch {shlex.quote(str(w.marker))}"

    # config files
    (f / "broken.yaml").write_text("model:\n  n_layer: [2, 3\n")
    (f / "list.yaml").write_text("- model\n- train\n")
    (f / "section.yaml").write_text("model: 3\n")
    (f / "exec.yaml").write_text(f"model:\n  n_layer: !!python/object/apply:os.system [{touch!r}]\n")
    # text files
    (f / "empty.txt").write_bytes(b"")
    (f / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (f / "latin1.txt").write_bytes("Café crème, à la carte.\n".encode("latin-1") * 50)
    (f / "short.txt").write_text("hi\n")
    (f / "other.txt").write_text("to be or not to be\n" * 300)  # a different char vocabulary
    (f / "emoji.txt").write_text("To be, or not to be 🙂\n")
    # tokenizer files
    (f / "garbage.json").write_text("{not json")
    (f / "other.json").write_text('{"hello": 1}')
    save_tokenizer(CharTokenizer("\nabc"), f / "abc_tokenizer.json")
    # checkpoints
    good = (w.run / "ckpt.pt").read_bytes()
    (f / "truncated.pt").write_bytes(good[: len(good) // 2])
    (f / "text.pt").write_text("this is not a checkpoint\n")
    torch.save({"model": {}}, f / "no_marker.pt")
    torch.save({"format": FORMAT, "model": RunsCommand(touch)}, f / "exploit_torch.pt")
    with open(f / "exploit_pickle.pt", "wb") as fh:
        pickle.dump({"format": FORMAT, "model": RunsCommand(touch)}, fh)
    state = load_checkpoint(w.run / "ckpt.pt")
    state["config"]["model"]["n_layer"] = 3  # weights of 2 layers, a config that says 3
    torch.save(state, f / "mismatched.pt")
    state = load_checkpoint(w.run / "ckpt.pt")
    del state["tokenizer"]
    torch.save(state, f / "no_tokenizer.pt")
    (f / "flipped.pt").write_bytes(flip_weight_bytes(w.run / "ckpt.pt"))
    for name, change in CRAFTED.items():
        state = load_checkpoint(w.run / "ckpt.pt")
        change(state)
        torch.save(state, f / name)
    return w


def flip_weight_bytes(path):
    """The checkpoint with 4 KB inside its largest tensor zeroed: the zip CRC no longer matches."""
    import zipfile

    data = bytearray(Path(path).read_bytes())
    with zipfile.ZipFile(path) as z:
        member = max(z.infolist(), key=lambda i: i.file_size)
    start = member.header_offset + 30 + len(member.filename) + 64 + 256  # past the local header
    data[start : start + 4096] = bytes(4096)
    return bytes(data)


CRAFTED = {  # checkpoints whose content is not what quill writes
    "nan_weights.pt": lambda s: s["model"]["lm_head.weight"].fill_(float("nan")),
    "string_step.pt": lambda s: s.update(step="12"),
    "negative_step.pt": lambda s: s.update(step=-3),
    "int_weights.pt": lambda s: s["model"].update({"lm_head.weight": s["model"]["lm_head.weight"].long()}),
    "list_weights.pt": lambda s: s["model"].update({"lm_head.weight": [1.0, 2.0]}),
    "model_not_a_dict.pt": lambda s: s.update(model=[1, 2]),
    "newer_config_key.pt": lambda s: s["config"]["model"].update(moe_experts=8),
    "no_sampler.pt": lambda s: s.pop("sampler"),
    "no_vocab_size.pt": lambda s: s["config"]["model"].update(vocab_size=None),
    "huge_config.pt": lambda s: s["config"]["model"].update(n_layer=1024, n_embd=131072, n_head=2),
}

# name → (arguments, fragments the one error line must contain: the problem, then the fix)
CASES = {
    # --- config
    "config_missing": lambda w: (["train", "--config", str(w.f / "nope.yaml")], ["nope.yaml does not exist", "pass --config"]),
    "config_not_yaml": lambda w: (["train", "--config", str(w.f / "broken.yaml")], ["is not valid YAML at line"]),
    "config_not_a_mapping": lambda w: (
        ["train", "--config", str(w.f / "list.yaml")],
        ["must be a YAML mapping", "data/model/train/sample"],
    ),
    "config_section_not_a_mapping": lambda w: (["train", "--config", str(w.f / "section.yaml")], ["model must be a mapping"]),
    "config_python_tag": lambda w: (
        ["train", "--config", str(w.f / "exec.yaml")],
        ["exec.yaml is not valid YAML", "python/object/apply:os.system"],
    ),
    "unknown_key": lambda w: (train_cmd(w, "model.n_layr=3"), ["unknown config key model.n_layr", "did you mean 'n_layer'"]),
    "unknown_section": lambda w: (train_cmd(w, "modle.n_layer=3"), ["unknown config section 'modle'", "did you mean 'model'"]),
    "override_without_value": lambda w: (train_cmd(w, "train.max_iters"), ["'train.max_iters' must look like section.key=value"]),
    "wrong_type": lambda w: (train_cmd(w, "train.max_iters=lots"), ["train.max_iters must be int, got 'lots'"]),
    "wrong_choice": lambda w: (train_cmd(w, "model.pos=sinusoidal"), ["model.pos must be learned | rope"]),
    "negative_count": lambda w: (train_cmd(w, "train.max_iters=-1"), ["train.max_iters must be at least 1, got -1"]),
    # --- integer flags past any machine integer: one line where they are parsed (cli.count_option)
    "huge_port": lambda w: (["serve", "--ckpt", str(w.run), "--port", str(2**63)], ["--port", "4611686018427387904"]),
    "huge_max_batch": lambda w: (["serve", "--ckpt", str(w.run), "--max-batch", str(2**64)], ["--max-batch"]),
    "huge_max_tokens": lambda w: (["serve", "--ckpt", str(w.run), "--max-tokens", str(2**63)], ["--max-tokens"]),
    "huge_top_k": lambda w: (["attention", "--ckpt", str(w.run), "-p", "a", "--top-k", str(2**63)], ["--top-k"]),
    "huge_head": lambda w: (["attention", "--ckpt", str(w.run), "-p", "a", "--head", str(-(2**63))], ["--head"]),
    "huge_vocab_size": lambda w: (["tokenizer", "train", str(w.text), "--vocab-size", str(2**63)], ["--vocab-size"]),
    "heads_do_not_divide_width": lambda w: (
        train_cmd(w, "model.n_embd=30", "model.n_head=4"),
        ["model.n_embd (30) must be divisible by model.n_head (4)"],
    ),
    "kv_heads_do_not_divide_heads": lambda w: (train_cmd(w, "model.n_kv_head=3"), ["model.n_kv_head (3) must divide model.n_head (2)"]),
    "rope_odd_head_size": lambda w: (
        train_cmd(w, "model.pos=rope", "model.n_embd=30"),
        ["model.pos=rope needs an even head size, got n_embd/n_head = 15"],
    ),
    "block_longer_than_val_split": lambda w: (
        train_cmd(w, "model.block_size=200000"),
        ["the val split has", "use a smaller model.block_size"],
    ),
    "vocab_smaller_than_tokenizer": lambda w: (
        train_cmd(w, "model.vocab_size=10"),
        ["model.vocab_size=10 is smaller than the tokenizer's 65", "remove model.vocab_size"],
    ),
    "min_lr_above_lr": lambda w: (train_cmd(w, "train.min_lr=0.5", "train.learning_rate=0.1"), ["0 ≤ train.min_lr ≤ train.learning_rate"]),
    "unknown_device": lambda w: (train_cmd(w, "train.device=tpu"), ["train.device must be auto, cpu, cuda, cuda:N or mps, got 'tpu'"]),
    "bad_time_budget": lambda w: (train_cmd(w, "train.time_budget=soon"), ["train.time_budget must be a positive duration such as 90s"]),
    "val_fraction_out_of_range": lambda w: (train_cmd(w, "data.val_fraction=1.5"), ["data.val_fraction must be in (0, 1), got 1.5"]),
    "out_dir_is_a_file": lambda w: (train_cmd(w, f"train.out_dir={w.f / 'text.pt'}"), ["is not writable", "choose another directory"]),
    # --- data
    "data_missing": lambda w: (
        train_cmd(w, f"data.path={w.f / 'missing.txt'}"),
        ["data file not found", "set data.path to a UTF-8 text file"],
    ),
    "data_is_a_directory": lambda w: (
        train_cmd(w, f"data.path={w.f / 'empty_dir'}"),
        ["holds no .txt, .jsonl or .parquet files", "set data.path to"],
    ),
    "data_empty": lambda w: (train_cmd(w, f"data.path={w.f / 'empty.txt'}"), ["empty.txt is empty"]),
    "data_binary": lambda w: (
        train_cmd(w, f"data.path={w.f / 'image.png'}"),
        ["image.png is not UTF-8 text: byte 0x89 at byte offset 0", "convert it first"],
    ),
    "data_not_utf8": lambda w: (
        train_cmd(w, f"data.path={w.f / 'latin1.txt'}"),
        ["latin1.txt is not UTF-8 text: byte 0xe9 at byte offset 3", "iconv"],
    ),
    "data_too_short": lambda w: (
        train_cmd(w, f"data.path={w.f / 'short.txt'}", f"data.out_dir={w.f / 'short_data'}"),
        ["the train split has 2 tokens, fewer than block_size + 1 = 17", "use a smaller model.block_size"],
    ),
    # --- tokenizer
    "tokenizer_unknown_name": lambda w: (train_cmd(w, "data.tokenizer=gpt5"), ["unknown tokenizer 'gpt5'", "use one of char, gpt2"]),
    "tokenizer_file_not_json": lambda w: (
        train_cmd(w, f"data.tokenizer={w.f / 'garbage.json'}"),
        ["garbage.json is not a tokenizer JSON file"],
    ),
    "tokenizer_file_not_a_tokenizer": lambda w: (
        train_cmd(w, f"data.tokenizer={w.f / 'other.json'}"),
        ["other.json is not a QuillGPT tokenizer file", "quill tokenizer train"],
    ),
    "tokenizer_file_missing_chars": lambda w: (
        train_cmd(w, f"data.tokenizer={w.f / 'abc_tokenizer.json'}"),
        ["character(s) the tokenizer", "cannot encode", "use data.tokenizer=char"],
    ),
    "bpe_vocab_too_small": lambda w: (
        train_cmd(w, "data.tokenizer=bpe", "data.bpe_vocab_size=100"),
        ["data.bpe_vocab_size must be between 257"],
    ),
    "tokenizer_train_missing_input": lambda w: (
        ["tokenizer", "train", "-i", str(w.f / "missing.txt"), "-o", str(w.f / "tok.json")],
        ["--input", "missing.txt does not exist"],
    ),
    "tokenizer_train_vocab_too_small": lambda w: (
        ["tokenizer", "train", "-i", str(w.f / "other.txt"), "--vocab-size", "10", "-o", str(w.f / "tok.json")],
        ["a BPE vocabulary needs at least 257 ids", "got 10"],
    ),
    "eval_text_is_a_directory": lambda w: (["eval", "--ckpt", str(w.run), "--text", str(w.f)], ["--text", "is a directory; pass a file"]),
    "eval_text_unreadable": lambda w: (
        ["eval", "--ckpt", str(w.run), "--text", "/proc/self/mem"],
        ["cannot read --text /proc/self/mem: Input/output error"],
    ),
    "eval_text_name_too_long": lambda w: (
        ["eval", "--ckpt", str(w.run), "--text", str(w.f / ("t" * 300))],
        ["cannot read --text", "File name too long"],
    ),
    "eval_text_not_utf8": lambda w: (
        ["eval", "--ckpt", str(w.run), "--text", str(w.f / "latin1.txt")],
        ["--text", "latin1.txt is not UTF-8 text"],
    ),
    "attention_out_under_proc": lambda w: (
        ["attention", "--ckpt", str(w.run), "-p", "To be", "--out", "/proc/x/a.png"],
        ["--out", "/proc/x is not writable"],
    ),
    "attention_out_is_a_directory": lambda w: (
        ["attention", "--ckpt", str(w.run), "-p", "To be", "--out", str(w.f / "dir.png")],
        ["is a directory; pass a file name"],
    ),
    "plot_out_under_proc": lambda w: (["plot", str(w.run), "-o", "/proc/x/c.png"], ["/proc/x is not writable"]),
    "plot_out_name_too_long": lambda w: (["plot", str(w.run), "-o", str(w.f / ("c" * 300 + ".png"))], ["File name too long"]),
    "config_unreadable": lambda w: (["train", "--config", "/proc/self/mem"], ["cannot read --config /proc/self/mem: Input/output error"]),
    "tokenizer_file_unreadable": lambda w: (
        train_cmd(w, "data.tokenizer=/proc/self/mem"),
        ["cannot read tokenizer file /proc/self/mem: Input/output error"],
    ),
    "eval_text_with_unknown_chars": lambda w: (
        ["eval", "--ckpt", str(w.run), "--text", str(w.f / "emoji.txt")],
        ["cannot encode ('🙂' ×1)", "pass --skip-unknown"],
    ),
    # --- checkpoints
    "ckpt_missing": lambda w: (["eval", "--ckpt", str(w.f / "nope.pt")], ["checkpoint not found", "run directory or a .pt"]),
    "ckpt_dir_without_one": lambda w: (["eval", "--ckpt", str(w.f / "empty_dir")], ["no checkpoint in", "train one with quill train"]),
    "ckpt_truncated": lambda w: (
        ["eval", "--ckpt", str(w.f / "truncated.pt")],
        ["truncated.pt is not a readable checkpoint (truncated or corrupt", "use the other checkpoint in the run"],
    ),
    "ckpt_not_a_checkpoint": lambda w: (
        ["eval", "--ckpt", str(w.f / "text.pt")],
        ["text.pt is not a QuillGPT checkpoint (not a PyTorch zip archive)", "written by quill train"],
    ),
    "ckpt_bytes_flipped": lambda w: (
        ["eval", "--ckpt", str(w.f / "flipped.pt")],
        ["flipped.pt is not a readable checkpoint", "fails its CRC check", "use the other checkpoint in the run"],
    ),
    "ckpt_nan_weights": lambda w: (
        ["eval", "--ckpt", str(w.f / "nan_weights.pt")],
        ["nan_weights.pt: weight", "holds NaN or infinite values"],
    ),
    "ckpt_string_step": lambda w: (
        ["sample", "--ckpt", str(w.f / "string_step.pt"), "-p", "To be"],
        ["string_step.pt: 'step' must be int, got str"],
    ),
    "ckpt_negative_step": lambda w: (["eval", "--ckpt", str(w.f / "negative_step.pt")], ["'step' is -3"]),
    "ckpt_int_weights": lambda w: (
        ["eval", "--ckpt", str(w.f / "int_weights.pt")],
        ["weight 'lm_head.weight' is a torch.int64 tensor, not a floating-point tensor"],
    ),
    "ckpt_list_weights": lambda w: (["eval", "--ckpt", str(w.f / "list_weights.pt")], ["is list, not a floating-point"]),
    "ckpt_model_not_a_dict": lambda w: (["eval", "--ckpt", str(w.f / "model_not_a_dict.pt")], ["'model' must be dict, got list"]),
    "ckpt_newer_config_key": lambda w: (
        ["attention", "--ckpt", str(w.f / "newer_config_key.pt"), "-p", "To be"],
        ["config is not valid for this version of quill", "model.moe_experts", "written by a newer version"],
    ),
    "ckpt_no_vocab_size": lambda w: (
        ["eval", "--ckpt", str(w.f / "no_vocab_size.pt")],
        ["no_vocab_size.pt: the checkpoint's config has no model.vocab_size"],
    ),
    "ckpt_huge_config": lambda w: (
        ["eval", "--ckpt", str(w.f / "huge_config.pt")],
        ["checkpoint weights do not match its own config", "wrong shape"],
    ),
    "ckpt_unreadable": lambda w: (["eval", "--ckpt", "/proc/self/mem"], ["cannot read checkpoint /proc/self/mem: Input/output error"]),
    "ckpt_name_too_long": lambda w: (["eval", "--ckpt", str(w.f / ("c" * 300 + ".pt"))], ["File name too long"]),
    "ckpt_without_marker": lambda w: (
        ["attention", "--ckpt", str(w.f / "no_marker.pt"), "-p", "To be"],
        ["no_marker.pt is not a QuillGPT checkpoint (no", "written by quill train"],
    ),
    "ckpt_runs_code_torch_save": lambda w: (
        ["eval", "--ckpt", str(w.f / "exploit_torch.pt")],
        ["exploit_torch.pt was refused", "it would call posix.system", "only load checkpoints written by quill"],
    ),
    "ckpt_runs_code_plain_pickle": lambda w: (
        ["eval", "--ckpt", str(w.f / "exploit_pickle.pt")],
        ["exploit_pickle.pt is not a QuillGPT checkpoint"],
    ),
    "ckpt_weights_disagree_with_config": lambda w: (
        ["eval", "--ckpt", str(w.f / "mismatched.pt")],
        ["checkpoint weights do not match its own config"],
    ),
    "ckpt_without_tokenizer": lambda w: (
        ["export-hf", str(w.f / "no_tokenizer.pt"), "-o", str(w.f / "hf")],
        ["no_tokenizer.pt is missing 'tokenizer'", "not written by quill train"],
    ),
    "resume_a_different_model": lambda w: (
        train_cmd(w, "train.resume=true", "model.n_layer=3"),
        ["cannot resume", "model.n_layer: 2 → 3", "use the run's own config.yaml"],
    ),
    "resume_a_different_tokenizer": lambda w: (
        train_cmd(w, "train.resume=true", f"data.path={w.f / 'other.txt'}", f"data.out_dir={w.f / 'other_data'}"),
        ["cannot resume", "data.tokenizer: char (65 characters) → char (8 characters)"],
    ),
    "resume_without_checkpoint": lambda w: (
        train_cmd(w, f"train.out_dir={w.f / 'new_run'}", "train.resume=true"),
        ["cannot resume: no checkpoint", "drop --resume"],
    ),
    "init_from_missing": lambda w: (train_cmd(w, f"train.init_from={w.f / 'nope'}"), ["checkpoint not found"]),
    "which_unknown": lambda w: (["eval", "--ckpt", str(w.run), "--which", "newest"], ["--which must be best or latest"]),
    # --- flags
    "eval_stride_zero": lambda w: (
        ["eval", "--ckpt", str(w.run), "--stride", "0"],
        ["--stride must be between 1 and the model's block_size (16), got 0"],
    ),
    "eval_negative_batch": lambda w: (["eval", "--ckpt", str(w.run), "--batch-size", "-1"], ["--batch-size must be at least 1, got -1"]),
    "eval_unknown_split": lambda w: (["eval", "--ckpt", str(w.run), "--split", "test"], ["--split must be val or train"]),
    "eval_unknown_device": lambda w: (["eval", "--ckpt", str(w.run), "--device", "tpu"], ["--device must be auto, cpu"]),
    "eval_meta_device": lambda w: (
        ["eval", "--ckpt", str(w.run), "--device", "meta"],
        ["--device must be auto, cpu, cuda, cuda:N or mps, got 'meta'"],
    ),
    "eval_device_torch_lacks": lambda w: (["eval", "--ckpt", str(w.run), "--device", "xpu"], ["got 'xpu'"]),
    "attention_meta_device": lambda w: (["attention", "--ckpt", str(w.run), "-p", "To be", "--device", "meta"], ["got 'meta'"]),
    "eval_unknown_quantization": lambda w: (
        ["eval", "--ckpt", str(w.run), "--quantize", "int3"],
        ["--quantize must be int8, int8-channel, int5, int4, int4-g64, int4-g128 or none, got 'int3'"],
    ),
    "attention_unknown_quantization": lambda w: (
        ["attention", "--ckpt", str(w.run), "-p", "To be", "--quantize", "fp8"],
        ["--quantize must be int8, int8-channel, int5, int4, int4-g64, int4-g128 or none, got 'fp8'"],
    ),
    "eval_cpu_index": lambda w: (["eval", "--ckpt", str(w.run), "--device", "cpu:3"], ["there is one CPU device"]),
    # --- numbers
    "nan_learning_rate": lambda w: (train_cmd(w, "train.learning_rate=nan"), ["train.learning_rate must be a finite number, got 'nan'"]),
    "inf_learning_rate": lambda w: (train_cmd(w, "train.learning_rate=inf"), ["must be a finite number"]),
    "nan_grad_clip": lambda w: (train_cmd(w, "train.grad_clip=.nan"), ["train.grad_clip must be a finite number"]),
    "negative_seed": lambda w: (train_cmd(w, "train.seed=-1"), ["train.seed must be between 0 and 4294967295"]),
    "batch_cannot_fit": lambda w: (
        train_cmd(w, "train.batch_size=1000000000"),
        ["this run needs at least", "GB is free", "lower train.batch_size"],
    ),
    "model_cannot_fit": lambda w: (train_cmd(w, "model.n_embd=65536"), ["parameters × 16 bytes", "or the model's size"]),
    "eval_windows_cannot_fit": lambda w: (
        train_cmd(w, "train.eval_iters=1000000000000"),
        ["GB of evaluation windows for train.eval_iters=1000000000000"],
    ),
    "tokenizer_train_vocab_too_large": lambda w: (
        ["tokenizer", "train", "-i", str(w.f / "other.txt"), "--vocab-size", str(2**40), "-o", str(w.f / "tok.json")],
        ["at most 16,777,216, got 1099511627776"],
    ),
    "attention_layer_out_of_range": lambda w: (
        ["attention", "--ckpt", str(w.run), "-p", "To be", "--layer", "7"],
        ["--layer 7 is out of range: the model has layers 0..1"],
    ),
    "attention_negative_head": lambda w: (
        ["attention", "--ckpt", str(w.run), "-p", "To be", "--head", "-1"],
        ["--head -1 is out of range: the model has heads 0..1"],
    ),
    "attention_top_k_zero": lambda w: (
        ["attention", "--ckpt", str(w.run), "-p", "To be", "--top-k", "0"],
        ["--top-k must be at least 1, got 0"],
    ),
    "plot_not_a_run": lambda w: (
        ["plot", str(w.f / "empty_dir"), "-o", str(w.f / "curves.png")],
        ["has no metrics.jsonl", "pass a run directory written by quill train"],
    ),
    "unknown_command": lambda w: (["smaple", "--ckpt", str(w.run)], ["No such command 'smaple'", "see quill --help"]),
    "missing_required_flag": lambda w: (["eval"], ["Missing option '--ckpt'", "see quill eval --help"]),  # its own help
    "unknown_flag": lambda w: (["eval", "--ckpt", str(w.run), "--bogus"], ["No such option: --bogus", "see quill eval --help"]),
    "flag_not_a_number": lambda w: (
        ["eval", "--ckpt", str(w.run), "--stride", "many"],
        ["Invalid value for '--stride'", "see quill eval --help"],
    ),
    # --- quill sample
    "sample_top_p_above_1": lambda w: (sample(w, "--top-p", "1.5"), ["--top-p must be in (0, 1], got 1.5"]),
    "sample_negative_temperature": lambda w: (sample(w, "--temperature", "-1"), ["--temperature must be ≥ 0 (0 = greedy), got -1"]),
    "sample_negative_max_new_tokens": lambda w: (sample(w, "--max-new-tokens", "-1"), ["--max-new-tokens must be ≥ 0, got -1"]),
    "sample_min_p_of_1": lambda w: (sample(w, "--min-p", "1"), ["--min-p must be in [0, 1)"]),
    "sample_zero_repetition_penalty": lambda w: (sample(w, "--repetition-penalty", "0"), ["--repetition-penalty must be > 0 (1 = off)"]),
    "sample_no_samples": lambda w: (sample(w, "--num-samples", "0"), ["--num-samples must be at least 1, got 0"]),
    "sample_prompt_outside_char_vocab": lambda w: (
        sample(w, "-p", "To be 🙂"),
        ["not in the model's char vocabulary: '🙂'", "remove or replace them"],
    ),
    "sample_prompt_file_not_utf8": lambda w: (
        ["sample", "--ckpt", str(w.run), "--prompt-file", str(w.f / "latin1.txt")],
        ["latin1.txt is not UTF-8 text"],
    ),
    "sample_missing_ckpt": lambda w: (["sample", "--ckpt", str(w.f / "nope"), "-p", "To be"], ["checkpoint not found"]),
    "sample_truncated_ckpt": lambda w: (
        ["sample", "--ckpt", str(w.f / "truncated.pt"), "-p", "To be"],
        ["truncated.pt is not a readable checkpoint (truncated or corrupt"],
    ),
    "sample_ckpt_runs_code": lambda w: (
        ["sample", "--ckpt", str(w.f / "exploit_torch.pt"), "-p", "To be"],
        ["exploit_torch.pt was refused", "it would call posix.system"],
    ),
}


def sample(w, *flags):
    return ["sample", "--ckpt", str(w.run), "-p", "To be", "-n", "5", *flags]


def snapshot(*dirs):
    """path → (mtime, sha256) of every file. The run's .lock is left out: a trainer rewrites it
    with its pid when it takes the lock, which is that file's job."""
    return {
        p: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for d in dirs
        for p in sorted(Path(d).rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def run_main(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


@pytest.mark.parametrize("case", list(CASES))
def test_user_mistake_exits_2_with_one_clear_line_and_changes_nothing(case, w, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory either
    argv, fragments = CASES[case](w)
    before = snapshot(w.root, w.text.parent)
    code, _, err = run_main(capsys, argv)
    after = snapshot(w.root, w.text.parent)

    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert {p: after.get(p) for p in before} == before, "an existing file was changed or removed"
    assert not [p for p in after if p not in before and p.suffix == ".pt"], "a checkpoint was written"
    assert not list(tmp_path.iterdir())
    assert not w.marker.exists(), "a file given by the user ran code"


def test_crafted_pickles_are_refused_by_the_library_too(w):
    for name in ("exploit_torch.pt", "exploit_pickle.pt"):
        with pytest.raises(QuillError):
            load_checkpoint(w.f / name)
        with pytest.raises(QuillError):
            load_run(w.f / name)
    with pytest.raises(QuillError, match="exploit_pickle.pt is not UTF-8 text"):
        load_tokenizer(w.f / "exploit_pickle.pt")
    assert not w.marker.exists()


def test_checkpoint_structure_checks(w):
    """Resume needs the training state; inference does not. A clean checkpoint still loads."""
    with pytest.raises(QuillError, match="no_sampler.pt is missing 'sampler'"):
        load_checkpoint(w.f / "no_sampler.pt", require=RESUME_KEYS)
    assert load_run(w.f / "no_sampler.pt").step == 2
    assert load_checkpoint(w.run / "ckpt.pt", require=RESUME_KEYS)["step"] == 2


def test_real_entry_point_and_quill_debug(w):
    """`python -m quillgpt`: exit 2 and one line; with QUILL_DEBUG=1 the traceback is shown."""
    argv = [sys.executable, "-m", "quillgpt", "eval", "--ckpt", str(w.f / "exploit_torch.pt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("QUILL_DEBUG", None)
    plain = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert plain.returncode == 2 and plain.stdout == ""
    assert plain.stderr.startswith("error: ") and len(plain.stderr.strip().splitlines()) == 1, plain.stderr
    assert "was refused" in plain.stderr and not w.marker.exists()

    debug = subprocess.run(argv, capture_output=True, text=True, env={**env, "QUILL_DEBUG": "1"}, cwd=ROOT, timeout=120)
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert "quillgpt.errors.QuillError" in debug.stderr and "was refused" in debug.stderr
    assert not w.marker.exists()


@pytest.mark.parametrize(
    "value, debug", [("false", False), ("0", False), ("no", False), ("OFF", False), ("", False), ("1", True), ("true", True), ("yes", True)]
)
def test_quill_debug_false_means_off(w, capsys, monkeypatch, value, debug):
    monkeypatch.setenv("QUILL_DEBUG", value)
    argv = ["eval", "--ckpt", str(w.f / "nope.pt")]
    if debug:
        with pytest.raises(QuillError):
            main(argv)
    else:
        code, _, err = run_main(capsys, argv)
        assert code == 2 and err.startswith("error: checkpoint not found")


def test_error_line_stays_one_line(w, capsys):
    """A user's value with a newline in it is escaped, not printed as a second line."""
    code, _, err = run_main(capsys, ["eval", "--ckpt", str(w.f / "two\nlines.pt")])
    assert code == 2 and err.count("\n") == 1 and "two\\nlines.pt" in err
