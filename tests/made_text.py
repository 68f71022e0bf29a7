"""A play-shaped text the tests can make where ../shared's Tiny Shakespeare is missing: speakers'
names in capitals, a colon, lines of words, blank lines between speeches, and the same 65
characters as Tiny Shakespeare (so a char model of it has the same vocabulary, and prompts such as
"ROMEO:" encode). Deterministic: the same bytes on every machine. Its statistics are not
Shakespeare's; a test that compares against a run recorded on the real text asks for it by name
(conftest.py's `real_shakespeare_path`)."""

from __future__ import annotations

import random
from pathlib import Path

ALPHABET = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # Tiny Shakespeare's 65
SPEAKERS = (
    "ROMEO", "JULIET", "MERCUTIO", "NURSE", "FIRST CITIZEN", "SECOND CITIZEN", "MENENIUS", "CORIOLANUS",
    "KING RICHARD III", "QUEEN ELIZABETH", "GLOUCESTER", "BUCKINGHAM", "DUKE VINCENTIO", "ISABELLA",
    "LUCIO", "PETRUCHIO", "KATHARINA", "BAPTISTA", "PROSPERO", "MIRANDA", "3 KING HENRY VI", "WARWICK",
)  # fmt: skip
WORDS = (
    "the and to of i you my a that in is not it me with be his your for this have he but as so thou "
    "what all him will her by thy do no shall if are our lord good now o we sir come king they or "
    "well love let on more here then how there from would should at upon which an were like may "
    "make know their thee yet must say was hath what's let's go see man such us hear speak day night "
    "heart death life blood crown grace honour queen father mother brother son daughter sweet fair "
    "noble gentle royal true false old young great little heaven earth world time hand eyes tongue "
    "soul mind word words friend friends enemy war peace fortune duke citizen rome verona london "
    "tell give take keep bear stand leave bring find think fear die live swear pray mark stay "
    "never ever still again away too very most much once twice why where when whose whom 'tis "
    "o'er ne'er e'er zeal quick quiet jest jealous joy justice vex vexed wax wit wise zounds"
).split()
ENDS = (".", ".", ".", ",", ",", ";", ":", "!", "?", "?", "", "", "", " -", "&c.", "$")


def made_text(chars: int = 1_115_394, seed: int = 0) -> str:
    """About `chars` characters of speeches (Tiny Shakespeare's length by default), every one of
    ALPHABET's characters among them."""
    rng = random.Random(seed)
    speeches = [ALPHABET.replace("\n", " ").strip() + "\n"]  # every character at least once
    total = len(speeches[0])
    while total < chars:
        lines = [line(rng) for _ in range(rng.randint(1, 6))]
        speech = f"{rng.choice(SPEAKERS)}:\n" + "\n".join(lines) + "\n"
        speeches.append(speech)
        total += len(speech) + 1
    return "\n".join(speeches)[:chars]


def line(rng: random.Random) -> str:
    words = rng.choices(WORDS, k=rng.randint(4, 10))
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(ENDS)


def write_made_text(path: Path) -> Path:
    path.write_text(made_text(), encoding="utf-8")
    return path
