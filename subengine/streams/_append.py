"""Appending events to a stream inside the caller's transaction (DESIGN.md, Append flow).

Validation happens here, before any SQL runs, so bad input changes nothing and leaves the
caller's transaction usable. The append itself is one call of the SQL function
`append_events`, which locks the touched partition heads in ascending order, numbers the
events densely, inserts them and sends one notification per partition.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg

from subengine.db._connection import psycopg_connection
from subengine.db._sql import SQL, Query, Result
from subengine.model._errors import (
    EventIdConflict,
    InvalidEvent,
    InvalidInput,
    SchemaNotReady,
    StreamBeingDeleted,
    StreamNotFound,
    SubengineError,
    WrongExpectedVersion,
)
from subengine.model._events import Appended, NewEvent, new_event_ids
from subengine.model._names import (
    BIGINT_MAX,
    EARLIEST,
    LATEST,
    shown_value,
    validate_key,
    validate_stream_name,
    validate_type,
    validate_whole_number,
)
from subengine.model._settings import Settings
from subengine.model._tracing import current_context, with_context

ExpectedVersion = int | Mapping[str, int] | None

# SQLSTATEs raised by the append_events function
STREAM_NOT_FOUND = "SE404"
VERSION_CONFLICT = "SE409"
ID_CONFLICT = "SE410"


# A NUL character as JSON escapes it: \u0000 after an even number of backslashes.
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


# One encoder for every append: `json.dumps` with options builds a new one per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _json(value: Any, what: str) -> tuple[str, int]:
    """The JSON text of `value` and its size in UTF-8 bytes; raises InvalidInput."""
    try:
        text = _ENCODER.encode(value)
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
    except (TypeError, ValueError) as error:  # UnicodeEncodeError: a lone surrogate
        raise InvalidInput(f"{what} is not valid JSON ({error})") from None
    except RecursionError:
        raise InvalidInput(f"{what} is nested too deeply to be JSON") from None
    if "\\u0000" in text and _ESCAPED_NUL.search(text):
        raise InvalidInput(f"{what} contains a NUL character, which PostgreSQL's JSON cannot store")
    return text, size


def _validated(
    event: object, settings: Settings, trace: dict[str, str] | None = None
) -> tuple[str, str]:
    """The JSON texts of a valid event's data and metadata, with the `trace` context
    added to the metadata (docs/tracing.md); raises InvalidInput."""
    if not isinstance(event, NewEvent):
        raise InvalidInput(f"is a {type(event).__name__}, not a NewEvent")
    validate_key(event.key)
    validate_type(event.type)
    if not isinstance(event.metadata, dict | None):
        raise InvalidInput("metadata must be a JSON object (a dict)")
    if event.id is not None and not isinstance(event.id, uuid.UUID):
        raise InvalidInput(f"id must be a UUID, not {type(event.id).__name__}")
    if event.occurred_at is not None:
        if not isinstance(event.occurred_at, datetime) or event.occurred_at.tzinfo is None:
            raise InvalidInput("occurred_at must be a datetime with a time zone")
        if not EARLIEST <= event.occurred_at <= LATEST:
            raise InvalidInput(
                f"occurred_at must lie between {EARLIEST:%Y-%m-%d} and "
                f"{LATEST:%Y-%m-%d} (UTC), not {event.occurred_at.isoformat()}"
            )
    data_text, data_size = _json(event.data, "data")
    metadata = event.metadata if trace is None else with_context(event.metadata, trace)
    metadata_text, metadata_size = ("{}", 2) if not metadata else _json(metadata, "metadata")
    size = data_size + metadata_size
    if size > settings.max_event_bytes:
        raise InvalidInput(
            f"{size} bytes of JSON is over the limit of {settings.max_event_bytes} "
            "(SUBENGINE_MAX_EVENT_BYTES)"
        )
    return data_text, metadata_text


def _expected_versions(
    expected_version: ExpectedVersion, keys: list[str]
) -> tuple[list[str] | None, list[int] | None]:
    if expected_version is None:
        return None, None
    if isinstance(expected_version, int) and not isinstance(expected_version, bool):
        distinct = sorted(set(keys))
        if len(distinct) != 1:
            raise InvalidInput(
                "an integer expected_version needs events of one key; these events have "
                f"{len(distinct)} keys: pass a mapping of key to version"
            )
        expected_version = {distinct[0]: expected_version}
    if not isinstance(expected_version, Mapping):
        raise InvalidInput(
            f"expected_version must be an int or a mapping of key to int, "
            f"not {type(expected_version).__name__}"
        )
    present = set(keys)
    for key, version in expected_version.items():
        if key not in present:
            raise InvalidInput(
                f"expected_version names key {shown_value(key)}, which has no event here"
            )
        validate_whole_number(version, f"expected_version for key {key!r}", 0, BIGINT_MAX)
    return list(expected_version), list(expected_version.values())


def prepare(
    stream: str,
    events: Iterable[NewEvent],
    expected_version: ExpectedVersion,
    settings: Settings,
) -> dict[str, Any]:
    """Validate an append and return the parameters of the append_events query."""
    validate_stream_name(stream)
    if isinstance(events, NewEvent):
        events = [events]
    ids: list[Any] = []
    keys: list[str] = []
    types: list[str] = []
    data: list[str] = []
    metadata: list[str] = []
    occurred: list[Any] = []
    trace = current_context()  # the span current at append, when the application traces
    for index, event in enumerate(events):
        try:
            data_text, metadata_text = _validated(event, settings, trace)
        except InvalidInput as error:
            raise InvalidEvent(index, str(error)) from None
        keys.append(event.key)
        types.append(event.type)
        ids.append(event.id)
        data.append(data_text)
        metadata.append(metadata_text)
        occurred.append(event.occurred_at)
    missing = [index for index, event_id in enumerate(ids) if event_id is None]
    for index, event_id in zip(missing, new_event_ids(len(missing)), strict=True):
        ids[index] = event_id
    expected_keys, expected_values = _expected_versions(expected_version, keys)
    return {
        "stream": stream,
        "ids": ids,
        "keys": keys,
        "types": types,
        "data": data,
        "metadata": metadata,
        "occurred_at": occurred,
        "expected_keys": expected_keys,
        "expected_versions": expected_values,
    }


def translate_error(error: psycopg.Error, stream: str) -> SubengineError | None:
    """The subengine error a database error stands for, if any."""
    if error.sqlstate == STREAM_NOT_FOUND:
        if json.loads(error.diag.message_detail or "{}").get("deleting"):
            return StreamBeingDeleted(stream)
        return StreamNotFound(stream)
    if error.sqlstate == VERSION_CONFLICT:
        detail = json.loads(error.diag.message_detail or "{}")
        return WrongExpectedVersion(stream, detail["key"], detail["expected"], detail["actual"])
    if error.sqlstate == ID_CONFLICT:
        detail = json.loads(error.diag.message_detail or "{}")
        return EventIdConflict(
            stream, detail["id"], detail["key"], detail["type"], stored=detail["stored"]
        )
    if (
        isinstance(error, psycopg.errors.UniqueViolation)
        and error.diag.constraint_name == "event_id_is_unique"
    ):
        # the same id appended at the same time to two partitions (so with two keys)
        return InvalidInput(
            f"an event id of this append was stored at the same time by another "
            f"transaction in stream {stream!r}, for an event of another key; an id names "
            "one event"
        )
    return schema_not_ready(error)


@contextmanager
def subengine_errors(stream: str) -> Iterator[None]:
    """Raise the subengine error a database error stands for, if there is one."""
    try:
        yield
    except psycopg.Error as error:
        translated = translate_error(error, stream)
        if translated is None:
            raise
        raise translated from error


def schema_not_ready(error: psycopg.Error) -> SchemaNotReady | None:
    """SchemaNotReady when `error` says subengine's tables or functions are missing."""
    if isinstance(
        error,
        psycopg.errors.UndefinedTable
        | psycopg.errors.UndefinedFunction
        | psycopg.errors.InvalidSchemaName,
    ):
        return SchemaNotReady(
            f"subengine's schema is missing or out of date ({error.diag.message_primary}); "
            "run `subengine migrate`"
        )
    return None


