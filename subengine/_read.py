"""Reading streams: by position within a partition, by time across partitions, and heads.

Positions are the cursor a subscriber keeps (DESIGN.md, "Pull for outsiders"): events of a
partition after position p come back in position order, and none that commits later is
ever skipped. Reads by time are for finding a starting point, not for catching up.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from subengine._errors import InvalidInput, PartitionNotFound, StreamNotFound
from subengine._events import Event, PartitionState, Stream
from subengine._names import (
    BIGINT_MAX,
    INTEGER_MAX,
    validate_stream_name,
    validate_whole_number,
)
from subengine._queries import query


def _limit(limit: int) -> int:
    return validate_whole_number(limit, "limit", 1, BIGINT_MAX)


def _events(rows: list[tuple[Any, ...]]) -> list[Event]:
    # rows carry the stream's partition count first; a stream with no events in range
    # comes back as one row of NULL event columns
    return [Event(*row[1:]) for row in rows if row[1] is not None]


def read_after(
    conn: psycopg.Connection[Any], schema: str, stream: str, partition: int, after: int, limit: int
) -> list[Event]:
    validate_stream_name(stream)
    validate_whole_number(after, "after", 0, BIGINT_MAX)
    validate_whole_number(partition, "partition", -INTEGER_MAX, INTEGER_MAX)
    rows = conn.execute(
        query(schema, "read_after"),
        {"stream": stream, "partition": partition, "after": after, "limit": _limit(limit)},
    ).fetchall()
    if not rows:
        raise StreamNotFound(stream)
    partitions = rows[0][0]
    if not 0 <= partition < partitions:
        raise PartitionNotFound(stream, partition, partitions)
    return _events(rows)


def read_since(
    conn: psycopg.Connection[Any], schema: str, stream: str, since: datetime, limit: int
) -> list[Event]:
    validate_stream_name(stream)
    if not isinstance(since, datetime) or since.tzinfo is None:
        raise InvalidInput(f"since must be a datetime with a time zone, not {since!r}")
    rows = conn.execute(
        query(schema, "read_since"), {"stream": stream, "since": since, "limit": _limit(limit)}
    ).fetchall()
    if not rows:
        raise StreamNotFound(stream)
    return _events(rows)


def get_stream(conn: psycopg.Connection[Any], schema: str, stream: str) -> Stream:
    validate_stream_name(stream)
    row = conn.execute(query(schema, "get_stream"), {"stream": stream}).fetchone()
    if row is None:
        raise StreamNotFound(stream)
    return Stream(*row)


def partition_states(
    conn: psycopg.Connection[Any], schema: str, stream: str
) -> list[PartitionState]:
    validate_stream_name(stream)
    rows = conn.execute(query(schema, "partitions"), {"stream": stream}).fetchall()
    if not rows:
        raise StreamNotFound(stream)
    return [PartitionState(*row) for row in rows]
