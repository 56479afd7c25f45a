"""The gateway's pages read ahead (subengine.gateway._ahead): each page is handed to one
request or dropped, ends with one outcome, and the places each API holds are bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from subengine.gateway import _ahead
from subengine.gateway._ahead import ReadsAhead

OUTCOMES = ("used", "unused", "at_end", "failed")


class Reads:
    """A ReadsAhead with its own metric, and reads that end when the test says."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        counter = Counter("pages", "pages read ahead", ["outcome"], registry=self.registry)
        self.ahead = ReadsAhead(counter)
        self.gates: list[asyncio.Future[Any]] = []

    def outcomes(self) -> dict[str, float]:
        found = {}
        for outcome in OUTCOMES:
            value = self.registry.get_sample_value("pages_total", {"outcome": outcome})
            if value:
                found[outcome] = value
        return found

    def read(self) -> Callable[[], Awaitable[Any]]:
        """A read that, once started, returns (or raises) what the test sets on its gate
        (the gates in the order the reads started)."""

        async def page() -> Any:
            gate: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self.gates.append(gate)
            return await gate

        return page


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run(test: Callable[[Reads], Awaitable[None]]) -> None:
    async def main() -> None:
        reads = Reads()
        try:
            await test(reads)
        finally:
            await reads.ahead.close()

    asyncio.run(main())


def test_a_page_goes_to_the_request_of_its_key_once() -> None:
    async def test(reads: Reads) -> None:
        reads.ahead.start(("v1", "a", 10), reads.read())
        await settle()
        assert await reads.ahead.take(("v1", "a", 11)) is None  # another key
        reads.gates[0].set_result(["page"])
        assert await reads.ahead.take(("v1", "a", 10)) == ["page"]
        assert await reads.ahead.take(("v1", "a", 10)) is None  # taken
        assert reads.outcomes() == {"used": 1}

    run(test)


def test_a_read_that_keeps_nothing_or_fails_gives_its_place_up_at_once() -> None:
    async def test(reads: Reads) -> None:
        for n in range(4):
            reads.ahead.start(("v1", n), reads.read())
        await settle()
        reads.gates[0].set_result(None)
        reads.gates[1].set_exception(RuntimeError("the database went away"))
        await settle()
        assert reads.outcomes() == {"at_end": 1, "failed": 1}
        reads.ahead.start(("v1", 4), reads.read())  # in a place given up
        reads.ahead.start(("v1", 5), reads.read())
        await settle()
        assert len(reads.gates) == 6
        assert await reads.ahead.take(("v1", 0)) is None
        assert await reads.ahead.take(("v1", 1)) is None
        assert reads.outcomes() == {"at_end": 1, "failed": 1}

    run(test)


def test_each_api_holds_at_most_four() -> None:
    async def test(reads: Reads) -> None:
        for n in range(5):
            reads.ahead.start(("v1", n), reads.read())
        await settle()
        assert len(reads.gates) == 4
        reads.ahead.start(("durable-streams", 0), reads.read())
        reads.ahead.start(("durable-streams", 0), reads.read())  # held already
        await settle()
        assert len(reads.gates) == 5

    run(test)


def test_an_unasked_page_is_dropped_in_time_without_another_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_ahead, "READ_AHEAD_SECONDS", 0.05)

    async def test(reads: Reads) -> None:
        reads.ahead.start(("v1", "late"), reads.read())
        await settle()
        reads.gates[0].set_result(["page"])
        reads.ahead.start(("v1", "reading"), reads.read())
        await asyncio.sleep(0.5)
        assert reads.outcomes() == {"unused": 2}
        assert reads.gates[1].cancelled()  # its read stopped
        assert await reads.ahead.take(("v1", "late")) is None

    run(test)


def test_a_request_that_gives_up_waiting_stops_the_read() -> None:
    async def test(reads: Reads) -> None:
        reads.ahead.start(("v1", "slow"), reads.read())
        waiting = asyncio.ensure_future(reads.ahead.take(("v1", "slow")))
        await settle()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await settle()
        assert reads.gates[0].cancelled()
        assert reads.outcomes() == {"unused": 1}

    run(test)


def test_closing_ends_the_reads_and_takes_no_more() -> None:
    async def test(reads: Reads) -> None:
        reads.ahead.start(("v1", "open"), reads.read())
        waiting = asyncio.ensure_future(reads.ahead.take(("v1", "open")))
        await settle()
        await reads.ahead.close()
        assert await waiting is None  # the request reads anew
        reads.ahead.start(("v1", "after"), reads.read())
        await settle()
        assert len(reads.gates) == 1
        assert await reads.ahead.take(("v1", "after")) is None
        assert reads.outcomes() == {}

    run(test)
