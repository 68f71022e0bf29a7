"""One line per request in the server's log: method, route, status, tokens and time.

An ASGI middleware, so a streamed reply is logged when its last byte is sent (not when its
headers are), and a client that leaves mid-stream is logged as such. The generation routes put
their `Reply` in the request's state (`request.state.reply`); its token counts go on the line.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("uvicorn.error")  # uvicorn's own log: the access log is off (server.uvicorn_server)


class AccessLog:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status, done = time.perf_counter(), None, False

        async def watched(message: dict) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            log.info(request_line(scope, status, done, time.perf_counter() - started))


def request_line(scope: dict, status: int | None, done: bool, seconds: float) -> str:
    """'POST /v1/completions 200 6+50 tokens 0.84s': status 500 for an error no route answered."""
    parts = [scope["method"], scope["path"], str(status or 500)]
    reply = scope.get("state", {}).get("reply")
    if reply is not None:
        parts.append(f"{reply.prompt_tokens}+{reply.completion_tokens} tokens")
    parts.append(f"{seconds:.3f}s" if seconds < 1 else f"{seconds:.2f}s")
    if reply is not None and reply.streamed and not reply.completed:
        parts.append("(cut: the client left before the end of the stream)")
    elif status is not None and not done:
        parts.append("(client left before the end)")
    return " ".join(parts)
