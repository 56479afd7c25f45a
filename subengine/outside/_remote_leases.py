"""Leases of remote workers (docs/remote-workers.md): a worker in any language claims one
partition of a subscription over HTTP, with a batch of its events, and acks, extends,
releases or nacks it. Remote and local workers compete on the same position rows:

- A claim takes the partition whose next event is oldest (invariant 7) among those no
  local batch holds (its position row, locked: SKIP LOCKED) and no local slot holds (its
  partition lock, taken for the claim's transaction), and holds it through the position
  row's retry_at, which every local worker already waits for: one batch of a partition
  in flight at a time (invariant 4). An expired lease frees the partition by itself.
- An ack moves the position with the same compare-and-set on position and generation as
  a local batch (invariant 3): a stale or foreign one is `LeaseConflict` and changes
  nothing. Effects are at least once: a lease lost before its ack is the same batch again.
- A nack counts an attempt toward the subscription's remote error policy with the code
  local batches use (`record_failure`), and a gap comes as a tombstone to ack past
  (invariant 6).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from subengine.db._locks import lock_key
from subengine.db._sql import Db, Query, Row, first_row, nothing
from subengine.model._declarations import ERROR_POLICIES, MAX_BATCH_SIZE, Subscription
from subengine.model._errors import (
    Fenced,
    InvalidInput,
    LeaseConflict,
    LeaseNotFound,
    PositionsMissing,
    SubscriptionNotFound,
)
from subengine.model._events import Tombstone, gap_reason, stored_events
from subengine.model._names import shown_value, validate_stream_name
from subengine.model._settings import Settings
from subengine.streams._read import RawEvent
from subengine.subscriptions._batches import record_gap
from subengine.subscriptions._failures import (
    BatchFailed,
    Failure,
    record_failure,
    stop_partition,
)
from subengine.subscriptions._parking import check_parked, parked_among

# A lease lasts from one second to ten minutes (Durable Streams' bounds), 30 s unless asked.
MIN_LEASE_SECONDS = 1.0
MAX_LEASE_SECONDS = 600.0
DEFAULT_LEASE_SECONDS = 30.0
# Partitions a claim tries, oldest first, before it answers that there is no work.
CANDIDATES = 16
MAX_WORKER_NAME = 200
MAX_ERROR_TEXT = 2000


class RemoteHandlerFailed(Exception):
    """What a remote worker's nack says went wrong (stored as the attempt's error)."""


@dataclass(frozen=True, slots=True)
class RemoteSubscription:
    """A subscription as remote workers consume it: its stream and its remote policy."""

    name: str
    stream: str
    on_error: str
    max_attempts: int
    batch_size: int

    def declaration(self) -> Subscription:
        """The subscription as the engine's failure and parking code takes it."""
        return Subscription(
            self.name, self.stream, batch_size=self.batch_size, ack="at_least_once",
            on_error=self.on_error, max_attempts=self.max_attempts,  # type: ignore[arg-type]
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Lease:
    """A remote worker's hold on one partition of a subscription until `deadline`: the
    batch after `position` (in `generation`) up to `through`, as `events` (those of
    parked keys left out) or as the `gap` retention left there."""

    id: uuid.UUID
    subscription: str
    stream: str
    partition: int
    worker: str
    generation: int
    position: int
    through: int
    deadline: datetime
    events: list[RawEvent]
    gap: Tombstone | None = None


@dataclass(frozen=True, slots=True)
class _Stored:
    """A lease's row."""

    id: uuid.UUID
    subscription: str
    partition: int
    worker: str
    generation: int
    position: int
    through: int
    gap: dict[str, Any] | None
    parked: list[uuid.UUID]
    deadline: datetime
    ended: str | None
    expired: bool


def validate_lease_seconds(seconds: object) -> float:
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not MIN_LEASE_SECONDS <= seconds <= MAX_LEASE_SECONDS
    ):
        raise InvalidInput(
            f"lease_seconds must be a number from {MIN_LEASE_SECONDS:g} to "
            f"{MAX_LEASE_SECONDS:g}, not {shown_value(seconds)}"
        )
    return float(seconds)


