"""The Spark source's range read in this process, without Spark: what PostgreSQL sends is
decoded into exactly the stored events, however awkward their text, however large, and
however the read is cut into batches (tests/acceptance/test_spark.py reads through Spark)."""

from __future__ import annotations

import logging
from collections.abc import Generator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from helpers import wait_for

import subengine
from subengine import NewEvent

pytest.importorskip("pyspark", reason="PySpark is not installed: pip install -e '.[spark]'")

import pyarrow as pa

from subengine.spark import _store

SCHEMA = "subengine"
STREAM = "reads"

Row = tuple[Any, ...]


@pytest.fixture
def stream(engine: subengine.Engine) -> str:
    engine.create_stream(STREAM, partitions=2)
    return STREAM


def stored_rows(sql: psycopg.Connection[Any], partition: int) -> list[Row]:
    """The partition's events as PostgreSQL writes them as text, in position order."""
    return sql.execute(
        "SELECT stream, partition, position, id::text, key, key_version, type, data::text,"
        " metadata::text, occurred_at, recorded_at FROM subengine.events"
        " WHERE stream = %s AND partition = %s ORDER BY position",
        (STREAM, partition),
    ).fetchall()


def batches(
    dsn: str, partition: int, after: int, upto: int
) -> Generator[pa.RecordBatch, None, None]:
    return _store.read_range(dsn, SCHEMA, STREAM, partition, after, upto, True)


def read_rows(dsn: str, partition: int, after: int, upto: int) -> list[Row]:
    rows: list[Row] = []
    for batch in batches(dsn, partition, after, upto):
        assert batch.schema == _store.ARROW_SCHEMA
        rows += [tuple(row.values()) for row in batch.to_pylist()]
    return rows


def read_everything(engine: subengine.Engine, sql: psycopg.Connection[Any]) -> None:
    """Reads every partition, whole and in two ranges, and compares with PostgreSQL's text."""
    for partition, head in engine.heads(STREAM).items():
        stored = stored_rows(sql, partition)
        assert len(stored) == head
        assert read_rows(engine.dsn, partition, 0, head) == stored
        middle = head // 2
        halves = read_rows(engine.dsn, partition, 0, middle)
        halves += read_rows(engine.dsn, partition, middle, head)
        assert halves == stored


AWKWARD_TEXT = [
    "quotes \" and ' and a comma, a semicolon;",
    "back\\slash \\\\ and \\n not a newline",
    "a newline\n, a tab\t, a carriage return\r, a form feed\f, a bell\x07",
    "ünïcödé ✓ 漢字 😀 and a separator JSON allows raw: \u2028 \u2029 \u0085",
    "",
    "N",
    "\\N",
]


def awkward_events() -> list[NewEvent]:
    zones = [UTC, timezone(timedelta(hours=5, minutes=30)), timezone(timedelta(hours=-11))]
    events = []
    for n, text in enumerate(AWKWARD_TEXT):
        events.append(
            NewEvent(
                key=f"ключ-{n}-\\-\"'-,;-😀",
                type=f'Type "{n}", ✓',
                data={"text": text, text or "empty": [text, n, n / 3, None, True], "n": n},
                metadata={"source": text, "ünïcödé": {"nested": [text]}},
                occurred_at=datetime(2026, 3, 4, 5, 6, 7, 890123, tzinfo=zones[n % 3]),
            )
        )
    events += [
        NewEvent("no-metadata", "T", {"a": 1}, metadata=None),
        NewEvent("json-null", "T", None),
        NewEvent("json-string", "T", 'just a string with "quotes" and \\ and \n'),
        NewEvent("json-number", "T", -12.5e-7),
        NewEvent("json-array", "T", [[], {}, "", 0]),
        NewEvent("earliest", "T", {}, occurred_at=datetime(1, 1, 2, tzinfo=UTC)),
        NewEvent("latest", "T", {}, occurred_at=datetime(9999, 12, 30, tzinfo=UTC)),
        NewEvent("before-2000", "T", {}, occurred_at=datetime(1999, 12, 31, 23, 59, 59, 1, UTC)),
        NewEvent("before-1970", "T", {}, occurred_at=datetime(1969, 7, 20, 20, 17, 40, 5, UTC)),
    ]
    return events


def test_awkward_events_arrive_exactly_as_stored(
    engine: subengine.Engine, sql: psycopg.Connection[Any], stream: str
) -> None:
    engine.append(stream, awkward_events())
    read_everything(engine, sql)


def test_events_larger_than_a_batch_arrive_whole_and_in_order(
    engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    stream: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes = [10, 70_000, 3, 200_000, 1, 1, 150_000, 5]
    engine.append(
        stream,
        [
            NewEvent(f"k{n % 3}", "Big", {"blob": "é✓" * size, "n": n}, metadata={"n": n})
            for n, size in enumerate(sizes * 3)
        ],
    )
    monkeypatch.setattr(_store, "BATCH_BYTES", 100_000)
    for partition, head in engine.heads(stream).items():
        if head:
            assert len(list(batches(engine.dsn, partition, 0, head))) > 1
    read_everything(engine, sql)


def test_many_small_events_arrive_across_batches(
    engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    stream: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine.append(stream, [NewEvent(f"k{n}", "T", {"n": n}) for n in range(3_000)])
    monkeypatch.setattr(_store, "BATCH_BYTES", 10_000)
    read_everything(engine, sql)


def test_an_empty_range_reads_nothing(engine: subengine.Engine, stream: str) -> None:
    engine.append(stream, [NewEvent("k", "T", {})])
    partition = subengine.partition_for("k", 2)
    assert list(batches(engine.dsn, partition, 1, 1)) == []
    assert list(batches(engine.dsn, 1 - partition, 0, 0)) == []


def test_a_range_missing_a_position_fails_rather_than_return_fewer_events(
    engine: subengine.Engine, sql: psycopg.Connection[Any], stream: str
) -> None:
    engine.append(stream, [NewEvent("k", "T", {"n": n}) for n in range(10)])
    partition = subengine.partition_for("k", 2)
    sql.execute(
        "DELETE FROM subengine.events WHERE stream = %s AND partition = %s AND position = %s",
        (stream, partition, 10),
    )
    with pytest.raises(subengine.SubengineError, match="hold 9 events, not 10"):
        read_rows(engine.dsn, partition, 0, 10)
    sql.execute(
        "DELETE FROM subengine.events WHERE stream = %s AND partition = %s AND position = %s",
        (stream, partition, 4),
    )
    with pytest.raises(subengine.SubengineError, match="positions must be dense"):
        read_rows(engine.dsn, partition, 0, 10)


def spark_connections(sql: psycopg.Connection[Any]) -> int:
    row = sql.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'subengine-spark'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_read_stopped_after_its_first_batch_ends_its_statement_and_connection(
    engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    stream: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine.append(stream, [NewEvent("k", "T", {"n": n, "pad": "x" * 500}) for n in range(2_000)])
    monkeypatch.setattr(_store, "BATCH_BYTES", 10_000)
    partition = subengine.partition_for("k", 2)
    reading = batches(engine.dsn, partition, 0, 2_000)
    first = next(reading)
    assert 0 < first.num_rows < 2_000
    assert spark_connections(sql) == 1
    with caplog.at_level(logging.WARNING):
        reading.close()
    assert caplog.records == []
    wait_for(lambda: spark_connections(sql) == 0, "the read's connection to end")
