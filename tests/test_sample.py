"""`quill sample` end to end on a tiny trained run: cache = recompute as text past block_size,
streamed = --no-stream = --json, seeds, several samples, stop strings, prompt sources, config
defaults, and bad input as one line with exit code 2."""

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quillgpt import native
from quillgpt.checkpoint import load_checkpoint, save_checkpoint
from quillgpt.cli import main
from quillgpt.config import load_config
from quillgpt.inference.generate import generate_text
from quillgpt.quant import plan, quantize
from quillgpt.runs import load_run
from quillgpt.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shakespeare_path):
    """2 layers, 32 wide, block 16, 8 steps on Tiny Shakespeare; run config: 7 new tokens."""
    tmp = tmp_path_factory.mktemp("sample")
    overrides = [
        f"data.path={shakespeare_path}",
        f"data.out_dir={tmp / 'data'}",
        f"train.out_dir={tmp / 'run'}",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        f"model.block_size={BLOCK}",
        "train.batch_size=4",
        "train.max_iters=8",
        "train.eval_interval=4",
        "train.eval_iters=2",
        "train.warmup_iters=2",
        "train.device=cpu",
        "sample.max_new_tokens=7",
        "sample.temperature=0.9",
    ]
    train(load_config(ROOT / "configs" / "shakespeare_char_cpu.yaml", overrides), progress=False)
    return tmp / "run"


@pytest.fixture(scope="module")
def decisive_ckpt(run_dir):
    """The run's checkpoint with larger random weights: greedy text that does not settle into
    one repeated character, so comparing two paths compares something."""
    state = load_checkpoint(run_dir / "best.pt")
    g = torch.Generator().manual_seed(0)
    for name, p in state["model"].items():
        is_gain = ".ln_" in name and name.endswith("weight")
        p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1) + float(is_gain))
    save_checkpoint(state, run_dir / "decisive.pt")
    return run_dir / "decisive.pt"


@pytest.fixture
def quill(capsys, monkeypatch):
    """Run `quill ARGS` in-process → (exit code, stdout, stderr); `stdin` feeds standard input."""

    def call(*args, stdin: bytes | None = None):
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        out, err = capsys.readouterr()
        return exit_info.value.code, out, err

    return call


def sample_json(quill, run_dir, *args):
    code, out, _ = quill("sample", "--ckpt", run_dir, "--json", *args)
    assert code == 0
    return json.loads(out)


def test_greedy_text_with_kv_cache_equals_recompute_past_block_size(quill, decisive_ckpt):
    args = ("-p", "ROMEO:", "--temperature", 0, "-n", 40)  # 6 + 40 tokens > block_size 16
    cached = sample_json(quill, decisive_ckpt, *args)
    plain = sample_json(quill, decisive_ckpt, *args, "--no-kv-cache")
    assert cached["samples"] == plain["samples"] and len(cached["samples"][0]) == 40
    assert len(set(cached["samples"][0][BLOCK:])) > 5  # varied text past block_size
    assert cached["settings"]["kv_cache"] and not plain["settings"]["kv_cache"]
    run = load_run(decisive_ckpt)
    assert cached["samples"] == generate_text(run.model, run.tokenizer, "ROMEO:", 40)[0]


def test_stream_no_stream_and_json_print_the_same_text(quill, run_dir):
    args = ("sample", "--ckpt", run_dir, "-p", "ROMEO:", "-n", 30, "--seed", 11)
    sample = sample_json(quill, run_dir, *args[3:])["samples"][0]
    code, streamed, err = quill(*args)
    assert code == 0 and streamed == "ROMEO:" + sample + ("" if sample.endswith("\n") else "\n")
    assert quill(*args, "--no-stream")[1] == streamed
    assert quill(*args, "--no-echo")[1] == streamed[len("ROMEO:") :]
    assert "30 new tokens" in err and "tokens/s" in err and "prefill" in err and err.count("\n") == 1
    assert quill(*args, "--quiet")[2] == ""


def test_seed_makes_sampling_reproducible(quill, run_dir):
    args = ("-p", "ROMEO:", "-n", 40, "--temperature", 1.0)
    first = sample_json(quill, run_dir, *args, "--seed", 5)["samples"]
    assert sample_json(quill, run_dir, *args, "--seed", 5)["samples"] == first
    assert sample_json(quill, run_dir, *args, "--seed", 6)["samples"] != first


