#!/usr/bin/env python
"""Where a decode step's time goes: torch.profiler over the engine's cached greedy steps, op by
op, grouped by what the op does, for float32, bf16, int8 and int4 weights.

    python scripts/profile_decode.py                      # 6L/6H/384, block 1,024, batch 1
    python scripts/profile_decode.py --batch 8 --threads 1 --top 12
    python scripts/profile_decode.py --ckpt out/smollm2 --context 40 --tokens 20   # a real (imported) model

The model is scripts/bench.py's sample model (random init, 65-character vocabulary, biases as
GPT-2). Each weights kind generates --warmup tokens, then --tokens more under the profiler,
after a --context-token prompt (so attention reads about that many keys per layer). Printed:
per kind, ms per token of each group of ops (self CPU time, the ops' own work without their
children) and the --top single ops. With several threads the profiler's times are wall times
of the calling thread; --threads 1 gives CPU time that other processes on the machine disturb less.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quillgpt.config import ModelConfig  # noqa: E402
from quillgpt.inference.engine import in_dtype  # noqa: E402
from quillgpt.inference.generate import generate_tokens  # noqa: E402
from quillgpt.model.gpt import GPT  # noqa: E402
from quillgpt.model.quant import plan_of, quantize  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402

GROUPS = {  # aten op (its name without "aten::" and leading "_") → what it does in a decode step
    "linear matmuls": ("addmm", "mm", "weight_int8pack_mm", "weight_int4pack_mm_for_cpu", "linear", "matmul", "bmm"),
    "attention": ("scaled_dot_product", "softmax"),
    "KV cache writes": ("index_put",),
    "norms": ("layer_norm", "native_layer_norm", "rms_norm", "fused_rms_norm"),
    "activation": ("gelu", "relu", "silu"),
    "dtype casts": ("to_copy", "copy", "to"),
    "mask (per step)": ("ge", "gt", "le", "lt", "eq", "logical", "bitwise", "masked_fill", "sub"),
    "adds (residual, bias)": ("add", "mul"),
    "embeddings, sampling": ("embedding", "index_select", "argmax", "remainder", "arange", "item", "local_scalar_dense"),
    "views and allocation": (
        "view",
        "reshape",
        "slice",
        "select",
        "split",
        "transpose",
        "expand",
        "as_strided",
        "empty",
        "zeros",
        "fill",
        "unsqueeze",
        "permute",
        "contiguous",
        "t",
    ),
}


def group_of(name: str) -> str:
    """The group of an op: a key is its whole name, or the name up to an "_" (add_, index_put_impl_)."""
    base = name.split("::")[-1].lstrip("_")
    for group, keys in GROUPS.items():
        if any(base == k or base.startswith(k + "_") for k in keys):
            return group
    return "other"


def model_of(block: int) -> GPT:
    cfg = ModelConfig(vocab_size=65, block_size=block, n_layer=6, n_head=6, n_embd=384, bias=True, dropout=0.0)
    torch.manual_seed(0)
    return GPT(cfg).eval()


def profile_kind(model: GPT, args: argparse.Namespace) -> tuple[dict[str, float], list[tuple[str, float, int]], float]:
    """({group: ms/token}, [(op, ms/token, calls/token)], wall ms/token) of args.tokens decode steps."""
    prompts = [[(7 * i + r) % 65 for i in range(args.context)] for r in range(args.batch)]  # ids every vocabulary has
    steps = iter(generate_tokens(model, prompts, args.warmup + args.tokens))
    for _ in range(args.warmup):
        next(steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.tokens):
            next(steps)
        wall = time.perf_counter() - start
    groups: dict[str, float] = defaultdict(float)
    ops = []
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3 / args.tokens
        groups[group_of(e.key)] += ms
        ops.append((e.key, ms, round(e.count / args.tokens)))
    return dict(groups), sorted(ops, key=lambda o: -o[1])[: args.top], 1e3 * wall / args.tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=500, help="prompt tokens: the keys each step attends over")
    p.add_argument("--tokens", type=int, default=100, help="profiled decode steps")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--top", type=int, default=8, help="single ops listed per kind")
    p.add_argument("--ckpt", type=Path, help="profile this run's model (an imported one: a real model) instead of the random 6L/384")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_run(args.ckpt, which="latest").model if args.ckpt else model_of(args.block)
    kinds = {
        "float32": model,
        "bf16 weights": in_dtype(model, torch.bfloat16),
        "int8 weights": quantize(copy.deepcopy(model), "int8", rows=args.batch, cache=True),
        "int4 weights": quantize(copy.deepcopy(model), "int4"),
    }  # shown even if slower
    shape = f"{args.ckpt}" if args.ckpt else f"6L/6H/384 (block {args.block:,})"
    print(
        f"decode steps of {shape}, batch {args.batch}, ~{args.context} keys a layer; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {plan_of(kinds['int8 weights']).describe()}"
    )
    results = {name: profile_kind(m, args) for name, m in kinds.items()}
    names = list(results)
    print(f"\n{'ms per token (self CPU)':<26}" + "".join(f"{n:>14}" for n in names))
    for group in [*GROUPS, "other"]:
        print(f"{group:<26}" + "".join(f"{results[n][0].get(group, 0.0):>14.3f}" for n in names))
    print(f"{'sum of ops':<26}" + "".join(f"{sum(results[n][0].values()):>14.3f}" for n in names))
    print(f"{'wall, profiled':<26}" + "".join(f"{results[n][2]:>14.3f}" for n in names))
    for n in names:
        print(f"\n{n}: top ops (ms per token, calls per token)")
        for op, ms, calls in results[n][1]:
            print(f"  {op:<52} {ms:>7.3f}  {calls:>4}")


if __name__ == "__main__":
    main()
