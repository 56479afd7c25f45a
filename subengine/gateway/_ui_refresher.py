"""The status page's one reader of the database per gateway process: while any page is
open, a single task reads the status snapshot every REFRESH_SECONDS and wakes every page,
which then sends the view it shows, encoded once per version for all pages that see the
same (docs/status-page.md). Twenty open pages cost what one costs: one status query per
refresh. With no page open, nothing is read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from subengine.gateway._ui_views import Board, Visibility, view

log = logging.getLogger("subengine.gateway")

# Seconds between two reads of the snapshot while a page is open.
REFRESH_SECONDS = 1.0
# A read that takes long spaces the next one out: it starts at least this many times the
# read's duration after the last one started, so the page never keeps a connection of
# the database busy more than a quarter of the time.
_SPACING = 4.0
# Seconds the refresher waits for a page to come back (a reload, a click to another
# view) before it stops; its history stays for the next one.
IDLE_SECONDS = 30.0
# Views encoded per version at most (a page per key and subscription, say).
_ENCODED_PER_VERSION = 256


class PageWake:
    """What wakes an open page: set at every new version (and by the page's own event
    stream when its client leaves or the server stops)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass(eq=False)
class Published:
    """One snapshot as the pages see it: its `version` (1, 2, ... one per read), the
    database's time of it, its data (None until a read succeeded), and `error`, why the
    last read failed, if it did (the data is then the last good one)."""

    version: int
    taken_at: str | None
    data: dict[str, Any] | None
    error: str | None
    board: Board
    _encoded: dict[tuple[Any, ...], bytes] = field(default_factory=dict)

    def encoded(self, visibility: Visibility, name: str, subscription: str | None) -> bytes:
        """View `name` for a page of `visibility`, as JSON: made once per version for
        every page that sees the same."""
        cache_key = (visibility.cache_key, name, subscription)
        found = self._encoded.get(cache_key)
        if found is not None:
            return found
        body: dict[str, Any] = {
            "version": self.version,
            "taken_at": self.taken_at,
            "refresh": REFRESH_SECONDS,
            "error": self.error,
            "view": name,
        }
        if self.data is not None:
            body.update(view(self.data, self.board, visibility, name, subscription))
        text = orjson.dumps(body)
        if len(self._encoded) < _ENCODED_PER_VERSION:
            self._encoded[cache_key] = text
        return text


class Refresher:
    """Reads the snapshot with `read` while pages wait on it, and publishes each read to
    them. A page `join`s with an event, which is set at every new version, and `leave`s.
    `poke` reads again at once (after an action). `queries` counts the reads begun."""

    def __init__(
        self,
        read: Callable[[], Awaitable[str]],
        closing: asyncio.Event,
        interval: float = REFRESH_SECONDS,
        idle: float = IDLE_SECONDS,
    ) -> None:
        self._read = read
        self._closing = closing
        self._interval = interval
        self._idle = idle
        self._pages: set[PageWake] = set()
        self._poked = asyncio.Event()
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._board = Board()
        self._data: dict[str, Any] | None = None
        self._read_at = 0.0
        self._reading = False
        self.queries = 0
        self.latest: Published | None = None

    @property
    def pages(self) -> int:
        """The pages (event streams and waiting long-polls) following the snapshots."""
        return len(self._pages)

    def join(self, page: PageWake) -> None:
        """Wake `page` at every new version from now on; a snapshot older than the
        refresh interval is read again at once, unless a read is under way: that one
        wakes the page, and asking for another would bring the next read forward (a
        page opening during every read would halve the interval)."""
        self._pages.add(page)
        self._arrived.set()
        loop = asyncio.get_running_loop()
        stale = self.latest is None or loop.time() - self._read_at >= self._interval
        if stale and not self._reading:
            self._poked.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="subengine-gateway-status-page")

    def current(self) -> Published | None:
        """The latest snapshot to show; None while it is older than two refresh
        intervals and a new read is on its way (a page that comes back after a pause
        waits a moment for that one, rather than draw old news)."""
        latest = self.latest
        if latest is None:
            return None
        age = asyncio.get_running_loop().time() - self._read_at
        if age > 2 * self._interval and (self._poked.is_set() or self._reading):
            return None
        return latest

    def leave(self, page: PageWake) -> None:
        self._pages.discard(page)

    def poke(self) -> None:
        """Read again now (an action changed something)."""
        self._poked.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing.is_set():
            if not self._pages:
                self._arrived.clear()
                if not await _wait_for(self._arrived, self._idle):
                    if not self._pages:
                        return
                continue
            started = loop.time()
            self._poked.clear()
            self._reading = True
            try:
                await self._refresh()
            finally:
                self._reading = False
            self._read_at = started
            took = loop.time() - started
            # never two reads back to back, even when asked (pages that come back, an
            # action): at least half an interval between the end of one and the next
            rest = max(self._interval / 2, (_SPACING - 1) * took)
            await asyncio.sleep(rest)
            await _wait_for(self._poked, max(self._interval, _SPACING * took) - took - rest)

    async def _refresh(self) -> None:
        self.queries += 1
        error: str | None = None
        try:
            text = await self._read()
            self._data = self._board.add(orjson.loads(text))
        except asyncio.CancelledError:
            raise
        except Exception as failure:
            error = f"the status could not be read: {failure}"
            if self.latest is None or self.latest.error != error:
                log.warning("status page: %s", error)
        version = 1 if self.latest is None else self.latest.version + 1
        taken_at = None if self._data is None else self._data["taken_at"]
        self.latest = Published(version, taken_at, self._data, error, self._board)
        for page in list(self._pages):
            page.set()


async def _wait_for(event: asyncio.Event, timeout: float) -> bool:
    """Whether `event` was set within `timeout` seconds."""
    try:
        await asyncio.wait_for(event.wait(), max(timeout, 0.0))
    except TimeoutError:
        return False
    return True
