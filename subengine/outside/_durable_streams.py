"""The catalog of the gateway's Durable Streams surface (docs/durable-streams.md): which
engine stream a Durable Streams path is, its content type, expiry, tail, closed state and
Stream-Seq, its idempotent producers, and the bytes of byte messages.

A Durable Streams stream is a one-partition engine stream with a generated name, so a
path deleted and created again is a new engine stream at once (the old one is deleted
later, in batches). Each message is an engine event of key `MESSAGE_KEY`: a JSON
stream's message is its data; a byte stream's bytes are stored beside the event, byte
for byte (`durable_stream_bytes`), its data saying how long they are. Closing appends a
`CLOSED_TYPE` event after the last message, so that readers (and workers) learn of it
through the same notifications and positions as they learn of messages.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from subengine.db._sql import Query, Result, first_row, nothing, rowcount
from subengine.streams._append import translate_error

# The events of a Durable Streams stream: one key (so one partition), two types.
MESSAGE_KEY = "durable-stream"
MESSAGE_TYPE = "durable-streams.message"
CLOSED_TYPE = "durable-streams.closed"
# How an engine stream of a Durable Streams stream is named: this, then the path's
# letters (for people reading `subengine stream list`), then a random tag.
ENGINE_PREFIX = "ds."
_NAME_LETTERS = re.compile(r"[^A-Za-z0-9_-]+")
_NAME_PART = 60
_STREAM_COLUMNS = 15
_FORK_COLUMNS = 21
_OFFSET_DIGITS = 16


@dataclass(frozen=True, slots=True)
class Producer:
    """An idempotent producer's request: Producer-Id, Producer-Epoch and Producer-Seq."""

    id: str
    epoch: int
    seq: int


@dataclass(frozen=True, slots=True)
class Inherited:
    """A range a fork reads from another engine stream (docs/durable-streams.md, "Forks"):
    its positions after `after` up to `upto`, the last message cut to its first `cut`
    bytes when `cut` is not None (a fork point inside a byte message). `epoch` and
    `floor` are that engine stream's (epoch None: it is gone)."""

    stream: str
    epoch: int | None
    after: int
    upto: int
    cut: int | None = None
    floor: int = 1

    @property
    def lowest(self) -> int:
        """The lowest position of the range still stored (upto + 1: none)."""
        if self.epoch is None:
            return self.upto + 1
        return min(max(self.floor, self.after + 1), self.upto + 1)


