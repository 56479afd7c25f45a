"""The batch transaction of the Consume flow (DESIGN.md): lock the position row, read the
next events, set aside those of parked keys, run the handlers on the same connection,
compare-and-set the position, commit. The handlers' writes and the new position commit
together or not at all (invariant 2); a gap retention left is passed or stopped before,
never skipped silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import groupby
from operator import itemgetter
from uuid import UUID

import psycopg

from subengine.db._sql import Db, Query, Row, nothing
from subengine.model._declarations import Subscription
from subengine.model._errors import (
    Fenced,
    PositionsMissing,
    StoppedAtGap,
    SubscriptionNotFound,
)
from subengine.model._events import Event, Tombstone, gap_reason, stored_events
from subengine.model._tracing import batch_span
from subengine.subscriptions._failures import BatchFailed, database_trouble, stop_partition
from subengine.subscriptions._handlers import run_gap_handler, run_handlers
from subengine.subscriptions._parking import check_parked, park_events, parked_among


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What one batch did: the events handled and the position after them, and the
    events of parked keys it set aside instead (policy park)."""

    partition: int
    handled: int
    position: int
    next_time: datetime | None
    gap: Tombstone | None = None  # the gap the batch passed (policy skip or a handler)
    parked: int = 0


def process_batch(db: Db, subscription: Subscription, partition: int) -> BatchOutcome | None:
    """Handle the next batch of one partition.

    Transactional subscriptions run the handlers inside the transaction that moves the
    position: exactly once. At-least-once subscriptions run them between two
    transactions, without a connection; a crash before the second repeats the batch.
    Returns None when the partition is stopped, its subscription paused, or its failed
    event waits for the retry delay (`retry_at`). A handler's exception rolls the batch
    back and propagates; `Fenced` means the position moved under us (nothing of this
    batch was committed); `PositionsMissing` means events after the position are no longer
    stored (the partition is then stopped before them; `StoppedAtGap` when retention
    removed them and the gap policy is `stop`). A gap the policy passes is an outcome
    with no events handled and its `gap`.
    """
    try:
        outcomes = handle_batch(db, subscription, partition)
    except BatchFailed as failed:
        raise failed.error from None
    return None if outcomes is None else outcomes[0]


def handle_batch(
    db: Db,
    subscription: Subscription,
    partition: int,
    size: int | None = None,
    companions: int = 0,
    carried: int | None = None,
) -> list[BatchOutcome] | None:
    """`process_batch` for the worker: at most `size` events (default: the subscription's
    batch size) from the partition and, for a transactional subscription, from up to
    `companions` more of its partitions with work (see the `lock_batch` query), each of
    them at most `size` events too, up to `carried` events in the transaction (default:
    `size`); the outcome of each partition the batch moved, the chosen one first. A
    failure of the batch's events arrives as `BatchFailed`.

    Only the handlers' own exceptions, and a commit that fails because of their writes,
    are the events' failures. Any other error (reading the batch, moving the position,
    the connection) propagates as it is: it says nothing about the events.
    """
    size = size or subscription.batch_size
    if subscription.ack == "transactional":
        return _transactional_batch(
            db, subscription, partition, size, companions, max(size, carried or size)
        )
    batch: _Batch | None = None
    parked: frozenset[UUID] = frozenset()
    try:
        for _ in range(2):  # again once a gap's bounds are stored, for its handler to run
            with db.transaction():
                batch = _next_batch(db, subscription, partition, size, 0, size)
                if batch is not None and batch.parts and batch.parts[0].gap is not None:
                    return _commit_positions(db, subscription, batch)  # with the gap's record
                if batch is not None and batch.parts and batch.parts[0].events:
                    part = batch.parts[0]
                    db.run(_bounds(subscription, part.partition, part.old, part.generation,
                                   part.events[-1].position))  # fmt: skip
                    parked = parked_among(db, subscription, _parking_parts(batch))
            if batch is None or not batch.bounds_stored:
                break
    except psycopg.Error as error:
        # a commit that fails after a gap handler ran fails for what it wrote
        if batch is None or not batch.parts or subscription.gap is None or database_trouble(error):
            raise
        raise _failed(error, batch, batch.parts[0]) from error
    if batch is None or batch.bounds_stored:
        return None
    if batch.missing is not None:
        raise batch.missing
    _run_handlers(db, subscription, batch, False, parked)
    with db.transaction():
        parked = check_parked(db, subscription, _parking_parts(batch), partition, parked)
        return _commit_positions(db, subscription, batch, parked)


