"""OpenAI's response objects and Server-Sent Events for one request.

Completions are `text_completion` objects; chat replies are `chat.completion`, streamed as
`chat.completion.chunk`s whose first chunk per choice carries the role. Every chunk of a stream
has the request's id, finish_reason is null until a choice's last chunk, and the stream ends
with `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# One token's logprob entry: (token id, its logprob or None (the first prompt token), top (id, logprob) or None)
Entry = tuple[int, float | None, list[tuple[int, float]] | None]


def sse(obj: dict[str, Any] | str) -> str:
    """One Server-Sent Event: `data: <json>` and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


DONE = sse("[DONE]")


@dataclass
class Reply:
    """Builds the response objects of one request (completion or chat)."""

    chat: bool
    model: str
    prompt_tokens: int
    include_usage: bool = False
    completion_tokens: int = 0  # so far: the access log's count (serve/access_log.py)
    cached_tokens: int = 0  # of prompt_tokens, those read from the engine's prompt cache
    streamed: bool = False  # a stream was started...
    completed: bool = False  # ...and its last event ([DONE]) was taken by the server: not cut
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, streaming: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if streaming else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def chunk(
        self,
        index: int,
        text: str = "",
        finish: str | None = None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One streamed piece of choice `index` (role=True: the chat stream's opening chunk), with
        the logprobs of its tokens when asked for, and the tool calls a reply ended with."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        out = {**self._head(True), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": self.usage(completion_tokens)}

    def full(
        self,
        texts: list[str | None],
        finishes: list[str],
        completion_tokens: int,
        logprobs: list[dict[str, Any] | None] | None = None,
        tool_calls: list[list[dict[str, Any]]] | None = None,
    ) -> dict[str, Any]:
        """The non-streamed response: every choice whole (with its logprobs when asked for, a chat
        reply's tool calls), and the usage."""
        lps = logprobs or [None] * len(texts)
        calls = tool_calls or [[] for _ in texts]
        if self.chat:
            choices = [
                {"index": i, "message": _message(t, c), "logprobs": lp, "finish_reason": f}
                for i, (t, f, lp, c) in enumerate(zip(texts, finishes, lps, calls))
            ]
        else:
            choices = [
                {"index": i, "text": t, "logprobs": lp, "finish_reason": f} for i, (t, f, lp) in enumerate(zip(texts, finishes, lps))
            ]
        return {**self._head(False), "choices": choices, "usage": self.usage(completion_tokens)}


def _message(content: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat reply's message: its content (None when it is only tool calls), and its tool calls."""
    return {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}


def token_text(raw: bytes) -> str:
    """A token's text; a piece of a character as OpenAI writes it: bytes:\\xNN..."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completion_logprobs(entries: list[Entry], token_bytes: Callable[[int], bytes], offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions shape: tokens, token_logprobs, top_logprobs ({token: logprob}) and
    text_offset (each token's start in the choice's text, from `offset`, counting token strings).
    Two alternatives with one text (ids outside the tokenizer's vocabulary) share one key."""
    tokens = [token_text(token_bytes(i)) for i, _, _ in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    top = [None if alt is None else {token_text(token_bytes(i)): lp for i, lp in alt} for _, _, alt in entries]
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(entries: list[Entry], token_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    """OpenAI's chat shape: content, one {token, logprob, bytes, top_logprobs} a token."""

    def one(i: int, lp: float | None) -> dict[str, Any]:
        raw = token_bytes(i)
        return {"token": token_text(raw), "logprob": lp, "bytes": list(raw)}

    return {"content": [{**one(i, lp), "top_logprobs": [one(j, alt_lp) for j, alt_lp in alt or []]} for i, lp, alt in entries]}