@dataclass(frozen=True, slots=True)
class CatalogStream:
    """A Durable Streams stream as the catalog holds it, with its engine stream's epoch
    and floor: the lowest position readable from there on (for a fork, through what it
    inherits too).

    A fork (`source` set) reads the ranges it inherits (`inherited`, oldest first: the
    positions up to `fork_point`) and then its own messages, numbered on from
    `fork_point`. `deleted`: deleted softly, kept for the forks that read it."""

    path: str
    stream: str
    content_type: str
    ttl_seconds: int | None
    expires_at: datetime | None
    deadline: datetime | None
    tail: int
    closed: bool
    closed_by: Producer | None
    last_seq: str | None
    epoch: int
    floor: int
    expired: bool
    # a partition of an engine stream of its own, read only (docs/durable-streams.md,
    # "Engine streams"): not in the catalog, each message a whole event
    partition: int = 0
    view: bool = False
    deleted: bool = False
    source: str | None = None
    forked_from: str | None = None
    fork_offset: str | None = None
    fork_sub_offset: int = 0
    fork_point: int = 0
    inherited: tuple[Inherited, ...] = ()

    @property
    def json(self) -> bool:
        return media_type(self.content_type) == "application/json"

    def epoch_at(self, position: int) -> int:
        """The epoch of the offset that names `position`: that of the engine stream the
        message there is read from (a fork's offsets are its source's up to the fork
        point: PROTOCOL.md, "Offsets and forked streams")."""
        for part in self.inherited:
            if position <= part.upto:
                return self.epoch if part.epoch is None else part.epoch
        return self.epoch

    def offset_at(self, position: int) -> str:
        """The offset that names `position` of this stream."""
        return format_offset(self.epoch_at(position), position)

    def check_offset(self, epoch: int, position: int) -> str:
        """Whether (epoch, position) is an offset of this stream: `ok`; `gone` (an
        earlier incarnation of the path); `foreign` (an offset of a stream it inherits
        from, but not of what it inherits); `beyond` (past the tail, a later epoch). The
        zero offset (epoch 0, which no stream has) is the beginning."""
        if epoch == 0 and position == 0:
            return "ok"
        if epoch == self.epoch:
            if position > self.tail:
                return "beyond"
            return "ok" if position >= self.fork_point else "foreign"
        for part in self.inherited:
            if epoch == part.epoch:
                return "ok" if part.after <= position <= part.upto else "foreign"
        return "gone" if epoch < self.epoch else "beyond"

    def holder(self, position: int) -> tuple[str, int | None]:
        """The engine stream that holds the message at `position`, and the bytes of it
        this stream shows (None: all)."""
        for part in self.inherited:
            if part.after < position <= part.upto:
                return part.stream, part.cut if position == part.upto else None
        return self.stream, None

    def ranges(self, after: int = 0) -> list[Inherited]:
        """What a read after `after` reads, in order: the inherited ranges that end past
        it, then the stream's own messages."""
        own = Inherited(self.stream, self.epoch, self.fork_point, self.tail)
        return [part for part in (*self.inherited, own) if part.upto > after]

    def inherit(self, fork_point: int, cut: int | None) -> tuple[Inherited, ...]:
        """The ranges a fork of this stream at `fork_point` inherits (the message there
        cut to `cut` bytes when that is not None)."""
        ranges = []
        for part in self.ranges():
            if part.after >= fork_point:
                break
            if part.upto >= fork_point:
                kept = cut if cut is not None else part.cut if part.upto == fork_point else None
                ranges.append(Inherited(part.stream, part.epoch, part.after, fork_point, kept))
                break
            ranges.append(part)
        return tuple(ranges)


def _floor(own_floor: int, fork_point: int, inherited: tuple[Inherited, ...]) -> int:
    """The lowest position from which every message up to the tail is still stored:
    past the last range that retention (or an engine stream's deletion) cut into."""
    floor = own_floor if own_floor > fork_point + 1 else 1
    for part in inherited:
        if part.lowest > part.after + 1:
            floor = max(floor, part.lowest)
    return floor


def format_offset(epoch: int, position: int) -> str:
    """An offset (docs/durable-streams.md, "Offsets"): `EEEEEEEEEEEEEEEE_PPPPPPPPPPPPPPPP`,
    an engine stream's epoch and a position, each zero-padded to 16 digits."""
    return f"{epoch:0{_OFFSET_DIGITS}d}_{position:0{_OFFSET_DIGITS}d}"


def media_type(content_type: str) -> str:
    """The media type of a Content-Type, lower case, without its parameters."""
    return content_type.partition(";")[0].strip().lower()


def engine_name(path: str) -> str:
    """A new engine stream name for `path`: unique (a random tag), readable."""
    letters = _NAME_LETTERS.sub("-", path).strip("-")[:_NAME_PART] or "stream"
    return f"{ENGINE_PREFIX}{letters}.{secrets.token_hex(6)}"


def _inherited(row: Any) -> tuple[Inherited, ...]:
    streams, epochs, afters, uptos, cuts, floors = row[_FORK_COLUMNS : _FORK_COLUMNS + 6]
    if not streams:
        return ()
    return tuple(
        Inherited(stream, epoch, after, upto, cut, 1 if floor is None else floor)
        for stream, epoch, after, upto, cut, floor in zip(
            streams, epochs, afters, uptos, cuts, floors, strict=True
        )
    )


def _stream(row: Any) -> CatalogStream:
    (path, stream, content_type, ttl, expires_at, deadline, tail, closed) = row[:8]
    by_producer, by_epoch, by_seq, last_seq, epoch, floor, expired = row[8:_STREAM_COLUMNS]
    deleted, source, forked_from, fork_offset, sub_offset, fork_point = row[
        _STREAM_COLUMNS:_FORK_COLUMNS
    ]
    closed_by = None if by_producer is None else Producer(by_producer, by_epoch, by_seq)
    inherited = _inherited(row)
    fork_point = fork_point or 0
    return CatalogStream(
        path,
        stream,
        content_type,
        ttl,
        expires_at,
        deadline,
        tail,
        closed,
        closed_by,
        last_seq,
        epoch,
        _floor(floor, fork_point, inherited),
        expired,
        deleted=deleted,
        source=source,
        forked_from=forked_from,
        fork_offset=fork_offset,
        fork_sub_offset=sub_offset or 0,
        fork_point=fork_point,
        inherited=inherited,
    )


