"""A chat set from Tiny Shakespeare: "who speaks this line?" → the speaker.

Each line of a speech by one of the most frequent speakers becomes a conversation, the line
(its first --max-chars characters, cut at a word) from the user and the speaker's name from the
assistant. The speeches are split at random (seeded): every line of a held-out speech is
held out, so no held-out line has a neighbour from its own speech in the training set.

    python scripts/make_chat_data.py                  # → data/chat/speakers_train.jsonl, speakers_heldout.jsonl
    python scripts/make_chat_data.py --data-path my_copy_of_tinyshakespeare.txt

The speakers are those with the most speeches whose names have at most --max-name characters,
so that a conversation in quill's transcript ("User: <line>\\n\\nAssistant: <NAME>\\n\\nUser:", 26
characters besides the line and the name) fits the quickstart model's 64 + 1 characters.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import tempfile
from pathlib import Path

from harness import ROOT, add_common, text_path

SPEAKER = re.compile(r"([A-Z][A-Za-z' ]*):")


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, lines) of every speech: a block that starts with 'NAME:' on a line of its own."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if len(lines) >= 2 and SPEAKER.fullmatch(lines[0]):
            out.append((lines[0][:-1], [line.strip() for line in lines[1:] if line.strip()]))
    return out


def cut(line: str, most: int) -> str:
    """The line, or its first words that fit in `most` characters."""
    if len(line) <= most:
        return line
    head = line[: most + 1]
    return head[: head.rfind(" ")].rstrip(",;:") if " " in head else line[:most]


def conversation(line: str, speaker: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": line}, {"role": "assistant", "content": speaker}]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(ap, text=True)
    ap.add_argument("--out", type=Path, help="where the two files go (default: data/chat; --smoke: a temporary folder)")
    ap.add_argument("--speakers", type=int, default=8, help="how many speakers (classes)")
    ap.add_argument("--max-name", type=int, default=10, help="longest speaker name kept")
    ap.add_argument("--max-chars", type=int, default=29, help="a line is cut to this many characters")
    ap.add_argument("--min-chars", type=int, default=12, help="shorter lines are left out")
    ap.add_argument("--heldout", type=float, default=0.1, help="fraction of the speeches held out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    text = text_path(args.text).read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        args.out = args.out or (Path(tmp) if args.smoke else ROOT / "data" / "chat")
        write(args, text)


def write(args: argparse.Namespace, text: str) -> None:
    """The chosen speakers' lines as conversations, speeches split between the two files."""
    all_speeches = speeches(text)
    counts = collections.Counter(s for s, _ in all_speeches)
    chosen = [s for s, _ in counts.most_common() if len(s) <= args.max_name][: args.speakers]
    rng = random.Random(args.seed)
    split: dict[str, list[str]] = {"train": [], "heldout": []}
    for speaker, lines in all_speeches:
        if speaker in chosen:
            part = "heldout" if rng.random() < args.heldout else "train"
            split[part] += [conversation(cut(line, args.max_chars), speaker) for line in lines if len(line) >= args.min_chars]
    rng.shuffle(split["train"])  # quill prepare's val split (the last lines) then samples every speaker
    args.out.mkdir(parents=True, exist_ok=True)
    for part, lines in split.items():
        (args.out / f"speakers_{part}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    shares = collections.Counter(json.loads(c)["messages"][1]["content"] for c in split["heldout"])
    top, n = shares.most_common(1)[0]
    print(
        f"{len(split['train']):,} training and {len(split['heldout']):,} held-out conversations → {args.out}; "
        f"speakers {', '.join(chosen)}; the most common held-out answer ({top}) is {n / len(split['heldout']):.1%}"
    )


if __name__ == "__main__":
    main()
