"""Appending events to a stream inside the caller's transaction (DESIGN.md, Append flow).

Validation happens here, before any SQL runs, so bad input changes nothing and leaves the
caller's transaction usable. The append itself is one call of the SQL function
`append_events`, which locks the touched partition heads in ascending order, numbers the
events densely, inserts them and sends one notification per partition.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import psycopg

from subengine._connection import psycopg_connection
from subengine._errors import (
    InvalidEvent,
    InvalidInput,
    SchemaNotReady,
    StreamNotFound,
    SubengineError,
    WrongExpectedVersion,
)
from subengine._events import Appended, NewEvent, new_event_id
from subengine._names import validate_key, validate_stream_name, validate_type
from subengine._queries import query
from subengine._settings import Settings

ExpectedVersion = int | Mapping[str, int] | None

STREAM_NOT_FOUND = "SE404"
VERSION_CONFLICT = "SE409"


def _json(value: Any, what: str) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as error:
        raise InvalidInput(f"{what} is not valid JSON ({error})") from None
    if "\\u0000" in text:
        raise InvalidInput(f"{what} contains a NUL character, which PostgreSQL's JSON cannot store")
    return text


def _validated(event: object, settings: Settings) -> tuple[str, str]:
    """The JSON texts of a valid event's data and metadata; raises InvalidInput."""
    if not isinstance(event, NewEvent):
        raise InvalidInput(f"is a {type(event).__name__}, not a NewEvent")
    validate_key(event.key)
    validate_type(event.type)
    if not isinstance(event.metadata, dict | None):
        raise InvalidInput("metadata must be a JSON object (a dict)")
    if event.id is not None and not isinstance(event.id, uuid.UUID):
        raise InvalidInput(f"id must be a UUID, not {type(event.id).__name__}")
    if event.occurred_at is not None and (
        not isinstance(event.occurred_at, datetime) or event.occurred_at.tzinfo is None
    ):
        raise InvalidInput("occurred_at must be a datetime with a time zone")
    data_text = _json(event.data, "data")
    metadata_text = _json({} if event.metadata is None else event.metadata, "metadata")
    size = len(data_text.encode()) + len(metadata_text.encode())
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
            raise InvalidInput(f"expected_version names key {key!r}, which has no event here")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise InvalidInput(
                f"expected_version for key {key!r} must be a whole number >= 0, not {version!r}"
            )
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
    for index, event in enumerate(events):
        try:
            data_text, metadata_text = _validated(event, settings)
        except InvalidInput as error:
            raise InvalidEvent(index, str(error)) from None
        keys.append(event.key)
        types.append(event.type)
        ids.append(new_event_id() if event.id is None else event.id)
        data.append(data_text)
        metadata.append(metadata_text)
        occurred.append(event.occurred_at)
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
        return StreamNotFound(stream)
    if error.sqlstate == VERSION_CONFLICT:
        detail = json.loads(error.diag.message_detail or "{}")
        return WrongExpectedVersion(stream, detail["key"], detail["expected"], detail["actual"])
    return schema_not_ready(error)


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


def append_prepared(
    conn: psycopg.Connection[Any], params: dict[str, Any], settings: Settings
) -> list[Appended]:
    if not params["keys"]:
        return []
    try:
        rows = conn.execute(query(settings.schema, "append_events"), params).fetchall()
    except psycopg.Error as error:
        translated = translate_error(error, params["stream"])
        if translated is None:
            raise
        raise translated from error
    rows.sort()  # by ordinal: duplicates come back after the events stored now
    return [Appended(row[1], row[2], row[3], row[4], row[5]) for row in rows]


def append(
    conn: object,
    stream: str,
    events: Iterable[NewEvent],
    expected_version: ExpectedVersion = None,
    *,
    settings: Settings | None = None,
) -> list[Appended]:
    """Append `events` to `stream` inside the caller's open transaction.

    `conn` is a psycopg connection, a SQLAlchemy Connection or a SQLAlchemy Session; the
    events become visible when the caller commits. Returns, per event and in order, where
    it is stored. `expected_version` is the version each key must have before the append
    (an int when every event has the same key, else a mapping of key to version; 0 means
    the key has no event yet); on a mismatch `WrongExpectedVersion` is raised and nothing
    is written. An event whose id is already in the stream is not stored again.
    """
    settings = settings or Settings.from_env()
    params = prepare(stream, events, expected_version, settings)
    return append_prepared(psycopg_connection(conn), params, settings)
