"""Reading streams: by position within a partition, and by time across partitions.

Positions are the cursor a subscriber keeps (DESIGN.md, "Pull for outsiders"): events of a
partition after position p come back in position order, and none that commits later is
ever skipped. Reads by time are for finding a starting point, not for catching up.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar

from subengine.db._connection import psycopg_connection
from subengine.db._sql import SQL, Query, Result
from subengine.model._errors import (
    InvalidInput,
    PartitionNotFound,
    StreamBeingDeleted,
    StreamNotFound,
)
from subengine.model._event_fields import ALL_FIELDS, PLACE
from subengine.model._events import Event, Tombstone, gap_reason, stored_events
from subengine.model._gateway_cursor import GatewayCursor, StreamPosition
from subengine.model._names import (
    BIGINT_MAX,
    INTEGER_MAX,
    MAX_PARTITIONS,
    validate_stream_name,
    validate_whole_number,
)
from subengine.model._settings import Settings

E = TypeVar("E", Event, "RawEvent")
R = TypeVar("R")


def _limit(limit: int) -> int:
    return validate_whole_number(limit, "limit", 1, BIGINT_MAX)


def _events(rows: list[Any]) -> list[Event]:
    """Events from rows whose data and metadata are JSON text (decoded when read)."""
    # a stream with no events in range comes back as one row of NULL event columns
    return stored_events(row for row in rows if row[0] is not None)


class RawEvent(NamedTuple):
    """A stored event whose data and metadata are still their JSON text: what the
    gateway relays without decoding and encoding them again."""

    id: uuid.UUID
    stream: str
    partition: int
    position: int
    key: str
    key_version: int
    type: str
    data: str
    metadata: str
    occurred_at: datetime
    recorded_at: datetime


def _raw_events(rows: list[Any]) -> list[RawEvent]:
    return [RawEvent(*row) for row in rows if row[0] is not None]


def read_after(
    stream: str, partition: int, after: int, limit: int
) -> Query[list[Event | Tombstone]]:
    """Up to `limit` events of one partition after position `after`, in position order;
    first a tombstone when retention removed positions after `after` (DESIGN.md,
    "Retention and gaps"): the events then start at the floor."""
    return _read_after(stream, partition, after, limit, _events, lambda _epoch, items: items)


def read_after_raw(
    stream: str, partition: int, after: int, limit: int
) -> Query[tuple[int, list[RawEvent | Tombstone]]]:
    """The stream's epoch and `read_after`'s items, read in one snapshot, with each
    event's data and metadata as their JSON text: the epoch says which stream of the
    name the items are of (one deleted and created again has a new epoch), even when
    there are none."""
    return _read_after(
        stream, partition, after, limit, _raw_events, lambda epoch, items: (epoch, items)
    )


def _read_after(
    stream: str,
    partition: int,
    after: int,
    limit: int,
    events: Callable[[list[Any]], Sequence[E]],
    shape: Callable[[int, list[E | Tombstone]], R],
) -> Query[R]:
    """The query of `read_after`: `shape` makes its value of the stream's epoch and the
    items, `events` the items of the rows."""
    validate_stream_name(stream)
    validate_whole_number(after, "after", 0, BIGINT_MAX)
    validate_whole_number(partition, "partition", -INTEGER_MAX, INTEGER_MAX)

    def read(result: Result) -> R:
        if not result.rows:
            raise StreamNotFound(stream)
        epoch, partitions, floor, head, aged_through, capped_through = result.rows[0][:6]
        if not 0 <= partition < partitions:
            raise PartitionNotFound(stream, partition, partitions)
        if floor is None:  # its partitions are gone first: `stream delete` is under way
            raise StreamBeingDeleted(stream)
        items: list[E | Tombstone] = []
        if after < floor - 1:
            reason = gap_reason(after + 1, aged_through, capped_through)
            items.append(Tombstone(stream, partition, after + 1, floor - 1, floor, reason, head))
        items.extend(events([row[6:] for row in result.rows]))
        return shape(epoch, items)

    params = {"stream": stream, "partition": partition, "after": after, "limit": _limit(limit)}
    return Query("read_after", params, read)


# PostgreSQL's timestamptz and Python's datetime both count whole microseconds.
_RESOLUTION = timedelta(microseconds=1)


def _right_after(since: object) -> datetime:
    """The first time after `since` (P3Sub's "since": right after the time, not including
    it): the queries ask "at or after" this, which is exactly "after `since`"."""
    if not isinstance(since, datetime) or since.tzinfo is None:
        raise InvalidInput(f"since must be a datetime with a time zone, not {since!r}")
    try:
        return since + _RESOLUTION
    except OverflowError:
        raise InvalidInput(f"since must be before {since.isoformat()}") from None


def read_since(stream: str, since: datetime, limit: int) -> Query[list[Event | Tombstone]]:
    """Up to `limit` events of every partition recorded after `since` (not at it: a
    reader passes the time of the last event it has), oldest first; before them, a
    tombstone for each partition from which retention removed events recorded after
    `since`. Their times went with them, so such a tombstone names every position
    removed from the partition (from 1 to the floor's eve): to read without that
    doubt, keep positions."""
    validate_stream_name(stream)
    after = _right_after(since)

    def read(result: Result) -> list[Event | Tombstone]:
        if not result.rows:
            raise StreamNotFound(stream)
        _, gapped, floors, heads, aged, capped = result.rows[0][:6]
        items: list[Event | Tombstone] = [
            Tombstone(stream, partition, 1, floor - 1, floor, gap_reason(1, *removed), head)
            for partition, floor, head, *removed in zip(
                gapped or [], floors or [], heads or [], aged or [], capped or [], strict=True
            )
        ]
        items.extend(_events([row[6:] for row in result.rows]))
        return items

    return Query("read_since", {"stream": stream, "since": after, "limit": _limit(limit)}, read)


@dataclass(frozen=True, slots=True)
class Page:
    """What `read_page` found, in one snapshot: the stream's epoch, the head and floor of
    every partition (partition order), the tombstones of the gaps after the cursor and
    the events after it, oldest first across partitions."""

    stream: str
    epoch: int
    heads: tuple[int, ...]
    floors: tuple[int, ...]
    tombstones: list[Tombstone]
    events: list[RawEvent]
    # False: the cursor's positions are not one per partition of the stream (then
    # `tombstones` and `events` are empty)
    fits: bool = True


def _positions(positions: Sequence[int], what: str) -> list[int]:
    if isinstance(positions, str | bytes) or not isinstance(positions, Sequence):
        raise InvalidInput(f"{what} must be a sequence of positions")
    if len(positions) > MAX_PARTITIONS:
        raise InvalidInput(f"{what} has more than {MAX_PARTITIONS} positions")
    return [
        validate_whole_number(position, f"the position of partition {partition}", 0, BIGINT_MAX)
        for partition, position in enumerate(positions)
    ]


def read_page(stream: str, positions: Sequence[int], limit: int) -> Query[Page]:
    """Up to `limit` events of every partition after its position in `positions`
    (partition order; a partition past its end is at 0), oldest first across
    partitions; first a tombstone for each partition whose positions after the cursor
    retention removed. For positions that are not one per partition of the stream, the
    page has `fits` False and no events (a cursor of an earlier stream of the name: its
    epoch tells the caller)."""
    validate_stream_name(stream)
    after = _positions(positions, "the cursor")

    def read(result: Result) -> Page:
        if not result.rows:
            raise StreamNotFound(stream)
        epoch, partitions, heads, floors, aged, capped = result.rows[0][:6]
        if heads is None:  # its partitions are gone first: `stream delete` is under way
            raise StreamBeingDeleted(stream)
        if after and len(after) != partitions:
            # not a cursor of this stream: of an earlier one of the name (its epoch
            # tells), or none at all; the caller decides, nothing of it is read
            return Page(stream, epoch, tuple(heads), tuple(floors), [], [], fits=False)
        tombstones = _gaps(stream, after or [0] * partitions, heads, floors, aged, capped)
        events = _raw_events([row[6:] for row in result.rows])
        return Page(stream, epoch, tuple(heads), tuple(floors), tombstones, events)

    params = {"stream": stream, "positions": after, "limit": _limit(limit)}
    return Query("read_page", params, read)


def _gaps(
    stream: str,
    after: Sequence[int],
    heads: Sequence[int],
    floors: Sequence[int],
    aged: Sequence[int],
    capped: Sequence[int],
) -> list[Tombstone]:
    """A tombstone for each partition whose positions after `after` retention removed."""
    return [
        Tombstone(
            stream,
            partition,
            position + 1,
            floor - 1,
            floor,
            gap_reason(position + 1, aged[partition], capped[partition]),
            heads[partition],
        )
        for partition, (position, floor) in enumerate(zip(after, floors, strict=True))
        if position < floor - 1
    ]


@dataclass(frozen=True, slots=True)
class EncodedPage:
    """What `read_page_json` found, in one snapshot: `Page`'s epoch, heads, floors and
    tombstones, and the events as (partition, position, JSON text) in page order, the
    text None for an event the filters passed over. `size` is the bytes of the kept
    events' texts joined by commas; `full` says that the byte bound ended the page: the
    exact one, before an event PostgreSQL had written, or PostgreSQL's estimate."""

    stream: str
    epoch: int
    heads: tuple[int, ...]
    floors: tuple[int, ...]
    tombstones: list[Tombstone]
    events: list[tuple[int, int, str | None]]
    size: int = 0
    full: bool = False
    fits: bool = True


def _names(names: Iterable[str] | None, what: str) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, str | bytes):
        raise InvalidInput(f"{what} must be a collection of names, not one name")
    found = list(names)
    if not all(isinstance(name, str) for name in found):
        raise InvalidInput(f"{what} must be names (text)")
    return found


