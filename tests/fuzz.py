"""A hostile user's fuzz of quill: the CLI on a tiny run, and the HTTP API of a tiny server.

Builds a workspace in a temporary directory (a tiny trained run, its prepared data, an HF export
of it, FIFOs, device links, symlink loops, foreign files), then until --minutes are up throws
generated cases at two surfaces, round-robin:

  cli    `quill` commands run in this process (sample, chat, eval, attention, plot, tokenizer train,
         prepare, train, import-hf, export-hf, serve's flags) with hostile flags, overrides,
         input paths (FIFOs, /dev/zero, loops) and output paths (the run's own files...); import-hf
         of damaged HF directories (config.json, generation_config.json and tokenizer_config.json
         fields, chat templates that fail, loop or build huge values, fp8 weights); prepare of a
         conversation of 5,000 or 10,000 turns
  http   `quill serve` in a subprocess on 127.0.0.1: generated bodies, hostile sampling values,
         content types, auth headers, streams dropped mid-way, half-sent heads, stalled bodies,
         concurrent requests, and /health between them

and counts, per surface: cases tried, tracebacks (a CLI case that raised or printed one; the
server's log), hangs (a case past its time limit), 5xx answers, and overwrites (a file of the
run, its data or the HF export that changed). It prints the counts with a few examples of each
failure and exits 1 if any count but "cases" is non-zero.

It is a test tool, not a benchmark: tests/test_properties.py throws generated bad input at the
commands in the suite; this is its long-running cousin with more cases (not collected by pytest;
tests/test_scripts.py runs its --smoke).

    python tests/fuzz.py --minutes 10
    python tests/fuzz.py --smoke                  # the workspace, then a few seconds of cases
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "shakespeare_char_cpu.yaml"
TEXT = ROOT / "data" / "downloads" / "input.txt"  # the quickstart's download; --data-path names another copy
FAILURES = ("tracebacks", "hangs", "5xx", "overwrites")


class Tally:
    """Counts per surface, and the first few examples of each failure."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.examples: dict[tuple[str, str], list[str]] = defaultdict(list)
        self._lock = threading.Lock()  # HTTP cases also run on threads

    def add(self, surface: str, what: str, example: str = "") -> None:
        with self._lock:
            self.counts[surface][what] += 1
            if what != "cases" and not what.startswith("=") and len(self.examples[surface, what]) < 3:
                self.examples[surface, what].append(example[:600])

    def report(self) -> bool:
        print(f"{'surface':<8} {'cases':>7} " + " ".join(f"{f:>10}" for f in FAILURES) + "   outcomes")
        for surface, c in sorted(self.counts.items()):
            outcomes = ", ".join(f"{k[1:]} {n}" for k, n in sorted(c.items()) if k.startswith("="))
            print(f"{surface:<8} {c['cases']:>7} " + " ".join(f"{c[f]:>10}" for f in FAILURES) + f"   {outcomes}")
        for (surface, what), examples in sorted(self.examples.items()):
            for e in examples:
                print(f"  {surface} {what}: {e}")
        return any(c[f] for c in self.counts.values() for f in FAILURES)


# --- the workspace --------------------------------------------------------------------------


