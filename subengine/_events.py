"""Events as users write them (`NewEvent`) and read them (`Event`), and where a key lands.

`partition_for` is the documented partition function; the SQL function
`partition_for(key, partitions)` in the schema computes the same value.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

_SIGN_MASK = (1 << 63) - 1


def partition_for(key: str, partitions: int) -> int:
    """The partition of `key` in a stream of `partitions` partitions.

    The first 8 bytes of the MD5 digest of the UTF-8 key, read as a big-endian integer with
    the top bit cleared, modulo the partition count. Stable across versions and platforms,
    and identical to the SQL function `partition_for` in subengine's schema.
    """
    digest = hashlib.md5(key.encode("utf-8"), usedforsecurity=False).digest()
    return (int.from_bytes(digest[:8], "big") & _SIGN_MASK) % partitions


def new_event_id() -> uuid.UUID:
    """A time-ordered UUID (version 7), so ids of new events insert near each other."""
    millis = time.time_ns() // 1_000_000
    value = (millis & ((1 << 48) - 1)) << 80
    value |= int.from_bytes(os.urandom(10), "big") & ((1 << 80) - 1)
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return uuid.UUID(int=value)


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


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A gap: positions `gap_from` to `gap_to` of a partition are no longer stored
    (retention removed them), so a reader that asked for them gets this instead, before
    any later event (DESIGN.md, "Retention and gaps"). `floor` is the partition's lowest
    stored position when the gap was seen. A reader's cursor moves to `gap_to` with it.
    """

    stream: str
    partition: int
    gap_from: int
    gap_to: int
    floor: int
    reason: str = "retention"

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
        return (
            f"gap: {self.reason} removed {span} of partition {self.partition} of stream "
            f"{self.stream!r}"
        )