# The bytes of each field in an event's JSON that the page query does not measure (its
# key and type, its data and metadata and the stream's name it does): what it estimates
# a page's bytes by, before it writes any JSON (`page_event_size` in queries.sql).
_FIELD_BYTES = {
    "stream": 12,
    "partition": 16,
    "position": 20,
    "id": 46,
    "key": 9,
    "key_version": 18,
    "type": 10,
    "metadata": 12,
    "occurred_at": 48,
    "recorded_at": 48,
    "data": 8,
}


def read_page_json(
    stream: str,
    positions: Sequence[int],
    limit: int,
    *,
    keys: Iterable[str] | None = None,
    types: Iterable[str] | None = None,
    fields: frozenset[str] = ALL_FIELDS,
    max_bytes: int | None = None,
    oversize: bool = True,
) -> Query[EncodedPage]:
    """`read_page` as the gateway sends it: each event's JSON text made by PostgreSQL,
    byte for byte what `event_json` writes (docs/gateway.md, "Reading events"), with
    `fields` alone (`subengine.model._event_fields`), and None for an event not of
    `keys` and `types` (None: all), which the cursor still passes.

    With `max_bytes`, the page ends before the first kept event that would take the
    kept texts (joined by commas) past it; with `oversize`, a page's first kept event
    comes even when it alone is larger. An event the filters passed over takes no
    bytes. Whatever the bound leaves out is after every event the page holds, in
    every partition: the page is still a prefix of what follows the cursor. PostgreSQL
    ends the page first by an estimate of the bytes (`page_event_size` in queries.sql),
    so that it writes little JSON past the bound. A page that estimate ended may hold
    fewer bytes than `max_bytes` (the estimate ran high), and is `full` all the same;
    one that its probes ended early (their sizes ran high) is not `full` and is not up
    to date either, so its reader reads on at once."""
    validate_stream_name(stream)
    after = _positions(positions, "the cursor")
    if not isinstance(fields, frozenset) or not PLACE <= fields <= ALL_FIELDS:
        raise InvalidInput(f"fields must be a frozenset of event fields and the place: {fields!r}")
    if max_bytes is not None:
        validate_whole_number(max_bytes, "max_bytes", 0, BIGINT_MAX)
    budget = BIGINT_MAX if max_bytes is None else max_bytes

    def read(result: Result) -> EncodedPage:
        rows = result.rows
        if not rows:
            raise StreamNotFound(stream)
        epoch, partitions, heads, floors, aged, capped = rows[0][:6]
        if heads is None:  # its partitions are gone first: `stream delete` is under way
            raise StreamBeingDeleted(stream)
        if after and len(after) != partitions:
            # not a cursor of this stream (see read_page): nothing of it is read
            return EncodedPage(stream, epoch, tuple(heads), tuple(floors), [], [], fits=False)
        tombstones = _gaps(stream, after or [0] * partitions, heads, floors, aged, capped)
        events: list[tuple[int, int, str | None]] = []
        size, full = -1, False  # -1: no kept event yet (the first takes no comma)
        for row in rows:
            if row[6] is None:  # a page without events: one row, of the stream alone
                break
            text = row[8]
            if text is not None:
                grown = size + 1 + (len(text) if text.isascii() else len(text.encode()))
                if grown > budget and (size >= 0 or not oversize):
                    full = True
                    break
                size = grown
            events.append((row[6], row[7], text))
        else:  # PostgreSQL's estimate may have ended the page after its last row
            full = bool(rows[-1][9])
        return EncodedPage(
            stream, epoch, tuple(heads), tuple(floors), tombstones, events, max(size, 0), full
        )

    params = {
        "stream": stream,
        "positions": after,
        "limit": _limit(limit),
        "keys": _names(keys, "keys"),
        "types": _names(types, "types"),
        **{f"with_{name}": name in fields for name in ALL_FIELDS - PLACE},
        "max_bytes": budget,
        "bytes_bound": max_bytes is not None,
        "overhead": 2
        + sum(_FIELD_BYTES[name] for name in fields)
        + (len(stream) if "stream" in fields else 0),
    }
    return Query("read_page_json", params, read)


