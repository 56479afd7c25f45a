"""`EventStream.write_now`, the hub's way to send a waiting event stream its frames
without waking its task (issue 26): a send the server takes at once is done; one that
must wait (the socket is full) is left to the stream's task, and what follows it is
queued behind it, so nothing is lost or reordered; a send that fails ends the stream in
its task. The `send` here is an ASGI callable like uvicorn's: it waits while its
"socket" is paused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from subengine.gateway._hub import Wake
from subengine.gateway._sse import Blocked, EventStream, Gone


class Socket:
    """An ASGI `send` that takes bodies at once unless paused, as uvicorn's does."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.writable = asyncio.Event()
        self.writable.set()
        self.failure: BaseException | None = None

    async def send(self, message: dict[str, Any]) -> None:
        if not self.writable.is_set():
            await self.writable.wait()
        if self.failure is not None:
            raise self.failure
        self.bodies.append(message["body"])


async def never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def opened(socket: Socket, write_timeout: float = 30.0) -> EventStream:
    return EventStream(never_disconnects, socket.send, Wake(), write_timeout)  # type: ignore[arg-type]


def test_a_send_taken_at_once_is_done_without_the_task() -> None:
    async def scenario() -> None:
        socket = Socket()
        stream = await opened(socket)
        assert stream.write_now(b"one") and stream.write_now(b"two")
        assert socket.bodies == [b"one", b"two"]
        assert not stream.pending
        assert stream.bytes_sent == 6

    asyncio.run(scenario())


def test_a_send_that_must_wait_is_finished_by_the_task_before_what_follows() -> None:
    async def scenario() -> None:
        socket = Socket()
        stream = await opened(socket)
        assert stream.write_now(b"1")
        socket.writable.clear()  # the socket is full
        assert not stream.write_now(b"2")
        assert not stream.write_now(b"3")  # queued behind the unfinished one
        assert stream.pending and socket.bodies == [b"1"]

        async def task() -> None:
            await stream.flush()
            await stream.write(b"4")

        running = asyncio.create_task(task())
        await asyncio.sleep(0.01)
        assert socket.bodies == [b"1"]  # still waiting on the socket
        socket.writable.set()
        await asyncio.wait_for(running, 5)
        assert socket.bodies == [b"1", b"2", b"3", b"4"]
        assert not stream.pending
        assert stream.bytes_sent == 4

    asyncio.run(scenario())


def test_a_send_that_stays_blocked_ends_the_stream_in_its_task() -> None:
    async def scenario() -> None:
        socket = Socket()
        socket.writable.clear()

        async def task() -> None:
            stream = await opened(socket, write_timeout=0.05)
            assert not stream.write_now(b"stuck")
            watchdog = asyncio.get_running_loop().call_later(0.2, stream.check, 1e12)
            try:
                await stream.flush()
            finally:
                watchdog.cancel()

        with pytest.raises(Blocked):
            await asyncio.wait_for(asyncio.create_task(task()), 5)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("failure", "raised"), [(ConnectionResetError(), Gone), (RuntimeError("bad"), RuntimeError)]
)
def test_a_failed_send_is_met_by_the_task(failure: BaseException, raised: type) -> None:
    async def scenario() -> None:
        socket = Socket()
        socket.failure = failure
        stream = await opened(socket)
        assert not stream.write_now(b"lost?")
        assert not stream.write_now(b"after")  # never sent past a failure
        with pytest.raises(raised):
            await stream.flush()
        assert socket.bodies == []

    asyncio.run(scenario())


def test_a_failure_after_a_wait_is_met_by_the_task() -> None:
    async def scenario() -> None:
        socket = Socket()
        stream = await opened(socket)
        socket.writable.clear()
        assert not stream.write_now(b"x")
        socket.failure = ConnectionResetError()
        socket.writable.set()
        with pytest.raises(Gone):
            await stream.flush()

    asyncio.run(scenario())
