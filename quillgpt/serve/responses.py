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
from dataclasses import dataclass, field
from typing import Any


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
    streamed: bool = False  # a stream was started...
    completed: bool = False  # ...and its last event ([DONE]) was taken by the server: not cut
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, streaming: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if streaming else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def chunk(self, index: int, text: str = "", finish: str | None = None, role: bool = False) -> dict[str, Any]:
        """One streamed piece of choice `index` (role=True: the chat stream's opening chunk)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        out = {**self._head(True), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": self.usage(completion_tokens)}

    def full(self, texts: list[str], finishes: list[str], completion_tokens: int) -> dict[str, Any]:
        """The non-streamed response: every choice whole, and the usage."""
        if self.chat:
            choices = [
                {"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None, "finish_reason": f}
                for i, (t, f) in enumerate(zip(texts, finishes))
            ]
        else:
            choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": f} for i, (t, f) in enumerate(zip(texts, finishes))]
        return {**self._head(False), "choices": choices, "usage": self.usage(completion_tokens)}