def positions_since(stream: str, since: datetime) -> Query[tuple[int, list[int]]]:
    """The stream's epoch, and the position of every partition just before its first
    event recorded after `since` (not at it: P3Sub's "since"): exact, because
    recorded_at never decreases along a partition. A partition from which retention
    removed events recorded after `since` is at 0, so a read from there meets the gap
    first."""
    validate_stream_name(stream)
    after = _right_after(since)

    def read(result: Result) -> tuple[int, list[int]]:
        if not result.rows:
            raise StreamNotFound(stream)
        epoch, positions = result.rows[0]
        return epoch, list(positions)

    return Query("positions_since", {"stream": stream, "since": after}, read)


def epochs_and_heads(streams: Sequence[str]) -> Query[dict[str, tuple[int, list[int] | None]]]:
    """The epoch and the heads (partition order) of each of `streams` that exists; heads
    None for a stream being deleted."""
    names = [validate_stream_name(stream) for stream in streams]

    def read(result: Result) -> dict[str, tuple[int, list[int] | None]]:
        return {name: (epoch, heads) for name, epoch, heads in result.rows}

    return Query("epochs_and_heads", {"streams": names}, read)


def gateway_cursor(
    conn: object,
    streams: str | Iterable[str],
    *,
    schema: str | None = None,
    settings: Settings | None = None,
) -> str:
    """The gateway cursor standing at the heads of `streams`, read inside the caller's
    open transaction (DESIGN.md, the gateway's race-free start): hand it to an outside
    reader with the data this transaction wrote, and it gets exactly what commits after
    that data. `conn` is a psycopg connection, a SQLAlchemy Connection or Session.
    `schema` and `settings` are those of `subengine.append`."""
    names = [streams] if isinstance(streams, str) else list(streams)
    if not names:
        raise InvalidInput("give at least one stream")
    settings = settings or Settings.from_env()
    if schema is not None:
        settings = settings.with_changes(schema=schema)
    found = SQL(settings.schema).run(psycopg_connection(conn), epochs_and_heads(names))
    positions: dict[str, StreamPosition] = {}
    for name in names:
        epoch, heads = found.get(name, (None, None))
        if epoch is None or heads is None:
            raise StreamNotFound(name)
        positions[name] = StreamPosition(epoch, tuple(heads))
    return GatewayCursor(positions).encode()