def _appended(result: Result) -> list[Appended]:
    rows = sorted(result.rows)  # by ordinal: duplicates come back after the events stored now
    return [Appended(row[1], row[2], row[3], row[4], row[5]) for row in rows]


def append_events(params: dict[str, Any]) -> Query[list[Appended]]:
    """The append of events `prepare` checked, in the caller's transaction."""
    stream = params["stream"]
    return Query("append_events", params, _appended, lambda error: translate_error(error, stream))


def append_prepared(
    conn: psycopg.Connection[Any], params: dict[str, Any], settings: Settings
) -> list[Appended]:
    if not params["keys"]:
        return []
    return SQL(settings.schema).run(conn, append_events(params))


def append(
    conn: object,
    stream: str,
    events: Iterable[NewEvent],
    expected_version: ExpectedVersion = None,
    *,
    schema: str | None = None,
    settings: Settings | None = None,
) -> list[Appended]:
    """Append `events` to `stream` inside the caller's open transaction.

    `conn` is a psycopg connection, a SQLAlchemy Connection or a SQLAlchemy Session; the
    events become visible when the caller commits. Returns, per event and in order, where
    it is stored. `expected_version` is the version each key must have before the append
    (an int when every event has the same key, else a mapping of key to version; 0 means
    the key has no event yet); on a mismatch `WrongExpectedVersion` is raised and nothing
    is written. An event whose id is already in the stream is not stored again.
    `schema` (default: SUBENGINE_SCHEMA) and `settings` configure where and what limits;
    pass `engine.settings` to append to an engine's schema.
    """
    settings = settings or Settings.from_env()
    if schema is not None:
        settings = settings.with_changes(schema=schema)
    params = prepare(stream, events, expected_version, settings)
    return append_prepared(psycopg_connection(conn), params, settings)
