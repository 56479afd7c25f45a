"""Server-sent events over raw ASGI: every write raced against the client's disconnect,
the server's shutdown and a socket that stays blocked (DESIGN.md, known pitfalls: an SSE
response that ignores the disconnect writes to dead sockets and blocks shutdown)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from starlette.types import Receive, Scope, Send

from subengine.gateway._connections import Slot


class Gone(Exception):
    """The client disconnected (or the server is shutting down): stop at once."""


class Blocked(Exception):
    """The client's socket took no data for the whole write timeout."""


def frame_text(kind: str, data: str, cursor: str | None) -> str:
    # JSON never holds a raw CR or LF, so the data is one `data:` line.
    head = f"id: {cursor}\n" if cursor is not None else ""
    return f"{head}event: {kind}\ndata: {data}\n\n"


# The scope key under which the gateway's app (`GatewayApp`) collects the held-open
# response its routes chose, to run it once they have returned.
HELD = "subengine.held_open"


class HeldOpen:
    """A response that holds its connection open: an event stream. Under the gateway's
    app it runs after the routing and middleware that chose it have returned, so that
    their coroutine frames (about 6 KB) do not live as long as the connection; it writes
    through the `send` they passed on, so what they add to a response still applies
    (CORS headers). Outside the gateway's app (its routes in another app) it runs in
    place. Mounted in another app, the gateway's app still holds it: only the outer
    app's own frames stay."""

    slot: Slot  # released when the response ends, however it ends

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        held = scope.get(HELD)
        if held is None or held:
            await self.serve(receive, send)
        else:
            held.append((self, receive, send))

    async def serve(self, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class Wakeable(Protocol):
    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    async def wait(self) -> None: ...


class EventStream:
    """One open SSE response. `write` sends text; `wait` sleeps until `wake` is set. Both
    end with `Gone` as soon as the client leaves, which also sets `wake`, as the server's
    shutdown does (`close`).

    A write that stays blocked longer than the write timeout is ended by `check`, which
    the gateway's watchdog calls about every second for every open stream: one timer for
    all of them instead of one per write.
    """

    def __init__(self, receive: Receive, send: Send, wake: Wakeable, write_timeout: float) -> None:
        self._receive = receive
        self._send = send
        self._wake = wake
        self._write_timeout = write_timeout
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._left = self._loop.create_task(self._watch_disconnect())
        self._writing_since: float | None = None
        self._blocked = False
        self.closing = False
        self.bytes_sent = 0
        self._timer: asyncio.TimerHandle | None = None  # of wait_until
        self._timer_deadline = 0.0

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._wake.set()
                return

    @property
    def gone(self) -> bool:
        return self._left.done()

    def close(self) -> None:
        """The server shuts down: wake the stream so that it ends (saying why)."""
        self.closing = True
        self._wake.set()

    def check(self, now: float) -> None:
        """End the write under way if it has waited on the socket for too long."""
        since = self._writing_since
        if since is not None and now - since > self._write_timeout and not self._blocked:
            self._blocked = True
            if self._task is not None:
                self._task.cancel()

    async def start(self, headers: list[tuple[bytes, bytes]]) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

    async def write(self, text: str | bytes) -> None:
        """Send `text` (or its UTF-8 bytes). uvicorn's send returns at once while the
        socket takes data, waits while it does not, and returns (sending nothing) once the
        client is gone."""
        if self.gone:
            raise Gone
        body = text if isinstance(text, bytes) else text.encode()
        self._writing_since = self._loop.time()
        try:
            await self._send({"type": "http.response.body", "body": body, "more_body": True})
        except asyncio.CancelledError:
            if not self._blocked or self._task is None:
                raise
            self._task.uncancel()
            raise Gone if self.gone else Blocked from None
        except OSError:  # the transport failed: the client is gone
            raise Gone from None
        finally:
            self._writing_since = None
        self.bytes_sent += len(body)

    async def wait(self, timeout: float) -> None:
        """Sleep until woken or for `timeout` seconds, whichever comes first (the caller
        looks at what changed either way); Gone once the client has left."""
        if self.gone:
            raise Gone
        if not self._wake.is_set():
            # a timer that wakes the stream costs less than a timeout scope per wait
            timer = self._loop.call_at(self._loop.time() + max(timeout, 0.0), self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()
        if self.gone:
            raise Gone

    async def wait_until(self, deadline: float) -> None:
        """As `wait`, until `deadline` (of time.monotonic). Its timer stays set after a
        wake-up for the next wait until the same deadline: a stream that sends frames
        between heartbeats sets one per heartbeat, not one per frame. Set between waits,
        it makes the next one return at once, the deadline being past."""
        if self.gone:
            raise Gone
        if not self._wake.is_set():
            if self._timer is None or self._timer_deadline != deadline:
                if self._timer is not None:
                    self._timer.cancel()
                delay = max(deadline - time.monotonic(), 0.0)
                self._timer = self._loop.call_later(delay, self._ring)
                self._timer_deadline = deadline
            await self._wake.wait()
        if self.gone:
            raise Gone

    def _ring(self) -> None:
        self._timer = None
        self._wake.set()

    async def end(self) -> None:
        """Finish the response (unless the client is gone) and stop watching."""
        self._left.cancel()
        if self._timer is not None:
            self._timer.cancel()
        try:
            async with asyncio.timeout(1.0):
                await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        except (Exception, asyncio.CancelledError):  # the client went away meanwhile
            pass
