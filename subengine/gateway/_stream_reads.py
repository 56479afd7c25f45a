"""The endpoints that read streams: the list of streams, one stream's partitions and
cursor, and its events by page, by long-poll or as an event stream."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from subengine.gateway._auth import Denied
from subengine.gateway._connections import LONG_POLL, PULL, SSE
from subengine.gateway._http import (
    CURSOR_HEADER,
    NO_STORE,
    SUPERSEDED_HEADER,
    UP_TO_DATE_HEADER,
    bad_request,
    json_response,
    parse_flag,
    parse_names,
    parse_number,
    parse_whole,
    path_stream,
)
from subengine.gateway._hub import dumps
from subengine.gateway._reading import PAGE_BYTES, Reader, Selection
from subengine.gateway._sse_response import (
    EventStreamResponse,
    open_event_stream,
    released_on_error,
)
from subengine.gateway._state import Gateway, gateway_of
from subengine.model._event_fields import read_fields, split_fields
from subengine.model._gateway_cursor import GatewayCursor, StreamPosition
from subengine.model._names import validate_key, validate_type
from subengine.streams._read import EncodedPage

# A subscriber's session id, which a long-poll may name (docs/gateway.md, "Long-poll").
SESSION = re.compile(r"[A-Za-z0-9._~-]{1,128}")


async def list_streams(request: Request) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.auth.principal(request)
    if principal.key is not None and "read" not in principal.key.scopes:
        raise Denied(403, "forbidden", "this key may not read streams")
    streams = [s for s in await gateway.engine.streams() if principal.may(s.name, "read")]
    return json_response(
        {
            "streams": [
                {"name": s.name, "partitions": s.partitions, "epoch": s.epoch} for s in streams
            ]
        }
    )


async def show_stream(request: Request) -> Response:
    gateway = gateway_of(request)
    stream = path_stream(request)
    (await gateway.auth.principal(request)).require(stream, "read")
    found = await gateway.read_engine.stream(stream)
    states = await gateway.read_engine.partitions(stream)
    heads = tuple(state.head for state in states)
    now = GatewayCursor({stream: StreamPosition(found.epoch, heads)})
    return json_response(
        {
            "name": found.name,
            "epoch": found.epoch,
            "retention": found.retention,
            "partitions": [
                {
                    "partition": state.partition,
                    "head": state.head,
                    "head_time": None if state.head_time is None else state.head_time.isoformat(),
                    "floor": state.floor,
                }
                for state in states
            ],
            "cursor": now.encode(),
        }
    )


async def read_events(request: Request) -> Response | EventStreamResponse:
    gateway = gateway_of(request)
    stream = path_stream(request)
    principal = await gateway.auth.principal(request)
    principal.require(stream, "read")
    live = request.query_params.get("live")
    if live not in (None, "long-poll", "sse"):
        raise bad_request(f"live must be long-poll or sse, not {live[:32]!r}")
    selection = _selection(request, stream)
    if live == "sse":
        heartbeat = parse_number(
            request.query_params.get("heartbeat"), "heartbeat", 1, 60, gateway.config.heartbeat
        )
        slot = gateway.connections.admit(SSE, principal.id)
        with released_on_error(slot):
            start = await gateway.start_of(stream, request)
            return await open_event_stream(
                gateway, {stream: selection}, {stream: start}, heartbeat, principal, slot
            )
    limit = parse_whole(
        request.query_params.get("limit"),
        "limit",
        1,
        gateway.config.max_page_limit,
        gateway.config.page_limit,
    )
    if request.headers.get("last-event-id"):
        raise bad_request("Last-Event-ID is for live=sse; give the cursor as after=")
    if live == "long-poll":
        answer = await _long_poll_request(gateway, request, principal.id, stream, selection, limit)
        gateway.metrics.sent(LONG_POLL, None, len(answer.body))
        return answer
    slot = gateway.connections.admit(PULL, principal.id)
    try:
        start = await gateway.start_of(stream, request)
        reader = Reader(gateway.hub, {stream: selection}, {stream: start})
        ahead = await _page_read_ahead(gateway, selection, limit, start)
        taken = await reader.page(stream, limit, ahead=ahead)
        answer = _page(reader, taken.events, taken.tombstones, taken.up_to_date)
        if not taken.up_to_date:
            # the reader asks for the next page as soon as it has taken in this one
            after = reader.cursor.streams[stream]
            gateway.reads_ahead.start(
                _ahead_key(selection, limit, after), reader.read_ahead(stream, limit)
            )
    finally:
        slot.release()
    gateway.metrics.sent(PULL, None, len(answer.body))
    return answer


def _ahead_key(
    selection: Selection, limit: int, after: StreamPosition
) -> tuple[str, Selection, int, StreamPosition]:
    """The key of a pull's page among the pages read ahead: what it reads, from where."""
    return ("v1", selection, limit, after)


