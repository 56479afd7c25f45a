"""What the engine's inspection methods return: one frozen dataclass per kind of row.

The field names are the column names of the views and tables behind them
(subscription_status, workers_status, dead_letters, ...), so `dataclasses.asdict` of a
record is the row as plain SQL shows it. Counts and sums are ints; seconds that the views
round to milliseconds stay `Decimal`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredSubscription:
    """A subscription as stored: its stream, start point (stored form), generation."""

    name: str
    stream: str
    start: dict[str, Any]
    generation: int
    paused: bool
    created_at: datetime


@dataclass(frozen=True, slots=True)
class SubscriptionSummary:
    """One subscription at a glance: its partitions' lag, their states by count, and how
    many connected workers run it."""

    subscription: str
    stream: str
    partitions: int
    lag: int
    lag_seconds: Decimal | None
    generation: int
    ok: int
    idle: int
    retrying: int
    stopped: int
    paused: int
    workers: int
    gap: int = 0
    parked_keys: int = 0
    parked_events: int = 0


@dataclass(frozen=True, slots=True)
class PartitionStatus:
    """Where a subscription stands in one partition, how far behind, in which state
    (ok, idle, retrying, stopped, paused, or gap: below the floor, so retention removed
    positions `gap_from` to `gap_to` before it handled them), which worker holds it, and
    the keys it has parked there with the events waiting under them."""

    subscription: str
    stream: str
    partition: int
    position: int
    head: int
    lag: int
    next_event_at: datetime | None
    lag_seconds: Decimal | None
    state: str
    attempts: int
    last_error: str | None
    retry_at: datetime | None
    generation: int
    worker_id: uuid.UUID | None
    worker_host: str | None
    worker_pid: int | None
    updated_at: datetime
    floor: int = 1
    gap_from: int | None = None
    gap_to: int | None = None
    parked_keys: int = 0
    parked_events: int = 0


@dataclass(frozen=True, slots=True)
class WorkerRegistration:
    """A worker as it registered (for inspection only)."""

    id: uuid.UUID
    host: str
    pid: int
    subscriptions: list[str]
    started_at: datetime
    heartbeat_at: datetime


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A registered worker: whether any connection of its is open, and how many
    partitions it holds."""

    id: uuid.UUID
    host: str
    pid: int
    subscriptions: list[str]
    started_at: datetime
    heartbeat_at: datetime
    seconds_since_heartbeat: Decimal
    connected: bool
    partitions_held: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An event a subscription gave up on (policy dead_letter), and what became of it
    (resolution: None while open, else retried, discarded or superseded)."""

    subscription: str
    stream: str
    partition: int
    position: int
    generation: int
    event_id: uuid.UUID
    key: str | None
    type: str | None
    error: str
    attempts: int
    retries: int
    resolution: str | None
    created_at: datetime
    resolved_at: datetime | None


@dataclass(frozen=True, slots=True)
class ParkedKey:
    """A key a subscription parked (policy park): the event at `position` failed
    `attempts` times, and it and every later event of the key are set aside until an
    operator retries or discards them. `events` were parked under it, `waiting` of them
    are not yet replayed (the first at `next_position`), the last parked at
    `last_position`. `resolution`: None while parked, else retried, discarded, or
    superseded by a reset."""

    subscription: str
    stream: str
    partition: int
    key: str
    generation: int
    position: int
    event_id: uuid.UUID
    type: str | None
    events: int
    waiting: int
    next_position: int | None
    last_position: int
    error: str
    attempts: int
    retries: int
    resolution: str | None
    created_at: datetime
    resolved_at: datetime | None


@dataclass(frozen=True, slots=True)
class ParkedEvent:
    """An event set aside under a parked key, and what became of it (resolution: None
    while it waits, else retried, discarded or superseded); `type` is None when the
    event is no longer stored."""

    subscription: str
    stream: str
    partition: int
    key: str
    position: int
    event_id: uuid.UUID
    type: str | None
    resolution: str | None
    parked_at: datetime
    resolved_at: datetime | None
