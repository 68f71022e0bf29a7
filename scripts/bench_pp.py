#!/usr/bin/env python
"""llama-bench's yardstick for quill and llama.cpp on the same GGUF file, in one run, batch 1:

    python scripts/bench_pp.py --gguf qwen2.5-0.5b.Q4_0.gguf --reps 3
    python scripts/bench_pp.py --gguf llama3.2-1b.Q4_0.gguf --depth 2048 --reps 3

- pp512: a 512-token prompt's forward (quill: the prefill of `generate_tokens`, as `quill sample`
  runs it; llama.cpp: one `Llama.eval` of the 512 ids, n_batch 512), tokens/s.
- tg128: 128 tokens one at a time after a one-token prompt, tokens/s.
- tg128 @ d<depth>: the same after a --depth-token prompt (a deep cache).

quill runs the file as `quill import-gguf` keeps it (each tensor's quantization kept: Q4_0/Q4_1 as
int4, Q8_0 as int8); both read the same ids (the tokenizer's ids of a text, repeated). Rows are
timed interleaved (rep 1 of every row, then rep 2, ...): compare ratios within one run. Each row's
fraction of its bound is measured in the same run: prefill's FLOPs (2 × the blocks' linear weights
× tokens + the head's once; attention not counted) over torch's fp32 matmul throughput on this machine
(an integer kernel can pass 100%), decode's weight bytes a token over the read bandwidth of a
buffer that size. --smoke runs the quill rows on a tiny random model.
"""

from __future__ import annotations

import argparse
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

from quillgpt.inference.generate import generate_tokens
from quillgpt.runs import load_run

TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. " * 8
Timed = Callable[[], float]  # one measurement → tokens/s


def prompt_ids(tokenizer, n: int) -> list[int]:
    """n ids of a plain text, repeated as needed (the same ids for both engines)."""
    ids = tokenizer.encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def quill_prefill(model, ids: list[int]) -> Timed:
    def run() -> float:
        t = time.perf_counter()
        next(generate_tokens(model, [ids], 1, temperature=0.0))  # the prompt's forward and one argmax
        return len(ids) / (time.perf_counter() - t)

    return run


def quill_decode(model, ids: list[int], n: int) -> Timed:
    def run() -> float:
        gen = generate_tokens(model, [ids], n + 1, temperature=0.0)
        next(gen)  # the prompt: not timed
        t = time.perf_counter()
        steps = sum(1 for _ in gen)
        return steps / (time.perf_counter() - t)

    return run


def llama_rows(path: Path, ids: list[int], depth_ids: list[int], n: int, threads: int) -> dict[str, Timed]:
    """pp, tg and tg at depth for llama.cpp (llama-cpp-python's Llama.eval) on the GGUF file."""
    from llama_cpp import Llama

    llm = Llama(
        str(path), n_threads=threads, n_threads_batch=threads, n_ctx=max(len(ids), len(depth_ids)) + n + 16, n_batch=512, verbose=False
    )

    def prefill() -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        return len(ids) / (time.perf_counter() - t)

    def decode(prompt: list[int]) -> Timed:
        def run() -> float:
            llm.reset()
            llm.eval(prompt)
            tok = llama_argmax(llm)
            t = time.perf_counter()
            for _ in range(n):
                llm.eval([tok])
                tok = llama_argmax(llm)
            return n / (time.perf_counter() - t)

        return run

    return {"pp": prefill, "tg": decode(ids[:1]), "tg@d": decode(depth_ids)}


def matmul_flops() -> float:
    """torch's fp32 matmul throughput here (multiply-adds × 2 per second), 1024 × 2048 × 2048, the
    best of three half-second measurements."""
    a, b = torch.randn(1024, 2048), torch.randn(2048, 2048)
    a @ b
    best = 0.0
    for _ in range(3):
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < 0.5:
            a @ b
            reps += 1
        best = max(best, reps * 2 * a.shape[0] * a.shape[1] * b.shape[1] / elapsed)
    return best


