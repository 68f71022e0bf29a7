#!/usr/bin/env python
"""What quantized weights cost in quality: `quill eval --quantize SCHEME` against fp32 on trained runs.

    python scripts/quant_quality.py --ckpt out/shakespeare_char_3m --ckpt out/shakespeare_gpt2_small
    python scripts/quant_quality.py --ckpt out/shakespeare_char_3m --scheme int8 --scheme int8-channel --scheme int4

For each run and scheme (int8 unless --scheme is given; its prepared val split, as `quill eval`
scores it): the loss and bits per byte of the float model and of the same weights quantized at
load (`--quantize SCHEME`: the kernels it takes here), the loss difference, and greedy agreement
over --tokens new tokens: how many leading greedy tokens int8 shares with fp32 from a prompt
taken from the val text (greedy decoding parts for good at the first near-tie), and the top-1
agreement of the two models on the val text itself, teacher-forced over --tokens positions
(every position counts, whatever came before). Prints one markdown table.

The runs: `quill train --config configs/shakespeare_char_3m.yaml` (3 minutes) and a GPT-2-shaped
BPE model, e.g. `quill train --config configs/shakespeare_gpt2.yaml model.n_layer=4 model.n_head=4
model.n_embd=256 model.block_size=128 train.batch_size=16 train.grad_accum=1
train.learning_rate=2e-3 train.time_budget=10m` (each after its `quill prepare`).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quillgpt.data.prepare import load_tokens  # noqa: E402
from quillgpt.evaluate.scores import EvalResult, evaluate_checkpoint  # noqa: E402
from quillgpt.inference.generate import generate_tokens  # noqa: E402
from quillgpt.model.gpt import GPT, evaluating  # noqa: E402
from quillgpt.model.quant import quantize, weights_note  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402


def greedy_prefix(fp32: GPT, quant: GPT, prompt: list[int], n: int) -> int:
    """Leading greedy tokens the two models share after `prompt` (of n)."""
    a = torch.cat(list(generate_tokens(fp32, [prompt], n)))
    b = torch.cat(list(generate_tokens(quant, [prompt], n)))
    differ = (a != b).nonzero()
    return int(differ[0, 0]) if len(differ) else n


def top1_agreement(fp32: GPT, quant: GPT, tokens: torch.Tensor, n: int) -> tuple[float, int]:
    """Fraction of positions where both models' most likely next token is the same, on the
    first whole block_size windows of the text covering n positions (teacher-forced); and how
    many positions that was."""
    block = fp32.config.block_size
    x = tokens[: -(-n // block) * block].view(-1, block)
    with evaluating(fp32), evaluating(quant):
        a = fp32(x, all_logits=True)[0].argmax(-1)
        b = quant(x, all_logits=True)[0].argmax(-1)
    return float((a == b).float().mean()), a.numel()


def compare(path: Path, n: int, scheme: str) -> dict[str, object]:
    fp32_eval: EvalResult = evaluate_checkpoint(path, device="cpu")[0]
    quant_eval: EvalResult = evaluate_checkpoint(path, device="cpu", quantize=scheme)[0]
    run = load_run(path, device="cpu")
    quant = quantize(copy.deepcopy(run.model), scheme)  # as quill eval --quantize runs it
    val = torch.from_numpy(load_tokens(run.config.data.out_dir, "val")[: n + run.config.model.block_size].astype("int64"))
    prompt = val[:16].tolist()
    agree, positions = top1_agreement(run.model, quant, val, n)
    return {
        "run": f"{path.name} ({run.model.num_params() / 1e6:.2f}M, {run.tokenizer.name}, step {run.step})",
        "scheme": scheme,
        "fp32 loss": f"{fp32_eval.loss:.4f}",
        "quantized loss": f"{quant_eval.loss:.4f}",
        "Δ loss": f"{100 * (quant_eval.loss - fp32_eval.loss) / fp32_eval.loss:+.2f}%",
        "fp32 bits/byte": f"{fp32_eval.bits_per_byte:.4f}",
        "quantized bits/byte": f"{quant_eval.bits_per_byte:.4f}",
        f"greedy: same first tokens of {n:,}": f"{greedy_prefix(run.model, quant, prompt, n):,}",
        "top-1 agreement on val": f"{100 * agree:.1f}% of {positions:,}",
        "kernels": weights_note(quant, sep=""),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", type=Path, action="append", required=True, help="a trained run directory (repeatable)")
    p.add_argument("--tokens", type=int, default=1000, help="greedy tokens and val positions compared (default 1,000)")
    p.add_argument("--scheme", action="append", default=[], help="a --quantize scheme (repeatable; default int8)")
    args = p.parse_args()
    rows = [compare(path, args.tokens, scheme) for path in args.ckpt for scheme in args.scheme or ["int8"]]
    head = list(rows[0])
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; eval: the run's full val split, stride = block_size\n"
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in head) + " |")


if __name__ == "__main__":
    main()
