"""Passkey retrieval: Infini-attention vs a sliding window with the same attention span.

A window of --segments × --segment tokens of random filler holds a passkey "K d1 d2" (two
digits) somewhere in the first segment; the window ends with "? d1 d2": the model must repeat the
key, several segments later. Both models have the same size, data, steps and seed and attend
directly over the same span (Infini-attention: causal inside each segment of --segment tokens;
sliding window: the last --segment tokens, model.window); only Infini-attention has a compressive
memory of the earlier segments. Loss and accuracy count the two key digits after "?"; accuracy
is the greedy answer (argmax at "?", then at d1 given d1) on held-out windows. Chance: 10% per
digit, 1% for both. A sliding window of n_layer layers sees n_layer·(span−1)+1 tokens back at
most, less than the distance to the key, so its figure is the chance baseline by construction.

    python scripts/passkey.py                     # ~2-3 minutes on 2 CPU cores
    python scripts/passkey.py --generate 100000   # then each model generates 100,000 tokens, one at a
                                                  # time, reporting its state bytes and the process's RSS

Both train through the package's train_step (harness.train_toy: the gates' lr_mult, clipping,
warmup 50 steps, cosine to a tenth).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from harness import add_toy_task, train_toy

from quillgpt.config import ModelConfig
from quillgpt.inference.engine import Engine
from quillgpt.model.gpt import GPT
from quillgpt.sampling_params import SamplingParams

DIGITS, FILLER = 10, 20  # ids 0..9 digits, 10..29 filler
KEY, ASK = DIGITS + FILLER, DIGITS + FILLER + 1
VOCAB = ASK + 1


def windows(n: int, args: argparse.Namespace, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y (n, T) with T = segments·segment; y is -1 except at the two key digits after "?"."""
    T = args.segments * args.segment
    seq = torch.randint(DIGITS, DIGITS + FILLER, (n, T + 1), generator=g)
    key = torch.randint(DIGITS, (n, 2), generator=g)
    at = torch.randint(args.segment - 3, (n,), generator=g)  # "K d1 d2" inside the first segment
    rows = torch.arange(n)
    seq[rows, at], seq[rows, at + 1], seq[rows, at + 2] = KEY, key[:, 0], key[:, 1]
    seq[:, T - 2], seq[:, T - 1], seq[:, T] = ASK, key[:, 0], key[:, 1]
    y = torch.full((n, T), -1)
    y[:, T - 2 :] = key
    return seq[:, :T], y


def make_model(kind: str, args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)
    T = args.segments * args.segment
    extra = {"attention": "infini", "segment_size": args.segment} if kind == "infini" else {"window": args.segment}
    cfg = ModelConfig(vocab_size=VOCAB, block_size=T, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, pos="rope", **extra)
    return GPT(cfg)


class Windows:
    """The training batches: fresh windows every step, the same stream for both models."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.g = args, torch.Generator().manual_seed(args.seed + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return windows(self.args.batch, self.args, self.g)


@torch.no_grad()
def accuracy(model: GPT, args: argparse.Namespace) -> tuple[float, float]:
    """(both digits, per digit) accuracy of the greedy answer on held-out windows."""
    model.eval()
    x, y = windows(args.eval_n, args, torch.Generator().manual_seed(10_000 + args.seed))
    logits, _ = model(x, all_logits=True)
    got, want = logits[:, -2:].argmax(-1), y[:, -2:]  # teacher-forced d1 = greedy while d1 is right
    return (got == want).all(1).float().mean().item(), (got == want).float().mean().item()


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@torch.no_grad()
def long_generation(model: GPT, n: int) -> str:
    """Generate n tokens one at a time through the engine: state bytes and peak RSS along the way."""
    engine = Engine(model.eval(), 1)
    engine.add([KEY, 1, 2], SamplingParams(max_new_tokens=n, temperature=1.0, seed=0))
    cache = engine._rows[0].cache if engine.cache is None else engine.cache  # infini: the row's own state
    kv = cache.kv_bytes if hasattr(cache, "kv_bytes") else cache.nbytes
    mem = getattr(cache, "memory_bytes", 0)
    t0, done, marks = time.perf_counter(), 1, []
    while engine.active_rows():
        engine.step()
        done += 1
        if done in (n // 10, n):
            marks.append(f"peak RSS {rss_mib():.0f} MiB at {done:,}")
    rate = n / (time.perf_counter() - t0)
    return f"  {n:,} tokens: KV {kv:,} B + memory {mem:,} B (fixed), {'; '.join(marks)}, {rate:,.0f} tokens/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--segment", type=int, default=16)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--generate", type=int, default=0, help="then generate this many tokens with each model")
    add_toy_task(ap, steps=400, batch=32)
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.batch, args.eval_n, args.generate = 3, 4, 8, min(args.generate, 20)
    T = args.segments * args.segment
    print(
        f"passkey in segment 1 of {args.segments} (window {T} tokens, span {args.segment}), "
        f"{args.n_layer} layers × {args.n_embd} wide, {args.steps} steps × batch {args.batch}, seed {args.seed}"
    )
    print(f"{'attention':<16} {'params':>7} {'both':>6} {'per digit':>9} {'train s':>7}")
    for kind, name in (("window", f"sliding window {args.segment}"), ("infini", "infini")):
        model = make_model(kind, args)
        seconds = train_toy(model, args, Windows(args))
        both, digit = accuracy(model, args)
        print(f"{name:<16} {model.num_params():>7,} {both:>6.1%} {digit:>9.1%} {seconds:>7.1f}")
        if kind == "infini":
            gates = [f"{g:.2f}" for m in model.modules() if hasattr(m, "beta") for g in torch.sigmoid(m.beta).tolist()]
            print(f"  memory gates sigmoid(β) per head: {' '.join(gates)}")
        if args.generate:
            print(long_generation(model, args.generate))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