def validate_worker_name(worker: object) -> str:
    if not isinstance(worker, str) or not 1 <= len(worker) <= MAX_WORKER_NAME:
        raise InvalidInput(
            f"worker must be a name of 1 to {MAX_WORKER_NAME} characters, not {shown_value(worker)}"
        )
    return worker


def parse_lease_id(text: object) -> uuid.UUID:
    try:
        return uuid.UUID(str(text))
    except ValueError:
        raise InvalidInput(f"lease id must be a UUID, not {shown_value(text)}") from None


def remote_subscription(db: Db, name: str) -> RemoteSubscription:
    """Subscription `name` with its remote policy; SubscriptionNotFound when there is none."""
    validate_stream_name(name)
    row = db.run(Query("remote_subscription", {"name": name}, first_row))
    if row is None:
        raise SubscriptionNotFound(
            f"no subscription named {name!r}; create it with "
            f"`subengine subscription create {name} --stream STREAM`"
        )
    return RemoteSubscription(str(row[0]), str(row[1]), str(row[2]), int(row[3]), int(row[4]))


def set_remote_policy(
    db: Db, name: str, on_error: str = "stop", max_attempts: int = 5, batch_size: int = 100
) -> None:
    """Store the error policy and batch size that the remote workers of subscription
    `name` follow (the defaults of a local declaration until one is stored)."""
    remote_subscription(db, name)
    if on_error not in ERROR_POLICIES:
        raise InvalidInput(
            f"on_error must be one of {', '.join(ERROR_POLICIES)}, not {shown_value(on_error)}"
        )
    # the declaration checks max_attempts and batch_size
    RemoteSubscription(name, "checked", on_error, max_attempts, batch_size).declaration()
    params = {"name": name, "on_error": on_error, "max_attempts": max_attempts,
              "batch_size": batch_size}  # fmt: skip
    db.run(Query("set_remote_policy", params, nothing))


@dataclass(frozen=True, slots=True)
class LiveLease:
    """A live lease as an operator sees it: who holds which batch of a partition until
    when."""

    id: uuid.UUID
    partition: int
    worker: str
    generation: int
    position: int
    through: int
    deadline: datetime
    created_at: datetime


def live_leases(db: Db, name: str) -> list[LiveLease]:
    """The live leases of subscription `name`, by partition."""
    remote_subscription(db, name)
    return db.run(
        Query(
            "list_remote_leases",
            {"name": name},
            lambda result: [LiveLease(*row) for row in result.rows],
        )
    )


def claim(
    db: Db,
    schema: str,
    name: str,
    worker: str,
    seconds: float = DEFAULT_LEASE_SECONDS,
    max_events: int | None = None,
) -> Lease | None:
    """Lease the partition of subscription `name` whose next event is oldest among those
    no other worker holds, with its next batch (at most `max_events`, default the remote
    policy's batch size); None when no partition can be taken now. One transaction."""
    validate_worker_name(worker)
    seconds = validate_lease_seconds(seconds)
    if max_events is not None and not (
        isinstance(max_events, int)
        and not isinstance(max_events, bool)
        and 1 <= max_events <= MAX_BATCH_SIZE
    ):
        raise InvalidInput(
            f"max_events must be a whole number from 1 to {MAX_BATCH_SIZE}, "
            f"not {shown_value(max_events)}"
        )
    with db.transaction():
        subscription = remote_subscription(db, name)
        size = max_events or subscription.batch_size
        candidates = db.run(
            Query(
                "remote_candidates",
                {"name": name, "limit": CANDIDATES},
                lambda result: [int(row[0]) for row in result.rows],
            )
        )
        for partition in candidates:
            params = {
                "name": name,
                "partition": partition,
                "key": lock_key(schema, name, partition),
            }
            row = db.run(Query("remote_lock_partition", params, first_row))
            if row is None:
                continue  # a local batch or slot holds it, or it was taken meanwhile
            lease = _take(db, subscription, partition, worker, seconds, size)
            if lease is not None:
                return lease
    return None


