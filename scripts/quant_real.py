#!/usr/bin/env python
"""What --quantize costs on a real (imported) chat model: loss, mean KL from fp32 and teacher-forced
top-1 agreement with fp32 on a text, and how many of 10 everyday chat prompts keep fp32's first greedy tokens.

    python scripts/quant_real.py --ckpt out/smollm2 --text ../shared/data/tinyshakespeare.txt \\
        --scheme int8 --scheme int8-channel --scheme int4 --scheme int4-g64 --group 64

Each scheme's weights are dequantized into float32 linears (the weights' error alone), and also
run as --quantize runs them (through the kernels this machine's plan picks); --gguf FILE adds
llama.cpp's loss, agreement and greedy tokens on the same ids (a GGUF of the same weights);
--gguf-type TYPE adds the run as `quill export-gguf --type TYPE` writes it, imported back (with
its file's MB); --int8-activations adds each scheme with its linears' inputs rounded to int8 per
32, what a kernel multiplying int8 activations (`vpdpbusd`) would cost; --kept FILE adds the run
`quill import-gguf FILE` writes (the file's quantization kept) against --ckpt, which is then
`quill import-gguf FILE --dequantize` (fp32 of the same blocks). --prompts coding asks 10 everyday
coding questions instead of chat ones; --passage N puts each after the text's first N tokens, so
the prompt runs the prompt's GEMM (issue 63's quality check: ~500). Prints one markdown table and
the load average before and after.

    python scripts/quant_real.py --ckpt out/qwen-fp32 --kept qwen2.5-coder-0.5b.gguf --prompts coding --text FILE
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import add_common, load_line, skipped, tiny_run

from quillgpt.inference.chat_session import chat_prompt_ids
from quillgpt.inference.generate import generate_tokens
from quillgpt.interop.gguf_family import WRITE_TYPES
from quillgpt.interop.gguf_import import import_gguf
from quillgpt.interop.gguf_write import export_gguf
from quillgpt.model.gpt import GPT
from quillgpt.quant import SCHEMES, dequantize, plan_of, quantize
from quillgpt.quant.int4 import Int4Linear
from quillgpt.quant.int8 import Int8Linear
from quillgpt.quant.stored import scheme_of
from quillgpt.runs import load_run

PROMPTS = [
    "Give me three tips for sleeping better.",
    "What is the capital of France?",
    "How do I boil an egg?",
    "Write a short poem about the sea.",
    "What are the benefits of drinking water?",
    "Explain what a computer is to a child.",
    "Suggest a name for a pet cat.",
    "How can I save money on groceries?",
    "What should I pack for a beach trip?",
    "Why is the sky blue?",
]
CODING = [
    "Write a Python function that reverses a string.",
    "How do I read a JSON file in Python?",
    "Write a SQL query that counts the rows of a table named users.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a bash command that finds every .txt file under the current directory.",
    "How do I sort a dictionary by its values in Python?",
    "Write a JavaScript function that checks whether a number is prime.",
    "What does `git rebase` do?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "How do I remove duplicates from a list in Python while keeping the order?",
]


@torch.no_grad()
def scored(model: GPT, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The loss of `ids`, teacher-forced, and the logits it comes from (positions × vocab)."""
    logits = model(ids[:, :-1], all_logits=True)[0].flatten(0, 1)
    return F.cross_entropy(logits, ids[0, 1:]).item(), logits


class RoundedInputs(torch.nn.Module):
    """A linear whose input is rounded per block of 32 to ±levels steps of max|x| / levels, as a
    kernel with integer activations multiplies it (127: int8, llama.cpp's Q8_0 × Q8_0 dot)."""

    def __init__(self, linear: torch.nn.Module, levels: int) -> None:
        super().__init__()
        self.linear, self.levels = linear, levels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.reshape(*x.shape[:-1], -1, 32)
        step = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-30) / self.levels
        return self.linear((torch.round(blocks / step) * step).reshape(x.shape))


