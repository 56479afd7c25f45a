"""Events as users write them (`NewEvent`) and read them (`Event`), and where a key lands.

`partition_for` is the documented partition function; the SQL function
`partition_for(key, partitions)` in the schema computes the same value.
`NewEvent.from_json` is the one rule for an event given as a JSON object (a JSON Lines
file of `subengine append --file`, the gateway's `POST .../events`). `stored_events` is
the one way a stored event becomes an `Event`: its data and metadata stay JSON text until
something reads them, so a handler that never looks at them never pays for decoding.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, NamedTuple

from subengine.model._errors import InvalidInput
from subengine.model._json import loads
from subengine.model._names import shown_value

_SIGN_MASK = (1 << 63) - 1

# The fields of an event as a JSON object: required, then optional.
EVENT_FIELDS = ("key", "type", "data")
OPTIONAL_EVENT_FIELDS = ("metadata", "id", "occurred_at")
# RFC 3339's date-time: a full time with seconds and a zone; fromisoformat alone would
# also take a date, a time without seconds or no zone at all.
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})")


def partition_for(key: str, partitions: int) -> int:
    """The partition of `key` in a stream of `partitions` partitions.

    The first 8 bytes of the MD5 digest of the UTF-8 key, read as a big-endian integer with
    the top bit cleared, modulo the partition count. Stable across versions and platforms,
    and identical to the SQL function `partition_for` in subengine's schema.
    """
    digest = hashlib.md5(key.encode("utf-8"), usedforsecurity=False).digest()
    return (int.from_bytes(digest[:8], "big") & _SIGN_MASK) % partitions


_VERSION_7 = (0x7 << 76) | (0x2 << 62)  # the version (7) and the RFC 4122 variant bits
_RANDOM_BITS = ((1 << 80) - 1) & ~(0xF << 76) & ~(0x3 << 62)  # all of rand_a and rand_b


def new_event_ids(count: int) -> list[uuid.UUID]:
    """`count` time-ordered UUIDs (version 7), so ids of new events insert near each other.

    48 bits of Unix milliseconds, then 74 random bits; the random bytes of all `count`
    ids come from one `os.urandom` call rather than one per id.
    """
    millis = time.time_ns() // 1_000_000
    time_bits = ((millis & ((1 << 48) - 1)) << 80) | _VERSION_7
    randomness = os.urandom(10 * count)
    return [
        uuid.UUID(int=time_bits | (int.from_bytes(randomness[i : i + 10]) & _RANDOM_BITS))
        for i in range(0, 10 * count, 10)
    ]


# byte 6 of a version 7 UUID: the version (7) above 4 random bits; byte 8: the RFC 4122
# variant (binary 10) above 6 random bits
_VERSION_BYTE = bytes(0x70 | (b & 0x0F) for b in range(256))
_VARIANT_BYTE = bytes(0x80 | (b & 0x3F) for b in range(256))


def new_event_id_bytes(count: int) -> bytes:
    """`new_event_ids(count)` as 16 bytes each, one after another, without a UUID object
    per id (a 500-event append took 0.5 ms to make them as objects, 0.02 ms as bytes)."""
    millis = (time.time_ns() // 1_000_000) & ((1 << 48) - 1)
    randomness = bytearray(os.urandom(10 * count))
    randomness[0::10] = randomness[0::10].translate(_VERSION_BYTE)
    randomness[2::10] = randomness[2::10].translate(_VARIANT_BYTE)
    ids = bytearray(16 * count)
    for i, byte in enumerate(millis.to_bytes(6, "big")):
        ids[i::16] = bytes((byte,)) * count
    for i in range(10):
        ids[6 + i :: 16] = randomness[i::10]
    return bytes(ids)


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to append: its ordering key, type and JSON data.

    `id` makes the append idempotent (an id already in the stream is not stored again);
    it defaults to a new time-ordered UUID. `occurred_at` defaults to the time of append.
    """

    key: str
    type: str
    data: Any
    metadata: dict[str, Any] | None = None
    id: uuid.UUID | None = None
    occurred_at: datetime | None = None

    @classmethod
    def from_json(cls, fields: object) -> NewEvent:
        """The event of a JSON object with "key", "type" and "data", and optionally
        "metadata" (an object), "id" (a UUID) and "occurred_at" (an RFC 3339 time with a
        zone, such as "2026-01-02T03:04:05Z"). Raises InvalidInput naming the field; the
        key, type, data and metadata themselves are checked by the append."""
        if not isinstance(fields, dict):
            raise InvalidInput(f"expected a JSON object, got {_json_kind(fields)}")
        missing = [name for name in EVENT_FIELDS if name not in fields]
        if missing:
            raise InvalidInput(f"missing {', '.join(repr(name) for name in missing)}")
        unknown = sorted(set(fields) - set(EVENT_FIELDS) - set(OPTIONAL_EVENT_FIELDS))
        if unknown:
            raise InvalidInput(f"unknown field(s) {', '.join(map(shown_value, unknown))}")
        event_id = _text(fields, "id")
        occurred_at = _text(fields, "occurred_at")
        return cls(
            key=fields["key"],
            type=fields["type"],
            data=fields["data"],
            metadata=fields.get("metadata"),
            id=None if event_id is None else _uuid(event_id),
            occurred_at=None if occurred_at is None else _rfc3339(occurred_at),
        )


