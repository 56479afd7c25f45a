"""Appending events given as JSON objects, as the gateway decodes them from a request body.

`prepare_json` checks them by the rules of `NewEvent.from_json` and `prepare`, and the
statement `append_json` sends them to PostgreSQL as one jsonb array, which it unpacks
into append_events' arguments: no NewEvent, no JSON text of its own per event, no array
of ids built in Python (issue 26's profile of 500-event appends over HTTP: decoding them
into objects and encoding each event's data again was 45 % of the gateway's CPU).

`prepare_json` vouches only for what it checks by exactly those rules with little work.
For anything else it returns None and the caller takes the general path (`NewEvent.
from_json`, then `append`), which answers as it always did: an error to name, an event
near the size limit, maybe a NUL character, data orjson cannot write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from psycopg.types.json import Jsonb

from subengine.db._sql import Query
from subengine.model._errors import InvalidInput
from subengine.model._events import (
    EVENT_FIELDS,
    OPTIONAL_EVENT_FIELDS,
    Appended,
    NewEvent,
    new_event_id_bytes,
)
from subengine.model._names import (
    EARLIEST,
    LATEST,
    validate_key,
    validate_stream_name,
    validate_type,
)
from subengine.model._settings import Settings
from subengine.streams._append import (
    ExpectedVersion,
    _appended,
    _expected_versions,
    translate_error,
)

_REQUIRED = frozenset(EVENT_FIELDS)
_KNOWN = _REQUIRED | frozenset(OPTIONAL_EVENT_FIELDS)
# orjson escapes a NUL character so; whether it is one (not an escaped backslash before
# "u0000") the general path finds out
_MAYBE_NUL = b"\\u0000"


def prepare_json(
    stream: str,
    events: Sequence[Any],
    expected_version: ExpectedVersion,
    settings: Settings,
) -> dict[str, Any] | None:
    """The parameters of the `append_json` statement for `events`, JSON values as orjson
    decodes them, or None: take the general path. Raises InvalidInput as `prepare` does
    for a bad stream name or expected_version (what it checks after the events)."""
    validate_stream_name(stream)
    packed = _packed(events, settings)
    if packed is None:
        return None
    params, keys = packed
    expected_keys, expected_values = _expected_versions(expected_version, keys)
    return {
        "stream": stream,
        **params,
        "expected_keys": expected_keys,
        "expected_versions": expected_values,
    }


def json_events(events: Sequence[Any], settings: Settings) -> dict[str, Any] | None:
    """The parameters of the `json_events` part for `events`, as `prepare_json` checks
    them (None: take the general path), for a statement that names the stream itself."""
    packed = _packed(events, settings)
    return None if packed is None else packed[0]


def _packed(events: Sequence[Any], settings: Settings) -> tuple[dict[str, Any], list[str]] | None:
    """The `json_events` parameters of `events` and their keys, or None."""
    sent: list[Any] | None = None  # events as sent, where an id or a time was rewritten
    keys: list[str] = []
    for index, event in enumerate(events):
        if type(event) is not dict or not _KNOWN.issuperset(event) or not _REQUIRED <= event.keys():
            return None
        key = event["key"]
        try:
            validate_key(key)
            validate_type(event["type"])
        except InvalidInput:
            return None
        if len(event) > len(_REQUIRED):
            metadata = event.get("metadata")
            if metadata is not None and type(metadata) is not dict:
                return None
            if event.get("id") is not None or event.get("occurred_at") is not None:
                rewritten = _with_id_and_time_rewritten(event)
                if rewritten is None:
                    return None
                sent = sent or list(events)
                sent[index] = rewritten
        keys.append(key)
    sent = sent or list(events)
    try:
        payload = orjson.dumps(sent)
    except orjson.JSONEncodeError:  # nested deeper than the 254 levels orjson writes
        return None
    if _MAYBE_NUL in payload or not _every_event_fits(sent, payload, settings.max_event_bytes):
        return None
    params = {
        "events": Jsonb(payload, dumps=_as_it_is),
        "new_ids": new_event_id_bytes(len(sent)),
    }
    return params, keys


def append_json(params: dict[str, Any]) -> Query[list[Appended]]:
    """The append of events `prepare_json` checked, in the caller's transaction: its
    result and errors are `append_events`'."""
    stream = params["stream"]
    return Query("append_json", params, _appended, lambda error: translate_error(error, stream))


def _with_id_and_time_rewritten(event: dict[str, Any]) -> dict[str, Any] | None:
    """`event` with its id as str(UUID) and its time as isoformat writes it (what
    PostgreSQL reads exactly as the general path's UUID and datetime), or None."""
    try:
        parsed = NewEvent.from_json(event)
    except InvalidInput:
        return None
    rewritten = dict(event)
    if parsed.id is not None:
        rewritten["id"] = str(parsed.id)
    if parsed.occurred_at is not None:
        if not EARLIEST <= parsed.occurred_at <= LATEST:
            return None
        rewritten["occurred_at"] = parsed.occurred_at.isoformat()
    return rewritten


def _every_event_fits(events: list[dict[str, Any]], payload: bytes, limit: int) -> bool:
    """Whether the general path takes every event's size: the UTF-8 JSON of its data and
    metadata ("{}" when it has none), as the standard library's encoder writes it, at
    most `limit` bytes.

    That text differs from orjson's only in how a float is written ("1e-05" and
    "0.00001"), at most 25 % longer (tried on every power of ten and 300,000 random
    doubles): so orjson's sizes up to 4/5 of the limit are taken by both, and the general
    path decides the rest. `payload`, the whole array, is longer than any event's."""
    if 5 * len(payload) <= 4 * limit:
        return True
    for event in events:
        metadata = event.get("metadata")
        size = len(orjson.dumps(event["data"])) + (len(orjson.dumps(metadata)) if metadata else 2)
        if 5 * size > 4 * limit:
            return False
    return True


def _as_it_is(payload: bytes) -> bytes:
    return payload
