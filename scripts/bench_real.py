#!/usr/bin/env python
"""Decode speed on a real (imported) model, quill beside transformers and llama.cpp on the same
weights, in one run, batch 1, greedy:

    python scripts/bench_real.py --ckpt out/smollm2 --hf path/to/hf-dir --tokens 128 --reps 2
    python scripts/bench_real.py --ckpt out/smollm2 --compile          # + the compiled decode step

Rows: quill fp32 / bf16 / --quantize int8 / int4 (as `quill sample` runs them: generate_tokens
over the engine's static cache), transformers fp32 `generate` (--hf), and llama.cpp Q8_0 and Q4_0
(llama-cpp-python, where installed: `Llama.eval` one token at a time and the argmax of its
logits — llama.cpp's own loop with the least Python around it). The GGUF files are quill's own
export of the run (`quill export-gguf --type q8_0`, and f16 requantized to Q4_0 by llama.cpp's
`llama_model_quantize`), so every engine decodes the same weights from the same prompt ids.

Each row of the markdown table: median tokens/s over --reps (interleaved), the weight bytes one
token reads in that engine's format, and the fraction of the weight-streaming bound (the read
bandwidth of a buffer that size, measured in this run, / those bytes); prefill and loading are not
timed. Then each quill row over its llama.cpp counterpart (int8 schemes: Q8_0, int4: Q4_0) as the
median of the per-rep ratios, steadier on a drifting machine than the ratio of the medians.

OpenMP's wait policy is left as the user has it (as `quill sample` runs); torch and llama.cpp read
OMP_WAIT_POLICY once at start and PASSIVE slows both (docs/performance.md), so compare rows only
under one policy. --smoke times fp32 and int8 on a tiny random model, a few tokens.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from harness import (
    Stats,
    add_common,
    interleaved,
    llama_argmax,
    load_line,
    machine_line,
    read_bandwidth,
    skipped,
    step_weight_bytes,
    tiny_run,
)

from quillgpt.inference.chat_session import chat_prompt_ids
from quillgpt.inference.generate import generate_tokens
from quillgpt.interop.gguf_write import export_gguf
from quillgpt.quant import quantize, weights_note
from quillgpt.runs import load_run

PROMPT = "Give me three tips for sleeping better."
Decode = Callable[[], float]  # one timed generation → tokens/s


def quill_row(model, ids: list[int], n: int, compile: bool = False, native: bool = True) -> Decode:
    def run() -> float:
        gen = generate_tokens(model, [ids], n, temperature=0.0, compile=compile, native=native)
        next(gen)  # the prompt's forward: not timed
        t = time.perf_counter()
        steps = sum(1 for _ in gen)
        return steps / (time.perf_counter() - t)

    return run


def hf_row(path: Path, ids: list[int], n: int) -> tuple[Decode, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])

    def run() -> float:
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False)  # prefill's share
            t = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return n / (time.perf_counter() - t)

    return run, sum(p.nbytes for p in model.parameters())


def llama_row(path: Path, ids: list[int], n: int, threads: int) -> Decode:
    from llama_cpp import Llama

    llm = Llama(str(path), n_threads=threads, n_ctx=len(ids) + n + 8, verbose=False)

    def run() -> float:
        llm.reset()
        llm.eval(ids)
        tok = llama_argmax(llm)
        t = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([tok])
            tok = llama_argmax(llm)
        return (n - 1) / (time.perf_counter() - t)

    return run


def gguf_files(ckpt: Path, work: Path) -> dict[str, Path]:
    """{"Q8_0": file, "Q4_0": file} of the run, exported by quill (Q4_0 requantized by llama.cpp)."""
    import llama_cpp

    q8, f16, q4 = work / "q8_0.gguf", work / "f16.gguf", work / "q4_0.gguf"
    export_gguf(ckpt, q8, kind="q8_0", which="latest")
    export_gguf(ckpt, f16, kind="f16", which="latest")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, 2
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(q4).encode(), ctypes.byref(params)) != 0:
        raise SystemExit("llama_model_quantize failed")
    return {"Q8_0": q8, "Q4_0": q4}


def rows_of(args: argparse.Namespace, work: Path) -> dict[str, tuple[Decode, int, str]]:
    """name → (timed generation, weight bytes per token, a note)."""
    run = load_run(args.ckpt, which="latest")
    ids = chat_prompt_ids(run.tokenizer, [{"role": "user", "content": PROMPT}])[0]
    n, rows = args.tokens, {}
    for name in args.quill:
        model = run.model if name == "fp32" else copy.deepcopy(run.model)
        if name == "bf16":
            model = model.to(torch.bfloat16)
        elif name != "fp32":
            quantize(model, name, cache=True)
        bytes_ = step_weight_bytes(model)
        rows[f"quill {name}"] = (quill_row(model, ids, n), bytes_, weights_note(model, "").split(":")[0])
        if args.op_by_op and name not in ("fp32", "bf16"):
            rows[f"quill {name}, op by op"] = (quill_row(model, ids, n, native=False), bytes_, "without the native decode block")
        if args.compile:
            rows[f"quill {name}, compiled"] = (quill_row(model, ids, n, compile=True), bytes_, "torch.compile'd decode step")
    if args.hf:
        fn, bytes_ = hf_row(args.hf, ids, n)
        rows["transformers fp32"] = (fn, bytes_, "generate, use_cache")
    if args.smoke:
        skipped("llama.cpp rows", "--smoke: no GGUF of a real model")
        return rows
    try:
        files = gguf_files(args.ckpt, work)
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp rows (pip install llama-cpp-python)")
        return rows
    for kind, path in files.items():
        rows[f"llama.cpp {kind}"] = (llama_row(path, ids, n, torch.get_num_threads()), path.stat().st_size, "quill export-gguf")
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", type=Path, help="a quill run of the model (quill import-hf / import-gguf)")
    p.add_argument("--hf", type=Path, help="the same model as a Hugging Face directory: adds transformers' row")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--quill", nargs="+", default=["fp32", "int8", "int4"], help="quill rows: fp32, bf16 or a --quantize scheme")
    p.add_argument("--compile", action="store_true", help="also time each quill row with the compiled decode step")
    p.add_argument("--op-by-op", action="store_true", help="also time each quantized row without the native decode block")
    add_common(p)
    return p


def measure(args: argparse.Namespace) -> list[tuple[str, list[float], int, float, str]]:
    """Every row of `args` (parser()'s), timed interleaved: (name, tokens/s of each rep, weight
    bytes a token, read bandwidth of a buffer that size, note)."""
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            args.ckpt, args.tokens, args.reps, args.quill = tiny_run(Path(tmp) / "tiny"), 4, 1, ["fp32", "int8"]
        elif args.ckpt is None:
            raise SystemExit("error: --ckpt RUN is needed (a quill run of a real model), or --smoke")
        rows = rows_of(args, Path(tmp))
        for fn, _, _ in rows.values():
            fn()  # warm-up (and compile) outside the timings
        speeds = interleaved({name: fn for name, (fn, _, _) in rows.items()}, args.reps)
    return [(name, speeds[name], nbytes, read_bandwidth(nbytes), note) for name, (_, nbytes, note) in rows.items()]


def main() -> None:
    args = parser().parse_args()
    print(f"{machine_line()} | OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}\n{load_line('before')}", flush=True)
    measured = measure(args)
    print(f"\n{args.tokens} new tokens, batch 1, greedy, median of {args.reps}\n")
    print("| engine | tokens/s (min–max) | MB read per token | read bandwidth GB/s | of the bound | note |")
    print("|---|---|---|---|---|---|")
    for name, xs, nbytes, bw, note in measured:
        st = Stats.of(xs)
        print(f"| {name} | {st} | {nbytes / 1e6:.0f} | {bw / 1e9:.1f} | {st.median * nbytes / bw:.0%} | {note} |")
    print(f"\n{load_line('after')}")
    print_ratios({name: xs for name, xs, *_ in measured})


def llama_ratios(speeds: dict[str, list[float]]) -> dict[str, tuple[str, list[float]]]:
    """quill row → (its llama.cpp kind, the per-rep ratios to it): int8 schemes to Q8_0, int4 to Q4_0."""
    out = {}
    for name, xs in speeds.items():
        kind = "Q4_0" if "int4" in name else "Q8_0" if "int8" in name else None
        ref = speeds.get(f"llama.cpp {kind}")
        if ref is not None:
            out[name] = (kind, [a / b for a, b in zip(xs, ref)])
    return out


def print_ratios(speeds: dict[str, list[float]]) -> None:
    """Each quill row over the llama.cpp row of its kind: the median of the per-rep ratios."""
    for name, (kind, ratios) in llama_ratios(speeds).items():
        st = Stats.of(ratios)
        print(f"{name} / llama.cpp {kind}: {st.median:.3f}× (per-rep {st.lo:.3f}–{st.hi:.3f})")


if __name__ == "__main__":
    main()
