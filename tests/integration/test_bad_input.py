"""Bad input gets a clear error naming the problem, and changes nothing."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from helpers import snapshot, stored_events

import subengine
from subengine import NewEvent

HOSTILE_NAMES = [
    "orders'; DROP TABLE subengine.events; --",
    'orders"',
    "or ders",
    "",
    "-orders",
    "x" * 10_000,
    "orders\n",
    "ördërs",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_invalid_stream_names_are_refused_everywhere(
    engine: subengine.Engine, stored: str, sql: psycopg.Connection[Any], name: Any
) -> None:
    before = snapshot(sql)
    with pytest.raises(subengine.InvalidInput, match="invalid stream name"):
        engine.create_stream(name, partitions=2)
    with pytest.raises(subengine.InvalidInput, match="invalid stream name"):
        engine.append(name, [NewEvent("k", "T", {})])
    with pytest.raises(subengine.InvalidInput, match="invalid stream name"):
        stored_events(engine.read(name, 0))
    assert snapshot(sql) == before


def test_unknown_stream(
    engine: subengine.Engine, stored: str, sql: psycopg.Connection[Any]
) -> None:
    before = snapshot(sql)
    for call in (
        lambda: engine.append("missing", [NewEvent("k", "T", {})]),
        lambda: stored_events(engine.read("missing", 0)),
        lambda: engine.heads("missing"),
        lambda: stored_events(engine.read_since("missing", datetime.now().astimezone())),
    ):
        with pytest.raises(subengine.StreamNotFound, match="stream 'missing' does not exist"):
            call()
    assert snapshot(sql) == before


def test_unknown_partition(engine: subengine.Engine, stored: str) -> None:
    for partition in (4, -1, 10**6):
        with pytest.raises(subengine.PartitionNotFound, match=r"partitions 0\.\.3"):
            stored_events(engine.read(stored, partition))


@pytest.mark.parametrize("partitions", [0, -1, 4097, True, "4", 2.5])
def test_invalid_partition_counts(
    engine: subengine.Engine, sql: psycopg.Connection[Any], partitions: Any
) -> None:
    before = snapshot(sql)
    with pytest.raises(subengine.InvalidInput, match="partition count"):
        engine.create_stream("new", partitions=partitions)
    assert snapshot(sql) == before


def test_creating_an_existing_stream_is_an_error(
    engine: subengine.Engine, stored: str, sql: psycopg.Connection[Any]
) -> None:
    before = snapshot(sql)
    with pytest.raises(subengine.StreamExists, match="exists already, with 4 partitions"):
        engine.create_stream(stored, partitions=8)
    assert snapshot(sql) == before


DEEP: list[Any] = []
for _ in range(100_000):
    DEEP = [DEEP]

BAD_EVENTS = [
    (NewEvent("k", "T", {1, 2}), "data is not valid JSON"),
    (NewEvent("k", "T", {"x": math.nan}), "data is not valid JSON"),
    (NewEvent("k", "T", object()), "data is not valid JSON"),
    (NewEvent("k", "T", {"x": "a\u0000b"}), "NUL"),
    (NewEvent("k", "T", {}, metadata=[1]), "metadata must be a JSON object"),  # type: ignore[arg-type]
    (NewEvent("", "T", {}), "invalid event key"),
    (NewEvent("k" * 10_000, "T", {}), "invalid event key"),
    (NewEvent("k\x00", "T", {}), "invalid event key"),
    (NewEvent("k", "", {}), "invalid event type"),
    (NewEvent("k", " T", {}), "invalid event type"),
    (NewEvent("k", "T" * 201, {}), "invalid event type"),
    (NewEvent("k", "T", {}, id="not-a-uuid"), "id must be a UUID"),  # type: ignore[arg-type]
    (NewEvent("k", "T", {}, occurred_at=datetime(2020, 1, 1)), "time zone"),
    ({"key": "k", "type": "T", "data": {}}, "not a NewEvent"),
    (NewEvent("k", "T", {"x": "\ud800"}), "data is not valid JSON"),
    (NewEvent("k", "T", DEEP), "nested too deeply"),
    (
        NewEvent("k", "T", {}, occurred_at=datetime(9999, 12, 31, 23, tzinfo=UTC)),
        "must lie between",
    ),
    (NewEvent("k", "T", {}, occurred_at=datetime(1, 1, 1, 1, tzinfo=UTC)), "must lie between"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_EVENTS)
def test_a_bad_event_fails_the_whole_append(
    engine: subengine.Engine, stored: str, sql: psycopg.Connection[Any], bad: Any, message: str
) -> None:
    before = snapshot(sql)
    with pytest.raises(subengine.InvalidEvent, match=message) as caught:
        engine.append(stored, [NewEvent("good", "T", {}), bad])
    assert caught.value.index == 1
    assert str(caught.value).startswith("event 1: ")
    assert snapshot(sql) == before


def test_payload_over_the_limit(dsn: str, sql: psycopg.Connection[Any]) -> None:
    settings = subengine.Settings(dsn=dsn, max_event_bytes=1000)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("orders", partitions=2)
        engine.append("orders", [NewEvent("k", "T", {"s": "x" * 900})])
        before = snapshot(sql)
        with pytest.raises(subengine.InvalidEvent, match="over the limit of 1000"):
            engine.append("orders", [NewEvent("k", "T", {"s": "x" * 1000})])
        assert snapshot(sql) == before


@pytest.mark.parametrize(
    ("expected", "message"),
    [
        (-1, "whole number from 0"),
        (2**70, "whole number from 0"),
        ({"other": 1}, "no event here"),
        ("1", "int or a mapping"),
        ({"k": 1.5}, "whole number from 0"),
    ],
)
def test_invalid_expected_versions(
    engine: subengine.Engine, stored: str, sql: psycopg.Connection[Any], expected: Any, message: str
) -> None:
    before = snapshot(sql)
    with pytest.raises(subengine.InvalidInput, match=message):
        engine.append(stored, [NewEvent("k", "T", {})], expected_version=expected)
    assert snapshot(sql) == before


@pytest.mark.parametrize("limit", [0, -5, True, 10**20])
def test_invalid_read_limits(engine: subengine.Engine, stored: str, limit: Any) -> None:
    with pytest.raises(subengine.InvalidInput, match="limit"):
        stored_events(engine.read(stored, 0, limit=limit))


def test_an_escaped_backslash_before_u0000_is_not_a_nul(
    engine: subengine.Engine, stored: str
) -> None:
    text = "C:\\u0000dir"  # a backslash, then the letters u0000
    [appended] = engine.append(stored, [NewEvent("k", "T", {"path": text})])
    [event] = stored_events(engine.read(stored, appended.partition, after=appended.position - 1))
    assert event.data == {"path": text}


def test_an_autocommit_connection_is_refused_outside_a_transaction(
    engine: subengine.Engine, stored: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    before = snapshot(sql)
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(subengine.InvalidInput, match="autocommit"):
            subengine.append(conn, stored, [NewEvent("k", "T", {})])
        assert snapshot(sql) == before
        with conn.transaction():
            subengine.append(conn, stored, [NewEvent("k", "T", {})])
    assert sum(engine.heads(stored).values()) == 9


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            "append_events('orders', NULL, ARRAY[NULL, 'a'], ARRAY['T', 'T'],"
            " ARRAY['{}', '{}']::jsonb[])",
            "event 1 has no key",
        ),
        (
            "append_events('orders', NULL, ARRAY['a'], ARRAY['T'], ARRAY['{}']::jsonb[],"
            " expected_keys => ARRAY['zz'], expected_versions => ARRAY[5])",
            "every expected key",
        ),
        ("append('orders', 'a', 'T', '{}', occurred_at => 'infinity')", "occurred_at_is_readable"),
        (
            "append_events('orders', NULL, ARRAY['a'], ARRAY['T', 'U'], ARRAY['{}']::jsonb[])",
            "one element per event",
        ),
    ],
)
def test_plain_sql_bad_input_is_refused(
    stored: str,
    sql: psycopg.Connection[Any],
    call: Callable[[psycopg.Connection[Any]], object],
    message: str,
) -> None:
    before = snapshot(sql)
    with pytest.raises(psycopg.Error, match=message):
        sql.execute(f"SELECT * FROM subengine.{call}")  # noqa: S608 (constant test SQL)
    assert snapshot(sql) == before