async def _page_read_ahead(
    gateway: Gateway, selection: Selection, limit: int, start: StreamPosition
) -> EncodedPage | None:
    """The page read ahead for a pull from `start`, if there is one and its stream is
    still the one it was read from: a stream deleted (and maybe created again) since is
    read anew, which says so (404, or a reset)."""
    page: EncodedPage | None = await gateway.reads_ahead.take(_ahead_key(selection, limit, start))
    if page is None:
        return None
    found = await gateway.read_engine.epochs_and_heads([selection.stream])
    epoch, heads = found.get(selection.stream, (None, None))
    return page if epoch == page.epoch and heads is not None else None


def _page(
    reader: Reader, events: list[str], tombstones: list[dict[str, Any]], up_to_date: bool
) -> Response:
    cursor = reader.cursor.encode()
    resets = [json.loads(frame.data) for frame in reader.take_frames() if frame.kind == "reset"]
    body = (
        f'{{"events":[{",".join(events)}],"tombstones":{dumps(tombstones)},'
        f'"resets":{dumps(resets)},"cursor":{dumps(cursor)},'
        f'"up_to_date":{"true" if up_to_date else "false"}}}'
    )
    return json_response(
        body,
        headers={CURSOR_HEADER: cursor, UP_TO_DATE_HEADER: "true" if up_to_date else "false"},
    )


@dataclass(frozen=True, slots=True)
class Gathering:
    """When a long-poll answers (docs/gateway.md, "Long-poll"): as soon as `min_events`
    events are there (at most `limit`), or `linger` seconds after the first one arrived
    (None: no such bound), or when `wait` ends; a tombstone or a reset at once."""

    wait: float
    limit: int
    min_events: int
    linger: float | None


def _gathering(request: Request, gateway: Gateway, limit: int) -> Gathering:
    params, config = request.query_params, gateway.config
    wait = parse_number(params.get("wait"), "wait", 0, config.max_wait, config.default_wait)
    linger = params.get("linger")
    lingers = None if linger is None else parse_number(linger, "linger", 0, config.max_wait, 0)
    # with a linger time, a reply gathers up to a full page unless told fewer
    most = limit if lingers is not None else 1
    min_events = parse_whole(params.get("min_events"), "min_events", 1, limit, most)
    return Gathering(wait, limit, min_events, lingers)


def _session(request: Request) -> str | None:
    session = request.query_params.get("session")
    if session is not None and SESSION.fullmatch(session) is None:
        raise bad_request(
            f"session must be 1 to 128 letters, digits, '.', '_', '~' or '-', not {session[:32]!r}"
        )
    return session


async def _long_poll_request(
    gateway: Gateway,
    request: Request,
    principal: str,
    stream: str,
    selection: Selection,
    limit: int,
) -> Response:
    """A long-poll, the only one in flight of its session (if it names one)."""
    gathering = _gathering(request, gateway, limit)
    session = _session(request)
    poll = await gateway.sessions.enter(principal, session) if session is not None else None
    try:
        slot = gateway.connections.admit(LONG_POLL, principal)
        try:
            start = await gateway.start_of(stream, request)
            reader = Reader(gateway.hub, {stream: selection}, {stream: start})
            superseded = None if poll is None else poll.superseded
            return await _long_poll(gateway, request, reader, stream, gathering, superseded)
        finally:
            slot.release()
    finally:
        if poll is not None and session is not None:
            gateway.sessions.leave(principal, session, poll)


