"""Does seeing the right side of the prompt help? Prefix-LM vs causal attention on sorting/reversing.

Each example is a random string s of --length letters, "=", then the answer (s sorted, or s
reversed) and a newline. Both models have the same size, data, steps and seed, and are trained
on the same loss (the answer tokens only, as a prefix-LM is); they differ only in attention: the
prefix-LM reads "s=" both ways (model.attention=prefix, prefix_len = len(s) + 1), the causal model
left to right. Accuracy = exact-match of the greedy answer on held-out strings (and per token).

    python scripts/prefix_task.py                 # sort, about a minute on 2 CPU cores
    python scripts/prefix_task.py --task reverse --seed 1
"""

from __future__ import annotations

import argparse
import time

import torch

from quillgpt.config import ModelConfig
from quillgpt.data.prefix_batches import mask_prefix_targets
from quillgpt.model.gpt import GPT

LETTERS = "abcdefghijklmnop"
EQ, NL = len(LETTERS), len(LETTERS) + 1  # ids of "=" and "\n"


def examples(n: int, length: int, task: str, g: torch.Generator) -> torch.Tensor:
    """(n, 2·length + 2) ids: s, "=", answer, "\\n"."""
    s = torch.randint(len(LETTERS), (n, length), generator=g)
    answer = s.sort(dim=1).values if task == "sort" else s.flip(1)
    return torch.cat([s, torch.full((n, 1), EQ), answer, torch.full((n, 1), NL)], dim=1)


def make_model(attention: str, length: int, args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)  # same initial weights for both
    cfg = ModelConfig(
        vocab_size=len(LETTERS) + 2, block_size=2 * length + 1, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, attention=attention
    )
    return GPT(cfg)


def train(model: GPT, args: argparse.Namespace) -> float:
    """Fresh random examples every step (same stream for both models); returns seconds."""
    g = torch.Generator().manual_seed(args.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    P = torch.full((args.batch,), args.length + 1)  # "s=" is the prefix
    prefix = P if model.config.attention == "prefix" else None
    t0 = time.perf_counter()
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:  # linear warmup, then linear decay to 10%
            group["lr"] = args.lr * min(1.0, (step + 1) / 50) * (1 - 0.9 * step / args.steps)
        ex = examples(args.batch, args.length, args.task, g)
        x, y = ex[:, :-1], mask_prefix_targets(ex[:, 1:], P)  # loss on the answer only, for both
        _, loss = model(x, y, prefix_len=prefix)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


@torch.no_grad()
def accuracy(model: GPT, args: argparse.Namespace) -> tuple[float, float]:
    """(exact-match, per-token) accuracy of greedy answers on held-out strings."""
    model.eval()
    ex = examples(args.eval_n, args.length, args.task, torch.Generator().manual_seed(10_000 + args.seed))
    n = args.length
    seq = ex[:, : n + 1]  # the prompt "s="
    P = torch.full((len(ex),), n + 1) if model.config.attention == "prefix" else None
    for _ in range(n):  # recompute each step: the prompt stays the prefix
        logits, _ = model(seq, prefix_len=P)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    got, want = seq[:, n + 1 :], ex[:, n + 1 : 2 * n + 1]
    return (got == want).all(1).float().mean().item(), (got == want).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=["sort", "reverse"], default="sort")
    ap.add_argument("--length", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(
        f"task {args.task}, length {args.length}, {args.n_layer} layers × {args.n_embd} wide, "
        f"{args.steps} steps × batch {args.batch}, seed {args.seed}"
    )
    print(f"{'attention':<9} {'params':>7} {'exact':>6} {'per-token':>9} {'train s':>7}")
    for attention in ("causal", "prefix"):
        model = make_model(attention, args.length, args)
        seconds = train(model, args)
        exact, token = accuracy(model, args)
        print(f"{attention:<9} {model.num_params():>7,} {exact:>6.1%} {token:>9.1%} {seconds:>7.1f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