def _bounds(
    subscription: Subscription, partition: int, old: int, generation: int, through: int
) -> Query[None]:
    """Store where an at_least_once batch (or gap) ends, before its handlers run: until
    its position commits, every retry of it (after RetryLater, a failure, a crash, from
    any process) reads that batch again and no more, however many events came since
    (DESIGN.md, "A retry is the same batch"). A handler that sends it somewhere can
    name it by its bounds."""
    params = {
        "name": subscription.name,
        "partition": partition,
        "position": old,
        "generation": generation,
        "through": through,
    }
    return Query("fix_batch", params, nothing)


def _transactional_batch(
    db: Db,
    subscription: Subscription,
    partition: int,
    size: int,
    companions: int,
    carried: int,
) -> list[BatchOutcome] | None:
    batch: _Batch | None = None
    handled = False
    outcomes: list[BatchOutcome] | None = None
    try:
        with db.transaction():
            batch = _next_batch(db, subscription, partition, size, companions, carried)
            if batch is not None and batch.missing is None:
                parked = park_events(db, subscription, _parking_parts(batch))
                _run_handlers(db, subscription, batch, True, parked)
                handled = True
                outcomes = _commit_positions(db, subscription, batch, parked)
    except psycopg.Error as error:
        # Once the handlers have run, an error that is not the database's own trouble
        # comes from what they did: a write that breaks a deferred constraint at COMMIT,
        # or an error they caught, which left the transaction aborted.
        if batch is not None and handled and not database_trouble(error):
            raise _failed(error, batch, batch.parts[0]) from error
        raise
    if batch is not None and batch.missing is not None:
        raise batch.missing  # the partition's stop committed
    return outcomes


def _parking_parts(batch: _Batch) -> list[tuple[list[Event], int]]:
    return [(part.events, part.generation) for part in batch.parts]


def _run_handlers(
    db: Db,
    subscription: Subscription,
    batch: _Batch,
    in_transaction: bool,
    parked: frozenset[UUID] = frozenset(),
) -> None:
    """Each partition's events in one call, in position order, but those set aside for
    their parked key (`parked`): a handler sees no event of a parked key."""
    for part in batch.parts:
        events = part.events
        if parked:
            events = [event for event in events if event.id not in parked]
        try:
            with batch_span(subscription.name, subscription.stream, part.partition, events):
                run_handlers(db, subscription, events, in_transaction)
        except Exception as error:
            if database_trouble(error):
                raise  # a database error is never the events' failure (invariant 8)
            raise _failed(error, batch, part) from error