def quill(argv: list[str], limit: float = 60.0, stdin: bytes | Path = b"ROMEO:") -> tuple[int | str, str, str]:
    """`quill ARGV` in this process: (exit code, or "hang" / "raised", stdout, stderr); `stdin`:
    the bytes standard input holds, or a file (/dev/zero) it reads."""
    from quillgpt.cli import main

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError

    out, err = io.StringIO(), io.StringIO()
    source = open(stdin, "rb") if isinstance(stdin, Path) else io.BytesIO(stdin)  # noqa: SIM115 — closed below
    stdin, sys.stdin = sys.stdin, io.TextIOWrapper(source)  # for `-p -` and chat
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(argv)
        code: int | str = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code
    except TimeoutError:
        code = "hang"
    except BaseException as e:  # noqa: BLE001 — anything but SystemExit is a traceback for the user
        code = "raised"
        err.write(f"Traceback: {type(e).__name__}: {e}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sys.stdin = stdin
        source.close()
    return code, out.getvalue(), err.getvalue()


TINY = "model.n_layer=2 model.n_head=2 model.n_embd=32 model.block_size=16 train.batch_size=4 train.max_iters=2 train.eval_interval=2"


def tiny(w: dict, *extra: str) -> list[str]:
    where = [f"data.path={w['text']}", f"data.out_dir={w['data']}", f"train.out_dir={w['run']}"]
    return [*where, *TINY.split(), "train.eval_iters=2", "train.device=cpu", *extra]


def workspace(root: Path) -> dict:
    w = {
        "root": root,
        "text": root / "small.txt",
        "data": root / "data",
        "run": root / "run",
        "hf": root / "hf",
        "run_llama": root / "run_llama",
        "hf_llama": root / "hf_llama",  # a Llama-family export: its tokenizer files are import-hf's to read
        "scratch": root / "scratch",
    }
    build(w)
    w["scratch"].mkdir()
    special = root / "special"
    (special / "loop" / "deep").mkdir(parents=True)
    (special / "withfifo").mkdir()
    os.mkfifo(special / "pipe.txt")
    os.mkfifo(special / "withfifo" / "a.txt")
    os.symlink("/dev/zero", special / "zero.txt")
    os.symlink(".", special / "loop" / "self")
    os.symlink("..", special / "loop" / "deep" / "up")
    shutil.copy(w["text"], special / "loop" / "deep" / "real.txt")
    (special / "notes.png").write_text("not an image")
    (special / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    w["inputs"] = [
        str(p)
        for p in (
            special / "pipe.txt",
            special / "zero.txt",
            special / "withfifo",
            w["text"],
            special / "deep.jsonl",
            special / "notes.png",
        )
    ] + [
        "/dev/zero",
        "/dev/null",
        str(special / "loop" / "**" / "*.txt"),
        str(w["run"] / "best.pt"),
        "",
        "/proc/self/mem",
        str(w["run"]),
        str(w["hf"]),
        str(w["run"] / "config.yaml"),
        "x" * 300,
    ]
    w["outputs"] = [str(w["run"] / n) for n in ("best.pt", "ckpt.pt", "config.yaml", "tokenizer.json", "metrics.jsonl")] + [
        str(w["data"] / "meta.json"),
        str(w["data"] / "train.bin"),
        str(w["hf"] / "config.json"),
        str(special / "pipe.txt"),
        str(special / "notes.png"),
        str(w["text"]),
        "/dev/null",
        str(w["scratch"] / "new.png"),
        str(w["scratch"] / "n.json"),
        str(w["scratch"] / "a" / "b.svg"),
        str(w["scratch"] / ("n" * 300)),
        "/proc/x.png",
        str(w["root"]),
    ]
    return w


def snapshot(w: dict) -> dict[str, str]:
    files = [p for d in (w["run"], w["data"], w["hf"]) for p in sorted(Path(d).rglob("*")) if p.is_file() and p.name != ".lock"] + [
        w["text"]
    ]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


# --- CLI cases ------------------------------------------------------------------------------

FLOATS = ["0", "1", "-1", "nan", "inf", "-inf", "1e-46", "5e-324", "1e-300", "1e300", "0.5", "1e999", "x", "", "2"]
INTS = ["0", "1", "-1", "3", "17", "2147483648", str(2**64), "x", "", "1e3"]
PROMPTS = ["ROMEO:", "", "\n", "日本語", "a" * 200, "\x00", "To be", "-"]
DEVICES = ["cpu", "auto", "meta", "cuda:7", "", "mps", "cpu\n"]


def cli_case(w: dict, r: random.Random) -> list[str]:
    run = str(w["run"])

    def pick(values: list, good: object = None) -> object:  # with `good`: that value half the time
        return good if good is not None and r.random() < 0.5 else r.choice(values)

    kind = pick(
        ["sample", "sample", "chat", "eval", "attention", "plot", "tokenizer", "prepare", "train", "hf", "serve", "hfcfg", "longchat"]
        + list(CASE_MAKERS)
    )
    if kind in CASE_MAKERS:
        return CASE_MAKERS[kind](w, r)
    if kind == "hfcfg":
        return hostile_hf_dir(w, r)
    if kind == "longchat":
        return long_chat(w, r)
    if kind == "sample":
        flags = {
            "-p": pick(PROMPTS),
            "-n": pick(["1", "3", "8", "0", "-1"], "4"),
            "--temperature": pick(FLOATS, "1"),
            "--top-p": pick(FLOATS, "1e-46"),
            "--top-k": pick(INTS, "3"),
            "--min-p": pick(FLOATS, "0.1"),
            "--seed": pick(INTS, "7"),
            "--repetition-penalty": pick(FLOATS, "1.2"),
            "--num-samples": pick(["1", "2", "0"]),
            "--dtype": pick(["float32", "bfloat16", "float16", "int8"]),
            "--stop": pick(["\\n", "", "a", "ROMEO"]),
            "--device": pick(DEVICES, "cpu"),
            "--prompt-file": pick(w["inputs"]),
        }
        chosen = ["-n", *r.sample(sorted(set(flags) - {"-n"}), r.randint(1, 4))]  # -n always: the run's default is 500
        if "--prompt-file" in chosen and "-p" in chosen:
            chosen.remove("-p")
        argv = ["sample", "--ckpt", pick([run, run, *w["inputs"]]), "--json", *[x for k in chosen for x in (k, flags[k])]]
        return argv + (["--no-kv-cache"] if r.random() < 0.3 else [])
    if kind == "chat":  # standard input holds one message, then ends
        flags = {
            "--temperature": pick(FLOATS, "1"),
            "--top-p": pick(FLOATS, "1e-46"),
            "--top-k": pick(INTS, "3"),
            "--min-p": pick(FLOATS),
            "--seed": pick(INTS, "7"),
            "--system": pick(PROMPTS),
            "--dtype": pick(["float32", "bfloat16", "float16", "int8"]),
        }
        chosen = r.sample(sorted(flags), r.randint(1, 3))
        return [
            "chat",
            "--ckpt",
            pick(w["inputs"], run),
            "-n",
            pick(["1", "8", "0", "-1"], "6"),
            *[x for k in chosen for x in (k, flags[k])],
        ]
    if kind == "eval":
        argv = ["eval", "--ckpt", pick(w["inputs"], run), "--json", "--text", pick(w["inputs"], str(w["text"]))]
        return argv + pick([[], ["--stride", pick(INTS)], ["--batch-size", pick(INTS)]])
    if kind == "attention":
        out = pick([[], ["--out", pick(w["outputs"])], ["--summary-json", pick(w["outputs"])]])
        argv = ["attention", "--ckpt", run, "-p", pick(PROMPTS), *out]
        return argv + pick([[], ["--layer", pick(["all", "-9", "x"])], ["--head", pick(INTS)], ["--force"]])
    if kind == "plot":
        return ["plot", pick([run, *w["inputs"]]), "-o", pick(w["outputs"]), *pick([[], ["--x", pick(["time", "x"])]])]
    if kind == "tokenizer":
        argv = ["tokenizer", "train", "-i", pick(w["inputs"]), "-o", pick(w["outputs"])]
        return argv + ["--vocab-size", pick(["257", "260", "300", "0", "70000"]), *pick([[], ["--force"]])]
    if kind in ("prepare", "train"):
        out = w["scratch"] / f"{kind}_{r.randrange(3)}"
        extra = [f"data.path={pick(w['inputs'])}"] if r.random() < 0.5 else []
        extra += [f"data.out_dir={pick([str(Path(p).parent) for p in w['outputs']], str(out))}"]
        extra += [f"train.out_dir={pick([str(Path(p).parent) for p in w['outputs']], str(out) + '_run')}"]
        extra += r.sample(
            [
                f"sample.top_p={pick(FLOATS)}",
                f"model.n_layer={pick(INTS)}",
                f"train.init_from={run}",
                f"data.tokenizer={pick(w['inputs'])}",
                "train.resume=true",
                f"train.seed={pick(INTS)}",
            ],
            r.randint(0, 2),
        )
        return [kind, "--config", pick(w["inputs"], str(CONFIG)), *(["-q"] if kind == "train" else []), *tiny(w), *extra]
    if kind == "hf":
        which = pick(["import-hf", "export-hf"])
        source = str(w["hf"] if which == "import-hf" else w["run"]) if r.random() < 0.7 else pick(w["inputs"])
        return [which, source, "--out", pick([str(w["scratch"] / f"hf_{r.randrange(3)}"), *w["outputs"]])]
    bad = [["--api-key", ""], ["--max-batch", "0"], ["--port", "70000"], ["--dtype", "int8"], ["--max-tokens", "0"], ["--api-key", " "]]
    return ["serve", "--ckpt", run, *pick(bad)]


HOSTILE_TEMPLATES = [
    "{{ 1/0 }}",
    "{{ 10|divisibleby(0) }}",
    "{{ range(10**9)|list }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{% include 'x' %}",
    "{{ strftime_now(None) }}",
    "{{ ['a'] * 10**9 }}",
    "{% for %}",
    "{{ raise_exception('no') }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # memory bombs: a huge value built in one expression, in C
    "{% set ns = namespace(x='x') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x }}",
    "{{ 'x'|center(10**9) }}",
    "{{ '%999999999s'|format('x') }}",
    "{{ '%*s' % (999999999, 'x') }}",
    "{{ '{:>{w}}'.format('x', w=10**9) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ (['y' * 1000000] * 1000)|join }}",
    "{{ ['y' * 1000000] * 1000 }}",
    "{{ [1]|tojson(indent=10**9) }}",
    "{% set b %}{% for i in range(1000) %}{{ 'y' * 1000000 }}{% endfor %}{% endset %}{{ b }}",
]
# fields of the tokenizer files import-hf reads (once quill_tokenizer.json is gone)
HOSTILE_TOKENIZER_FIELDS = {
    "generation_config.json": {
        "eos_token_id": [[999999, -3], "2", [], 10**40, True, [1.5], {"a": 1}],
        "bos_token_id": [-1, "x", 10**6, 2**64],
        "pad_token_id": [{}, -5],
    },
    "tokenizer_config.json": {
        "eos_token": [7, {"content": 5}, [], ""],
        "bos_token": [{"content": None}, 1.5],
        "chat_template": [{"a": 1}, [{"name": "default"}], 5, [1]],
        "added_tokens_decoder": [[], {"-1": {"content": "x"}}, {"0": "x"}, {"99999999": {"content": "x"}}],
        "model_max_length": ["x", 0, -1, float("nan")],
    },
}
HOSTILE_FIELDS = {
    "n_embd": ["64", None, 0, -3, 10**40, 63, 1.5, True],
    "n_head": [0, "4", None, 3, 10**40],
    "n_layer": [0, 1, 99, "2", None],
    "vocab_size": [None, 1, 10**40, "65", -1],
    "n_positions": [0, None, "16", 10**40],
    "n_inner": [1, 129, "x", 0],
    "layer_norm_epsilon": [-1, "x", None, 0, 1e400],
    "tie_word_embeddings": ["yes", 2, None],
    "model_type": ["llama", 3, None, "qwen2"],
}


def hostile_hf_dir(w: dict, r: random.Random) -> list[str]:
    """import-hf of a copy of an HF export (GPT-2's, or the Llama family's with its tokenizer
    files) with hostile config.json, generation_config.json or tokenizer_config.json fields, a
    hostile chat template, and/or an fp8 weight."""
    src = w["scratch"] / f"hfsrc_{r.randrange(1 << 30)}"
    shutil.copytree(w["hf"] if r.random() < 0.4 else w["hf_llama"], src)
    config = json.loads((src / "config.json").read_text())
    for field in r.sample(sorted(HOSTILE_FIELDS), r.choice([0, 0, 1, 2])):  # (none half the time: what comes after is read)
        config[field] = r.choice(HOSTILE_FIELDS[field])
    (src / "config.json").write_text(json.dumps(config))
    if r.random() < 0.5:  # the directory's own tokenizer files are read, not the one quill saved beside them
        (src / "quill_tokenizer.json").unlink()
    if r.random() < 0.5:
        (src / "chat_template.jinja").write_text(r.choice(HOSTILE_TEMPLATES))
    for name in r.sample(sorted(HOSTILE_TOKENIZER_FIELDS), r.randint(0, 2)):
        data = json.loads((src / name).read_text()) if (src / name).is_file() else {}
        field = r.choice(sorted(HOSTILE_TOKENIZER_FIELDS[name]))
        data[field] = r.choice(HOSTILE_TOKENIZER_FIELDS[name][field])
        (src / name).write_text(json.dumps(data) if r.random() < 0.9 else json.dumps(list(data)))  # sometimes not an object
    if r.random() < 0.2:
        fp8_weight(src / "model.safetensors", r)
    return ["import-hf", str(src), "--out", str(w["scratch"] / f"hfout_{r.randrange(1 << 30)}")]


def fp8_weight(path: Path, r: random.Random) -> None:
    """One tensor of a safetensors file stored as fp8 (which import-hf must refuse by name)."""
    import safetensors.torch
    import torch

    tensors = safetensors.torch.load_file(path)
    name = r.choice(sorted(tensors))
    tensors[name] = tensors[name].to(r.choice([torch.float8_e4m3fn, torch.float8_e5m2]))
    safetensors.torch.save_file(tensors, path)


def long_chat(w: dict, r: random.Random) -> list[str]:
    """`quill prepare` of chat data holding one conversation of 5,000 or 10,000 turns (it must
    prepare in time linear in its length, not hang)."""
    turns = r.choice([5000, 10000])
    says = ["What say you?", "ROMEO, sir."]
    messages = [{"role": ["user", "assistant"][i % 2], "content": says[i % 2]} for i in range(turns)]
    path = w["scratch"] / f"long_{r.randrange(1 << 30)}.jsonl"
    lines = [{"messages": messages}, {"prompt": "Who?", "completion": "ROMEO"}, {"prompt": "And?", "completion": "JULIET"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return [
        "prepare",
        "--config",
        str(CONFIG),
        *tiny(w),
        f"data.path={path}",
        "data.format=chat",
        "data.val_fraction=0.4",
        f"data.tokenizer={w['run'] / 'tokenizer.json'}",
        f"data.out_dir={w['scratch'] / f'longchat_{r.randrange(1 << 30)}'}",
    ]


# --- issue 67: GGUF tensors and headers, damaged blocks, outputs onto inputs, hostile tokenizer.json.
# Each a case maker (w, r) → argv, registered in CASE_MAKERS (cli_case picks from it as from its
# own kinds); output_onto_input leaves w["onto_input"]: its --force asks for nothing to be replaced.


def _gguf_helpers():
    """The GGUF tests' writers (tests/interop/test_gguf_checks.py of this checkout, whatever --tree is)."""
    import importlib.util

    if "gguf_checks_helpers" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gguf_checks_helpers", ROOT / "tests" / "interop" / "test_gguf_checks.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["gguf_checks_helpers"] = module
    return sys.modules["gguf_checks_helpers"]


def good_gguf(w: dict, kind: str) -> Path:
    """The workspace's Llama-shaped run exported as a GGUF of `kind` (f32 or q8_0), once."""
    path = w["scratch"] / f"good_{kind}.gguf"
    if not path.exists():
        code, _, err = quill(["export-gguf", str(w["run_llama"]), "-o", str(path), "--type", kind], limit=300)
        if code != 0:
            sys.exit(f"could not export the workspace's GGUF: {err}")
    return path


def _import_gguf(w: dict, r: random.Random, path: Path) -> list[str]:
    extra = ["--dequantize"] if r.random() < 0.3 else []
    return ["import-gguf", str(path), "--out", str(w["scratch"] / f"ggufout_{r.randrange(1 << 30)}"), *extra]


def misshapen_gguf(w: dict, r: random.Random) -> list[str]:
    """import-gguf of a GGUF with one tensor of other dims, missing, or one extra (a layer past block_count...)."""
    import gguf

    t = _gguf_helpers()
    src = good_gguf(w, r.choice(["f32", "q8_0"]))
    target = r.choice([x.name for x in gguf.GGUFReader(src).tensors])
    how = r.choice(["reshape", "reshape", "drop", "extra"])
    dst = w["scratch"] / f"shape_{r.randrange(1 << 30)}.gguf"
    if how == "reshape":
        change = t.reshaped(target, r.choice([-2, -1, 0, 1, 3, 32]), r.choice([-32, 0, 32, 64]))
    elif how == "drop":
        change = lambda n, a, k: None if n == target else (n, a, k)  # noqa: E731
    else:
        extra = r.choice(["blk.9.attn_q.weight", "blk.0.attn_extra.weight", "rope_freqs.weight", "output.bias", "token_embd.weight2"])
        change = lambda n, a, k: [(n, a, k), (extra, a, k)] if n == target else (n, a, k)  # noqa: E731
    with contextlib.suppress(ValueError):  # a shape np.resize cannot make: the good file itself
        return _import_gguf(w, r, t.rewritten(src, dst, change))
    return _import_gguf(w, r, src)


def lying_gguf_header(w: dict, r: random.Random) -> list[str]:
    """import-gguf of a GGUF whose header lies: an array count or string length of up to 2^64, two
    tensors' data overlapping, or rows that are not whole quantization blocks."""
    t = _gguf_helpers()
    src = good_gguf(w, r.choice(["f32", "q8_0"]))
    how = r.choice(["count", "length", "overlap", "blocks"])
    if how in ("count", "length"):
        key = r.choice(
            ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"]
            if how == "count"
            else ["general.name", "tokenizer.ggml.model"]
        )
        data, at = t.field_at(src, key)
        at += 4 if how == "count" else 0  # an array's count follows its item type
        data[at : at + 8] = r.choice([2**62, 2**63 - 1, 2**64 - 1, 2**32, 10**6 * len(data)]).to_bytes(8, "little")
    else:
        import gguf

        names = [x.name for x in gguf.GGUFReader(src).tensors if len(x.shape) == 2]
        a, b = r.sample(names, 2)
        data, dims_at, offset_at = t.tensor_field(src, a)
        if how == "overlap":
            _, _, other_at = t.tensor_field(src, b)
            data[offset_at : offset_at + 8] = data[other_at : other_at + 8]
        else:
            data[dims_at : dims_at + 8] = r.choice([1, 31, 33, 48, 100]).to_bytes(8, "little")
    dst = w["scratch"] / f"header_{r.randrange(1 << 30)}.gguf"
    dst.write_bytes(bytes(data))
    return _import_gguf(w, r, dst)


def damaged_gguf_blocks(w: dict, r: random.Random) -> list[str]:
    """import-gguf of a Q8_0 GGUF with a NaN or infinite block scale, or an F32 one holding NaN or inf
    (damage of that tensor in the file: not a model that diverged)."""
    import gguf
    import numpy as np

    t = _gguf_helpers()
    kind = r.choice(["q8_0", "f32"])
    src = good_gguf(w, kind)
    tensors = {x.name: x for x in gguf.GGUFReader(src).tensors if kind == "f32" or x.tensor_type.name == "Q8_0"}
    target = r.choice(sorted(tensors))
    value = r.choice([np.nan, np.inf, -np.inf])
    if kind == "q8_0":
        change = t.bad_scale(target, r.randrange(tensors[target].n_bytes // 34), value)
    else:
        at = r.randrange(int(tensors[target].n_elements))

        def change(name, a, k):
            if name == target:
                a.reshape(-1)[at] = value
            return name, a, k

    return _import_gguf(w, r, t.rewritten(src, w["scratch"] / f"blocks_{r.randrange(1 << 30)}.gguf", change))


def output_onto_input(w: dict, r: random.Random) -> list[str]:
    """A command with --force whose output is (by its name, through a linked directory or a linked
    checkpoint) a file the same command reads: it must be refused, --force or not."""
    run, hf = w["run"], w["hf"]
    alias, hf_alias = w["scratch"] / "run_alias", w["scratch"] / "hf_alias"
    for link, target in ((alias, run), (hf_alias, hf)):
        if not link.is_symlink():
            link.symlink_to(target)
    linked = w["scratch"] / f"linked_{r.randrange(1 << 30)}"
    linked.mkdir()
    (linked / "ckpt.pt").symlink_to(run / "best.pt")
    (linked / "model.safetensors").symlink_to(run / "best.pt")
    w["onto_input"] = True  # the --force below does not ask for the input to be replaced
    return r.choice(
        [
            ["export-gguf", str(run), "-o", str(run / "best.pt")],
            ["export-gguf", str(run / "best.pt"), "-o", str(run / "best.pt")],
            ["export-gguf", str(run), "-o", str(alias / "best.pt")],
            ["export-gguf", str(linked), "--which", "latest", "-o", str(run / "best.pt")],
            ["import-hf", str(hf), "-o", str(hf)],
            ["import-hf", str(hf), "-o", str(hf_alias)],
            ["quantize", str(linked), "--which", "latest", "-o", str(run), "--quantize", "int8"],
            ["export-hf", str(run), "-o", str(linked)],
        ]
    ) + ["--force"]


# pre-tokenizer regexes the regex engine gives up on (a Rust panic), and normalizers that multiply text
HOSTILE_REGEXES = ["(x+x+)+y", "(\\w+\\s?)+$", "(a+a+)+b", "(\\d+\\d+)+x", "(.+.+)+!z", "([a-z]+[a-z]+)+0"]


def _hostile_normalizer(r: random.Random) -> dict:
    c = r.choice("ae \n1日")
    steps = [
        {"type": "Replace", "pattern": {"String": c}, "content": c * r.choice([2, 10, 100, 1000])},
        {"type": "Replace", "pattern": {"Regex": r.choice(["", "\\b", "$", "(?=a)"])}, "content": "xy" * r.choice([1, 50])},
        {"type": "Replace", "pattern": {"String": ""}, "content": "z" * r.choice([1, 100])},
        {"type": "Prepend", "prepend": "\u2581" * r.choice([1, 1000, 100000])},
    ]
    return {"type": "Sequence", "normalizers": [r.choice(steps) for _ in range(r.choice([1, 3, 8, 20]))]}


def hostile_tokenizer(w: dict, r: random.Random) -> list[str]:
    """import-hf (or prepare with data.tokenizer) of an HF directory whose tokenizer.json has a
    pre-tokenizer regex that makes the regex engine panic, or a normalizer that multiplies text."""
    src = w["scratch"] / f"toksrc_{r.randrange(1 << 30)}"
    shutil.copytree(w["hf_llama"], src)
    (src / "quill_tokenizer.json").unlink(missing_ok=True)  # the directory's own tokenizer.json is read
    data = json.loads((src / "tokenizer.json").read_text())
    if r.random() < 0.5:
        split = {"type": "Split", "pattern": {"Regex": r.choice(HOSTILE_REGEXES)}, "behavior": "Isolated", "invert": False}
        data["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [split] + ([data["pre_tokenizer"]] if data.get("pre_tokenizer") else []),
        }
    else:
        data["normalizer"] = _hostile_normalizer(r)
    (src / "tokenizer.json").write_text(json.dumps(data))
    if r.random() < 0.5:
        return ["import-hf", str(src), "--out", str(w["scratch"] / f"tokout_{r.randrange(1 << 30)}")]
    out = w["scratch"] / f"tokdata_{r.randrange(1 << 30)}"
    return ["prepare", "--config", str(CONFIG), *tiny(w), f"data.tokenizer={src / 'tokenizer.json'}", f"data.out_dir={out}"]


# --- issue 67: damaged resume states, hostile task folders and limits, huge numbers and YAML
# tags, stream bombs. Each a case maker (w, r) → argv, registered in CASE_MAKERS; a maker may
# leave w["watch"] (paths that must not change or appear) and w["stdin"] (what stdin holds).


def _resume_damages(r: random.Random) -> list:
    """Ways to damage a ckpt.pt's training state, each drawn with its own random values."""
    import torch

    def moment(s: dict) -> None:
        entry = r.choice(list(s["optimizer"]["state"].values()))
        key = r.choice(["exp_avg", "exp_avg_sq"])
        entry[key] = r.choice(
            [entry[key].reshape(-1)[: -r.randint(1, 3)].clone(), torch.full_like(entry[key], r.choice([math.nan, math.inf]))]
        )

    def embedding(s: dict) -> None:
        key = r.choice(sorted(s["model"]))
        s["model"][key] = torch.zeros(r.randint(1, 9), r.randint(1, 40))

    return [
        lambda s: s.update(optimizer=r.choice([{}, {"state": {}}, [], {"state": {}, "param_groups": []}])),
        moment,
        lambda s: next(iter(s["optimizer"]["state"].values())).update(step=torch.tensor(r.choice([math.nan, -1.0, math.inf]))),
        lambda s: s["optimizer"]["param_groups"][0].update(
            **{r.choice(["lr", "betas", "params", "eps"]): r.choice(["x", None, [7], math.nan])}
        ),
        lambda s: s["optimizer"]["state"].update({r.randint(100, 10**6): {"step": torch.tensor(1.0)}}),
        lambda s: s.update(sampler=r.choice([{}, {"generator": torch.zeros(r.randint(0, 6000), dtype=torch.uint8)}, {"generator": "x"}])),
        lambda s: s["rng"].update(
            **{
                r.choice(["torch", "python", "numpy", "cuda"]): r.choice(
                    [torch.zeros(r.randint(0, 9), dtype=torch.uint8), [3, [1], None], "x", 7]
                )
            }
        ),
        lambda s: s["rng"]["python"][1].__setitem__(r.randrange(625), r.choice([-1, 2**40, 10**30])),
        lambda s: s["rng"]["numpy"].__setitem__(2, r.choice([-5, 625, 10**6])),  # its position
        lambda s: s["rng"]["numpy"].__setitem__(3, r.choice([-1, 2, 10**6])),  # has_gauss
        lambda s: s.update(rank_rng=r.choice([[], "x", [{}]])),
        lambda s: s["config"].update(model=r.choice(["gpt", 7, [1], None])),
        lambda s: s["config"]["model"].update(
            **{r.choice(["n_layers", "zzz", "n_layer", "n_embd", "pos"]): r.choice(["two", -3, 1.5, [], 2**70])}
        ),
        lambda s: s["model"].update(**{f"extra{r.randrange(99)}": torch.zeros(r.randint(1, 4))}),
        lambda s: s["model"].pop(r.choice(sorted(k for k in s["model"] if not k.startswith("extra")))),  # (not the one just added)
        embedding,
        lambda s: s.update(tokens_seen=r.choice([-1, -(2**40), 2**63])),
        lambda s: s.update(elapsed_s=r.choice([math.inf, -1.0, math.nan, -(10**300)])),
        lambda s: s.update(best_val_loss=r.choice([math.nan, -2.0])),
        lambda s: s.update(horizon=r.choice([-3, 0, 2**70, "x"]), budget_ended=r.choice([True, "yes"])),
        lambda s: s.update(scaler=r.choice([[], "x", 7])),
    ]


def damaged_resume(w: dict, r: random.Random) -> list[str]:
    """`train --resume` of a copy of the run whose ckpt.pt's training state is damaged (or has
    bytes after its zip): one line, and the copy byte for byte unchanged."""
    import torch

    run = w["scratch"] / f"resume_{r.randrange(1 << 30)}"
    shutil.copytree(w["run"], run)
    path = run / "ckpt.pt"
    if r.random() < 0.15:
        with open(path, "ab") as f:
            f.write(r.randbytes(r.randint(1, 70_000)))
    else:
        state = torch.load(path, weights_only=True)
        for damage in r.sample(_resume_damages(r), r.randint(1, 2)):
            with contextlib.suppress(Exception):  # a first damage may leave nothing for the second to damage
                damage(state)
        torch.save(state, path)
    w["watch"] = [run]
    return ["train", "--config", str(CONFIG), "-q", "--resume", *tiny(w, f"train.out_dir={run}", "train.max_iters=4")]


TASK_DAMAGES = [
    lambda t, r: t.replace("dataset_path: json\n", ""),
    lambda t, r: t.replace('doc_to_text: "{{q}}"\n', ""),
    lambda t, r: t.replace("test_split: train\n", ""),
    lambda t, r: t.replace("output_type: multiple_choice", "output_type: " + r.choice(["essay", "1", "[]", "null"])),
    lambda t, r: t.replace("metric: acc", "metric: " + r.choice(["vibes", "accuracy!", "1"])),
    lambda t, r: t.replace('"{{q}}"', r.choice(['"{{q"', '"{% for %}"', '"{{ q | nosuchfilter }}"', '"{{ nothing }}"'])),
    lambda t, r: t.replace(
        '"{{q}}"', r.choice(['"{{ q.__class__.__mro__ }}"', '"{{ cycler.__init__.__globals__ }}"', '"{{ range(10**9)|list }}"'])
    ),
    lambda t, r: t.replace("DOCS", r.choice(["none.jsonl", "/dev/zero", ".", "/proc/self/mem"])),
    lambda t, r: t.replace('doc_to_text: "{{q}}"', "doc_to_text: !function utils.f"),
    lambda t, r: t + r.choice(["class: !function utils.T\n", "x: !!python/name:os.system\n", "include: t.yaml\n"]),
]


def hostile_task_folder(w: dict, r: random.Random) -> list[str]:
    """`eval --tasks` of a task folder written here (a multiple-choice task over a local jsonl),
    damaged or hostile (code, sandbox escapes, self-including groups), with hostile --limit and
    --num-fewshot; its utils.py leaves a marker that must never appear."""
    folder = w["scratch"] / f"tasks_{r.randrange(1 << 30)}"
    folder.mkdir()
    marker = folder / "RAN"
    docs = [{"q": f"ROMEO: what light {'abc'[i % 3]}", "choices": [" yes", " no"], "label": i % 2} for i in range(r.randint(0, 6))]
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "utils.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n\ndef f(doc):\n    return doc['q']\n")
    name = f"fz{r.randrange(1 << 20)}"
    text = (
        f"task: {name}\ndataset_path: json\ntest_split: train\ndataset_kwargs:\n  cache_dir: {folder / 'cache'}\n"
        "  data_files:\n    train: DOCS\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_target: "{{label}}"\ndoc_to_choice: "{{choices}}"\nmetric_list:\n  - metric: acc\n'
    )
    for damage in r.sample(TASK_DAMAGES, r.choice([0, 1, 1, 2])):
        text = damage(text, r)
    (folder / "t.yaml").write_text(text.replace("DOCS", str(folder / "docs.jsonl")))
    asked = name
    if r.random() < 0.2:  # a group that includes itself, directly or through another
        (folder / "g.yaml").write_text(f"group: {name}_g\ntask:\n  - {name}_h\n")
        (folder / "h.yaml").write_text(f"group: {name}_h\ntask:\n  - {r.choice([name + '_g', name + '_h'])}\n")
        asked = f"{name}_g"
    flags = r.choice(
        [[], ["--limit", r.choice(FLOATS + ["0.5", "2", "1e300", "2.5"])], ["--num-fewshot", r.choice(INTS + ["5000", "1025"])]]
    )
    w["watch"] = [marker, w["run"]]
    return ["eval", "--ckpt", str(w["run"]), "--which", "latest", "--tasks", asked, "--include-path", str(folder), *flags]


HUGE = ["9223372036854775808", str(2**64), "1" * 400, "-9223372036854775809", "1e300"]


def huge_numbers(w: dict, r: random.Random) -> list[str]:
    """Integers past every bound, as flags, overrides and YAML (5,000 digits; !!binary; 1:30),
    finetune --epochs by the billion, and HF configs with numbers a model cannot mean."""
    kind = r.choice(["flag", "yaml", "override", "epochs", "hf"])
    if kind == "flag":
        flag, command = r.choice([("--batch-size", "eval"), ("--stride", "eval"), ("--num-samples", "sample"), ("-n", "sample")])
        extra = ["--text", str(w["text"])] if command == "eval" else ["-p", "ROMEO:"]
        return [command, "--ckpt", str(w["run"]), flag, r.choice(HUGE), *extra]
    if kind in ("yaml", "override"):
        key = r.choice(["train.max_iters", "model.n_layer", "train.seed", "data.shard_tokens", "train.learning_rate", "data.path"])
        value = r.choice(
            ["1" * r.choice([4000, 5000, 20000]), "0x" + "f" * 5000, "!!binary aGVsbG8=", "1:30", "-1:30:00", "1:30.5", "!!python/none"]
        )
        out = w["scratch"] / f"huge_{r.randrange(1 << 30)}"
        base = [f"data.out_dir={out}/data", f"train.out_dir={out}/run", *([f"data.path={w['text']}"] if key != "data.path" else [])]
        if kind == "override":
            return ["prepare", "--config", str(CONFIG), *tiny(w), *base, f"{key}={value}"]
        section, name = key.split(".")
        path = w["scratch"] / f"huge_{r.randrange(1 << 30)}.yaml"
        path.write_text(f"{section}:\n  {name}: {value}\n")
        return ["prepare", "--config", str(path), *base]
    if kind == "epochs":
        data = w["scratch"] / "chat.jsonl"
        data.write_text(json.dumps({"prompt": "Who?", "completion": "ROMEO"}) + "\n")
        out = w["scratch"] / f"ft_{r.randrange(1 << 30)}"
        w["watch"] = [out]
        return [
            "finetune",
            str(w["run"]),
            "--data",
            str(data),
            "-o",
            str(out),
            "--epochs",
            r.choice(["1000000000", "1001", *HUGE, "0", "-5"]),
        ]
    src = w["scratch"] / f"hfnum_{r.randrange(1 << 30)}"
    shutil.copytree(w["hf_llama"], src)
    config = json.loads((src / "config.json").read_text())
    field, value = r.choice(
        [
            ("rms_norm_eps", r.choice([2e64, 1e300, -1e-6, "1e-6", None])),
            ("rope_theta", r.choice(["10000.0", None, 1e300, -1, [1]])),
            ("rope_scaling", r.choice([{"rope_type": "linear", "factor": r.choice([-4.0, 0, 1e300, "8"])}, 0, [1, 2], "linear"])),
            (
                "rope_parameters",
                r.choice([{"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": r.choice([-1, 2**40, "x"])}, 0, []]),
            ),
        ]
    )
    config[field] = value
    (src / "config.json").write_text(json.dumps(config))
    return ["import-hf", str(src), "--out", str(w["scratch"] / f"hfnumout_{r.randrange(1 << 30)}")]


def stream_bomb(w: dict, r: random.Random) -> list[str]:
    """A prompt from an endless stream (/dev/zero as sample's `-p -` or chat's standard input, a
    link to it as --prompt-file): one line at the bound, never memory until it runs out."""
    kind = r.choice(["sample", "chat", "file"])
    if kind == "file":
        return [
            "sample",
            "--ckpt",
            str(w["run"]),
            "-n",
            "1",
            "--prompt-file",
            r.choice([str(w["root"] / "special" / "zero.txt"), "/dev/zero"]),
        ]
    w["stdin"] = Path("/dev/zero") if r.random() < 0.8 else b"ROMEO:\n" + b"a" * r.randint(0, 100_000)
    if kind == "sample":
        return ["sample", "--ckpt", str(w["run"]), "-n", "1", "-p", "-"]
    return ["chat", "--ckpt", str(w["run"]), "-n", "1"]


CASE_MAKERS = {
    "gguf_shapes": misshapen_gguf,
    "gguf_header": lying_gguf_header,
    "gguf_blocks": damaged_gguf_blocks,
    "onto_input": output_onto_input,
    "tokenizer_json": hostile_tokenizer,
    "resume": damaged_resume,
    "tasks": hostile_task_folder,
    "numbers": huge_numbers,
    "streams": stream_bomb,
}


def run_cli(w: dict, r: random.Random, tally: Tally) -> None:
    argv = cli_case(w, r)
    onto_input = w.pop("onto_input", False)  # such a case's --force asks for nothing to be replaced
    asked = ("--force" in argv and not onto_input) or "train.resume=true" in argv  # replacing or continuing was asked for
    before = w["built"]
    watched = {p: _digest(p) for p in w.pop("watch", [])}  # a case's own files: none may change (or appear)
    code, _, err = quill(argv, stdin=w.pop("stdin", b"ROMEO:"))
    if argv[0] == "chat" and err.startswith("chatting with "):  # chat's header line comes before whatever it says
        err = err.split("\n", 1)[1]
    tally.add("cli", "cases")
    tally.add("cli", f"={argv[0]} exit {code}")  # what the cases did, to show they reach the work
    shown = "quill " + " ".join(repr(a) if " " in a or not a else a for a in argv)[:300]
    if code == "hang":
        tally.add("cli", "hangs", shown)
    elif (
        code == "raised"
        or "Traceback" in err
        or code not in (0, 2)
        or (code == 2 and not (err.count("\n") == 1 and err.startswith("error: ")))
    ):
        tally.add("cli", "tracebacks", f"{shown} → exit {code}: {err[-300:]}")
    after = snapshot(w)
    touched = [str(p) for p, h in watched.items() if _digest(p) != h]
    if touched:
        tally.add("cli", "overwrites", f"{shown} changed or created {touched[:3]}")
    changed = [p for p, h in before.items() if after.get(p) != h]
    if changed and not asked and not all(rebuilt_dataset(argv, Path(p)) for p in changed):
        tally.add("cli", "overwrites", f"{shown} changed {changed[:3]}")
    if changed:  # restore the workspace, so later cases meet the same files
        rebuild(w)


def _digest(path: Path) -> str | None:
    """A file's sha256 (None: no file), or a directory's files' (the run a damaged resume must not touch)."""
    path = Path(path)
    if path.is_dir():
        return hashlib.sha256(
            "".join(f"{p}:{_digest(p)}" for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock").encode()
        ).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def rebuilt_dataset(argv: list[str], path: Path) -> bool:
    """Whether `path` is a file of the dataset in this prepare's (or train's) data.out_dir: a
    dataset of other inputs is rebuilt in place, as documented (its meta.json says so)."""
    out = next((a.split("=", 1)[1] for a in reversed(argv) if a.startswith("data.out_dir=")), None)
    return (
        argv[0] in ("prepare", "train")
        and out is not None
        and path.parent == Path(out)
        and re.fullmatch(r"meta\.json|\.prepare-state\.json|(?:train|val)(?:-\d{6})?(?:\.flags)?\.bin", path.name) is not None
    )


def build(w: dict) -> None:
    """Write the workspace's text, then train its run (and dataset) and export its HF model."""
    w["text"].write_text(TEXT.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    llama = ["model.pos=rope", "model.norm=rmsnorm", "model.mlp=swiglu", f"train.out_dir={w['run_llama']}"]
    for argv in (
        ["train", "--config", str(CONFIG), "-q", *tiny(w)],
        ["export-hf", str(w["run"]), "--out", str(w["hf"])],
        ["train", "--config", str(CONFIG), "-q", *tiny(w, *llama)],
        ["export-hf", str(w["run_llama"]), "--out", str(w["hf_llama"])],
    ):
        code, _, err = quill(argv, limit=600)
        if code != 0:
            sys.exit(f"could not build the workspace: quill {' '.join(argv)}: {err}")
    w["built"] = snapshot(w)  # what every case starts from


def rebuild(w: dict) -> None:
    """The workspace as built, after a case changed it (the text included)."""
    for d in (w["run"], w["data"], w["hf"], w["run_llama"], w["hf_llama"]):
        shutil.rmtree(d, ignore_errors=True)
    build(w)


# --- HTTP cases -----------------------------------------------------------------------------

VALUES = [
    None,
    0,
    1,
    -1,
    0.5,
    1e-46,
    5e-324,
    1e300,
    -1e300,
    2**31,
    2**64,
    10**40,
    "",
    "a",
    True,
    [],
    {},
    [1],
    {"1": 0},
    {"1": 5},
    "\ud800",
    "x" * 5000,
    4294967295,
    4294967296,
]
FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop",
    "seed",
    "n",
    "stream",
    "stream_options",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "echo",
    "logprobs",
    "suffix",
    "best_of",
    "messages",
    "max_completion_tokens",
    "\ud800",
    "unknown",
]


def body(r: random.Random) -> dict:
    base = {"prompt": r.choice(PROMPTS[:-1] + [["a", "b"]]), "max_tokens": r.choice([1, 4, 16, 40])}
    for _ in range(r.randint(0, 5)):
        base[r.choice(FIELDS)] = r.choice(VALUES)
    if r.random() < 0.3:
        base["stream"] = True
    return base


def http_case(url: str, r: random.Random, tally: Tally, slow: list[threading.Thread], nested: bool = False) -> None:
    """One HTTP case; slow ones (a half-sent head, a stalled body: the server's timeouts end
    them) run on a thread of `slow`."""
    import httpx

    kinds = ["json", "json", "json", "chat", "raw", "type", "auth", "drop", "health"] + ([] if nested else ["burst"])
    kind = r.choice(kinds + (["head", "stall"] if r.random() < 0.2 else []))
    if kind in ("head", "stall") and not nested:
        slow.append(threading.Thread(target=http_case, args=(url, random.Random(r.random()), tally, slow, True), daemon=True))
        slow[-1].start()
        return
    route = "/v1/chat/completions" if kind == "chat" else r.choice(["/v1/completions", "/v1/completions", "/v1/attention"])
    host, port = url.rsplit(":", 1)[0].split("//")[1], int(url.rsplit(":", 1)[1])
    tally.add("http", "cases")
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            if kind in ("json", "chat"):
                data = body(r)
                if kind == "chat":
                    data["messages"] = r.choice([[{"role": "user", "content": "hi"}], [], "x", [{"role": "x"}]])
                    data.pop("prompt")
                raw = json.dumps(data, ensure_ascii=r.random() < 0.5).encode("utf-8", "surrogatepass")
                check(tally, c.post(route, content=raw, headers={"Content-Type": "application/json"}), raw[:200])
            elif kind == "raw":
                raw = r.choice([b"", b"{", b"[" * 50_000, b"\xff\xfe", b'{"prompt": NaN}', os.urandom(64)])
                check(tally, c.post(route, content=raw, headers={"Content-Type": "application/json"}), raw[:80])
            elif kind == "type":
                kind_header = r.choice(["text/plain", "application/x-www-form-urlencoded", "", "multipart/form-data"])
                check(tally, c.post(route, content=b'{"prompt": "a"}', headers={"Content-Type": kind_header}), kind_header)
            elif kind == "auth":
                check(
                    tally,
                    c.get(
                        r.choice(["/v1/models", "/health", "/", "/static/../x", "/v2"]),
                        headers={"Authorization": r.choice(["", "Bearer", "Bearer x" * 100])},
                    ),
                    "auth",
                )
            elif kind == "drop":  # a stream read a little, then abandoned
                with c.stream("POST", "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 500, "stream": True}) as s:
                    for _ in zip(range(r.randint(0, 5)), s.iter_lines()):
                        pass
            elif kind in ("head", "stall"):  # the server must close it: 10 s for a head, 30 s for a body
                with socket.create_connection((host, port), timeout=45) as s:
                    s.sendall(
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        + (b"Content-Length: 100\r\n\r\n{" if kind == "stall" else b"Content-Le")
                    )
                    while s.recv(4096):
                        pass
            elif kind == "burst":
                threads = [threading.Thread(target=http_case, args=(url, random.Random(r.random()), tally, slow, True)) for _ in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
            else:
                check(tally, c.get("/health"), "health")
    except (httpx.TimeoutException, TimeoutError):
        tally.add("http", "hangs", f"{kind} {route}")
    except (httpx.TransportError, OSError) as e:  # a closed connection is an answer for a half-sent request
        if kind not in ("head", "stall", "drop"):
            tally.add("http", "hangs" if "timed out" in str(e) else "5xx", f"{kind} {route}: {type(e).__name__}: {e}")


def check(tally: Tally, r, what: object) -> None:
    tally.add("http", f"={r.status_code}")
    if r.status_code >= 500:
        tally.add("http", "5xx", f"{r.status_code} for {what!r}: {r.text[:200]}")
    if "text/event-stream" in r.headers.get("content-type", "") and not r.text.endswith("data: [DONE]\n\n"):
        tally.add("http", "hangs", f"a stream that did not end with [DONE] for {what!r}")


def start_server(w: dict, tree: Path) -> tuple[subprocess.Popen, str, list[str]]:
    from harness import serve  # scripts/harness.py: main puts this checkout's scripts/ on PYTHONPATH

    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    env.pop("QUILL_API_KEY", None)
    return serve(w["run"], "--max-batch", "4", "--device", "cpu", env=env, echo=False)


# --- main -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to throw cases (after the setup)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="where to build the workspace (default: a temp dir)")
    parser.add_argument(
        "--tree",
        type=Path,
        default=ROOT,
        help="the checkout whose quill is fuzzed (default: this one; e.g. an older commit's worktree, for a before/after)",
    )
    parser.add_argument("--data-path", type=Path, help="Tiny Shakespeare (default: data/downloads/input.txt, where the quickstart put it)")
    parser.add_argument("--smoke", action="store_true", help="a few seconds of cases after the workspace is built")
    args = parser.parse_args()
    tree = str(args.tree.resolve())
    first = [tree, str(ROOT / "scripts")]  # quillgpt from --tree, the harness (its serve) from this checkout
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if paths[:2] != first:  # run again with them first
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONPATH": os.pathsep.join(first + paths)})
    if args.smoke:
        args.minutes = 0.05
    global TEXT
    TEXT = (args.data_path or TEXT).resolve()  # (quillgpt is not imported here: --tree says which one runs)
    if not TEXT.is_file():
        sys.exit(
            f"error: no Tiny Shakespeare at {TEXT}: `quill train --config configs/quickstart.yaml` downloads it, or pass --data-path FILE"
        )
    os.environ.pop("QUILL_DEBUG", None)
    root = Path(tempfile.mkdtemp(prefix="quill-fuzz-", dir=args.workdir))
    cwd = os.getcwd()
    os.chdir(root)  # an empty output path writes to the working directory: let that be the workspace
    tally, r = Tally(), random.Random(args.seed)
    proc = None
    try:
        w = workspace(root)
        proc, url, log = start_server(w, args.tree.resolve())
        deadline, slow = time.monotonic() + 60 * args.minutes, []
        while time.monotonic() < deadline:
            run_cli(w, r, tally)
            for _ in range(4):
                http_case(url, r, tally, slow)
        for t in slow:
            t.join(60)
            if t.is_alive():
                tally.add("http", "hangs", "a half-sent request the server never closed")
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        time.sleep(0.5)
        for line in log:
            if "Traceback" in line or "internal error" in line:
                tally.add("http", "tracebacks", line.strip())
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        os.chdir(cwd)
        shutil.rmtree(root, ignore_errors=True)
    print(f"fuzz: {args.minutes:g} min, seed {args.seed}")
    sys.exit(1 if tally.report() else 0)


if __name__ == "__main__":
    main()
