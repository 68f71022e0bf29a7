"""Chat data (`data.format: chat`): jsonl conversations → token ids, and a flag per token.

A line is one conversation, in OpenAI's chat format or as a prompt/completion pair:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", ...}, {"role": "assistant", ...}]}
    {"prompt": "...", "completion": "..."}          (= a user turn and the assistant's reply)

Roles are system, developer (= system), user and assistant; every assistant turn must say
something, and a conversation needs at least one. Each conversation is rendered with the model's
chat template, or quill's transcript (data/chat_template.py, which also finds the assistant's tokens), and
stored as its ids in the token shards plus a parallel uint8 flags shard: ASSISTANT marks the
assistant's tokens (the only ones the loss counts), START each conversation's first token.

A bad line (not JSON, a missing role, an empty assistant turn, no assistant turn, characters the
tokenizer cannot encode, a template that refuses it) is one QuillError naming file and line; with
`data.skip_bad_lines: true` it is skipped and counted instead (prepare reports how many, and the
first one's reason).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from quillgpt.data.chat_template import ROLE_NAMES, Message, conversation_tokens
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError

ASSISTANT, START = 1, 2  # bits of a token's flag: the assistant's token; a conversation's first token
FLAGS_DTYPE = np.dtype(np.uint8)
SKIP_HINT = "fix the line, or set data.skip_bad_lines=true to skip such lines"


def parse_conversation(line: str) -> list[Message]:
    """One jsonl line → its messages, checked; a QuillError saying what is wrong (no location)."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        raise QuillError("not UTF-8 text") from None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise QuillError(f"not a JSON object ({str(e)[:80]})") from None
    if not isinstance(record, dict):
        raise QuillError(f"a JSON {type(record).__name__}, not an object with 'messages' (or 'prompt' and 'completion')")
    if "messages" in record:
        messages = _messages(record["messages"])
    elif "prompt" in record or "completion" in record:
        messages = _pair(record)
    else:
        raise QuillError("neither 'messages' nor 'prompt' and 'completion'")
    if not any(m["role"] == "assistant" for m in messages):
        raise QuillError("no assistant message, so nothing to train on")
    return messages


def _messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise QuillError('\'messages\' must be a non-empty list of {"role", "content"} objects')
    out = []
    for n, m in enumerate(value, 1):
        if not isinstance(m, dict):
            raise QuillError(f"message {n} is not an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role is None:
            raise QuillError(f"message {n} has no 'role' (one of {', '.join(ROLE_NAMES)})")
        if not isinstance(role, str):  # a list or object: unhashable, never a role
            raise QuillError(f"message {n} has a {type(role).__name__} 'role', not text (one of {', '.join(ROLE_NAMES)})")
        if role not in ROLE_NAMES:
            raise QuillError(f"message {n} has role {str(role)[:40]!r}; roles are {', '.join(ROLE_NAMES)}")
        if not isinstance(content, str):
            what = "no 'content'" if content is None else f"a {type(content).__name__} 'content', not text"
            raise QuillError(f"message {n} ({role}) has {what}")
        if role == "assistant" and not content.strip():
            raise QuillError(f"message {n} (assistant) is empty (an assistant turn must say something)")
        out.append({"role": role, "content": content})
    return out


def _pair(record: dict[str, Any]) -> list[Message]:
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise QuillError("'prompt' and 'completion' must both be text")
    if not completion.strip():
        raise QuillError("an empty 'completion' (the assistant's reply must say something)")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def encode_conversation(
    tok: Tokenizer, messages: list[Message], dtype: np.dtype, limit: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(ids (n,) in dtype, flags (n,) uint8) of one conversation; with `limit`, the ASSISTANT flags
    are found for its first `limit` ids only (the rows' length: conversation_tokens), and one
    whose assistant turns all start past them is kept (training counts it as untrained)."""
    ids, mine = conversation_tokens(tok, messages, limit)
    flags = np.where(np.asarray(mine, dtype=bool), ASSISTANT, 0).astype(FLAGS_DTYPE)
    if not flags.any() and (limit is None or len(ids) < limit):  # (else its turns start past a row: trained on none, counted)
        raise QuillError("no token of the assistant's after rendering (the chat template drops its replies?)")
    flags[0] |= START
    return np.asarray(ids, dtype=dtype), flags


@dataclass
class ChatStats:
    """What encoding a group of lines found: conversations kept per split, lines skipped."""

    conversations: int = 0
    skipped: int = 0
    first_skipped: str | None = None  # "path line N: reason" of the first skipped line

    def add(self, other: ChatStats) -> None:
        self.conversations += other.conversations
        self.skipped += other.skipped
        self.first_skipped = self.first_skipped or other.first_skipped


def encode_lines(
    tok: Tokenizer, lines: list[str], wheres: list[str], dtype: np.dtype, skip_bad: bool, limit: int | None = None
) -> tuple[tuple[np.ndarray, np.ndarray], ChatStats]:
    """((ids, flags) of the lines' conversations in order, their stats). A bad line raises a
    QuillError naming it (`wheres`: "path line N"), or with skip_bad is counted and left out.
    `limit`: flags for each conversation's first `limit` ids only (encode_conversation)."""
    ids, flags, stats = [np.zeros(0, dtype)], [np.zeros(0, FLAGS_DTYPE)], ChatStats()
    for line, where in zip(lines, wheres):
        try:
            i, f = encode_conversation(tok, parse_conversation(line), dtype, limit)
        except QuillError as e:
            if not skip_bad:
                raise QuillError(f"{where}: {e}; {SKIP_HINT}") from None
            stats.skipped += 1
            stats.first_skipped = stats.first_skipped or f"{where}: {e}"
            continue
        ids.append(i)
        flags.append(f)
        stats.conversations += 1
    return (np.concatenate(ids), np.concatenate(flags)), stats
