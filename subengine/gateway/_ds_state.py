"""A gateway's Durable Streams state (docs/durable-streams.md): the storage, and the
sweeper that deletes expired streams and the engine streams of deleted ones."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from subengine.engine._durable_streams import DurableStreams
from subengine.gateway._ds_views import read_view, view_of, view_stream
from subengine.gateway._state import Gateway
from subengine.outside._durable_streams import CatalogStream

log = logging.getLogger("subengine.gateway")

# seconds between two runs of the sweeper (expired streams, deleted streams' events)
SWEEP_SECONDS = 1.0


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

    async def read(self, found: CatalogStream, after: int) -> list[tuple[int, Any]]:
        """The messages of `found` after position `after`: a page bounded by bytes."""
        if found.view:
            return await read_view(self.gateway.read_engine, found, after, self.max_page_bytes)
        return await self.store.read(found, after)

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
