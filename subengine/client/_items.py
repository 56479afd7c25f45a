"""What a reader hands its caller: events, tombstones (subengine's own `Tombstone`) and
resets, each read from the gateway's JSON (docs/gateway.md, "Events")."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from subengine.model._events import Tombstone


@dataclass(frozen=True, slots=True)
class Event:
    """An event as the gateway sent it. `data` is None when the read asked for metadata
    only (`include_data=False`)."""

    stream: str
    partition: int
    position: int
    id: uuid.UUID
    key: str
    key_version: int
    type: str
    data: Any
    metadata: dict[str, Any]
    occurred_at: datetime
    recorded_at: datetime


@dataclass(frozen=True, slots=True)
class Reset:
    """The stream was deleted and created again (its epoch changed): what follows are
    events of the new stream, from its beginning; anything built from the old one is
    stale."""

    stream: str
    previous_epoch: int
    epoch: int
    reason: str


Item = Event | Tombstone | Reset


def event_from_json(body: dict[str, Any]) -> Event:
    return Event(
        stream=body["stream"],
        partition=body["partition"],
        position=body["position"],
        id=uuid.UUID(body["id"]),
        key=body["key"],
        key_version=body["key_version"],
        type=body["type"],
        data=body.get("data"),
        metadata=body.get("metadata") or {},
        occurred_at=datetime.fromisoformat(body["occurred_at"]),
        recorded_at=datetime.fromisoformat(body["recorded_at"]),
    )


def tombstone_from_json(body: dict[str, Any]) -> Tombstone:
    return Tombstone(
        stream=body["stream"],
        partition=body["partition"],
        gap_from=body["gap_from"],
        gap_to=body["gap_to"],
        floor=body["floor"],
        reason=body.get("reason", "retention"),
        head=body.get("head"),
        cursor_below_floor=bool(body.get("cursor_below_floor", False)),
    )


def reset_from_json(body: dict[str, Any]) -> Reset:
    return Reset(
        stream=body["stream"],
        previous_epoch=body["previous_epoch"],
        epoch=body["epoch"],
        reason=body.get("reason", ""),
    )
