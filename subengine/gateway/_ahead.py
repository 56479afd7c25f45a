"""Catch-up pages read ahead: a reader given a page short of the end asks for the next
one as soon as it has taken this one in, so the gateway reads that page meanwhile and
hands it to the request that names where it starts. A catch-up then costs the time of
the slower of the reader and the gateway, rather than of both.

One gateway keeps one `ReadsAhead` for both of its APIs (docs/gateway.md, "Reading
events"; docs/durable-streams.md, "Reads"): its few pages take few of the pool's
connections (10 by default), whichever API asks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from prometheus_client import Counter

# how long a page read ahead waits for its request, and how many are held (reading or read)
READ_AHEAD_SECONDS = 5.0
READ_AHEAD_PAGES = 4


class ReadsAhead:
    """Pages read ahead, each under the key of the request that will ask for it (which
    names the stream, where the page starts and what it holds). A read that finds
    nothing worth keeping returns None."""

    def __init__(self, outcomes: Counter) -> None:
        self._outcomes = outcomes
        # key -> (when it is dropped, the page's read)
        self._ahead: dict[Hashable, tuple[float, asyncio.Task[Any]]] = {}
        # every read not finished, taken or not: cancelled at close
        self._reading: set[asyncio.Task[Any]] = set()

    def start(self, key: Hashable, read: Callable[[], Awaitable[Any]]) -> None:
        """Start `read`, the page that the request of `key` will ask for (unless one is
        held for it already, or enough are held)."""
        self.expire()
        if key in self._ahead or len(self._ahead) >= READ_AHEAD_PAGES:
            return
        task = asyncio.ensure_future(read())
        self._reading.add(task)
        task.add_done_callback(self._finished)
        self._ahead[key] = (time.monotonic() + READ_AHEAD_SECONDS, task)
        # dropped then if still unasked, even when no other page is asked for after it
        # (a little later: the loop may run a timer up to its clock's resolution early)
        asyncio.get_running_loop().call_later(READ_AHEAD_SECONDS + 0.05, self.expire)

    async def take(self, key: Hashable) -> Any | None:
        """The page read ahead for `key`, once read, if any: None when there is none, its
        read failed (the request reads anew, where a failure reaches the client) or it
        found nothing worth keeping."""
        self.expire()
        ahead = self._ahead.pop(key, None)
        if ahead is None:
            return None
        try:
            page = await asyncio.shield(ahead[1])
        except Exception:
            return None
        if page is not None:
            self._outcomes.labels("used").inc()
        return page

    def expire(self) -> None:
        """Drop the pages that nobody asked for in time."""
        now = time.monotonic()
        for key, (deadline, task) in list(self._ahead.items()):
            if deadline <= now:
                del self._ahead[key]
                task.cancel()
                self._outcomes.labels("unused").inc()

    def _finished(self, task: asyncio.Task[Any]) -> None:
        """A read ended. One that failed fails again when asked for (the request reads
        anew), or is dropped: its error is not the event loop's to report. One that kept
        nothing is counted now."""
        self._reading.discard(task)
        if task.cancelled() or task.exception() is not None:
            return
        if task.result() is None:
            self._outcomes.labels("at_end").inc()

    async def close(self) -> None:
        tasks = list(self._reading)
        self._ahead.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
