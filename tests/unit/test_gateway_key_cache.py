"""The gateway's key cache answers a crowd with one read: when a thousand event streams
find the cached answer stale at once, they wait for one read of the database instead of
making a thousand (the benchmark saw 20 queries per notification before)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from subengine.gateway import _auth
from subengine.streams._listener import Changes


def listening() -> Changes:
    changes = Changes()
    changes.listening = True
    return changes


def test_callers_that_find_the_value_stale_together_share_one_read() -> None:
    reads = 0

    async def read() -> int:
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.01)
        return reads

    async def crowd() -> list[int]:
        cached = _auth._Cached(read, listening())
        return await asyncio.gather(*(cached.get() for _ in range(1000)))

    assert asyncio.run(crowd()) == [1] * 1000
    assert reads == 1


def test_a_failed_read_is_tried_again_by_the_next_caller() -> None:
    attempts = 0

    async def read() -> str:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise ConnectionError("database away")
        return "ok"

    async def twice() -> tuple[BaseException | str, str]:
        cached = _auth._Cached(read, listening())
        first = await asyncio.gather(cached.get(), return_exceptions=True)
        return first[0], await cached.get()

    first, second = asyncio.run(twice())
    assert isinstance(first, ConnectionError) and second == "ok"


def counting() -> Callable[[], Awaitable[int]]:
    """A read that answers how many times it was called."""
    reads = 0

    async def read() -> int:
        nonlocal reads
        reads += 1
        return reads

    return read


def test_a_change_makes_the_next_caller_read_again() -> None:
    async def around_a_change() -> list[int]:
        changes = listening()
        cached = _auth._Cached(counting(), changes)
        before = [await cached.get(), await cached.get()]
        changes._moved()
        return [*before, await cached.get(), await cached.get()]

    assert asyncio.run(around_a_change()) == [1, 1, 2, 2]


def test_nothing_is_trusted_while_the_listener_is_not_listening() -> None:
    async def unheard() -> list[int]:
        cached = _auth._Cached(counting(), Changes())
        return [await cached.get() for _ in range(3)]

    assert asyncio.run(unheard()) == [1, 2, 3]
