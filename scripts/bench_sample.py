#!/usr/bin/env python
"""Sampling speed: the KV cache vs the recompute path, side by side in one run.

    python scripts/bench_sample.py                          # 800 new tokens, 1 rep: ~3 min on 2 cores
    python scripts/bench_sample.py --tokens 1000            # the headline figure: ~4-5 min
    python scripts/bench_sample.py --tokens 300 --reps 3    # quicker, with min/max spread

The model is the 6-layer / 6-head / 384-wide recipe of configs/shakespeare_char.yaml, randomly
initialised, with a 65-character vocabulary, at block_size 1,024 and 256. Each row generates
--tokens new tokens greedily after a 16-token prompt, batch 1, through the same
`generate_text` that `quill sample` uses, and reports the median over --reps of tokens/s and of
the prefill (time to the first new token). A last table times the prefill of a prompt that fills
the whole block. Greedy text must be identical on both paths; the script checks it.

What to expect: recompute pays for the whole context at every step, the cache for one token, so
the gap grows with the context. Past block_size, learned positions shift every token's position
at each step, so the cache must be refilled from the window every step (quillgpt/model/gpt.py): at block 256
with 1,000 tokens, most steps cost the same on both paths. (RoPE models keep the cache past
block_size; `--pos rope` adds those rows, whose recompute path is much slower still.)

The machine may be shared: the reps of all rows are interleaved so load bursts hit them alike,
and the load average is printed before and after. Compare ratios within one run. OpenMP threads
spin while they wait by default; when another process holds a core, every small op of a decode
step then waits for a descheduled thread (measured here: 2 threads ran the cached path at ~40
tokens/s spinning vs ~250 passive). So the script sets OMP_WAIT_POLICY=PASSIVE unless it is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch's OpenMP starts

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quillgpt.config import load_config  # noqa: E402
from quillgpt.data.tokenizer import CharTokenizer  # noqa: E402
from quillgpt.inference.generate import generate_text  # noqa: E402
from quillgpt.model.gpt import GPT  # noqa: E402

VOCAB = "\n" + "".join(chr(c) for c in range(32, 96))  # 65 characters, like Tiny Shakespeare's
PROMPT = "FIRST CITIZEN:\nB"  # 16 tokens


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def build(block: int, pos: str) -> GPT:
    cfg = load_config(
        ROOT / "configs" / "shakespeare_char.yaml",
        [f"model.block_size={block}", f"model.vocab_size={len(VOCAB)}", f"model.pos={pos}"],
    ).model
    torch.manual_seed(0)
    return GPT(cfg).eval()


def spread(values: list[float], fmt: str) -> str:
    med = format(statistics.median(values), fmt)
    return med if len(values) == 1 else f"{med} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=800, help="new tokens per row (default 800: ~3 min on 2 cores)")
    ap.add_argument("--reps", type=int, default=1, help="repetitions per row; the median is reported")
    ap.add_argument("--blocks", type=int, nargs="+", default=[1024, 256], help="block sizes (default 1024 256)")
    ap.add_argument("--pos", nargs="+", default=["learned"], choices=["learned", "rope"], help="position schemes")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tok = CharTokenizer(VOCAB)
    rows = [(block, pos) for pos in args.pos for block in args.blocks]
    models = {row: build(*row) for row in rows}
    n_params = models[rows[0]].num_params() / 1e6
    print(
        f"bench_sample: 6 layers, 6 heads, 384 wide ({n_params:.1f}M params), vocab {len(VOCAB)}, random init; "
        f"greedy, {args.tokens:,} new tokens after a {len(tok.encode(PROMPT))}-token prompt, batch 1; "
        f"cpu float32, {torch.get_num_threads()} threads (OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}), "
        f"torch {torch.__version__}, {args.reps} rep(s)"
    )
    print(f"load average (1/5/15 min) before: {load()}", flush=True)

    for model in models.values():  # warm-up: kernel selection, allocator
        for use_cache in (True, False):
            generate_text(model, tok, PROMPT, 8, use_cache=use_cache)

    tps: dict[tuple, list[float]] = {}
    prefill: dict[tuple, list[float]] = {}
    texts: dict[tuple, str] = {}
    t_start = time.perf_counter()
    for _ in range(args.reps):
        for row in rows:
            for use_cache in (True, False):
                out, stats = generate_text(models[row], tok, PROMPT, args.tokens, use_cache=use_cache)
                key = (*row, use_cache)
                tps.setdefault(key, []).append(stats.tokens_per_s)
                prefill.setdefault(key, []).append(stats.prefill_ms)
                texts[key] = out[0]
                print(
                    f"  block {row[0]}, {row[1]}, {'cache' if use_cache else 'recompute'}: {stats.tokens_per_s:.1f} tokens/s",
                    file=sys.stderr,
                    flush=True,
                )

    full: dict[tuple, list[float]] = {}  # prefill of a prompt filling the block: time to first token
    for row in rows:
        long_prompt = (VOCAB[1:] * 64)[: row[0] - 1]
        for _ in range(max(3, args.reps)):
            full.setdefault(row, []).append(generate_text(models[row], tok, long_prompt, 1)[1].prefill_ms)

    print()
    print(f"{'block':>6}  {'pos':<8} {'path':<10} {'tokens/s':>22} {'prefill ms (16 tok)':>22} {'cache speedup':>14}")
    for row in rows:
        for use_cache in (True, False):
            key = (*row, use_cache)
            speedup = statistics.median(tps[key]) / statistics.median(tps[(*row, False)])
            print(
                f"{row[0]:>6,}  {row[1]:<8} {'KV cache' if use_cache else 'recompute':<10} "
                f"{spread(tps[key], '.1f'):>22} {spread(prefill[key], '.1f'):>22} "
                f"{(f'{speedup:.1f}x' if use_cache else ''):>14}"
            )
    print()
    for row in rows:
        print(f"prefill of a {row[0] - 1:,}-token prompt (block {row[0]:,}, {row[1]}): {spread(full[row], '.1f')} ms")
    same = all(texts[(*row, True)] == texts[(*row, False)] for row in rows)
    print(f"same greedy text with the cache and without: {'yes' if same else 'NO'}")
    print(f"load average (1/5/15 min) after: {load()}; {time.perf_counter() - t_start:.0f}s timed")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
