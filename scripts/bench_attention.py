"""The attention variants side by side: training tokens/s and what sampling keeps in memory.

One shape (4 layers, 4 heads, 128 wide, block 128, batch 12, char Tiny Shakespeare), fp32 on CPU:
causal, sliding window, prefix-LM and Infini-attention (linear and delta). Training: the
package's train step, the variants interleaved. Sampling: one row through the engine, a 16-token prompt then
--tokens new tokens; "state" is what the row keeps (KV cache, plus the compressive memory for
Infini-attention), measured at the end, and whether it grows with the text.

    python scripts/bench_attention.py              # ~1-2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from harness import Stats, add_common, interleaved, load_line, machine_line, text_path, timed, trainer

from quillgpt.config import ModelConfig, TrainConfig
from quillgpt.data.batches import BatchSampler
from quillgpt.data.prefix_batches import PrefixLengths, PrefixSampler
from quillgpt.inference.engine import Engine
from quillgpt.model.gpt import GPT
from quillgpt.sampling_params import SamplingParams
from quillgpt.train.loop import train_step

VARIANTS = {
    "causal": {},
    "sliding window 32": {"window": 32},
    "prefix-LM": {"attention": "prefix"},
    "infini, segment 32, linear": {"attention": "infini", "segment_size": 32},
    "infini, segment 32, delta": {"attention": "infini", "segment_size": 32, "memory_update": "delta"},
}


def build(kw: dict, vocab: int, args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    shape = {"n_layer": 1, "n_head": 2, "n_embd": 32} if args.smoke else {"n_layer": 4, "n_head": 4, "n_embd": 128}
    return GPT(ModelConfig(vocab_size=vocab, block_size=args.block, bias=False, **shape, **kw))


def steps(model: GPT, tokens: np.ndarray, args: argparse.Namespace):
    """A function running --steps of the package's train_step (a prefix-LM's batches with drawn
    prefixes, as `quill train` draws them), returning seconds per step."""
    sampler = BatchSampler(tokens, args.block, args.batch, seed=1)
    if model.config.attention == "prefix":
        sampler = PrefixSampler(sampler, PrefixLengths(model.config, 2))
    t = trainer(model.train(), TrainConfig(batch_size=args.batch, learning_rate=1e-3, device="cpu"), sampler)
    return lambda: timed(lambda: train_step(t.model, t), args.steps)


@torch.no_grad()
def sampling(model: GPT, n_new: int) -> tuple[int, bool, float]:
    """(state bytes of the row at the end, whether they grew, decode tokens/s)."""
    engine = Engine(model.eval(), 1)
    engine.add(list(range(16)), SamplingParams(max_new_tokens=n_new, temperature=1.0, seed=0))
    state = engine._rows[0].cache if engine.cache is None else engine.cache  # infini: the row's own
    start_bytes, t0 = state.nbytes, time.perf_counter()
    while engine.active_rows():
        engine.step()
    return state.nbytes, state.nbytes != start_bytes, n_new / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per timed repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1000, help="new tokens when sampling")
    add_common(ap, text=True)
    args = ap.parse_args()
    if args.smoke:
        args.block, args.batch, args.steps, args.reps, args.tokens = 64, 2, 1, 1, 8
    text = text_path(args.text).read_text(encoding="utf-8")
    chars = sorted(set(text))
    tokens = np.array([chars.index(c) for c in text[:200_000]], dtype=np.uint16)
    models = {name: build(kw, len(chars), args) for name, kw in VARIANTS.items()}
    runs = {name: steps(m, tokens, args) for name, m in models.items()}
    for run in runs.values():
        run()  # warm-up
    print(f"{machine_line()}\n{load_line('before')}", flush=True)
    times = interleaved(runs, args.reps)
    c = next(iter(models.values())).config
    shape = f"{c.n_layer}L/{c.n_head}H/{c.n_embd}, block {args.block}, batch {args.batch}, fp32"
    print(f"{shape}; sampling: 1 row, 16-token prompt + {args.tokens:,} new tokens")
    print(f"{'attention':<28} {'train tok/s':>11} {'sample tok/s':>12} {'state bytes':>12}  grows?")
    for name, model in models.items():
        tok_s = args.batch * args.block / Stats.of(times[name]).median
        n_new = args.tokens
        if model.config.attention == "prefix":  # the prompt is never cropped: stop at block_size
            n_new = min(n_new, args.block - 16)
        nbytes, grew, rate = sampling(model, n_new)
        note = f"  ({n_new} new tokens: prompt + new must fit block_size)" if n_new != args.tokens else ""
        print(f"{name:<28} {tok_s:>11,.0f} {rate:>12,.0f} {nbytes:>12,}  {'yes' if grew else 'no'}{note}")
    print(load_line("after"))


if __name__ == "__main__":
    main()