def _stream_or_none(result: Result) -> CatalogStream | None:
    row = first_row(result)
    return None if row is None else _stream(row)


def get_stream(path: str, *, touch: bool) -> Query[CatalogStream | None]:
    """The stream at `path` (None: none), its TTL countdown reset when `touch`."""
    return Query("ds_stream", {"path": path, "touch": touch}, _stream_or_none)


def lock_stream(path: str) -> Query[CatalogStream | None]:
    """The stream at `path`, locked until the transaction ends (None: none)."""
    return Query("ds_lock_stream", {"path": path}, _stream_or_none)


def insert_stream(
    path: str,
    stream: str,
    content_type: str,
    ttl_seconds: int | None,
    expires_at: datetime | None,
) -> Query[bool]:
    """Add a stream to the catalog; False when the path is taken."""
    params = {
        "path": path,
        "stream": stream,
        "content_type": content_type,
        "ttl_seconds": ttl_seconds,
        "expires_at": expires_at,
    }
    return Query("ds_insert_stream", params, lambda result: bool(result.rows))


def appended(
    path: str,
    tail: int,
    last_seq: str | None,
    closed: bool,
    producer: Producer | None,
) -> Query[None]:
    """Record what an append did: the new tail, Stream-Seq and closed state."""
    params = {
        "path": path,
        "tail": tail,
        "last_seq": last_seq,
        "closed": closed,
        "producer": None if producer is None else producer.id,
        "epoch": None if producer is None else producer.epoch,
        "seq": None if producer is None else producer.seq,
    }
    return Query("ds_appended", params, nothing)


def append_plain(
    path: str, events: dict[str, Any]
) -> Query[tuple[CatalogStream | None, list[int] | None]]:
    """The append of JSON messages (`events`: json_events' parameters) to the stream at
    `path` in one statement, when the stream takes it as it is: the stream as locked
    (None: none) and the positions appended (None: nothing written; the general path
    decides)."""

    def read(result: Result) -> tuple[CatalogStream | None, list[int] | None]:
        row = first_row(result)
        if row is None:
            return None, None
        return _stream(row), row[-1]

    # as append_json's errors (an engine stream deleted under it: StreamNotFound)
    return Query(
        "ds_append_plain", {"path": path, **events}, read, lambda e: translate_error(e, path)
    )


def producer_state(stream: str, producer: str) -> Query[tuple[int, int] | None]:
    """A producer's (epoch, last accepted seq) on an engine stream; None: new."""

    def read(result: Result) -> tuple[int, int] | None:
        row = first_row(result)
        return None if row is None else (row[0], row[1])

    return Query("ds_producer", {"stream": stream, "producer": producer}, read)


def put_producer(stream: str, producer: Producer) -> Query[None]:
    params = {"stream": stream, "producer": producer.id, "epoch": producer.epoch}
    return Query("ds_put_producer", {**params, "seq": producer.seq}, nothing)


def insert_bytes(stream: str, positions: Sequence[int], bodies: Sequence[bytes]) -> Query[None]:
    params = {"stream": stream, "positions": list(positions), "bodies": list(bodies)}
    return Query("ds_insert_bytes", params, nothing)


def _messages(result: Result) -> list[tuple[int, Any]]:
    return [(row[0], row[1]) for row in result.rows]


def read_bytes(
    stream: str, after: int, tail: int, max_bytes: int, limit: int
) -> Query[list[tuple[int, bytes]]]:
    """The messages of a byte stream after `after`, up to `tail`: (position, bytes), as
    many as fit in `max_bytes`, at least one."""
    params = {"stream": stream, "after": after, "tail": tail, "max_bytes": max_bytes}
    return Query("ds_read_bytes", {**params, "limit": limit}, _messages)