def _take(
    db: Db,
    subscription: RemoteSubscription,
    partition: int,
    worker: str,
    seconds: float,
    size: int,
) -> Lease | None:
    """The lease of a partition whose row the claim locked, or None when it has nothing
    to hand out (no events after all, or events missing above the floor: then stopped
    before them, as a local batch does)."""
    name, stream = subscription.name, subscription.stream
    params = {"name": name, "partition": partition, "stream": stream, "size": size}
    rows = db.run(Query("lock_batch", params, lambda result: result.rows))
    if not rows:
        return None
    _, old, generation, halted, _, head, take = rows[0][:7]
    if halted or take == 0:
        return None
    raw = [RawEvent(*row[7:18]) for row in rows if row[7] is not None]
    dense = 0
    while dense < min(take, len(raw)) and raw[dense].position == old + 1 + dense:
        dense += 1
    gap: Tombstone | None = None
    parked: frozenset[uuid.UUID] = frozenset()
    if dense == 0:
        gap = _gap(db, subscription, partition, old, generation, raw, head)
        if gap is None:
            return None
        through = gap.gap_to
        events: list[RawEvent] = []
    else:
        events = raw[:dense]
        through = old + dense
        if subscription.on_error == "park":
            batch = stored_events(tuple(event) for event in events)
            parked = parked_among(db, subscription.declaration(), [(batch, generation)])
            events = [event for event in events if event.id not in parked]
    db.run(Query("remote_end_stale_leases", {"name": name, "partition": partition}, nothing))
    lease_id = uuid.uuid4()
    deadline = db.run(
        Query(
            "remote_take_lease",
            {
                "id": lease_id, "name": name, "stream": stream, "partition": partition,
                "worker": worker,
                "generation": generation, "position": old, "through": through,
                "gap": None if gap is None else json.dumps(_gap_json(gap)),
                "parked": list(parked), "seconds": seconds,
            },
            first_row,
        )
    )  # fmt: skip
    if deadline is None:
        return None
    return Lease(
        lease_id, name, stream, partition, worker, generation, old, through, deadline[0],
        events, gap,
    )  # fmt: skip


def _gap(
    db: Db,
    subscription: RemoteSubscription,
    partition: int,
    old: int,
    generation: int,
    raw: list[RawEvent],
    head: int,
) -> Tombstone | None:
    """The gap after `old` when retention removed its next position (below the floor);
    otherwise the partition stops before the missing events (None)."""
    name, stream = subscription.name, subscription.stream
    floor, kept, partition_head, aged_through, capped_through = db.run(
        Query(
            "partition_floor",
            {"name": name, "stream": stream, "partition": partition},
            lambda result: result.rows[0],
        )
    )
    if old + 1 >= int(floor):
        last = raw[0].position - 1 if raw else head
        missing = PositionsMissing(name, stream, partition, old + 1, last)
        db.run(stop_partition(name, partition, old, generation, missing))
        return None
    last = floor - 1 if kept is None or kept <= old else min(floor - 1, int(kept))
    reason = gap_reason(old + 1, aged_through, capped_through)
    return Tombstone(stream, partition, old + 1, last, floor, reason, partition_head)


def _gap_json(gap: Tombstone) -> dict[str, Any]:
    return {"gap_from": gap.gap_from, "gap_to": gap.gap_to, "floor": gap.floor,
            "reason": gap.reason, "head": gap.head}  # fmt: skip


def _stored(row: Row) -> _Stored:
    gap = row[7]
    if isinstance(gap, str):
        gap = json.loads(gap)
    return _Stored(
        row[0], str(row[1]), int(row[2]), str(row[3]), int(row[4]), int(row[5]), int(row[6]),
        gap, list(row[8] or []), row[9], row[10], bool(row[11]),
    )  # fmt: skip