def prefill_macs(model: torch.nn.Module, tokens: int) -> int:
    """Multiply-adds of a prompt's linear layers: every block's for every token, the head's for the
    last (a prefill needs the next token's logits only; attention not counted)."""
    layers = [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    head = model.lm_head
    return sum(m.in_features * m.out_features for m in layers if m is not head) * tokens + head.in_features * head.out_features


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, help="the GGUF file both engines run (quill imports it, quantization kept)")
    p.add_argument("--prompt", type=int, default=512, help="pp's prompt tokens (llama-bench: 512)")
    p.add_argument("--tokens", type=int, default=128, help="tg's new tokens (llama-bench: 128)")
    p.add_argument("--depth", type=int, default=2048, help="tokens in the cache before the deep tg row (0: no such row)")
    p.add_argument("--reps", type=int, default=3)
    add_common(p)
    return p


def rows_of(args: argparse.Namespace, work: Path) -> tuple[dict[str, Timed], int, int]:
    """name → timed row; and the quill model's prefill multiply-adds and decode bytes a token."""
    from quillgpt.interop.gguf_import import import_gguf

    if args.smoke:
        run = load_run(tiny_run(work / "tiny", block_size=160))
        args.prompt, args.tokens, args.depth, args.reps = 64, 8, 96, 1
    else:
        run = load_run(import_gguf(args.gguf, work / "run").path)
    model, threads = run.model, torch.get_num_threads()
    ids, depth_ids = prompt_ids(run.tokenizer, args.prompt), prompt_ids(run.tokenizer, args.depth)
    rows = {"quill pp": quill_prefill(model, ids), "quill tg": quill_decode(model, ids[:1], args.tokens)}
    if args.depth:
        rows["quill tg@d"] = quill_decode(model, depth_ids, args.tokens)
    if args.smoke:
        skipped("llama.cpp rows", "--smoke: no GGUF of a real model")
    else:
        try:
            theirs = llama_rows(args.gguf, ids, depth_ids or ids[:1], args.tokens, threads)
        except ImportError:
            print("llama-cpp-python is not installed: no llama.cpp rows (pip install llama-cpp-python)")
        else:
            rows |= {f"llama.cpp {k}": fn for k, fn in theirs.items() if args.depth or k != "tg@d"}
    return rows, prefill_macs(model, args.prompt), step_weight_bytes(model)


def table(args: argparse.Namespace, speeds: dict[str, list[float]], macs: int, nbytes: int) -> None:
    peak, bandwidth = matmul_flops(), read_bandwidth(nbytes)
    label = {"pp": f"pp{args.prompt}", "tg": f"tg{args.tokens}", "tg@d": f"tg{args.tokens} @ d{args.depth}"}
    print(f"\nfp32 matmul {peak / 1e9:.0f} GFLOP/s; read bandwidth {bandwidth / 1e9:.1f} GB/s over {nbytes / 1e6:.0f} MB", end="")
    print(f" (quill's bytes a token)\nmedian of {args.reps}, tokens/s (min–max)\n")
    print("| test | quill | llama.cpp | quill / llama.cpp | quill of its bound |\n|---|---|---|---|---|")
    for key, name in label.items():
        ours, theirs = speeds.get(f"quill {key}"), speeds.get(f"llama.cpp {key}")
        if ours is None:
            continue
        st = Stats.of(ours)
        bound = st.median * 2 * macs / args.prompt / peak if key == "pp" else st.median * nbytes / bandwidth
        ratio = f"{Stats.of([a / b for a, b in zip(ours, theirs)]).median:.2f}×" if theirs else "–"
        print(f"| {name} | {st} | {Stats.of(theirs) if theirs else '–'} | {ratio} | {bound:.0%} |")


def main() -> None:
    args = parser().parse_args()
    if args.gguf is None and not args.smoke:
        raise SystemExit("error: --gguf FILE is needed (the GGUF both engines run), or --smoke")
    print(f"{machine_line()}\n{load_line('before')}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows, macs, nbytes = rows_of(args, Path(tmp))
        for fn in rows.values():
            fn()  # warm-up: kernels built, plans measured, pages touched
        speeds = interleaved(rows, args.reps)
    table(args, speeds, macs, nbytes)
    print(f"\n{load_line('after')}")


if __name__ == "__main__":
    main()
