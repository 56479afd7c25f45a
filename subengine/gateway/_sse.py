"""Server-sent events over raw ASGI: every write raced against the client's disconnect,
the server's shutdown and a socket that stays blocked (DESIGN.md, known pitfalls: an SSE
response that ignores the disconnect writes to dead sockets and blocks shutdown)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, Protocol

from starlette.types import Message, Receive, Scope, Send

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
    # Whether its writes may be begun outside its task (the hub's fan-out, see
    # `EventStream.write_now`): the gateway's app says so when the send it writes
    # through is the server's own, or that under the app's CORS middleware alone. Other
    # middleware's sends may need to run in the response's task (a timeout, a context
    # variable).
    sends_from_outside = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        held = scope.get(HELD)
        if held is None or held:
            await self.serve(receive, send)
        else:
            held.append((self, receive, send))

    async def serve(self, receive: Receive, send: Send) -> None:
        raise NotImplementedError


def _body(body: bytes) -> Message:
    return {"type": "http.response.body", "body": body, "more_body": True}


async def _awaited(awaitable: Awaitable[None]) -> None:
    await awaitable


async def _finished(sending: Coroutine[Any, Any, None], waits_on: Any) -> None:
    """Run to its end, in the current task, a coroutine begun outside it (by
    `EventStream.write_now`) that stopped to wait on `waits_on` (a future, or None for a
    bare yield): what a task does for the coroutine it runs."""
    while True:
        try:
            # waited on without awaiting it here: the coroutine awaits it, and takes its
            # result (or failure) when resumed
            if waits_on is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait((waits_on,))
        except asyncio.CancelledError as cancelled:
            # the task is cancelled (the watchdog, a shutdown): so is the send
            try:
                waits_on = sending.throw(cancelled)
            except StopIteration:
                return
            continue
        try:
            waits_on = sending.send(None)
        except StopIteration:
            return


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
        self.sent_at = time.monotonic()  # when the last write was handed to the server
        # what `write_now` could not send at once: the send it began (what it waits on,
        # and the bytes of its body), the bodies after it, or what the send raised;
        # `flush` finishes them
        self._unfinished: tuple[Coroutine[Any, Any, None], Any, int] | None = None
        self._queued: list[bytes] = []
        self._failure: Exception | None = None

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
        await self._guarded(self._send(_body(body)), len(body))

    async def _guarded(self, sending: Awaitable[None], size: int) -> None:
        """Await a send of `size` bytes under the watchdog (`check`)."""
        self._writing_since = self._loop.time()
        try:
            await sending
        except asyncio.CancelledError:
            if not self._blocked or self._task is None:
                raise
            self._task.uncancel()
            raise Gone if self.gone else Blocked from None
        except OSError:  # the transport failed: the client is gone
            raise Gone from None
        finally:
            self._writing_since = None
        self.bytes_sent += size
        self.sent_at = time.monotonic()

    def write_now(self, body: bytes) -> bool:
        """Send `body` from outside the stream's task (the hub's wake-up of a stream that
        waits in `wait_until`), without waiting: True once the server took it, which it
        does at once while the socket takes data. Otherwise the send is left where it
        stopped (the socket is full, or it failed), later bodies are queued behind it,
        False is returned, and the stream's task must `flush` before it writes again."""
        if self.pending:
            self._queued.append(body)
            return False
        try:
            sent = self._send(_body(body))
            sending = sent if isinstance(sent, Coroutine) else _awaited(sent)
            waits_on = sending.send(None)
        except StopIteration:
            self.bytes_sent += len(body)
            self.sent_at = time.monotonic()
            return True
        except Exception as error:  # met by the stream's task in `flush`
            self._failure = error
            return False
        self._unfinished = (sending, waits_on, len(body))
        return False

    @property
    def pending(self) -> bool:
        """Whether `write_now` left something for `flush`."""
        return self._unfinished is not None or self._failure is not None or bool(self._queued)

    async def flush(self) -> None:
        """In the stream's task: finish what `write_now` began, then send what it queued,
        each as `write` would (Gone, Blocked); raise what a send of it raised."""
        failure, self._failure = self._failure, None
        if failure is not None:
            self._queued.clear()
            if isinstance(failure, OSError):
                raise Gone from None
            raise failure
        if self._unfinished is not None:
            sending, waits_on, size = self._unfinished
            self._unfinished = None
            await self._guarded(_finished(sending, waits_on), size)
        while self._queued:
            await self.write(self._queued.pop(0))

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
        if self._unfinished is not None:
            self._unfinished[0].close()
            self._unfinished = None
        try:
            async with asyncio.timeout(1.0):
                await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        except (Exception, asyncio.CancelledError):  # the client went away meanwhile
            pass
