"""Server-sent events over raw ASGI: every write raced against the client's disconnect,
the server's shutdown and a socket that stays blocked (DESIGN.md, known pitfalls: an SSE
response that ignores the disconnect writes to dead sockets and blocks shutdown)."""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Send


class Gone(Exception):
    """The client disconnected (or the server is shutting down): stop at once."""


class Blocked(Exception):
    """The client's socket took no data for the whole write timeout."""


def frame_text(kind: str, data: str, cursor: str | None) -> str:
    # JSON never holds a raw CR or LF, so the data is one `data:` line.
    head = f"id: {cursor}\n" if cursor is not None else ""
    return f"{head}event: {kind}\ndata: {data}\n\n"


class EventStream:
    """One open SSE response: `write` sends text, `wait` sleeps until woken, and both end
    with `Gone` as soon as the client leaves or the server shuts down."""

    def __init__(
        self, receive: Receive, send: Send, closing: asyncio.Event, write_timeout: float
    ) -> None:
        self._receive = receive
        self._send = send
        self._closing = closing
        self._write_timeout = write_timeout
        self._left = asyncio.get_running_loop().create_task(self._watch_disconnect())
        self._closing_wait = asyncio.get_running_loop().create_task(closing.wait())
        self.bytes_sent = 0

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return

    @property
    def gone(self) -> bool:
        return self._left.done()

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    async def start(self, headers: list[tuple[bytes, bytes]]) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

    async def write(self, text: str) -> None:
        if self.gone:
            raise Gone
        body = text.encode()
        sending = asyncio.ensure_future(
            self._send({"type": "http.response.body", "body": body, "more_body": True})
        )
        done, _ = await asyncio.wait(
            {sending, self._left}, timeout=self._write_timeout, return_when="FIRST_COMPLETED"
        )
        if sending not in done:
            sending.cancel()
            if self.gone:
                raise Gone
            raise Blocked
        sending.result()  # an error of the transport: the client is gone
        self.bytes_sent += len(body)

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        """Sleep until `event` is set (True), `timeout` seconds pass (False), the client
        leaves or the server shuts down (both: Gone)."""
        if event.is_set():
            return True
        woken = asyncio.ensure_future(event.wait())
        try:
            done, _ = await asyncio.wait(
                {woken, self._left, self._closing_wait},
                timeout=max(timeout, 0.0),
                return_when="FIRST_COMPLETED",
            )
        finally:
            woken.cancel()
        if self._left in done:
            raise Gone
        return woken in done and not woken.cancelled()

    async def end(self) -> None:
        """Finish the response (unless the client is gone) and stop watching."""
        self._left.cancel()
        self._closing_wait.cancel()
        try:
            await asyncio.wait_for(
                self._send({"type": "http.response.body", "body": b"", "more_body": False}),
                self._write_timeout,
            )
        except Exception:  # the client went away meanwhile: nothing to finish
            pass
