"""The endpoints that read streams: the list of streams, one stream's partitions and
cursor, and its events by page, by long-poll or as an event stream."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from subengine.gateway._auth import Denied
from subengine.gateway._connections import LONG_POLL, PULL, SSE
from subengine.gateway._http import (
    CURSOR_HEADER,
    NO_STORE,
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
from subengine.gateway._reading import Reader, Selection
from subengine.gateway._sse_response import (
    EventStreamResponse,
    open_event_stream,
    released_on_error,
)
from subengine.gateway._state import Gateway, gateway_of
from subengine.model._gateway_cursor import GatewayCursor, StreamPosition
from subengine.model._names import validate_key, validate_type


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
    wait = 0.0
    if live == "long-poll":
        wait = parse_number(
            request.query_params.get("wait"),
            "wait",
            0,
            gateway.config.max_wait,
            gateway.config.default_wait,
        )
    slot = gateway.connections.admit(PULL if live is None else LONG_POLL, principal.id)
    try:
        start = await gateway.start_of(stream, request)
        reader = Reader(gateway.hub, {stream: selection}, {stream: start})
        if live is None:
            events, tombstones, up_to_date = await reader.page(stream, limit)
            answer = _page(reader, events, tombstones, up_to_date)
        else:
            answer = await _long_poll(gateway, request, reader, stream, limit, wait)
    finally:
        slot.release()
    gateway.metrics.sent(slot.kind, None, len(answer.body))
    return answer


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


async def _long_poll(
    gateway: Gateway, request: Request, reader: Reader, stream: str, limit: int, wait: float
) -> Response:
    """A page as soon as anything after the cursor exists, or 204 when `wait` ends or
    the client leaves (noticed at once: a client gone holds no slot)."""
    deadline = time.monotonic() + wait
    watcher = await gateway.watcher(reader.selections)
    gateway.hub.add(watcher)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        while True:
            watcher.take()  # what moves from now on wakes the wait below
            events, tombstones, up_to_date = await reader.page(stream, limit)
            if events or tombstones or reader.frames_out:
                return _page(reader, events, tombstones, up_to_date)
            left = deadline - time.monotonic()
            if left <= 0 or gateway.closing.is_set() or gone.done():
                break
            if up_to_date:
                closing = asyncio.ensure_future(gateway.closing.wait())
                woken = asyncio.ensure_future(watcher.event.wait())
                gateway.metrics.long_polls_waiting.inc()
                try:
                    await asyncio.wait(
                        {woken, closing, gone}, timeout=left, return_when="FIRST_COMPLETED"
                    )
                finally:
                    gateway.metrics.long_polls_waiting.dec()
                    woken.cancel()
                    closing.cancel()
    finally:
        gone.cancel()
        gateway.hub.remove(watcher)
    cursor = reader.cursor.encode()
    return Response(
        status_code=204,
        headers={"Cache-Control": NO_STORE, CURSOR_HEADER: cursor, UP_TO_DATE_HEADER: "true"},
    )


async def _disconnected(receive: Receive) -> None:
    """Return once the client has disconnected (a GET's body is read on the way)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _selection(request: Request, stream: str) -> Selection:
    params = request.query_params
    return Selection(
        stream,
        keys=parse_names(params.getlist("key"), "key", validate_key),
        types=parse_names(params.getlist("type"), "type", validate_type),
        include_data=parse_flag(params.get("include_data"), "include_data", True),
    )