def _live(db: Db, name: str, lease_id: uuid.UUID) -> tuple[_Stored, str]:
    """The lease, once its partition's position row and then its own row are locked (the
    order a claim takes them in), and the subscription's stream; LeaseNotFound, or
    LeaseConflict unless it is live and its subscription still stands where it began."""
    found = db.run(Query("remote_lease", {"id": lease_id}, first_row))
    if found is None or _stored(found).subscription != name:
        raise LeaseNotFound(
            f"subscription {name!r} has no lease {str(lease_id)!r} (a lease is kept for a "
            "day after it ends); claim a new one"
        )
    partition = _stored(found).partition
    where = {"name": name, "partition": partition}
    standing = db.run(Query("remote_lock_position", where, first_row))
    lease = _stored(db.run(Query("remote_lock_lease", {"id": lease_id}, lambda r: r.rows[0])))
    if lease.ended is not None:
        raise LeaseConflict(f"lease {str(lease_id)!r} has ended ({lease.ended}); claim a new one")
    if lease.expired:
        raise LeaseConflict(
            f"lease {str(lease_id)!r} expired at {lease.deadline.isoformat()} (extend it "
            "before its deadline); claim a new one"
        )
    if standing is None or (int(standing[0]), int(standing[1])) != (
        lease.position,
        lease.generation,
    ):
        raise LeaseConflict(
            f"the position of {name!r} in partition {partition} moved since lease "
            f"{str(lease_id)!r} was claimed (a reset, or another worker); nothing was changed"
        )
    return lease, str(standing[2])


def _target(lease: _Stored, position: int | None, what: str) -> int:
    target = lease.through if position is None else position
    if isinstance(target, bool) or not isinstance(target, int):
        raise InvalidInput(f"{what} must be a whole number, not {shown_value(target)}")
    if not lease.position < target <= lease.through:
        raise InvalidInput(
            f"{what} {target} is outside the lease's batch: positions {lease.position + 1} "
            f"to {lease.through}"
        )
    if lease.gap is not None and target != lease.through:
        raise InvalidInput(f"a gap is acknowledged whole: {what} must be {lease.through}")
    return target


def _failing(db: Db, stream: str, lease: _Stored, position: int | None) -> int:
    """The position a nack charges: `position`, or the lease's first event delivered
    (the events of parked keys were left out of it, and are not the worker's to fail)."""
    if position is not None:
        failing = _target(lease, position, "position")
    if not lease.parked:
        return lease.position + 1 if position is None else failing
    params = {"stream": stream, "partition": lease.partition, "after": lease.position,
              "through": lease.through}  # fmt: skip
    events = db.run(Query("remote_read_events", params, lambda r: stored_events(r.rows)))
    parked = set(lease.parked)
    delivered = [event.position for event in events if event.id not in parked]
    if position is None:
        if not delivered:
            raise InvalidInput("this lease delivered no event to fail (all were parked): ack it")
        return delivered[0]
    if failing not in delivered:
        raise InvalidInput(
            f"position {failing} is an event of a parked key, which this lease did not deliver"
        )
    return failing


def _move(db: Db, name: str, stream: str, lease: _Stored, position: int) -> None:
    """Compare-and-set the position from the lease's to `position` (the events between
    handled), setting aside the events of parked keys among them as the claim did."""
    subscription = remote_subscription(db, name)
    if subscription.on_error == "park" and lease.gap is None:
        params = {"stream": stream, "partition": lease.partition, "after": lease.position,
                  "through": position}  # fmt: skip
        events = db.run(Query("remote_read_events", params, lambda r: stored_events(r.rows)))
        ids = {event.id for event in events}
        expected = frozenset(event_id for event_id in lease.parked if event_id in ids)
        try:
            check_parked(
                db, subscription.declaration(), [(events, lease.generation)], lease.partition,
                expected,
            )  # fmt: skip
        except Fenced as fenced:
            raise LeaseConflict(str(fenced)) from None
    params = {
        "name": name, "stream": stream, "partition": lease.partition, "old": lease.position,
        "new": position, "generation": lease.generation, "next_time": None,
    }  # fmt: skip
    if db.run(Query("commit_position", params, first_row)) is None:
        raise LeaseConflict(f"the position of {name!r} moved; nothing was changed")
    if lease.gap is not None:
        gap = Tombstone(stream, lease.partition, **lease.gap)
        db.run(record_gap(name, lease.generation, gap, "handled"))


