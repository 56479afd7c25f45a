"""Reading a Durable Streams stream (docs/durable-streams.md): a catch-up page, a long-poll
and server-sent events.

Live reads wait on the gateway's hub (DESIGN.md, the gateway's first principle: push
only wakes, the database is the truth): a watcher of the stream's engine partition wakes
when an append, or a close (an event too), moves its head, or when the stream is
deleted; the reader then reads the catalog and the messages after its offset again, in
one statement for a JSON stream that is no fork.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Send

from subengine.gateway._auth import Principal
from subengine.gateway._connections import LONG_POLL, PULL, SSE, Slot
from subengine.gateway._ds_http import (
    CACHEABLE,
    CLOSED,
    CURSOR,
    FLOOR,
    GAP_FROM,
    GAP_TO,
    NEXT_OFFSET,
    NO_STORE,
    SECURITY_HEADERS,
    SSE_ENCODING,
    UP_TO_DATE,
    DsError,
    Offset,
    parse_offset,
    response_cursor,
    text_response,
)
from subengine.gateway._ds_state import DurableStreamsState
from subengine.gateway._hub import Watcher
from subengine.gateway._sse import Blocked, EventStream, Gone, HeldOpen
from subengine.model._errors import DatabaseUnavailable
from subengine.outside._durable_streams import CatalogStream, media_type

log = logging.getLogger("subengine.gateway")

# Seconds an SSE response stays open before the server ends it (PROTOCOL.md 10.2: about
# a minute, so that caches can collapse readers); the client resumes from its offset.
SSE_LIFETIME = 60.0


def _start(found: CatalogStream, at: Offset) -> int:
    """The position a read starts after. A fork's offsets up to its fork point are its
    source's (docs/durable-streams.md, "Forks")."""
    if at.kind == "beginning":
        return max(found.floor - 1, 0)
    if at.kind == "now":
        return found.tail
    kind = found.check_offset(at.epoch, at.position)
    if kind == "gone":
        raise DsError(410, "the offset is of an earlier stream at this path, deleted since")
    if kind == "foreign":
        raise DsError(400, "the offset is of the stream this one forks, past the fork point")
    if kind != "ok":
        raise DsError(400, "the offset is beyond the stream's tail: use one it returned")
    _check_floor(found, at.position)
    return at.position


def _check_floor(found: CatalogStream, after: int) -> None:
    """410 when retention removed messages right after position `after`."""
    if after < found.floor - 1:
        headers = {
            FLOOR: found.offset_at(found.floor - 1),
            GAP_FROM: str(after + 1),
            GAP_TO: str(found.floor - 1),
        }
        raise DsError(410, "retention removed the messages after this offset", headers)


async def _read(
    state: DurableStreamsState, path: str, found: CatalogStream, after: int
) -> list[tuple[int, Any]]:
    """The messages after `after`; 410 when retention removed some of them since `found`
    was looked up. A catalog stream's messages have dense positions, so a page that
    does not start right after `after` says to look at the floor again."""
    messages = await state.read(found, after)
    if _dense(found, after, messages):
        return messages
    fresh = await state.lookup(path)
    if fresh is not None and not _replaced(found, fresh):
        _check_floor(fresh, after)
    return messages


def _dense(found: CatalogStream, after: int, messages: list[tuple[int, Any]]) -> bool:
    """Whether `messages`, read after `after` up to `found`'s tail, need no look at the
    floor: they start right after `after`, or are of a view (which reads tombstones), a
    fork (whose sources are held), or a read at the tail."""
    if found.view or found.inherited or after >= found.tail:
        return True
    return bool(messages) and messages[0][0] == after + 1


async def _look_again(
    state: DurableStreamsState, path: str, found: CatalogStream, after: int
) -> tuple[CatalogStream, list[tuple[int, Any]]]:
    """After a wake-up: the stream at `path` again and its messages after `after` (one
    statement for a JSON stream that is no fork); 404 when it was deleted since, 410
    when retention removed messages right after `after`."""
    again, messages = await state.lookup_and_read(path, found, after)
    if again is None or _replaced(found, again):
        raise DsError(404, f"the stream at {path!r} was deleted")
    if messages is None:
        return again, await _read(state, path, again, after)
    if not _dense(again, after, messages):
        _check_floor(again, after)  # the catalog row is of the messages' snapshot
    return again, messages


def _binary(found: CatalogStream) -> bool:
    kind = media_type(found.content_type)
    return not (kind.startswith("text/") or kind == "application/json")


def _body(found: CatalogStream, messages: list[tuple[int, Any]]) -> bytes:
    if found.json:
        return ("[" + ",".join(text for _, text in messages) + "]").encode()
    return b"".join(bytes(body) for _, body in messages)


