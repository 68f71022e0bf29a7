"""A tokenizer.json is untrusted input: its normalizer and pre-tokenizer are programs the Rust
`tokenizers` library runs. A regex can make the regex engine give up, which the library turns into
a Rust panic (pyo3's PanicException: a BaseException, which `except Exception` does not catch); a
chain of Replace normalizers can multiply a text's length until memory runs out.

So each tokenizer is checked where it is loaded, before any request: `growth` bounds what its
normalizer can multiply a text by, read from its JSON (a Replace of n characters by m, chained,
multiplies); `probe` runs the whole pipeline on a probe text inside a guard (a panic caught, a time
limit, the tokens per character bounded). At encode time `rust_call` turns a panic into a
QuillError, and `check_length` refuses a text the normalizer could grow beyond ENCODE_LIMIT before
the library is asked to encode it (a 400 in the server, one line in the CLI).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from quillgpt.errors import QuillError

T = TypeVar("T")
MAX_GROWTH = 64  # a normalizer that can make a text longer than this many times is refused at load
SAFE_GROWTH = 4  # up to this, a text's growth needs no bound at encode time (memory of the same order)
ENCODE_LIMIT = 1 << 24  # characters a normalizer may make of one text (a larger growth bounds the text)
MAX_TOKENS_PER_CHAR = 16  # on the probe text; byte-level BPE without merges makes at most 4
PROBE_SECONDS = 10.0
# runs of each kind of character (what makes a backtracking regex give up) and ordinary text
PROBE = "".join(c * 48 for c in "ax1 !\n\t.é日") + "Hello, world! It's 2024: naïve café, 12345 + 3.14 def f(x): return x**2 🎉"


def growth(tokenizer_json: str) -> float:
    """How many times the normalizer can multiply a text's length, at most (1: none of its steps
    lengthens text; NFKC's fixed expansions and a precompiled SentencePiece map are measured by
    the probe instead)."""
    try:
        normalizer = json.loads(tokenizer_json).get("normalizer")
    except (ValueError, AttributeError):
        return 1.0
    return _growth(normalizer)


def _growth(step: Any) -> float:
    if not isinstance(step, dict):
        return 1.0
    kind = step.get("type")
    if kind == "Sequence":
        out = 1.0
        for s in step.get("normalizers") or []:
            out *= _growth(s)
        return out
    if kind == "Prepend":
        return 1.0 + len(str(step.get("prepend", "")))
    if kind == "Replace":
        pattern, content = step.get("pattern") or {}, str(step.get("content", ""))
        text = pattern.get("String") if isinstance(pattern, dict) else None
        if isinstance(text, str) and text:
            return max(1.0, len(content) / len(text))
        return 1.0 + len(content)  # a regex may match the empty string: content before every character
    return 1.0


def rust_call(call: Callable[[], T], source: str) -> T:
    """call(), a Rust panic in it (pyo3's PanicException) one QuillError naming `source`."""
    try:
        return call()
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise QuillError(
            f"{source}: the tokenizer failed inside the tokenizers library ({str(e)[:100]}); its normalizer, pre-tokenizer "
            "regex or post-processor is broken: use the model's original tokenizer.json"
        ) from None


def check_length(text_chars: int, grows: float, source: str) -> None:
    """Refuse a text the tokenizer's normalizer could grow beyond ENCODE_LIMIT characters."""
    if grows > SAFE_GROWTH and text_chars * grows > ENCODE_LIMIT:
        raise QuillError(
            f"a text of {text_chars:,} characters could grow to {text_chars * grows:,.0f} under the normalizer of {source} "
            f"(it multiplies text up to {grows:g} times); send at most {int(ENCODE_LIMIT // grows):,} characters"
        )


def probe(encode: Callable[[str], list[int]], grows: float, source: str) -> None:
    """Run `encode` on PROBE in a guarded thread: a normalizer that multiplies text beyond
    MAX_GROWTH, a panic, more than PROBE_SECONDS or more than MAX_TOKENS_PER_CHAR tokens per
    character is one QuillError naming `source`, at load rather than at the first request."""
    if grows > MAX_GROWTH:
        raise QuillError(
            f"{source}: its normalizer can multiply a text's length {grows:.3g} times (Replace or Prepend steps that "
            f"lengthen text, chained); quill refuses more than {MAX_GROWTH}: use the model's original tokenizer.json"
        )
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["ids"] = rust_call(lambda: encode(PROBE), source)
        except QuillError as e:
            result["error"] = e
        except Exception as e:  # noqa: BLE001 — the library's own errors (a template naming a missing token...)
            result["error"] = QuillError(
                f"{source}: the tokenizer fails on a probe text ({str(e)[:100]}); use the model's original tokenizer.json"
            )

    with _rust_messages_silenced():
        worker = threading.Thread(target=run, daemon=True, name="tokenizer-probe")
        worker.start()
        worker.join(PROBE_SECONDS)
    if worker.is_alive():
        raise QuillError(
            f"{source}: the tokenizer took over {PROBE_SECONDS:g} s on a {len(PROBE)}-character probe text; "
            "its pre-tokenizer regex backtracks without end: use the model's original tokenizer.json"
        )
    if "error" in result:
        raise result["error"]
    if len(result["ids"]) > MAX_TOKENS_PER_CHAR * len(PROBE):
        raise QuillError(
            f"{source}: the tokenizer made {len(result['ids']):,} tokens of a {len(PROBE)}-character probe text; "
            "its normalizer multiplies text: use the model's original tokenizer.json"
        )


@contextlib.contextmanager
def _rust_messages_silenced() -> Iterator[None]:
    """File descriptor 2 on /dev/null: a Rust panic prints its message and backtrace there itself
    (the QuillError says what failed, in one line)."""
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