def _json_kind(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def _text(fields: dict[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidInput(f"{name} must be a string, not {_json_kind(value)}")
    return value


def _uuid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise InvalidInput(f"id {shown_value(text)} is not a UUID") from None


def _rfc3339(text: str) -> datetime:
    if _RFC3339.fullmatch(text) is None:
        raise InvalidInput(
            f"occurred_at {shown_value(text)} is not an RFC 3339 time with a zone "
            "(such as 2026-01-02T03:04:05Z)"
        )
    try:
        return datetime.fromisoformat(text.upper())
    except ValueError:  # a month 13, a second 60
        raise InvalidInput(f"occurred_at {shown_value(text)} is not a valid time") from None


@dataclass(frozen=True, slots=True)
class Event:
    """A stored event, as reads and handlers see it."""

    id: uuid.UUID
    stream: str
    partition: int
    position: int
    key: str
    key_version: int
    type: str
    data: Any
    metadata: dict[str, Any]
    occurred_at: datetime
    recorded_at: datetime
    # `data` as an instance of the class a handler was registered with (`payload=`)
    payload: Any = None


class _JSONText(str):
    """An Event field's stored JSON text, not decoded yet (see `stored_events`)."""

    __slots__ = ()


# The slot of each of Event's fields, in field order: `stored_events` fills them directly.
_SLOTS = tuple(Event.__dict__[field.name] for field in fields(Event))


def _decoded_on_first_read(name: str) -> None:
    """Make Event's field `name` decode a `_JSONText` value when it is first read, and
    keep the decoded value in its place. Everything that reads the field (handlers,
    equality, repr, `dataclasses.asdict` and `replace`, pickling) goes through the
    attribute, so it sees only decoded values."""
    stored = Event.__dict__[name]

    def read(event: Event) -> Any:
        value = stored.__get__(event, Event)
        if type(value) is _JSONText:
            value = loads(value)
            stored.__set__(event, value)
        return value

    setattr(Event, name, property(read, stored.__set__))


_METADATA_SLOT = Event.__dict__["metadata"]
_decoded_on_first_read("data")
_decoded_on_first_read("metadata")


def metadata_lacks(event: Event, text: str) -> bool:
    """Whether the event's metadata is still undecoded JSON text without `text` in it: a
    caller looking for a key need not decode it then. False once it is decoded."""
    value = _METADATA_SLOT.__get__(event, Event)
    return type(value) is _JSONText and text not in value


def stored_events(rows: Iterable[Sequence[Any]]) -> list[Event]:
    """The Events of rows of the columns id, stream, partition, position, key,
    key_version, type, data, metadata, occurred_at, recorded_at, with data and metadata
    as JSON text (`jsonb::text`), which are decoded when first read.

    This is a worker's hot path, so decoding waits, and the slots are filled directly
    rather than through `Event.__init__`'s call per field (measured with psycopg 3.3 on
    events of about 150 bytes: reading a batch's rows cost 8.1 µs of client time per
    event with both decoded as they were read, 2.3 µs without; building an event took
    1.6 µs through `__init__`, 0.9 µs this way).
    """
    new = object.__new__
    (set_id, set_stream, set_partition, set_position, set_key, set_key_version, set_type,
     set_data, set_metadata, set_occurred_at, set_recorded_at, set_payload) = (
        slot.__set__ for slot in _SLOTS
    )  # fmt: skip
    events = []
    for (id, stream, partition, position, key, key_version, type, data, metadata,
         occurred_at, recorded_at) in rows:  # fmt: skip
        event = new(Event)
        set_id(event, id)
        set_stream(event, stream)
        set_partition(event, partition)
        set_position(event, position)
        set_key(event, key)
        set_key_version(event, key_version)
        set_type(event, type)
        set_data(event, _JSONText(data))
        set_metadata(event, _JSONText(metadata))
        set_occurred_at(event, occurred_at)
        set_recorded_at(event, recorded_at)
        set_payload(event, None)
        events.append(event)
    return events


class Appended(NamedTuple):
    """Where an appended event is stored. `duplicate` is true when its id was stored before."""

    partition: int
    position: int
    id: uuid.UUID
    key_version: int
    duplicate: bool


@dataclass(frozen=True, slots=True)
class PartitionState:
    """A partition's head (last committed position), the time of it, and its floor."""

    stream: str
    partition: int
    head: int
    head_time: datetime | None
    floor: int


@dataclass(frozen=True, slots=True)
class Stream:
    """A stream's name and fixed partition count; its epoch (the identity of this
    creation: a stream deleted and created again under the name has another) and its
    retention policy as stored (None: keep every event; see `Retention.from_json`)."""

    name: str
    partitions: int
    created_at: datetime
    epoch: int = 0
    retention: dict[str, Any] | None = None


# A tombstone's reason as its message says it.
_REMOVED_BY = {"ttl": "age limit", "cap": "size limit", "mixed": "age and size limits"}


def gap_reason(gap_from: int, aged_through: int, capped_through: int) -> str:
    """Why retention removed a gap starting at `gap_from`, given the partition's highest
    positions removed by an age limit and by a count limit (positions go oldest first, so
    each limit removed a prefix): "ttl" (age alone), "cap" (count alone), "mixed" (both
    removed some of it), or "retention" where it went before the engine recorded why."""
    aged, capped = gap_from <= aged_through, gap_from <= capped_through
    if aged and capped:
        return "mixed"
    return "ttl" if aged else "cap" if capped else "retention"


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A gap: positions `gap_from` to `gap_to` of a partition are no longer stored
    (retention removed them), so a reader that asked for them gets this instead, before
    any later event (DESIGN.md, "Retention and gaps"). `floor` is the partition's lowest
    stored position when the gap was seen, `head` its highest (None where the reader did
    not read it). `reason` says why the range went (seed 002, see `gap_reason`). A
    reader's cursor moves to `gap_to` with it.
    """

    stream: str
    partition: int
    gap_from: int
    gap_to: int
    floor: int
    reason: str = "retention"
    head: int | None = None
    # the reader's cursor was already below the floor when it connected (seed 002's
    # from_seq_too_old), rather than retention removing the range while it read
    cursor_below_floor: bool = False

    @property
    def position(self) -> int:
        """The last position the gap covers: where a reader stands after it."""
        return self.gap_to

    def __str__(self) -> str:
        span = (
            f"position {self.gap_from}"
            if self.gap_from == self.gap_to
            else f"positions {self.gap_from} to {self.gap_to}"
        )
        by = _REMOVED_BY.get(self.reason)
        return (
            f"gap: retention removed {span} of partition {self.partition} of stream "
            f"{self.stream!r}" + (f" by its {by}" if by else "")
        )