def _failed(error: Exception, batch: _Batch, part: _Part) -> BatchFailed:
    # the part's events as read, those set aside included: a failure of a part that held
    # more than one of them is split, so that it is charged to the failing event alone
    last = part.events[-1].position if part.events else part.old
    return BatchFailed(
        error, len(part.events), last, part.old, part.generation, part.partition,
        len(batch.parts) > 1,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Part:
    """A batch's events of one partition, and where the subscription stood there."""

    partition: int
    old: int
    generation: int
    events: list[Event]
    next_time: datetime | None
    gap: Tombstone | None = None  # a gap the batch passes instead of events


@dataclass(frozen=True, slots=True)
class _Batch:
    """A batch: its partitions' parts, the chosen partition's first (perhaps without
    events), or the events no longer stored after the chosen partition's position."""

    parts: list[_Part]
    missing: PositionsMissing | None = None
    # an at_least_once gap's bounds were stored (in this transaction, to commit before
    # its handler runs in the next): no parts
    bounds_stored: bool = False


def _next_batch(
    db: Db,
    subscription: Subscription,
    partition: int,
    size: int,
    companions: int,
    carried: int,
) -> _Batch | None:
    """Lock the chosen partition's position row and read the events after it
    (`lock_batch`), then, when it has no more events for now and `companions` allows,
    the rows and events of other partitions of the subscription (`lock_companions`), up
    to `carried` events in all and `size` per partition; None if the partition is
    stopped or the subscription paused.

    Positions are dense and commit in order (invariant 1), so the events after the
    position are position + 1, + 2, ... up to the head, all committed: a hole shows
    events no longer stored. A batch takes a partition's events up to the first hole;
    a chosen partition whose next position is missing is a gap when retention removed
    it (below the floor: passed or stopped before by the subscription's gap policy, see
    `_missing`), and otherwise stopped before it (in this transaction) with the batch
    naming the missing positions (`missing`): they are never skipped silently. A
    companion whose next position is missing is left out: its own batch handles it.
    """
    params = {
        "name": subscription.name,
        "partition": partition,
        "stream": subscription.stream,
        "size": size,
    }
    rows = db.run(Query("lock_batch", params, lambda result: result.rows))
    if not rows:
        raise SubscriptionNotFound(
            f"subscription {subscription.name!r} is not stored for stream "
            f"{subscription.stream!r} (deleted?), or has no partition {partition}"
        )
    _, old, generation, halted, attempts, head, _ = rows[0][:7]
    if halted:
        return None
    [(chosen, found)] = _parts(rows)
    if chosen is None:  # the next position is no longer stored
        return _missing(db, subscription, partition, old, generation, found, head)
    parts = [chosen]
    room = carried - len(chosen.events)
    if companions and room > 0 and attempts == 0 and chosen.next_time is None:
        rows = db.run(
            Query(
                "lock_companions",
                {**params, "room": room, "companions": companions},
                lambda result: result.rows,
            )
        )
        # the query shares the room out without a cap per partition: each handler call
        # gets at most `size` events, and a partition cut short keeps its next event's time
        parts.extend(part for part, _ in _parts(rows, size) if part is not None)
    return _Batch(parts)


def _missing(
    db: Db,
    subscription: Subscription,
    partition: int,
    old: int,
    generation: int,
    found: int | None,
    head: int,
) -> _Batch:
    """The batch of a partition whose next position is not stored. Below the floor,
    retention removed it: a gap, which the subscription's policy passes (recorded, after
    its gap handler if it has one) or stops before. At or above the floor, the events
    are missing for another reason: the partition stops before them."""
    floor, kept, partition_head, aged_through, capped_through = db.run(
        Query(
            "partition_floor",
            {"name": subscription.name, "stream": subscription.stream, "partition": partition},
            lambda result: result.rows[0],
        )
    )
    floor = int(floor)
    if old + 1 >= floor:
        last = found - 1 if found is not None else head
        missing = PositionsMissing(subscription.name, subscription.stream, partition, old + 1, last)
        db.run(stop_partition(subscription.name, partition, old, generation, missing))
        return _Batch([], missing)
    # a retried gap keeps its bounds, though retention removed more since
    last = floor - 1 if kept is None or kept <= old else min(floor - 1, int(kept))
    reason = gap_reason(old + 1, aged_through, capped_through)
    gap = Tombstone(subscription.stream, partition, old + 1, last, floor, reason, partition_head)
    if subscription.on_gap == "stop":
        stopped = StoppedAtGap(subscription.name, gap)
        db.run(stop_partition(subscription.name, partition, old, generation, stopped))
        return _Batch([], stopped)
    unbounded = kept is None or kept <= old
    if subscription.gap is not None and subscription.ack == "at_least_once" and unbounded:
        # its bounds first, committed on their own: a crash in its handler keeps them
        db.run(_bounds(subscription, partition, old, generation, gap.gap_to))
        return _Batch([], bounds_stored=True)
    if subscription.gap is not None:
        try:
            run_gap_handler(db, subscription, gap)
        except Exception as error:
            if database_trouble(error):
                raise
            raise BatchFailed(error, 0, gap.gap_to, old, generation, partition, False) from error
    try:
        action = "handled" if subscription.gap else "skipped"
        db.run(record_gap(subscription.name, generation, gap, action))
    except psycopg.Error as error:
        if subscription.gap is None or database_trouble(error):
            raise
        # the gap handler left the transaction aborted (an SQL error it caught)
        raise BatchFailed(error, 0, old, old, generation, partition, False) from error
    return _Batch([_Part(partition, old, generation, [], None, gap)])


def record_gap(name: str, generation: int, gap: Tombstone, action: str) -> Query[None]:
    """Record a gap a subscription passed in its gaps table: `action` says how (the
    policy skipped it, its gap handler handled it, or an operator accepted it)."""
    return Query(
        "record_gap",
        {
            "name": name,
            "stream": gap.stream,
            "partition": gap.partition,
            "generation": generation,
            "gap_from": gap.gap_from,
            "gap_to": gap.gap_to,
            "floor": gap.floor,
            "reason": gap.reason,
            "action": action,
        },
        nothing,
    )


def _parts(rows: Sequence[Row], cap: int | None = None) -> list[tuple[_Part | None, int | None]]:
    """The parts of a batch from the rows of lock_batch or lock_companions (a
    partition's rows after the other): each partition's events up to the first hole in
    their positions (and at most `cap`) and its next stored event's time; None for a
    partition whose next position is missing (then with the first position found after
    it, if any)."""
    parts: list[tuple[_Part | None, int | None]] = []
    # a partition's rows repeat its first seven columns: its number tells them apart
    for _, grouped in groupby(rows, key=itemgetter(0)):
        group = list(grouped)
        part_partition, old, generation, _, _, _, take = group[0][:7]
        events = stored_events(row[7:] for row in group if row[7] is not None)
        dense = min(take, len(events), take if cap is None else cap)
        # positions only grow: when the last one is where no hole puts it, none is before
        if dense and events[dense - 1].position != old + dense:
            dense = 0
            while events[dense].position == old + 1 + dense:
                dense += 1
        if dense == 0 and take > 0:
            parts.append((None, events[0].position if events else None))
            continue
        # the next stored event's time (after a hole too: its batch must come to stop)
        next_time = events[dense].occurred_at if len(events) > dense else None
        parts.append((_Part(part_partition, old, generation, events[:dense], next_time), None))
    return parts


def _commit_positions(
    db: Db, subscription: Subscription, batch: _Batch, parked: frozenset[UUID] = frozenset()
) -> list[BatchOutcome]:
    news = [
        part.events[-1].position if part.events else part.gap.gap_to if part.gap else part.old
        for part in batch.parts
    ]
    query: Query[dict[int, datetime | None]]
    if len(batch.parts) == 1:
        [part] = batch.parts
        query = Query(
            "commit_position",
            {
                "name": subscription.name,
                "stream": subscription.stream,
                "partition": part.partition,
                "old": part.old,
                "new": news[0],
                "generation": part.generation,
                "next_time": part.next_time,
            },
            lambda result: dict(result.rows),
        )
    else:
        query = Query(
            "commit_positions",
            {
                "name": subscription.name,
                "stream": subscription.stream,
                "partitions": [part.partition for part in batch.parts],
                "old": [part.old for part in batch.parts],
                "new": news,
                "generations": [part.generation for part in batch.parts],
                "next_times": [part.next_time for part in batch.parts],
            },
            lambda result: dict(result.rows),
        )
    moved: dict[int, datetime | None] = db.run(query)
    if len(moved) != len(batch.parts):
        fenced = sorted({part.partition for part in batch.parts} - set(moved))
        raise Fenced(
            f"the position of {subscription.name!r} in partition"
            f"{'s' if len(fenced) > 1 else ''} {', '.join(map(str, fenced))} moved during "
            "the batch; nothing of it was committed"
        )
    # each next event's time as stored: events committed since the batch read may have
    # brought one
    outcomes = []
    for part, new in zip(batch.parts, news, strict=True):
        aside = sum(event.id in parked for event in part.events) if parked else 0
        outcomes.append(
            BatchOutcome(
                part.partition, len(part.events) - aside, new, moved[part.partition], part.gap,
                aside,
            )
        )  # fmt: skip
    return outcomes
