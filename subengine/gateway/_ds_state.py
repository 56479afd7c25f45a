"""A gateway's Durable Streams state (docs/durable-streams.md): the storage, and the
sweeper that deletes expired streams and the engine streams of deleted ones."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

from subengine.engine._durable_streams import DurableStreams
from subengine.gateway._ds_views import read_view, view_of, view_stream
from subengine.gateway._state import Gateway
from subengine.outside._durable_streams import CatalogStream

log = logging.getLogger("subengine.gateway")

# seconds between two runs of the sweeper (expired streams, deleted streams' events)
SWEEP_SECONDS = 1.0

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
        page: Page | None = await self.gateway.reads_ahead.take(_ahead_key(found, after))
        return await self.store.read(found, after) if page is None else page

    def read_ahead(self, found: CatalogStream, after: int) -> None:
        """Start reading the page of `found` after `after`, which the reader of the page
        that ends there will ask for next. The page is of the stream as it is now: the
        request that takes it gets messages up to this tail, the same page it would have
        read a moment earlier, and reads on from its end."""
        if found.view or found.inherited or after >= found.tail:
            return
        read = partial(self.store.read, found, after)
        self.gateway.reads_ahead.start(_ahead_key(found, after), read)

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
            try:
                await self.store.sweep()
            except Exception as error:  # the next run tries again
                log.warning("durable streams: the sweep failed: %s", error)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)


def _ahead_key(found: CatalogStream, after: int) -> tuple[str, str, int, int]:
    """The key of the page of `found` after position `after`, among pages read ahead."""
    return ("durable-streams", found.stream, found.epoch, after)