def ack(db: Db, name: str, lease_id: uuid.UUID, position: int | None = None) -> int:
    """Acknowledge the lease's events up to `position` (default: its whole batch, or its
    gap) and end it: the new position, committed by compare-and-set."""
    with db.transaction():
        lease, stream = _live(db, name, lease_id)
        target = _target(lease, position, "position")
        _move(db, name, stream, lease, target)
        db.run(Query("remote_end_lease", {"id": lease_id, "ended": "acked"}, nothing))
        return target


def extend(db: Db, name: str, lease_id: uuid.UUID, seconds: float) -> datetime:
    """Move a live lease's deadline to `seconds` from now (a heartbeat); the deadline."""
    seconds = validate_lease_seconds(seconds)
    with db.transaction():
        _live(db, name, lease_id)
        row = db.run(Query("remote_extend_lease", {"id": lease_id, "seconds": seconds}, first_row))
        if row is None:
            raise LeaseConflict(f"lease {str(lease_id)!r} could not be extended")
        deadline: datetime = row[0]
        return deadline


def release(db: Db, name: str, lease_id: uuid.UUID) -> None:
    """End a live lease without acknowledging anything: its partition is free at once,
    and its next claim gets the same batch."""
    with db.transaction():
        lease, _ = _live(db, name, lease_id)
        params = {"name": name, "partition": lease.partition, "position": lease.position,
                  "generation": lease.generation}  # fmt: skip
        db.run(Query("remote_free_partition", params, nothing))
        db.run(Query("remote_end_lease", {"id": lease_id, "ended": "released"}, nothing))


def nack(
    db: Db,
    name: str,
    lease_id: uuid.UUID,
    settings: Settings,
    error: str,
    position: int | None = None,
    retry_after: float | None = None,
) -> Failure:
    """The handling of event `position` (default: the batch's first) failed with
    `error`: the events before it are acknowledged, the lease ends, and the failure counts
    an attempt toward the subscription's remote error policy, as a local batch's would
    (retried after `retry_after` seconds, else after the settings' doubling delay; at the
    last attempt stopped, dead-lettered or parked). What the policy did."""
    if not isinstance(error, str):
        raise InvalidInput(f"error must be a text, not {shown_value(error)}")
    if retry_after is not None:
        if (
            isinstance(retry_after, bool)
            or not isinstance(retry_after, int | float)
            or not (0 <= retry_after <= 86_400)
        ):
            raise InvalidInput(
                f"retry_after must be a number of seconds from 0 to 86400, "
                f"not {shown_value(retry_after)}"
            )
        delay = delay_max = float(retry_after)
    else:
        delay, delay_max = settings.retry_delay, settings.retry_delay_max
    with db.transaction():
        lease, stream = _live(db, name, lease_id)
        failing = _failing(db, stream, lease, position)
        old = lease.position
        if lease.gap is None and failing > old + 1:
            _move(db, name, stream, lease, failing - 1)
            old = failing - 1
        db.run(Query("remote_end_lease", {"id": lease_id, "ended": "nacked"}, nothing))
        subscription = remote_subscription(db, name)
        failed = BatchFailed(
            RemoteHandlerFailed(error[:MAX_ERROR_TEXT]),
            0 if lease.gap is not None else 1,
            lease.through if lease.gap is not None else failing,
            old,
            lease.generation,
            lease.partition,
            False,
        )
        return record_failure(
            db, subscription.declaration(), lease.partition, failed, delay, delay_max
        )