def rounded_inputs(model: GPT, levels: int) -> None:
    """Every nn.Linear of a dequantized model (in_features a multiple of 32) → RoundedInputs."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child.in_features % 32 == 0:
                setattr(parent, name, RoundedInputs(child, levels))


def llama_scored(path: Path, ids: torch.Tensor, prompts: list[list[int]], n: int) -> tuple[float, torch.Tensor, list[list[int]]]:
    """scored() and greedy() through llama.cpp (llama-cpp-python) on a GGUF file of the same
    model: the loss and logits for the same ids, teacher-forced, and each prompt's first n greedy
    tokens (the argmax of its logits, a token at a time)."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=ids.shape[1] + 8, logits_all=True, n_threads=torch.get_num_threads(), verbose=False)
    llm.eval(ids[0, :-1].tolist())
    logits = torch.from_numpy(llm.scores[: ids.shape[1] - 1].copy()).float()
    texts = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        out = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
        while len(out) < n:
            llm.eval(out[-1:])
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        texts.append(out)
    return F.cross_entropy(logits, ids[0, 1:]).item(), logits, texts


def greedy(model: GPT, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [torch.cat(list(generate_tokens(model, [p], n))).tolist() for p in prompts]


def shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", type=Path, help="a quill run (an imported chat model)")
    p.add_argument("--positions", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=40, help="greedy tokens compared per prompt")
    p.add_argument("--scheme", action="append", default=[], help="a --quantize scheme (repeatable)")
    p.add_argument("--group", type=int, action="append", default=[], help="int8 with this many weights per scale (repeatable)")
    p.add_argument("--int8-activations", action="store_true", help="also each scheme with its linears' inputs rounded to int8 per 32")
    p.add_argument("--gguf", type=Path, action="append", default=[], help="the same model as a GGUF file: llama.cpp's row (repeatable)")
    gguf_type = "also the run as export-gguf writes this type, imported back"
    p.add_argument("--gguf-type", action="append", default=[], choices=list(WRITE_TYPES), help=gguf_type)
    p.add_argument("--kept", type=Path, action="append", default=[], help="a GGUF file imported keeping its quantization (repeatable)")
    p.add_argument("--prompts", choices=["chat", "coding"], default="chat", help="the 10 prompts asked: everyday chat or coding")
    passage = "each prompt after the text's first N tokens (0: none): a long prompt runs the prompt's GEMM, not the decode kernel"
    p.add_argument("--passage", type=int, default=0, metavar="N", help=passage)
    add_common(p, text=True)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:  # a tiny random model scored on its own characters
            args.ckpt, args.positions, args.tokens, args.scheme = tiny_run(Path(tmp) / "tiny"), 64, 4, ["int8", "int4"]
            args.gguf_type = args.gguf_type or ["q8_0"]
            args.text = Path(tmp) / "text.txt"
            args.text.write_text("".join(map(chr, range(32, 127))) * 2)
            if args.gguf:
                skipped("llama.cpp rows", "--smoke")
                args.gguf = []
        elif args.ckpt is None or args.text is None:
            raise SystemExit("error: --ckpt RUN and --text FILE are needed, or --smoke")
        print(load_line("before"), flush=True)
        compare(args, Path(tmp))
        print(f"\n{load_line('after')}")


@dataclass
class Baseline:
    """fp32's figures every row is compared with: its loss, log-probabilities (positions × vocab)
    and greedy tokens."""

    loss: float
    logp: torch.Tensor
    greedy: list[list[int]]
    tokens: int

    def row(self, name: str, acts: str, loss: float, logits: torch.Tensor, texts: list[list[int]], note: str = "") -> None:
        """One table row: the loss, the mean KL(fp32 ‖ row) a position, top-1 agreement, prompts kept."""
        kept = [shared(a, b) for a, b in zip(texts, self.greedy)]
        agree = 100 * float((logits.argmax(-1) == self.logp.argmax(-1)).float().mean())
        kl = F.kl_div(F.log_softmax(logits.float(), -1), self.logp, log_target=True, reduction="batchmean").item()
        print(
            f"| {name} | {acts} | {loss:.4f} | {100 * (loss - self.loss) / self.loss:+.3f}% | {kl:.4f} | {agree:.2f}% "
            f"| {sum(k == self.tokens for k in kept)}/10 | {kept} |{note}",
            flush=True,
        )


def gguf_round_trip(ckpt: Path, kind: str, work: Path) -> tuple[GPT, float]:
    """The run as `quill export-gguf --type KIND` writes it, imported back (dequantized, as
    llama.cpp computes with it): its model and the file's MB."""
    path = export_gguf(ckpt, work / f"{kind}.gguf", kind=kind).path
    import_gguf(path, work / kind)
    return load_run(work / kind, which="latest").model, path.stat().st_size / 1e6


def compare(args: argparse.Namespace, work: Path) -> None:
    """fp32's loss, top-1 and greedy tokens, then every scheme's (and GGUF's) against them: the table."""
    run = load_run(args.ckpt)
    tok = run.tokenizer
    text = tok.encode(args.text.read_text())
    ids = torch.tensor(text[-args.positions - 1 :])[None]
    lead = f"{tok.decode(text[: args.passage])}\n\n" if args.passage else ""
    asked = CODING if args.prompts == "coding" else PROMPTS
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": lead + q}])[0] for q in asked]
    loss, logits = scored(run.model, ids)
    base = Baseline(loss, F.log_softmax(logits, -1), greedy(run.model, prompts, args.tokens), args.tokens)
    print(f"fp32 loss {base.loss:.4f}; fp32 on the first prompt: {tok.decode(base.greedy[0])!r}\n", flush=True)
    kept = f"prompts keeping {args.tokens} greedy tokens"
    print(f"| weights | activations | loss | Δ loss | KL | top-1 agreement | {kept} | tokens kept per prompt |\n{'|---' * 8}|")
    cases = [(s, None) for s in args.scheme] + [("int8", g) for g in args.group]
    for scheme, group in cases:
        for kernel in ["dequant/model", "plan"] + (["int8 activations"] if args.int8_activations else []):  # "plan": --quantize's kernels
            t = time.perf_counter()
            fixed = "dequant/model" if kernel != "plan" and SCHEMES[scheme].layer is Int8Linear else None  # int4: one kernel a shape
            model = quantize(copy.deepcopy(run.model), scheme, kernel=fixed, group=group, cache=fixed is None)
            fours = sorted({m.kernel for m in model.modules() if isinstance(m, Int4Linear)})
            plan = plan_of(model)  # int8: the decode step's kernel
            run_as = f"as run: {', '.join(fours) if fours else plan.pick(plan.rows)}"
            model = dequantize(model) if kernel != "plan" else model
            if kernel == "int8 activations":
                rounded_inputs(model, 127)
            name = scheme if group is None else f"int8, {group or 'per-row'} per scale"
            acts = {"dequant/model": "fp32", "plan": run_as, "int8 activations": "int8 per 32 (Q8_0's)"}[kernel]
            base.row(name, acts, *scored(model, ids), greedy(model, prompts, args.tokens), f" <!-- {time.perf_counter() - t:.0f} s -->")
    for kind in args.gguf_type:
        model, mb = gguf_round_trip(args.ckpt, kind, work)
        base.row(f"export-gguf {kind} ({mb:.1f} MB), imported back", "fp32", *scored(model, ids), greedy(model, prompts, args.tokens))
    for path in args.kept:
        done = import_gguf(path, work / f"kept-{path.stem}")
        model = load_run(done.path, which="latest").model
        layers = sorted({scheme_of(m).name for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))})
        mb = (done.path / "weights.safetensors").stat().st_size / 1e6
        note = f" <!-- {done.note} -->"
        base.row(
            f"import-gguf {path.name}, kept ({mb:.1f} MB, file {path.stat().st_size / 1e6:.1f} MB)",
            "/".join(layers),
            *scored(model, ids),
            greedy(model, prompts, args.tokens),
            note,
        )
    for path in args.gguf:
        base.row(f"llama.cpp {path.name}", "its own", *llama_scored(path, ids, prompts, args.tokens))


if __name__ == "__main__":
    main()
