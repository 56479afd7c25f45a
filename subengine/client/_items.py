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
    """An event as the gateway sent it. A field the read did not ask for (`fields`) is
    None, and so is `data` when it asked for metadata only (`include_data=False`); its
    stream and place are always there."""

    stream: str
    partition: int
    position: int
    id: uuid.UUID | None
    key: str | None
    key_version: int | None
    type: str | None
    data: Any
    metadata: dict[str, Any] | None
    occurred_at: datetime | None
    recorded_at: datetime | None


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


def event_from_json(body: dict[str, Any], stream: str | None = None) -> Event:
    """The Event of an event's JSON; `stream` is the one it is of when the JSON does not
    say (a read that left `stream` out of its `fields`)."""
    get = body.get
    event_id, occurred, recorded = get("id"), get("occurred_at"), get("recorded_at")
    return Event(
        stream=body["stream"] if stream is None else get("stream", stream),
        partition=body["partition"],
        position=body["position"],
        id=None if event_id is None else uuid.UUID(event_id),
        key=get("key"),
        key_version=get("key_version"),
        type=get("type"),
        data=get("data"),
        metadata=(get("metadata") or {}) if "metadata" in body else None,
        occurred_at=None if occurred is None else datetime.fromisoformat(occurred),
        recorded_at=None if recorded is None else datetime.fromisoformat(recorded),
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
