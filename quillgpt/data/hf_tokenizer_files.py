"""tokenizer_config.json and generation_config.json read as untrusted input: every field quill
reads (and those transformers would choke on) typed and ranged where the files enter, so a bad
one is one QuillError naming the file, the field and the fix, never a traceback or an id that
silently means nothing. What quill does not read is left alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from quillgpt.errors import QuillError

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
FIX = "fix the file or delete the field"


def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """The file's JSON object; {} when there is no such file; one QuillError when it is not an object."""
    from quillgpt.files import input_file, read_json, shown

    if not input_file(path, what):  # a FIFO or device there is refused by name
        return {}
    data = read_json(path, what, limit=1 << 28)
    if not isinstance(data, dict):
        raise QuillError(f"{shown(path)} is a JSON {type(data).__name__}, not an object; fix the file or delete it")
    return data


def check_tokenizer_config(config: dict[str, Any], vocab_size: int, source: str) -> None:
    """tokenizer_config.json: the special tokens a string or {"content": string}; chat_template a
    string or a list of {"name", "template"} strings; added_tokens_decoder an object of ids within
    the vocabulary → {"content": string}; model_max_length a number ≥ 1."""
    for name in SPECIAL_TOKENS:
        if config.get(name) is not None:
            _token(config[name], f"{source}: {name}")
    extra = config.get("additional_special_tokens")
    if extra is not None:
        if not isinstance(extra, list):
            raise QuillError(f"{source}: additional_special_tokens is {_shown(extra)}, not a list of tokens; {FIX}")
        for n, token in enumerate(extra):
            _token(token, f"{source}: additional_special_tokens[{n}]")
    _check_template(config.get("chat_template"), source)
    _check_added_tokens(config.get("added_tokens_decoder"), vocab_size, source)
    length = config.get("model_max_length")
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, (int, float)) or not (math.isfinite(length) and length >= 1)
    ):
        raise QuillError(f"{source}: model_max_length is {_shown(length)}; it must be a number of tokens ≥ 1 ({FIX})")


def _token(value: Any, where: str) -> None:
    content = value.get("content") if isinstance(value, dict) else value
    if not isinstance(content, str) or not content:
        raise QuillError(f'{where} is {_shown(value)}; a special token is a non-empty string or {{"content": string}} ({FIX})')


def _check_template(template: Any, source: str) -> None:
    if template is None or isinstance(template, str):
        return
    if not isinstance(template, list):
        raise QuillError(f"{source}: chat_template is {_shown(template)}; it must be a string (a Jinja template) ({FIX})")
    for n, entry in enumerate(template):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)):
            raise QuillError(
                f"{source}: chat_template[{n}] is {_shown(entry)}; a list of templates holds "
                f'{{"name": string, "template": string}} objects ({FIX})'
            )


def _check_added_tokens(added: Any, vocab_size: int, source: str) -> None:
    if added is None:
        return
    if not isinstance(added, dict):
        raise QuillError(f'{source}: added_tokens_decoder is {_shown(added)}; it must be an object of id → {{"content": ...}} ({FIX})')
    for key, token in added.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise QuillError(
                f"{source}: added_tokens_decoder has the id {_shown(key)}; ids are 0 to {vocab_size - 1:,} "
                f"(the tokenizer's {vocab_size:,} tokens) ({FIX})"
            )
        if not isinstance(token, dict):
            raise QuillError(f'{source}: added_tokens_decoder["{key}"] is {_shown(token)}, not an object with "content" ({FIX})')
        _token(token, f'{source}: added_tokens_decoder["{key}"]')


def check_generation_config(config: dict[str, Any], vocab_size: int, source: str) -> None:
    """generation_config.json: bos/eos/pad ids each an integer of the vocabulary (eos_token_id may
    be a non-empty list of them), or null."""
    for name in TOKEN_IDS:
        value = config.get(name)
        if value is None:
            continue
        ids = value if name == "eos_token_id" and isinstance(value, list) else [value]
        if not ids:
            raise QuillError(f"{source}: eos_token_id is an empty list; give the end-of-sequence id(s) or delete the field")
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool):
                kind = "an integer or a list of integers" if name == "eos_token_id" else "an integer"
                raise QuillError(f"{source}: {name} is {_shown(value)}; it must be {kind} ({FIX})")
            if not 0 <= i < vocab_size:
                raise QuillError(
                    f"{source}: {name} {_shown(value)} has {_shown(i)}, outside the tokenizer's {vocab_size:,} ids "
                    f"(0 to {vocab_size - 1:,}); {FIX}"
                )


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 40:  # repr of 5,000 digits fails
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1:,} digits"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."