def read_json(
    stream: str, after: int, tail: int, max_bytes: int, limit: int
) -> Query[list[tuple[int, str]]]:
    """The messages of a JSON stream after `after`, up to `tail`: (position, JSON text)."""
    params = {"stream": stream, "after": after, "tail": tail, "max_bytes": max_bytes}
    return Query("ds_read_json", {**params, "limit": limit}, _messages)


def get_stream_and_json(
    path: str, stream: str, after: int, max_bytes: int, limit: int
) -> Query[tuple[CatalogStream | None, list[tuple[int, str]]]]:
    """`get_stream` (not touching it) and, read in the same snapshot, what `read_json`
    reads of JSON engine stream `stream` after `after` up to the tail found: a live
    reader's look after a wake-up, in one statement. No message when the path is now
    another engine stream."""

    def read(result: Result) -> tuple[CatalogStream | None, list[tuple[int, str]]]:
        row = first_row(result)
        if row is None:
            return None, []
        positions, texts = row[_FORK_COLUMNS + 6 :]
        return _stream(row), list(zip(positions or (), texts or (), strict=True))

    params = {"path": path, "stream": stream, "after": after, "max_bytes": max_bytes}
    return Query("ds_stream_and_json", {**params, "limit": limit}, read)


def delete_stream(path: str, stream: str | None = None) -> Query[str | None]:
    """Remove the stream at `path` (only if it is engine stream `stream`, when given)
    from the catalog, leaving its engine stream to delete; that engine stream, or None."""

    def read(result: Result) -> str | None:
        row = first_row(result)
        return None if row is None else str(row[0])

    return Query("ds_delete_stream", {"path": path, "stream": stream}, read)


def expired_streams(limit: int) -> Query[list[tuple[str, str]]]:
    """(path, engine stream) of streams whose deadline passed."""
    return Query("ds_expired", {"limit": limit}, lambda result: [(r[0], r[1]) for r in result.rows])


def garbage(limit: int) -> Query[list[str]]:
    """Engine streams of deleted streams, still to delete."""
    return Query("ds_garbage", {"limit": limit}, lambda result: [r[0] for r in result.rows])


def delete_bytes(stream: str, batch: int) -> Query[int]:
    return Query("ds_delete_bytes", {"stream": stream, "batch": batch}, rowcount)


def prune_bytes(batch: int) -> Query[int]:
    """Byte messages below their engine stream's floor (retention removed their events)."""
    return Query("ds_prune_bytes", {"batch": batch}, rowcount)


def forget_garbage(stream: str) -> Query[None]:
    return Query("ds_forget_garbage", {"stream": stream}, nothing)


def subscriptions_of(stream: str) -> Query[int]:
    return Query("ds_subscriptions_of", {"stream": stream}, lambda result: int(result.rows[0][0]))


@dataclass(frozen=True, slots=True)
class ProducerCheck:
    """What a producer's request gets (PROTOCOL.md 5.2.1): `accept` (store it, then the
    producer's state is `state`), `duplicate` (already stored: 204 with the last seq),
    `stale_epoch` (403), `bad_epoch_seq` (400: a new epoch starts at 0) or `gap` (409,
    with the expected seq)."""

    outcome: str
    epoch: int
    seq: int


def check_producer(state: tuple[int, int] | None, producer: Producer) -> ProducerCheck:
    """Validate a producer's request against its stored (epoch, last seq)."""
    if state is None:
        if producer.seq != 0:
            return ProducerCheck("gap", producer.epoch, 0)
        return ProducerCheck("accept", producer.epoch, 0)
    epoch, last = state
    if producer.epoch < epoch:
        return ProducerCheck("stale_epoch", epoch, last)
    if producer.epoch > epoch:
        if producer.seq != 0:
            return ProducerCheck("bad_epoch_seq", epoch, last)
        return ProducerCheck("accept", producer.epoch, 0)
    if producer.seq <= last:
        return ProducerCheck("duplicate", epoch, last)
    if producer.seq == last + 1:
        return ProducerCheck("accept", epoch, producer.seq)
    return ProducerCheck("gap", epoch, last + 1)
