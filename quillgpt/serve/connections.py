"""uvicorn, bounded: a deadline on every request head, and a shutdown that lets replies end.

`BoundedH11` is uvicorn's h11 protocol with a deadline on the request head: a client that
connects and sends nothing, or trickles half its headers a byte at a time (uvicorn's own
keep-alive timer restarts at every byte), is closed after `head_timeout_s`. The body has its
own deadline, in the app (serve/routes.py `Guard`). A reply sent while the client is still
uploading (a 413 for a body over the cap) ends in a lingering close: closing a socket with
unread bytes makes the kernel send a reset, which can destroy the reply before the client reads
it, so the server half-closes, drops what still arrives, and closes once nothing has come for
`LINGER_IDLE_S`, or `LINGER_MAX_S` after the reply (as nginx's lingering_close does). `DrainingServer` starts the app's `Drain`
when shutdown begins (SIGINT/SIGTERM): running replies get `drain_s` seconds, then end
themselves, a stream with an error event and [DONE], before uvicorn would cancel them.
Imported only when serving (uvicorn is the optional "serve" extra).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from quillgpt.serve.routes import Drain

GRACE_S = 1.0  # uvicorn waits this much past the drain before it cancels what is still running
LINGER_IDLE_S = 2.0  # after a reply sent mid-upload, the rest is read and dropped until this long a pause
LINGER_MAX_S = 30.0  # or this long after the reply, however it keeps coming


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol; a request head must arrive whole within head_timeout_s."""

    def __init__(self, *args: Any, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_transport: asyncio.Transport | None = None  # the real one, closed when the linger ends
        self._linger_end = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(LingeringClose(transport, self))  # type: ignore[arg-type]
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._linger_transport is None:
            super().data_received(data)
        else:  # the reply is sent: the rest of the upload is dropped
            self._linger_a_while()

    def linger(self, transport: asyncio.Transport) -> None:
        """Half-close after the reply; read (and drop) the rest of the upload while it comes."""
        transport.write_eof()  # after what is buffered: the client reads the whole reply, then EOF
        self.flow.resume_reading()
        self._linger_transport, self._linger_end = transport, self.loop.time() + LINGER_MAX_S
        self._linger_a_while()

    def _linger_a_while(self) -> None:
        """Close LINGER_IDLE_S from now unless more comes; LINGER_MAX_S after the reply at the latest."""
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        at = min(self.loop.time() + LINGER_IDLE_S, self._linger_end)
        self._linger_timer = self.loop.call_at(at, self._linger_transport.close)  # type: ignore[union-attr]

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE and self._head_timer is not None:  # the head is in
            self._head_timer.cancel()
            self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # waiting for the next request's head
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # nothing to answer: the request never arrived


class LingeringClose:
    """The connection's transport, whose close() lingers while the client's body is still coming.

    Everything else is the transport's own; once lingering it reads as closing, so uvicorn
    arms no keep-alive timer and starts no next request on it."""

    def __init__(self, transport: asyncio.Transport, protocol: BoundedH11) -> None:
        self._transport, self._protocol = transport, protocol
        self._lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._lingering or self._transport.is_closing()

    def close(self) -> None:
        uploading = self._protocol.conn.their_state is h11.SEND_BODY
        if self._lingering or not uploading or self._transport.is_closing() or not self._transport.can_write_eof():
            self._transport.close()
            return
        self._lingering = True
        self._protocol.linger(self._transport)


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown first starts the app's Drain."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_s: float) -> None:
        super().__init__(config)
        self.drain, self.drain_s = drain, drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.drain.start(self.drain_s)
        await super().shutdown(sockets)