async def read_stream(
    state: DurableStreamsState, request: Request, principal: Principal, path: str
) -> Any:
    """GET of a stream: a page, a long-poll or an event stream."""
    params = request.query_params
    live = params.get("live")
    if live not in (None, "long-poll", "sse"):
        raise DsError(400, f"live must be long-poll or sse, not {live[:32]!r}")
    offsets = params.getlist("offset")
    if live is not None and not offsets:
        raise DsError(400, f"live={live} needs an offset (-1 for the beginning)")
    at = parse_offset(offsets)
    gateway = state.gateway
    found = await state.lookup(path, touch=True)
    if found is None:
        raise DsError(404, f"no stream at {path!r}")
    if found.deleted:
        raise DsError(410, f"the stream at {path!r} is deleted; forks of it still read it")
    after = _start(found, at)
    cursor = params.get("cursor")
    if live == "sse":
        if gateway.closing.is_set():
            # Between the stop signal and the listener's close the server still takes
            # requests. An event stream started now would end at once, which reads as a
            # connection a proxy cuts short: the official TypeScript client gives up SSE
            # after three in a row, and its fallback then ends the read as if the stream
            # were done. A 503 it retries after Retry-After, on whatever answers then.
            # Nothing yields from here until the response is among the open streams the
            # shutdown ends: a stream is either refused here or ended by it.
            raise DsError(503, "the gateway is shutting down", {"Retry-After": "1"})
        slot = gateway.connections.admit(SSE, principal.id)
        return DsEventStream(state, path, found, after, cursor, slot)
    if live == "long-poll":
        slot = gateway.connections.admit(LONG_POLL, principal.id)
        try:
            return await _long_poll(state, request, path, found, after, cursor)
        finally:
            slot.release()
    slot = gateway.connections.admit(PULL, principal.id)
    try:
        return await _page(state, request, path, found, after, at)
    finally:
        slot.release()


async def _page(
    state: DurableStreamsState,
    request: Request,
    path: str,
    found: CatalogStream,
    after: int,
    at: Offset,
) -> Response:
    headers = {"Content-Type": found.content_type}
    if at.kind == "now":
        headers |= {NEXT_OFFSET: found.offset_at(after), UP_TO_DATE: "true"}
        if found.closed:
            headers[CLOSED] = "true"
        return text_response(200, b"[]" if found.json else b"", headers)
    messages = await _read(state, path, found, after)
    last = messages[-1][0] if messages else after
    up_to_date = last >= found.tail
    headers[NEXT_OFFSET] = found.offset_at(last)
    if up_to_date:
        headers[UP_TO_DATE] = "true"
    elif messages:
        state.read_ahead(found, last)
    at_end = up_to_date and found.closed
    if at_end:
        headers[CLOSED] = "true"
    etag = f'"{found.epoch}:{after}:{last}{":c" if at_end else ""}"'
    headers["ETag"] = etag
    headers["Cache-Control"] = CACHEABLE if messages else NO_STORE
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={**SECURITY_HEADERS, **headers})
    body = _body(found, messages)
    state.gateway.metrics.sent(PULL, None, len(body))
    return text_response(200, body, headers)


async def _long_poll(
    state: DurableStreamsState,
    request: Request,
    path: str,
    found: CatalogStream,
    after: int,
    cursor: str | None,
) -> Response:
    """The messages after `after` as soon as there are any; 204 when the wait ends, or
    at once at the tail of a closed stream."""
    gateway = state.gateway
    watcher = Watcher({found.stream: frozenset({found.partition})})
    gateway.hub.add(watcher)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    closing = asyncio.ensure_future(gateway.closing.wait())
    deadline = time.monotonic() + state.long_poll_timeout
    try:
        watcher.take()
        messages = await _read(state, path, found, after)
        while True:
            if messages:
                last = messages[-1][0]
                headers = {
                    "Content-Type": found.content_type,
                    NEXT_OFFSET: found.offset_at(last),
                    CURSOR: response_cursor(cursor),
                    "Cache-Control": CACHEABLE,
                }
                if last >= found.tail:
                    headers[UP_TO_DATE] = "true"
                    if found.closed:
                        headers[CLOSED] = "true"
                body = _body(found, messages)
                gateway.metrics.sent(LONG_POLL, None, len(body))
                return text_response(200, body, headers)
            if found.closed:
                headers = {NEXT_OFFSET: found.offset_at(after), UP_TO_DATE: "true"}
                return text_response(204, b"", {**headers, CLOSED: "true"})
            left = deadline - time.monotonic()
            if left <= 0 or gone.done() or closing.done():
                break
            woken = asyncio.ensure_future(watcher.event.wait())
            try:
                await asyncio.wait(
                    {woken, gone, closing}, timeout=left, return_when="FIRST_COMPLETED"
                )
            finally:
                woken.cancel()
            woke = watcher.event.is_set()
            # what moves from now on wakes the next wait
            watcher.take()
            if woke:
                found, messages = await _look_again(state, path, found, after)
            else:
                messages = await _read(state, path, found, after)
    finally:
        gone.cancel()
        closing.cancel()
        gateway.hub.remove(watcher)
    headers = {
        NEXT_OFFSET: found.offset_at(after),
        UP_TO_DATE: "true",
        CURSOR: response_cursor(cursor),
    }
    return text_response(204, b"", headers)