def test_num_samples_are_one_batch_printed_under_headers(quill, run_dir):
    args = ("-p", "KING:", "-n", 20, "--seed", 2, "--num-samples", 3)
    samples = sample_json(quill, run_dir, *args)["samples"]
    assert len(samples) == 3 and len(set(samples)) == 3
    code, out, err = quill("sample", "--ckpt", run_dir, *args)
    expected = "".join(f"--- sample {i} ---\nKING:{s}" + ("" if s.endswith("\n") else "\n") for i, s in enumerate(samples, 1))
    assert code == 0 and out == expected and "x 3 samples, 60 new tokens" in err


def test_stop_string_spanning_tokens_ends_the_sample_unprinted(quill, run_dir, decisive_ckpt):
    args = ("-p", "ROMEO:", "-n", 40, "--temperature", 0)
    free = sample_json(quill, decisive_ckpt, *args)["samples"][0]
    stop = free[12:15]  # three characters: three tokens of the char model
    expected = free[: free.index(stop)]
    got = sample_json(quill, decisive_ckpt, *args, "--stop", stop, "--stop", "never seen")
    assert got["samples"] == [expected] and got["stats"]["finish"] == ["stop"]
    assert got["stats"]["new_tokens"] == [len(expected) + 3]
    assert quill("sample", "--ckpt", decisive_ckpt, *args, "--stop", stop)[1] == "ROMEO:" + expected + "\n"
    assert sample_json(quill, run_dir, "-n", 1, "--stop", r"\n\n", "--stop", r"a\\b")["settings"]["stop"] == ["\n\n", "a\\b"]


def test_prompt_from_file_and_standard_input(quill, run_dir, tmp_path):
    args = ("-n", 10, "--seed", 1)
    expected = sample_json(quill, run_dir, "-p", "ROMEO:\n", *args)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("ROMEO:\n", encoding="utf-8")
    from_file = sample_json(quill, run_dir, "--prompt-file", prompt_file, *args)
    code, out, _ = quill("sample", "--ckpt", run_dir, "--json", "-p", "-", *args, stdin=b"ROMEO:\n")
    for got in (from_file, json.loads(out)):
        assert (got["prompt"], got["samples"]) == (expected["prompt"], expected["samples"])


def test_defaults_come_from_the_run_config_and_flags_override(quill, run_dir):
    got = sample_json(quill, run_dir, "-p", "A")
    assert got["stats"]["new_tokens"] == [7] and got["settings"]["temperature"] == 0.9
    assert got["settings"]["top_k"] == 200 and got["settings"]["seed"] == 1337
    got = sample_json(quill, run_dir, "-p", "A", "-n", 3, "--top-k", 0, "--top-p", 0.5, "--which", "latest")
    assert got["stats"]["new_tokens"] == [3] and got["settings"]["top_k"] is None
    assert got["settings"]["top_p"] == 0.5 and got["checkpoint"].endswith("ckpt.pt")


def test_empty_prompt_starts_from_a_newline(quill, run_dir):
    empty = sample_json(quill, run_dir, "--temperature", 0, "-n", 12)
    newline = sample_json(quill, run_dir, "-p", "\n", "--temperature", 0, "-n", 12)
    assert empty["prompt"] == "" and empty["stats"]["prompt_tokens"] == [1]
    assert empty["samples"] == newline["samples"]


def test_bfloat16_runs(quill, run_dir):
    got = sample_json(quill, run_dir, "-p", "ROMEO:", "-n", 20, "--dtype", "bfloat16", "--device", "cpu")
    assert got["settings"]["dtype"] == "bfloat16" and len(got["samples"][0]) == 20


def test_int8_sample_is_the_int8_models_text(quill, decisive_ckpt, fixed_int8_kernel):
    args = ("-p", "ROMEO:", "--temperature", 0, "-n", 40)
    got = sample_json(quill, decisive_ckpt, *args, "--quantize", "int8")
    run = load_run(decisive_ckpt)
    quantize(run.model, "int8", kernel=fixed_int8_kernel)
    want, _ = generate_text(run.model, run.tokenizer, "ROMEO:", 40, temperature=0)
    assert got["samples"] == want and len(set(want[0])) > 5
    assert got["settings"]["quantize"] == "int8" and got["settings"]["int8_kernel"] == fixed_int8_kernel
    plain = sample_json(quill, decisive_ckpt, *args)
    assert plain["settings"]["quantize"] == "none" and plain["settings"]["int8_kernel"] is None
    code, _, err = quill("sample", "--ckpt", decisive_ckpt, *args, "--quantize", "int8", "--dtype", "bfloat16")
    assert code == 0 and f"int8 weights (32 per scale), {fixed_int8_kernel}" in err and "bfloat16" in err and "s, not in tokens/s" in err