async def _long_poll(
    gateway: Gateway,
    request: Request,
    reader: Reader,
    stream: str,
    gathering: Gathering,
    superseded: asyncio.Event | None,
) -> Response:
    """A page once the gathering says so, or 204 when `wait` ends with nothing, the
    client leaves (noticed at once: a client gone holds no slot) or a newer long-poll of
    the session supersedes this one (204 from where this one started)."""
    started = reader.cursor.encode()
    now = time.monotonic()
    deadline = answer_by = now + gathering.wait
    watcher = await gateway.watcher(reader.selections, page_reads=True)
    gateway.hub.add(watcher)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    ended = [gone, asyncio.ensure_future(gateway.closing.wait())]
    if superseded is not None:
        ended.append(asyncio.ensure_future(superseded.wait()))
    events: list[str] = []
    size = 0  # bytes of the events' JSON joined by commas
    tombstones: list[dict[str, Any]] = []
    up_to_date = True
    # the last read found the stream up to date: read what moved, shared. A long-poll
    # at every head the hub knows (sent again with the cursor of the last answer)
    # starts so, without a page, when it waits at least a head poll's interval: what
    # was committed before it is then notified, or found by that poll, in time
    live = gathering.wait >= gateway.config.poll_interval and reader.at_known_heads(stream)
    try:
        while True:
            # what moves from now on wakes the wait below
            changed, resync = watcher.take()
            # what a reply gathers stays within one page's bytes: a later read adds only
            # what fits beside what is there (and a comma), nothing beside an event that
            # came alone over them
            room = max(PAGE_BYTES - size - 1, 0) if events else PAGE_BYTES
            if live and not resync:
                taken = await reader.live_page(
                    stream,
                    (partition for name, partition in changed if name == stream),
                    watcher.partitions.get(stream),
                    gathering.limit - len(events),
                    room,
                    oversize=not events,
                )
            else:  # the first read, or after a resync (the stream may be a new one)
                taken = await reader.page(
                    stream, gathering.limit - len(events), room, oversize=not events
                )
            live = taken.up_to_date
            now = time.monotonic()
            if taken.events and not events and gathering.linger is not None:
                answer_by = min(now + gathering.linger, deadline)
            if taken.events:
                size += taken.size + 1 if events else taken.size
                events += taken.events
            tombstones += taken.tombstones
            up_to_date = taken.up_to_date
            if tombstones or reader.frames_out or len(events) >= gathering.min_events or taken.full:
                return _page(reader, events, tombstones, up_to_date)
            if now >= answer_by or any(task.done() for task in ended):
                break
            if up_to_date:
                woken = asyncio.ensure_future(watcher.event.wait())
                gateway.metrics.long_polls_waiting.inc()
                try:
                    await asyncio.wait(
                        {woken, *ended}, timeout=answer_by - now, return_when="FIRST_COMPLETED"
                    )
                finally:
                    gateway.metrics.long_polls_waiting.dec()
                    woken.cancel()
    finally:
        for task in ended:
            task.cancel()
        gateway.hub.remove(watcher)
    headers = {"Cache-Control": NO_STORE, UP_TO_DATE_HEADER: "true"}
    if superseded is not None and superseded.is_set():
        # what this one gathered is the newer one's to send
        gateway.metrics.long_polls_superseded.inc()
        return Response(
            status_code=204, headers={**headers, CURSOR_HEADER: started, SUPERSEDED_HEADER: "true"}
        )
    if events:
        return _page(reader, events, tombstones, up_to_date)
    return Response(status_code=204, headers={**headers, CURSOR_HEADER: reader.cursor.encode()})


async def _disconnected(receive: Receive) -> None:
    """Return once the client has disconnected (a GET's body is read on the way)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _selection(request: Request, stream: str) -> Selection:
    params = request.query_params
    flag = params.get("include_data")
    return Selection(
        stream,
        keys=parse_names(params.getlist("key"), "key", validate_key),
        types=parse_names(params.getlist("type"), "type", validate_type),
        fields=read_fields(
            split_fields(params.getlist("fields")) if "fields" in params else None,
            None if flag is None else parse_flag(flag, "include_data", True),
        ),
    )