def _replaced(found: CatalogStream, again: CatalogStream) -> bool:
    """Whether the stream a live read follows was deleted (softly too) since."""
    return again.deleted or (again.stream, again.epoch) != (found.stream, found.epoch)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _data_event(found: CatalogStream, messages: list[tuple[int, Any]]) -> str:
    body = _body(found, messages)
    if _binary(found):
        return f"event: data\ndata:{base64.b64encode(body).decode()}\n\n"
    text = body.decode("utf-8", errors="replace")
    # every line ending of the text ends a `data:` line: the text can never end the
    # event or start another one (CR, LF and CRLF all end a line in SSE)
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    # `data:` then the line; a line that starts with a space keeps it (a reader drops one
    # space after the colon)
    return "event: data\n" + "".join(_data_line(line) for line in lines) + "\n"


def _data_line(line: str) -> str:
    return f"data: {line}\n" if line.startswith(" ") else f"data:{line}\n"


def _control(fields: dict[str, Any]) -> str:
    return f"event: control\ndata:{json.dumps(fields, separators=(',', ':'))}\n\n"


class DsEventStream(HeldOpen):
    """The SSE answer of a stream: a `data` event per page of messages, each followed by
    a `control` event with the next offset; then new messages as they are appended,
    until the stream is closed (a last control says so), deleted, or the response's
    lifetime ends."""

    def __init__(
        self,
        state: DurableStreamsState,
        path: str,
        found: CatalogStream,
        after: int,
        cursor: str | None,
        slot: Slot,
    ) -> None:
        self.state = state
        self.path = path
        self.found = found
        self.after = after
        self.cursor = cursor
        self.slot = slot

    async def serve(self, receive: Receive, send: Send) -> None:
        gateway = self.state.gateway
        watcher = Watcher({self.found.stream: frozenset({self.found.partition})})
        stream = EventStream(receive, send, watcher.event, gateway.config.write_timeout)
        gateway.open_streams.add(stream)
        gateway.watch_writes()
        headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *((k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()),
        ]
        if _binary(self.found):
            headers.append((SSE_ENCODING.lower().encode(), b"base64"))
        try:
            if gateway.closing.is_set():
                stream.close()
            gateway.hub.add(watcher)
            await stream.start(headers)
            await self._run(stream, watcher)
        except (Gone, Blocked):
            pass
        except (DatabaseUnavailable, DsError) as error:
            # the client resumes from its last offset (and learns then what is wrong)
            log.warning("durable streams: an event stream ended: %s", error)
        finally:
            gateway.open_streams.discard(stream)
            gateway.metrics.sent(SSE, None, stream.bytes_sent)
            self.slot.release()
            gateway.hub.remove(watcher)
            await stream.end()

    async def _run(self, stream: EventStream, watcher: Watcher) -> None:
        found, after = self.found, self.after
        ends = time.monotonic() + SSE_LIFETIME
        first = True
        watcher.take()
        try:
            messages = await _read(self.state, self.path, found, after)
        except DsError:
            return  # retention passed the reader: reconnecting from its offset says 410
        while True:
            data = ""
            if messages:
                after = messages[-1][0]
                data = _data_event(found, messages)
            up_to_date = after >= found.tail
            if messages or first or (up_to_date and found.closed):
                # a data event and its control event go in one write
                first = False
                control: dict[str, Any] = {"streamNextOffset": found.offset_at(after)}
                if up_to_date and found.closed:
                    # the end: no cursor, no reconnection (PROTOCOL.md 5.8)
                    ending = {**control, "streamClosed": True, "upToDate": True}
                    await stream.write(data + _control(ending))
                    return
                control["streamCursor"] = response_cursor(self.cursor)
                if up_to_date:
                    control["upToDate"] = True
                await stream.write(data + _control(control))
            try:
                if up_to_date:
                    if not await self._wait(stream, watcher, ends):
                        return
                    found, messages = await _look_again(self.state, self.path, found, after)
                else:
                    messages = await _read(self.state, self.path, found, after)
            except DsError:
                # deleted (or expired), or retention passed the reader: reconnecting
                # from its offset says 404 or 410
                return

    async def _wait(self, stream: EventStream, watcher: Watcher, ends: float) -> bool:
        """Wait for the stream's partition to move, with a heartbeat comment after each
        quiet spell; False when the response should end (shutdown, lifetime)."""
        heartbeat = self.state.gateway.config.heartbeat
        while True:
            now = time.monotonic()
            if stream.closing or now >= ends:
                return False
            await stream.wait(min(ends - now, heartbeat))
            changed, resync = watcher.take()
            if changed or resync:
                return True
            if not stream.closing and time.monotonic() < ends:
                await stream.write(": hb\n\n")
