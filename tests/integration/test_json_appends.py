"""Appends of events given as JSON (the gateway's): stored as `append` stores the same
events, and append_events takes ids made by its caller without looking them up."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg

import subengine
from subengine.db._sql import SQL
from subengine.model._events import NewEvent
from subengine.streams._append_json import append_json, prepare_json

# data as clients spell it: jsonb keeps no spelling, but a number PostgreSQL reads from
# text other than Python's (1.50, 1e2) would be stored otherwise
EVENTS = json.loads(
    r"""[
 {"key": "a", "type": "T", "data": {"z": 1, "a": [1e2, 1.50, -0.0, 1e-7, 0.1, 1e16, 5e-324]}},
 {"key": "a", "type": "T", "data": {"s": "\u00e9\ud83d\ude00\u2028 \"q\" \\ \/", "d": 1, "d": 2},
  "metadata": {"m": "\u0041"}},
 {"key": "b\u00e9", "type": "T", "data": null, "metadata": null},
 {"key": "b", "type": "T", "data": "text", "metadata": {},
  "id": "{0190A2B3-C4D5-7E6F-8A9B-0C1D2E3F4A5B}", "occurred_at": "2026-01-02t03:04:05.1234567z"},
 {"key": "c", "type": "T", "data": [[], {}, true, false, 0, 18446744073709551615]}
]"""
)
STORED = """
SELECT key, key_version, type, data::text, metadata::text, partition, position,
       nullif(occurred_at, recorded_at)  -- the time given, if any
  FROM subengine.events WHERE stream = %s ORDER BY partition, position"""


def rows(sql: psycopg.Connection[Any], stream: str) -> list[tuple[Any, ...]]:
    return sql.execute(STORED, (stream,)).fetchall()


def test_what_prepare_json_sends_is_stored_as_append_stores_it(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("general", partitions=3)
    engine.create_stream("json", partitions=3)
    engine.append("general", [NewEvent.from_json(event) for event in EVENTS])
    params = prepare_json("json", EVENTS, None, engine.settings)
    assert params is not None
    with engine.connection() as conn:
        stored = SQL(engine.schema).run(conn, append_json(params))
    assert rows(sql, "json") == rows(sql, "general")
    assert [a.key_version for a in stored] == [1, 2, 1, 1, 1]
    assert str(stored[3].id) == "0190a2b3-c4d5-7e6f-8a9b-0c1d2e3f4a5b"
    made = [a.id for n, a in enumerate(stored) if n != 3]
    assert {(i.version, i.variant) for i in made} == {(7, uuid.RFC_4122)}
    # a retry of the given id stores nothing again, and points at the stored event
    params = prepare_json("json", EVENTS[3:4], None, engine.settings)
    assert params is not None
    with engine.connection() as conn:
        (again,) = SQL(engine.schema).run(conn, append_json(params))
    assert again.duplicate and again.position == stored[3].position


def test_append_events_stores_the_ids_made_by_its_caller(
    orders: str, sql: psycopg.Connection[Any]
) -> None:
    given, made = uuid.uuid4(), uuid.uuid4()
    call = """
    SELECT ordinal, id, duplicate FROM subengine.append_events(
        'orders', %s::uuid[], ARRAY['a', 'b', 'c'], ARRAY['T', 'T', 'T'],
        ARRAY['1', '2', '3']::jsonb[], generated_ids => %s::uuid[]) ORDER BY ordinal"""
    first = sql.execute(call, ([None, given, None], [made, None, None])).fetchall()
    assert first[0] == (1, made, False) and first[1] == (2, given, False)
    assert first[2][1] not in (given, made) and first[2][1].version == 4  # made by the function
    again = sql.execute(call, ([None, given, None], [uuid.uuid4(), None, None])).fetchall()
    assert [row[2] for row in again] == [False, True, False]
    assert again[1][1] == given
    assert sql.execute("SELECT count(*) FROM subengine.events").fetchone() == (5,)
    bad = [uuid.uuid4()]
    try:
        sql.execute(call, ([None, None, None], bad))
    except psycopg.errors.InvalidParameterValue as error:
        assert "one element per event" in str(error)
    else:
        raise AssertionError("generated_ids of another length were taken")
