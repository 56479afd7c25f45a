"""The endpoint that appends events to a stream: one transaction per request, and a retry
of the same events is answered as such, not stored twice.

A body is decoded once, by orjson, and its events go to PostgreSQL as one jsonb array
(`prepare_json`), without an object or a JSON text of their own per event. Whatever that
path does not vouch for, the general one takes, as it always did: `json.loads`,
`NewEvent.from_json`, the engine's `append`; so both answer the same, errors included.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from subengine.gateway._http import (
    ApiError,
    bad_request,
    json_response,
    path_stream,
    read_body,
    refuse_unknown_fields,
)
from subengine.gateway._state import gateway_of
from subengine.model._errors import InvalidInput
from subengine.model._events import Appended, NewEvent
from subengine.model._json import fast_loads
from subengine.model._tracing import (
    carried_context,
    current_context,
    tracing_installed,
    with_context,
)
from subengine.streams._append_async import append_json_async
from subengine.streams._append_json import prepare_json


async def append_events(request: Request) -> Response:
    """Append a JSON array of events, or `{"events": [...], "expected_version": ...}`, in
    one transaction: 201 when any event was stored now, 200 when every one was stored
    before (a retry), with where each event is. A `traceparent` header (W3C Trace Context)
    goes into the metadata of events that carry none (docs/tracing.md)."""
    gateway = gateway_of(request)
    stream = path_stream(request)
    (await gateway.auth.principal(request)).require(stream, "append")
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        # a browser sends a cross-origin POST of another type without asking first (no
        # CORS preflight); a write must not be one
        raise ApiError(
            415, "unsupported_media_type", "send the events as Content-Type: application/json"
        )
    engine = gateway.engine
    text = await read_body(request, gateway.config.max_body_bytes)
    try:
        body = fast_loads(text)
    except ValueError:
        pass  # the general path decodes it, or names what is wrong
    else:
        given, expected_version = _append_request(body, request)
        params = prepare_json(stream, given, expected_version, engine.settings)
        if params is not None:
            async with engine.connection(autocommit=True) as conn:  # one statement
                return _answer(await append_json_async(conn, params, engine.settings))
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        raise bad_request("the body is not JSON") from None
    given, expected_version = _append_request(body, request)
    events = []
    for index, fields in enumerate(given):
        try:
            events.append(NewEvent.from_json(fields))
        except InvalidInput as error:
            raise ApiError(400, "bad_event", f"event {index}: {error}") from None
    return _answer(await engine.append(stream, events, expected_version))


def _append_request(body: Any, request: Request) -> tuple[list[Any], Any]:
    """The events and expected version of an append's body (checked by the engine), with
    the request's trace context in their metadata."""
    if isinstance(body, list):
        events, expected_version = body, None
    elif isinstance(body, dict):
        refuse_unknown_fields(body, ("events", "expected_version"))
        if not isinstance(body.get("events"), list):
            raise bad_request('expected {"events": [...], "expected_version": ...}')
        events, expected_version = body["events"], body.get("expected_version")
    else:
        raise bad_request('expected an array of events or {"events": [...]}')
    if not events:
        raise bad_request("the append holds no event")
    return _with_request_context(events, request), expected_version


def _with_request_context(events: list[Any], request: Request) -> list[Any]:
    """The events with the W3C trace context of the request's headers in the metadata of
    each one that carries none (docs/tracing.md), where OpenTelemetry is installed. What
    is no event object, or has metadata that is no object, is left for the append to
    name."""
    if not tracing_installed():
        return events
    # a gateway that traces itself (opentelemetry-instrument) has a span of the request
    context = current_context() or carried_context(request.headers)
    if context is None:
        return events
    carried = []
    for event in events:
        if isinstance(event, dict) and isinstance(event.get("metadata"), dict | None):
            event = {**event, "metadata": with_context(event.get("metadata"), context)}
        carried.append(event)
    return carried


def _answer(stored: Sequence[Appended]) -> Response:
    appended = [
        {
            "partition": a.partition,
            "position": a.position,
            "id": a.id,  # orjson writes a UUID as str() does
            "key_version": a.key_version,
            "duplicate": a.duplicate,
        }
        for a in stored
    ]
    every_one_stored_before = all(a.duplicate for a in stored)
    text = orjson.dumps({"appended": appended}).decode()
    return json_response(text, 200 if every_one_stored_before else 201)
