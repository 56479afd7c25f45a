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
    """A stream's name and fixed partition count."""

    name: str
    partitions: int
    created_at: datetime
