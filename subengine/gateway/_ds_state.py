"""A gateway's Durable Streams state (docs/durable-streams.md): the storage, and the
sweeper that deletes expired streams and the engine streams of deleted ones."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from subengine.engine._durable_streams import DurableStreams
from subengine.gateway._ds_views import read_view, view_of, view_stream
from subengine.gateway._state import Gateway
from subengine.outside._durable_streams import CatalogStream

log = logging.getLogger("subengine.gateway")

# seconds between two runs of the sweeper (expired streams, deleted streams' events)
SWEEP_SECONDS = 1.0
# A catch-up reader given a page short of the tail asks for the next one as soon as it
# has taken this one in: the gateway reads that page meanwhile, keeps it this long for
# the request, and holds at most this many such pages (reading or read) at a time, so
# that reads ahead take few of the pool's connections (10 by default).
READ_AHEAD_SECONDS = 5.0
READ_AHEAD_PAGES = 4

Page = list[tuple[int, Any]]


@dataclass(eq=False)
class DurableStreamsState:
    """A gateway's Durable Streams: the storage, and the sweeper that deletes expired
    streams and the engine streams of deleted ones."""

    gateway: Gateway
    long_poll_timeout: float
    max_page_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        self.store = DurableStreams(self.gateway.engine, self.max_page_bytes)
        self._poke = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        # (engine stream, epoch, position) -> (when it is dropped, the page's read)
        self._ahead: dict[tuple[str, int, int], tuple[float, asyncio.Task[Page]]] = {}
        # every read ahead not finished, taken or not: cancelled at close
        self._reading: set[asyncio.Task[Page]] = set()

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(
            self._sweep(), name="subengine-durable-streams-sweeper"
        )

    async def lookup(self, path: str, *, touch: bool = False) -> CatalogStream | None:
        """The stream at `path` (a view of an engine stream's partition, or one of the
        catalog), None when there is none; `touch` resets a TTL stream's countdown."""
        view = view_of(path)
        if view is not None:
            return await view_stream(self.gateway.read_engine, path, *view)
        found = await self.store.stream(path, touch=touch)
        if found is None:
            self.poke()  # it may have expired just now
        return found

    async def lookup_and_read(
        self, path: str, found: CatalogStream, after: int
    ) -> tuple[CatalogStream | None, Page | None]:
        """`lookup(path)` and, for `found` a JSON stream of the catalog that is no fork,
        the messages after `after` up to the tail it finds, in one statement (a live
        reader woken by an append); messages None otherwise, for `read` to read."""
        if found.view:
            return await self.lookup(path), None
        again, messages = await self.store.stream_and_read(path, found, after)
        if again is None:
            self.poke()  # it may have expired just now
        return again, messages

    async def read(self, found: CatalogStream, after: int) -> Page:
        """The messages of `found` after position `after`: a page bounded by bytes (the
        one read ahead for it, if any)."""
        if found.view:
            return await read_view(self.gateway.read_engine, found, after, self.max_page_bytes)
        self._expire()
        ahead = self._ahead.pop((found.stream, found.epoch, after), None)
        if ahead is not None:
            try:
                page = await asyncio.shield(ahead[1])
            except Exception:  # read it again here, where a failure reaches the client
                pass
            else:
                self.gateway.metrics.pages_read_ahead.labels("used").inc()
                return page
        return await self.store.read(found, after)

    def read_ahead(self, found: CatalogStream, after: int) -> None:
        """Start reading the page of `found` after `after`, which the reader of the page
        that ends there will ask for next. The page is of the stream as it is now: the
        request that takes it gets messages up to this tail, the same page it would have
        read a moment earlier, and reads on from its end."""
        if found.view or found.inherited or after >= found.tail:
            return
        self._expire()
        key = (found.stream, found.epoch, after)
        if key in self._ahead or len(self._ahead) >= READ_AHEAD_PAGES:
            return
        task = asyncio.ensure_future(self.store.read(found, after))
        self._reading.add(task)
        task.add_done_callback(self._finished)
        self._ahead[key] = (time.monotonic() + READ_AHEAD_SECONDS, task)

    def _expire(self) -> None:
        """Drop the pages read ahead that nobody asked for in time."""
        now = time.monotonic()
        for key, (deadline, task) in list(self._ahead.items()):
            if deadline <= now:
                del self._ahead[key]
                task.cancel()
                self.gateway.metrics.pages_read_ahead.labels("unused").inc()

    def _finished(self, task: asyncio.Task[Page]) -> None:
        """A read ahead ended. One that failed fails again when asked for (the request
        reads anew), or is dropped: its error is not the event loop's to report."""
        self._reading.discard(task)
        if not task.cancelled():
            task.exception()

    def poke(self) -> None:
        """Sweep soon (a stream was deleted or found expired)."""
        self._poke.set()

    async def _sweep(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._poke.wait(), SWEEP_SECONDS)
            except TimeoutError:
                pass
            self._poke.clear()
            self._expire()
            try:
                await self.store.sweep()
            except Exception as error:  # the next run tries again
                log.warning("durable streams: the sweep failed: %s", error)

    async def close(self) -> None:
        tasks: list[asyncio.Task[Any]] = list(self._reading)
        self._ahead.clear()
        for task in tasks:
            task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            tasks.append(self._sweeper)
        await asyncio.gather(*tasks, return_exceptions=True)
