"""The attention variants side by side: training tokens/s and what sampling keeps in memory.

One shape (4 layers, 4 heads, 128 wide, block 128, batch 12, char Tiny Shakespeare), fp32 on CPU:
causal, sliding window, prefix-LM and Infini-attention (linear and delta). Training: quill's model
and optimizer groups, timed in interleaved repetitions (rep 1 of every variant, then rep 2, ...)
so a busy machine slows them alike. Sampling: one row through the engine, a 16-token prompt then
--tokens new tokens; "state" is what the row keeps (KV cache, plus the compressive memory for
Infini-attention), measured at the end, and whether it grows with the text.

    python scripts/bench_attention.py              # ~1-2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from quillgpt.config import ModelConfig, TrainConfig
from quillgpt.data.download import local_text
from quillgpt.data.prefix_batches import PrefixLengths, mask_prefix_targets
from quillgpt.errors import QuillError
from quillgpt.inference.engine import Engine
from quillgpt.model.gpt import GPT
from quillgpt.sampling_params import SamplingParams
from quillgpt.train.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "causal": {},
    "sliding window 32": {"window": 32},
    "prefix-LM": {"attention": "prefix"},
    "infini, segment 32, linear": {"attention": "infini", "segment_size": 32},
    "infini, segment 32, delta": {"attention": "infini", "segment_size": 32, "memory_update": "delta"},
}


def build(kw: dict, vocab: int, block: int) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=vocab, block_size=block, n_layer=4, n_head=4, n_embd=128, bias=False, **kw))


def trainer(model: GPT, tokens: np.ndarray, batch: int, steps: int):
    """A function running `steps` optimizer steps, returning seconds per step."""
    cfg = model.config
    opt = build_optimizer(model, TrainConfig(learning_rate=1e-3), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    lengths = PrefixLengths(cfg, 2) if cfg.attention == "prefix" else None
    model.train()

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            starts = torch.randint(len(tokens) - cfg.block_size - 1, (batch,), generator=g).numpy()
            w = torch.from_numpy(tokens[starts[:, None] + np.arange(cfg.block_size + 1)].astype(np.int64))
            x, y, prefix = w[:, :-1], w[:, 1:], None
            if lengths is not None:
                prefix = lengths.draw(x)
                y = mask_prefix_targets(y, prefix)
            _, loss = model(x, y, prefix_len=prefix)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / steps

    return run


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
    ap.add_argument("--data-path", type=Path, help="Tiny Shakespeare (default: data/downloads/input.txt, where the quickstart put it)")
    args = ap.parse_args()
    try:
        text = local_text(args.data_path, ROOT).read_text(encoding="utf-8")
    except (QuillError, OSError, UnicodeDecodeError) as e:
        sys.exit(f"error: {e}")
    chars = sorted(set(text))
    tokens = np.array([chars.index(c) for c in text[:200_000]], dtype=np.int64)
    models = {name: build(kw, len(chars), args.block) for name, kw in VARIANTS.items()}
    runs = {name: trainer(m, tokens, args.batch, args.steps) for name, m in models.items()}
    for run in runs.values():
        run()  # warm-up
    times = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, run in runs.items():
            times[name].append(run())
    print(
        f"4L/4H/128, block {args.block}, batch {args.batch}, fp32, {torch.get_num_threads()} threads; "
        f"sampling: 1 row, 16-token prompt + {args.tokens:,} new tokens"
    )
    print(f"{'attention':<28} {'train tok/s':>11} {'sample tok/s':>12} {'state bytes':>12}  grows?")
    for name, model in models.items():
        tok_s = args.batch * args.block / statistics.median(times[name])
        n_new = args.tokens
        if model.config.attention == "prefix":  # the prompt is never cropped: stop at block_size
            n_new = min(n_new, args.block - 16)
        nbytes, grew, rate = sampling(model, n_new)
        note = f"  ({n_new} new tokens: prompt + new must fit block_size)" if n_new != args.tokens else ""
        print(f"{name:<28} {tok_s:>11,.0f} {rate:>12,.0f} {nbytes:>12,}  {'yes' if grew else 'no'}{note}")


if __name__ == "__main__":
    main()
