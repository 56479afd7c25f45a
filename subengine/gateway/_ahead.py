"""Catch-up pages read ahead: a reader given a page short of the end asks for the next
one as soon as it has taken this one in, so the gateway reads that page meanwhile and
hands it to the request that names where it starts. A catch-up then costs the time of
the slower of the reader and the gateway, rather than of both.

One gateway keeps one `ReadsAhead` for both of its APIs (docs/gateway.md, "Reading
events"; docs/durable-streams.md, "Reads").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from prometheus_client import Counter

# how long a page read ahead waits for its request, and how many each API holds (reading
# or read): few of the pool's connections (10 by default) go to reading ahead
READ_AHEAD_SECONDS = 5.0
READ_AHEAD_PAGES = 4


class ReadsAhead:
    """Pages read ahead, each under the key of the request that will ask for it: a tuple
    whose first item names the API (each holds at most READ_AHEAD_PAGES), and whose
    others name the stream, where the page starts and what it holds. A read that finds
    nothing worth keeping returns None.

    Every page read ahead ends with one outcome (the metric): `used` by its request,
    `unused` (dropped unasked, or its request gave up waiting for it), `at_end` (its
    read kept nothing) or `failed` (its read failed: the request reads anew, where a
    failure reaches the client)."""

    def __init__(self, outcomes: Counter) -> None:
        self._outcomes = outcomes
        # key -> (when it is dropped, the page's read)
        self._ahead: dict[tuple[Hashable, ...], tuple[float, asyncio.Task[Any]]] = {}
        # every read not finished, taken or not, and its key: cancelled at close
        self._reading: dict[asyncio.Task[Any], tuple[Hashable, ...]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    def start(self, key: tuple[Hashable, ...], read: Callable[[], Awaitable[Any]]) -> None:
        """Start `read`, the page that the request of `key` will ask for (unless one is
        held for it already, its API holds enough, or the gateway is closing)."""
        self.expire()
        if self._closed or key in self._ahead:
            return
        if sum(1 for held in self._ahead if held[0] == key[0]) >= READ_AHEAD_PAGES:
            return
        task = asyncio.ensure_future(read())
        self._reading[task] = key
        task.add_done_callback(self._finished)
        self._ahead[key] = (time.monotonic() + READ_AHEAD_SECONDS, task)
        self._schedule()

    async def take(self, key: tuple[Hashable, ...]) -> Any | None:
        """The page read ahead for `key`, once read, if any: None when there is none, its
        read failed or kept nothing, or the gateway closed meanwhile."""
        self.expire()
        ahead = self._ahead.pop(key, None)
        if ahead is None:
            return None
        task = ahead[1]
        try:
            page = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the gateway closes: the request reads anew
                return None
            task.cancel()  # its request gave up: nobody will ask for it
            self._outcomes.labels("unused").inc()
            raise
        except Exception:  # counted `failed` as it ended
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

    def _schedule(self) -> None:
        """Expire the held pages when the first of them is due, even if no request comes
        (a little later: the loop may run a timer up to its clock's resolution early)."""
        if self._timer is not None or not self._ahead:
            return
        due = min(deadline for deadline, _ in self._ahead.values()) - time.monotonic()
        self._timer = asyncio.get_running_loop().call_later(max(due, 0) + 0.05, self._due)

    def _due(self) -> None:
        self._timer = None
        self.expire()
        self._schedule()

    def _finished(self, task: asyncio.Task[Any]) -> None:
        """A read ended. One that failed or kept nothing gives its place up now (its
        request reads anew); its error is not the event loop's to report."""
        key = self._reading.pop(task)
        if task.cancelled():
            return
        if task.exception() is not None:
            outcome = "failed"
        elif task.result() is None:
            outcome = "at_end"
        else:
            return
        self._outcomes.labels(outcome).inc()
        held = self._ahead.get(key)
        if held is not None and held[1] is task:
            del self._ahead[key]

    async def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        tasks = list(self._reading)
        self._ahead.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
