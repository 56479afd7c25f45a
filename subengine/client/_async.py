"""`AsyncReader`: `Reader` for asyncio, on the same core (only the I/O differs)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from contextlib import aclosing
from datetime import datetime
from types import TracebackType

import httpx

from subengine.client._core import (
    CURSOR_HEADER,
    PAGE_LIMIT,
    Call,
    Mode,
    ReadCore,
    Reconnect,
    Resume,
    SseParser,
    StreamOptions,
    Unavailable,
    WatchCore,
    selection_of,
)
from subengine.client._http import new_async_client
from subengine.client._items import Item
from subengine.model._json import loads

log = logging.getLogger("subengine.client")


class AsyncReader:
    """`Reader` for asyncio: every event of `stream` after a cursor, exactly once, then
    live, for as long as it is iterated with `async for`.

    It pulls pages until up to date, then follows the gateway's event stream (SSE) from
    the same cursor; it reconnects with backoff and jitter, treats twice the heartbeat
    of silence as a dead connection, and long-polls for a while when event streams keep
    dying young (`Reconnect`). Items are `Event`, `Tombstone` (a gap retention made) and
    `Reset` (the stream was created again). After each item, `cursor` is where the
    reader stands: store it with the item's effects and start the next reader with
    `after=cursor`.

    `after` is a cursor, "beginning" (the default) or "now"; `since` a time instead.
    `keys` and `types` filter; `include_data=False` reads metadata only, and `fields`
    only the fields it names (with each event's stream and place; docs/gateway.md);
    `follow=False` ends the iteration once caught up instead of going live. `api_key` is
    sent as `Authorization: Bearer`. `client`, when given, is used and left open.
    """

    def __init__(
        self,
        base_url: str,
        stream: str,
        *,
        after: str | None = None,
        since: str | datetime | None = None,
        keys: Iterable[str] = (),
        types: Iterable[str] = (),
        include_data: bool = True,
        fields: Iterable[str] | None = None,
        follow: bool = True,
        api_key: str | None = None,
        heartbeat: float = 15.0,
        page_limit: int | None = PAGE_LIMIT,
        long_poll_wait: float = 30.0,
        timeout: float = 30.0,
        reconnect: Reconnect | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        core = ReadCore(
            stream,
            selection_of(keys, types, include_data, fields),
            after=after,
            since=since,
            api_key=api_key,
            heartbeat=heartbeat,
            page_limit=page_limit,
            long_poll_wait=long_poll_wait,
            timeout=timeout,
            reconnect=reconnect or Reconnect(),
        )
        self._setup(core, base_url, follow, client)

    @classmethod
    def watch(
        cls,
        base_url: str,
        streams: Mapping[str, StreamOptions],
        *,
        after: str | None = None,
        api_key: str | None = None,
        heartbeat: float = 15.0,
        timeout: float = 30.0,
        reconnect: Reconnect | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> AsyncReader:
        """A reader of several streams at once, on one connection (a watch): each
        stream from its `StreamOptions`, or all from `after`, the cursor of an earlier
        watch of the same streams. Items and cursor are as for one stream; the gateway
        catches a watch up itself, and a watch has no long-poll to fall back to."""
        core = WatchCore(
            streams,
            after=after,
            api_key=api_key,
            heartbeat=heartbeat,
            timeout=timeout,
            reconnect=reconnect or Reconnect(),
        )
        reader = cls.__new__(cls)
        reader._setup(core, base_url, True, client)
        return reader

    def _setup(
        self, core: ReadCore, base_url: str, follow: bool, client: httpx.AsyncClient | None
    ) -> None:
        self._core = core
        self._base_url = base_url.rstrip("/")
        self._owns_client = client is None
        self._client = client or new_async_client()
        self._follow_live = follow
        self._stop = asyncio.Event()

    @property
    def cursor(self) -> str | None:
        """Where the reader stands after the last item it handed out (None until the
        gateway answered, when it started without a cursor)."""
        return self._core.delivered

    @property
    def up_to_date(self) -> bool:
        """Whether the reader has caught up with the stream at least once."""
        return self._core.up_to_date

    @property
    def mode(self) -> Mode:
        """How it reads now: "pages" (catching up), "sse" or "long-poll"."""
        return self._core.mode(time.monotonic())

    def stop(self) -> None:
        """End the iteration (from the reader's event loop): at the next frame,
        heartbeat or long-poll answer, or at once if it is waiting to reconnect.
        Cancelling the iterating task ends it at once."""
        self._stop.set()

    async def close(self) -> None:
        self._stop.set()
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> AsyncReader:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def __aiter__(self) -> AsyncIterator[Item]:
        core = self._core
        while not self._stop.is_set():
            if core.up_to_date and not self._follow_live:
                return
            call = core.next_call(time.monotonic())
            try:
                if call.create is not None:
                    await self._create(call)
                    continue
                items = self._follow(call) if call.mode == "sse" else self._pull(call)
                # closed at once when the caller stops iterating, so that its connection
                # does not wait for the garbage collector
                async with aclosing(items):
                    async for item in items:
                        yield item
                continue
            except Resume as resume:
                log.info("the gateway ended the event stream (%s); resuming", resume)
                if resume.code == "rotate":
                    continue
                delay = core.failed()
            except Unavailable as unavailable:
                delay = core.failed(unavailable.retry_after)
                log.warning("the gateway answered %s; again in %.1fs", unavailable.status, delay)
            except (httpx.TransportError, ValueError, KeyError) as error:
                # ValueError and KeyError: an answer cut short or mangled on the way
                delay = core.failed()
                log.warning("reading %s failed (%r); again in %.1fs", call.path, error, delay)
            try:
                await asyncio.wait_for(self._stop.wait(), delay)
            except TimeoutError:
                pass

    async def _create(self, call: Call) -> None:
        response = await self._client.post(
            self._base_url + call.path,
            json=call.create,
            headers=call.headers,
            timeout=self._timeout(call),
        )
        self._core.check(response.status_code, response.headers, response.content)
        self._core.created(response.json())

    def _timeout(self, call: Call) -> httpx.Timeout:
        return httpx.Timeout(self._core.timeout, read=call.read_timeout)

    async def _pull(self, call: Call) -> AsyncGenerator[Item, None]:
        core = self._core
        response = await self._client.get(
            self._base_url + call.path,
            params=call.params,
            headers=call.headers,
            timeout=self._timeout(call),
        )
        core.check(response.status_code, response.headers, response.content)
        if response.status_code == 204:
            core.succeeded()
            core.no_news(response.headers.get(CURSOR_HEADER))
            return
        batch = core.page(loads(response.content))
        core.succeeded()
        for item, cursor in batch:
            core.delivered = cursor
            yield item

    async def _follow(self, call: Call) -> AsyncGenerator[Item, None]:
        core = self._core
        async with self._client.stream(
            "GET",
            self._base_url + call.path,
            params=call.params,
            headers=call.headers,
            timeout=self._timeout(call),
        ) as response:
            if response.status_code >= 400:
                core.check(response.status_code, response.headers, await response.aread())
            opened = time.monotonic()
            delivered = rotated = left = False
            parser = SseParser()
            try:
                async for line in response.aiter_lines():
                    frame = parser.feed(line)
                    if frame is not None and frame.kind != ":":
                        batch = core.frame(frame.kind, frame.data, frame.id)
                        if batch:
                            core.succeeded()
                            delivered = True
                        for item, cursor in batch:
                            core.delivered = cursor
                            yield item
                    if self._stop.is_set():
                        left = True
                        return
                raise Resume("closed", "the event stream ended without a word")
            except GeneratorExit:
                left = True
                raise
            except Resume as resume:
                rotated = resume.code == "rotate"
                raise
            finally:
                if not left:
                    now = time.monotonic()
                    core.sse_ended(now - opened, delivered, rotated, now)