def test_int4_sample_is_the_int4_models_text(quill, decisive_ckpt):
    args = ("-p", "ROMEO:", "--temperature", 0, "-n", 40)
    got = sample_json(quill, decisive_ckpt, *args, "--quantize", "int4")
    run = load_run(decisive_ckpt)
    quantize(run.model, "int4")
    want, _ = generate_text(run.model, run.tokenizer, "ROMEO:", 40, temperature=0)
    assert got["samples"] == want and len(set(want[0])) > 5 and got["settings"]["quantize"] == "int4"
    code, _, err = quill("sample", "--ckpt", decisive_ckpt, *args, "--quantize", "int4")
    head = "head int8 (per-channel scales, group_gemv)" if native.available() else "head in bf16"  # the C++ kernel or not
    assert code == 0 and "int4 weights (32 per scale)" in err and head in err


def test_int8_runs_where_no_kernel_beats_the_float_linears_and_says_so(quill, run_dir, monkeypatch):
    """A tiny model, or a busy machine while the kernels were timed: int8 was asked for, so it runs."""
    monkeypatch.setattr(plan, "_timings", lambda pairs, kernels, m, **budget: {"float": 0.1, **dict.fromkeys(kernels, 0.5)})
    code, out, err = quill("sample", "--ckpt", run_dir, "-p", "ROMEO:", "-n", "8", "--quantize", "int8")
    assert code == 0 and out.startswith("ROMEO:") and "a step's linears 0.50 ms vs 0.10 ms float (slower here" in err


@pytest.mark.parametrize("top_p", ["5e-324", "1e-46"])
@pytest.mark.parametrize(
    "extra", [[], ["--no-kv-cache"], ["--num-samples", "2"], ["--dtype", "bfloat16"]], ids=["cache", "no-cache", "two-samples", "bf16"]
)
def test_a_top_p_below_float32s_smallest_value_samples_the_greedy_text(quill, decisive_ckpt, top_p, extra):
    """The issue's cases: top_p rounds to 0 in float32, and the nucleus still holds the top token."""
    args = ("-p", "ROMEO:", "-n", 20, *extra)
    nucleus = sample_json(quill, decisive_ckpt, *args, "--temperature", 1.0, "--top-p", top_p, "--seed", 3)
    assert nucleus["samples"] == sample_json(quill, decisive_ckpt, *args, "--temperature", 0)["samples"]


def test_a_run_trained_with_a_tiny_top_p_samples(quill, run_dir, tmp_path):
    state = load_checkpoint(run_dir / "best.pt")
    state["config"]["sample"]["top_p"] = 1e-46  # what `quill train ... sample.top_p=1e-46` stores
    save_checkpoint(state, tmp_path / "tiny_top_p.pt")
    got = sample_json(quill, tmp_path / "tiny_top_p.pt", "-p", "A")
    assert got["settings"]["top_p"] == 1e-46 and got["stats"]["new_tokens"] == [7]


