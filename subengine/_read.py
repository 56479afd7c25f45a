"""Reading streams: by position within a partition, and by time across partitions.

Positions are the cursor a subscriber keeps (DESIGN.md, "Pull for outsiders"): events of a
partition after position p come back in position order, and none that commits later is
ever skipped. Reads by time are for finding a starting point, not for catching up.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from subengine._errors import (
    InvalidInput,
    PartitionNotFound,
    StreamBeingDeleted,
    StreamNotFound,
)
from subengine._events import Event, Tombstone
from subengine._names import (
    BIGINT_MAX,
    INTEGER_MAX,
    validate_stream_name,
    validate_whole_number,
)
from subengine._sql import Query, Result


def _limit(limit: int) -> int:
    return validate_whole_number(limit, "limit", 1, BIGINT_MAX)


def _events(rows: list[Any]) -> list[Event]:
    # a stream with no events in range comes back as one row of NULL event columns
    return [Event(*row) for row in rows if row[0] is not None]


def read_after(
    stream: str, partition: int, after: int, limit: int
) -> Query[list[Event | Tombstone]]:
    """Up to `limit` events of one partition after position `after`, in position order;
    first a tombstone when retention removed positions after `after` (DESIGN.md,
    "Retention and gaps"): the events then start at the floor."""
    validate_stream_name(stream)
    validate_whole_number(after, "after", 0, BIGINT_MAX)
    validate_whole_number(partition, "partition", -INTEGER_MAX, INTEGER_MAX)

    def read(result: Result) -> list[Event | Tombstone]:
        if not result.rows:
            raise StreamNotFound(stream)
        partitions, floor = result.rows[0][:2]
        if not 0 <= partition < partitions:
            raise PartitionNotFound(stream, partition, partitions)
        if floor is None:  # its partitions are gone first: `stream delete` is under way
            raise StreamBeingDeleted(stream)
        items: list[Event | Tombstone] = []
        if after < floor - 1:
            items.append(Tombstone(stream, partition, after + 1, floor - 1, floor))
        items.extend(_events([row[2:] for row in result.rows]))
        return items

    params = {"stream": stream, "partition": partition, "after": after, "limit": _limit(limit)}
    return Query("read_after", params, read)


def read_since(stream: str, since: datetime, limit: int) -> Query[list[Event | Tombstone]]:
    """Up to `limit` events of every partition recorded at or after `since`, oldest
    first; before them, a tombstone for each partition from which retention removed
    events recorded at or after `since`. Their times went with them, so such a
    tombstone names every position removed from the partition (from 1 to the floor's
    eve): to read without that doubt, keep positions."""
    validate_stream_name(stream)
    if not isinstance(since, datetime) or since.tzinfo is None:
        raise InvalidInput(f"since must be a datetime with a time zone, not {since!r}")

    def read(result: Result) -> list[Event | Tombstone]:
        if not result.rows:
            raise StreamNotFound(stream)
        _, gapped, floors = result.rows[0][:3]
        items: list[Event | Tombstone] = [
            Tombstone(stream, partition, 1, floor - 1, floor)
            for partition, floor in zip(gapped or [], floors or [], strict=True)
        ]
        items.extend(_events([row[3:] for row in result.rows]))
        return items

    return Query("read_since", {"stream": stream, "since": since, "limit": _limit(limit)}, read)
