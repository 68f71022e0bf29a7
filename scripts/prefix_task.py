"""Does seeing the right side of the prompt help? Prefix-LM vs causal attention on sorting/reversing.

Each example is a random string s of --length letters, "=", then the answer (s sorted, or s
reversed) and a newline. Both models have the same size, data, steps and seed, and are trained
on the same loss (the answer tokens only, as a prefix-LM is); they differ only in attention: the
prefix-LM reads "s=" both ways (model.attention=prefix, prefix_len = len(s) + 1), the causal model
left to right. Accuracy = exact-match of the greedy answer on held-out strings (and per token).

    python scripts/prefix_task.py                 # sort, about a minute on 2 CPU cores
    python scripts/prefix_task.py --task reverse --seed 1

Both train through the package's train_step at lr_at's schedule (warmup 50 steps, cosine to a tenth).
"""

from __future__ import annotations

import argparse

import torch
from harness import add_toy_task, train_toy

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


class Examples:
    """Fresh random examples every step (the same stream for both models), the loss on the answer
    only for both; the prefix-LM's batches also carry its prefix, "s=" (length + 1)."""

    def __init__(self, args: argparse.Namespace, prefix: bool) -> None:
        self.args, self.prefix, self.g = args, prefix, torch.Generator().manual_seed(args.seed + 1)

    def next(self) -> tuple[torch.Tensor, ...]:
        ex = examples(self.args.batch, self.args.length, self.args.task, self.g)
        P = torch.full((self.args.batch,), self.args.length + 1)
        x, y = ex[:, :-1], mask_prefix_targets(ex[:, 1:], P)
        return (x, y, P) if self.prefix else (x, y)


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
    add_toy_task(ap, steps=200, batch=64)
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.batch, args.eval_n = 3, 4, 8
    print(
        f"task {args.task}, length {args.length}, {args.n_layer} layers × {args.n_embd} wide, "
        f"{args.steps} steps × batch {args.batch}, seed {args.seed}"
    )
    print(f"{'attention':<9} {'params':>7} {'exact':>6} {'per-token':>9} {'train s':>7}")
    for attention in ("causal", "prefix"):
        model = make_model(attention, args.length, args)
        seconds = train_toy(model, args, Examples(args, attention == "prefix"))
        exact, token = accuracy(model, args)
        print(f"{attention:<9} {model.num_params():>7,} {exact:>6.1%} {token:>9.1%} {seconds:>7.1f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
