#!/usr/bin/env python
"""How often a chat model's greedy reply (its first line) is the expected answer, for several runs
on the same held-out conversations: a fine-tune beside its base.

    python scripts/score_chat.py --data data/chat/speakers_heldout.jsonl --ckpt out/smollm2 --ckpt out/smol-ft

Each conversation's first user turn goes through the run's own chat prompt (as `quill chat` asks
it); its last assistant turn is the expected answer. Prints one line per run: the accuracy, how
often the reply was one of the expected answers at all, and the first reply as an example.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from finetune_recipe import answers  # noqa: E402

from quillgpt.runs import load_run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="conversations, one JSON object a line ({'messages': [...]})")
    ap.add_argument("--ckpt", type=Path, action="append", required=True, help="a run (repeatable)")
    ap.add_argument("-n", type=int, default=200, help="the first N conversations")
    args = ap.parse_args()
    lines = args.data.read_text(encoding="utf-8").splitlines()[: args.n]
    conversations = [json.loads(line)["messages"] for line in lines]
    truth = [c[-1]["content"].strip() for c in conversations]
    for ckpt in args.ckpt:
        run = load_run(ckpt)
        ends = [run.tokenizer.decode([i]) for i in run.tokenizer.stop_ids]  # an imported model's end of turn
        said = [min((a.split(e)[0] for e in ends if e), key=len, default=a).strip() for a in answers(run, conversations)]
        right = sum(a == t for a, t in zip(said, truth)) / len(truth)
        named = sum(a in set(truth) for a in said) / len(truth)
        print(f"{ckpt}: {right:.1%} right, {named:.1%} an expected answer, of {len(truth)}; first reply {said[0]!r}", flush=True)


if __name__ == "__main__":
    main()