@pytest.fixture(scope="module")
def corrupt_ckpts(run_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corrupt")
    (tmp / "garbage.pt").write_bytes(b"not a checkpoint at all")
    data = (run_dir / "best.pt").read_bytes()
    (tmp / "truncated.pt").write_bytes(data[: len(data) // 2])
    torch.save({"weights": torch.zeros(2)}, tmp / "foreign.pt")
    (tmp / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    return tmp


BAD = {
    "missing checkpoint": (["--ckpt", "{tmp}/nope"], "checkpoint not found"),
    "empty run dir": (["--ckpt", "{tmp}"], "no checkpoint in"),
    "garbage checkpoint": (["--ckpt", "{tmp}/garbage.pt"], "garbage.pt"),
    "truncated checkpoint": (["--ckpt", "{tmp}/truncated.pt"], "truncated.pt"),
    "foreign checkpoint": (["--ckpt", "{tmp}/foreign.pt"], "not a QuillGPT checkpoint"),
    "chars outside the vocab": (["-p", "ROMEO: ¿dónde €?"], r"3 character\(s\).*'¿', 'ó', '€'"),
    "top-p 0": (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    "top-p above 1": (["--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
    "negative temperature": (["--temperature", "-0.5"], "--temperature must be ≥ 0"),
    "negative max-new-tokens": (["--max-new-tokens", "-1"], "--max-new-tokens must be ≥ 0"),
    "negative top-k": (["--top-k", "-3"], "--top-k must be at least 1"),
    "min-p 1": (["--min-p", "1"], "--min-p must be in"),
    "zero repetition penalty": (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    "zero samples": (["--num-samples", "0"], "--num-samples must be at least 1"),
    "samples beyond memory": (["--num-samples", "10000000000"], r"KV cache for 10000000000 sample\(s\) needs .*--num-samples"),
    "nan temperature": (["--temperature", "nan"], "--temperature must be ≥ 0 .*got nan"),
    "inf repetition penalty": (["--repetition-penalty", "inf"], "--repetition-penalty must be > 0 .*got inf"),
    "nan top-p": (["--top-p", "nan"], r"--top-p must be in \(0, 1\], got nan"),
    "huge max-new-tokens": (["-n", str(10**30)], "--max-new-tokens must be at most"),
    "unknown dtype": (["--dtype", "float8"], "--dtype must be float32, bfloat16 or float16"),
    "unknown quantization": (
        ["--quantize", "int3"],
        "--quantize must be int8, int8-channel, int5, int4, int4-g64, int4-g128 or none, got 'int3'",
    ),
    "unknown device": (["--device", "tpu"], "--device must be"),
    "empty stop string": (["--stop", ""], "stop string must not be empty"),
    "two prompts": (["-p", "a", "--prompt-file", "{tmp}/latin1.txt"], "--prompt or --prompt-file, not both"),
    "missing prompt file": (["--prompt-file", "{tmp}/none.txt"], "cannot read --prompt-file"),
    "prompt file not UTF-8": (["--prompt-file", "{tmp}/latin1.txt"], "not UTF-8 text .*offset 3"),
    "bad which": (["--which", "newest"], "--which must be best or latest"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_exit_2(quill, run_dir, corrupt_ckpts, case):
    args, match = BAD[case]
    args = [a.format(tmp=corrupt_ckpts) for a in args]
    if "--ckpt" not in args:
        args = ["--ckpt", str(run_dir), *args]
    code, out, err = quill("sample", *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ")
    assert re.search(match, err), err


def test_bad_input_from_the_shell_has_no_traceback(corrupt_ckpts):
    proc = subprocess.run(
        [sys.executable, "-m", "quillgpt", "sample", "--ckpt", str(corrupt_ckpts / "truncated.pt")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1


def test_a_prompt_from_an_endless_stream_is_refused_at_its_bound(quill, run_dir, tmp_path, monkeypatch):
    import quillgpt.cli as cli

    monkeypatch.setattr(cli, "MAX_PROMPT_CHARS", 1000)
    monkeypatch.setattr(cli, "MAX_PROMPT_BYTES", 4000)
    zero = open("/dev/zero", "rb")  # noqa: SIM115 — the endless stream the prompt is read from
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(zero))
    code, _, err = quill("sample", "--ckpt", run_dir, "-p", "-", "-n", 1)
    zero.close()
    assert code == 2 and "standard input holds more than 1,000 characters" in err and len(err.strip().splitlines()) == 1
    big = tmp_path / "big.txt"
    big.write_text("a" * 1001)
    code, _, err = quill("sample", "--ckpt", run_dir, "--prompt-file", big, "-n", 1)
    assert code == 2 and f"--prompt-file {big} holds more than 1,000 characters" in err
    code, _, err = quill("sample", "--ckpt", run_dir, "-p", "a", "--num-samples", 9223372036854775808)
    assert code == 2 and "--num-samples" in err and "4611686018427387904" in err and len(err.strip().splitlines()) == 1


def test_chat_s_piped_lines_are_bounded(quill, run_dir, monkeypatch):
    import quillgpt.cli as cli

    monkeypatch.setattr(cli, "MAX_PROMPT_CHARS", 1000)
    code, _, err = quill("chat", "--ckpt", run_dir, "-n", 2, stdin=b"hello\n" + b"\0" * 5000)
    assert code == 2 and "a line of standard input holds more than 1,000 characters" in err
    assert "Traceback" not in err
