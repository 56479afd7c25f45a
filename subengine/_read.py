"""Reading streams: by position within a partition, and by time across partitions.

Positions are the cursor a subscriber keeps (DESIGN.md, "Pull for outsiders"): events of a
partition after position p come back in position order, and none that commits later is
ever skipped. Reads by time are for finding a starting point, not for catching up.
"""

from __future__ import annotations

from datetime import datetime

from subengine._errors import InvalidInput, PartitionNotFound, StreamNotFound
from subengine._events import Event
from subengine._names import (
    BIGINT_MAX,
    INTEGER_MAX,
    validate_stream_name,
    validate_whole_number,
)
from subengine._sql import Query, Result


def _limit(limit: int) -> int:
    return validate_whole_number(limit, "limit", 1, BIGINT_MAX)


def _events(result: Result) -> list[Event]:
    # rows carry the stream's partition count first; a stream with no events in range
    # comes back as one row of NULL event columns
    return [Event(*row[1:]) for row in result.rows if row[1] is not None]


def read_after(stream: str, partition: int, after: int, limit: int) -> Query[list[Event]]:
    """Up to `limit` events of one partition after position `after`, in position order."""
    validate_stream_name(stream)
    validate_whole_number(after, "after", 0, BIGINT_MAX)
    validate_whole_number(partition, "partition", -INTEGER_MAX, INTEGER_MAX)

    def read(result: Result) -> list[Event]:
        if not result.rows:
            raise StreamNotFound(stream)
        partitions = result.rows[0][0]
        if not 0 <= partition < partitions:
            raise PartitionNotFound(stream, partition, partitions)
        return _events(result)

    params = {"stream": stream, "partition": partition, "after": after, "limit": _limit(limit)}
    return Query("read_after", params, read)


def read_since(stream: str, since: datetime, limit: int) -> Query[list[Event]]:
    """Up to `limit` events of every partition recorded at or after `since`."""
    validate_stream_name(stream)
    if not isinstance(since, datetime) or since.tzinfo is None:
        raise InvalidInput(f"since must be a datetime with a time zone, not {since!r}")

    def read(result: Result) -> list[Event]:
        if not result.rows:
            raise StreamNotFound(stream)
        return _events(result)

    return Query("read_since", {"stream": stream, "since": since, "limit": _limit(limit)}, read)
