"""Storing subscriptions and moving their positions, one batch at a time.

A subscription is stored on first use, with a position per partition chosen by its start
point; a later declaration that disagrees on stream or start is an error, never a
silent change. `process_batch` is the Consume flow's transaction (DESIGN.md): lock the
position, read the next events, run the handlers on the same connection, compare-and-set
the position, commit. The handlers' writes and the new position commit together or not
at all (invariant 2).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import groupby
from operator import itemgetter
from typing import Any, Literal

import psycopg
from psycopg.types.json import Jsonb

from subengine.db._sql import Db, Query, Result, Row, first_row, nothing, rowcount
from subengine.model._declarations import (
    Start,
    Subscription,
    describe_start,
    start_to_json,
)
from subengine.model._errors import (
    Fenced,
    InvalidInput,
    PositionsMissing,
    RetryLater,
    StoppedAtGap,
    StreamBeingDeleted,
    SubscriptionMismatch,
    SubscriptionNotFound,
)
from subengine.model._events import Event, Tombstone, stored_events
from subengine.model._names import INTEGER_MAX, validate_stream_name, validate_whole_number
from subengine.model._settings import Settings
from subengine.streams._streams import get_stream, partition_states

_MAX_ERROR_LENGTH = 4000


@dataclass(frozen=True, slots=True)
class SubscriptionPosition:
    """Where a subscription stands in one partition."""

    partition: int
    position: int
    generation: int
    next_time: datetime | None
    attempts: int
    last_error: str | None
    stopped: bool


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What one batch did: the events handled and the position after them."""

    partition: int
    handled: int
    position: int
    next_time: datetime | None
    gap: Tombstone | None = None  # the gap the batch passed (policy skip or a handler)


def ensure_subscription(db: Db, subscription: Subscription) -> None:
    """Store `subscription` if it is new; check it agrees with the stored one if not."""
    with db.transaction():
        db.run(get_stream(subscription.stream))  # raises StreamNotFound
        start = subscription.start_json
        _check_start_positions(db, subscription.stream, start)
        params = {"name": subscription.name, "stream": subscription.stream, "start": Jsonb(start)}
        if db.run(Query("create_subscription", params, first_row)) is not None:
            written = db.run(
                _write_positions(subscription.name, subscription.stream, start, 1, only_named=False)
            )
            if not written:  # no partition rows: a delete of the stream has begun
                raise StreamBeingDeleted(subscription.stream)
            return
        stored = db.run(Query("get_subscription", {"name": subscription.name}, first_row))
        if stored is None:  # deleted between the two statements: nothing to agree with
            raise SubscriptionMismatch(f"subscription {subscription.name!r} vanished; try again")
        name, stream, stored_start, _generation, _paused = stored
        if (stream, stored_start) != (subscription.stream, start):
            raise SubscriptionMismatch(
                f"subscription {name!r} is stored with stream {stream!r} and start "
                f"{describe_start(stored_start)}, but the app declares stream "
                f"{subscription.stream!r} and start {describe_start(start)}; declare it as "
                f"stored, delete the stored one (`subengine subscription delete {name}`: its "
                "positions and dead letters go with it), or give the new one another name"
            )


def reset_subscription(db: Db, name: str, to: Start, *, dry_run: bool = False) -> dict[int, int]:
    """Move positions of a stored subscription to `to`, in a new generation.

    `to` is 'beginning', 'end', a time, or a map of partition to position; a map moves
    only the partitions it names, the others keep their position, generation and failure
    state. One transaction: it waits for the batches in flight on the partitions it moves
    (they hold their position rows), then moves them at once and clears their failure
    state. A batch that read the old generation fails its compare-and-set (`Fenced`) and
    commits nothing. The stored start point is unchanged: it records where the
    subscription began. Returns the position of every partition after the reset; with
    `dry_run`, what they would be, and nothing changes.
    """
    validate_stream_name(name)
    start = start_to_json(to)
    with db.transaction(force_rollback=dry_run):
        bumped = db.run(Query("bump_generation", {"name": name}, first_row))
        if bumped is None:
            raise SubscriptionNotFound(f"no subscription named {name!r}")
        stream, generation = bumped
        _check_start_positions(db, stream, start)
        moved = db.run(_write_positions(name, stream, start, generation, only_named=True))
        return {p.partition: moved.get(p.partition, p.position) for p in db.run(positions(name))}


@dataclass(frozen=True, slots=True)
class Deleted:
    """What deleting a subscription removed."""

    name: str
    stream: str
    partitions: int
    dead_letters: int


def delete_subscription(db: Db, name: str, *, force: bool = False) -> Deleted:
    """Delete a subscription, its positions and its dead letters in one transaction.

    Refused (InvalidInput, nothing changed) while connected workers run it or hold its
    partitions, unless `force`. It waits for the batches in flight (they hold their
    position rows); a batch that started after it finds the subscription gone.
    """
    validate_stream_name(name)
    where = {"name": name}
    with db.transaction():
        row = db.run(Query("lock_subscription", where, first_row))
        if row is None:
            raise SubscriptionNotFound(f"no subscription named {name!r}")
        if not force:
            running: Sequence[Row] = db.run(Query("workers_running", where))
            if running:
                pids = ", ".join(f"pid {pid} on {host}" for host, pid in running)
                raise InvalidInput(
                    f"subscription {name!r} is run by connected workers ({pids}); stop "
                    "them first, or delete it anyway with --force (force=True)"
                )
        partitions = db.run(Query("delete_positions", where, rowcount))
        letters = db.run(Query("delete_dead_letters", where, rowcount))
        db.run(Query("delete_subscription", where, nothing))
        return Deleted(name, str(row[1]), partitions, letters)


def skip_gap(db: Db, name: str, partition: int) -> Tombstone:
    """Accept the gap before a subscription's position in one partition (an operator's
    `subscription skip-gap`): record it (action 'accepted'), move the position to the
    floor's eve and restart the partition, in one transaction. A batch moving that
    position meanwhile is waited for; one that read it before fails its compare-and-set.
    InvalidInput when the partition has no gap."""
    validate_stream_name(name)
    validate_whole_number(partition, "partition", 0, INTEGER_MAX)
    where = {"name": name, "partition": partition}
    with db.transaction():
        row = db.run(Query("lock_gap", where, first_row))
        if row is None:
            if db.run(Query("subscription_exists", {"name": name}, first_row)) is None:
                raise SubscriptionNotFound(f"no subscription named {name!r}")
            raise InvalidInput(f"subscription {name!r} has no partition {partition}")
        position, generation, stream, floor = row
        if position >= floor - 1:
            raise InvalidInput(
                f"partition {partition} of subscription {name!r} has no gap: its position "
                f"{position} is at or past the floor's eve ({floor - 1}); nothing to skip"
            )
        gap = Tombstone(stream, partition, position + 1, floor - 1, floor)
        db.run(_record_gap(name, generation, gap, "accepted"))
        db.run(Query("accept_gap", {**where, "stream": stream, "position": floor - 1}, nothing))
        return gap


def _positions_written(result: Result) -> dict[int, int]:
    return dict(sorted((partition, position) for partition, position in result.rows))


def _write_positions(
    name: str, stream: str, start: dict[str, Any], generation: int, *, only_named: bool
) -> Query[dict[int, int]]:
    return Query(
        "write_positions",
        {
            "name": name,
            "stream": stream,
            "kind": start["kind"],
            "time": start.get("time"),
            "positions": json.dumps(start.get("positions", {})),
            "generation": generation,
            "only_named": only_named,
        },
        _positions_written,
    )


def _check_start_positions(db: Db, stream: str, start: dict[str, Any]) -> None:
    if start["kind"] != "positions":
        return
    heads = {s.partition: s.head for s in db.run(partition_states(stream))}
    for partition, position in start["positions"].items():
        head = heads.get(int(partition))
        if head is None:
            raise InvalidInput(
                f"start names partition {partition}, but stream {stream!r} has "
                f"partitions 0..{len(heads) - 1}"
            )
        if position > head:
            raise InvalidInput(
                f"start position {position} of partition {partition} is past its head {head}"
            )


def positions(name: str) -> Query[list[SubscriptionPosition]]:
    """Every partition's position of a stored subscription, by partition."""
    return Query(
        "subscription_positions",
        {"name": name},
        lambda result: [SubscriptionPosition(*row) for row in result.rows],
    )


@dataclass(frozen=True, slots=True)
class Look:
    """What a look for work found: up to `limit` partitions with work, oldest next event
    first, and the suspects it could not settle because a batch held their rows."""

    work: list[tuple[tuple[str, int], datetime]]
    deferred: list[tuple[str, int]]


def look_for_work(
    serving: Sequence[str],
    suspects: Sequence[tuple[str, int]],
    whole: Sequence[str],
    limit: int,
) -> Query[Look]:
    """The look of the `look_for_work` query: the partitions with work of the `serving`
    subscriptions, after giving a next event's time to the `suspects` (pairs) and to
    every partition of the `whole` subscriptions that have events after their position
    but none yet (DESIGN.md invariant 7)."""

    def read(result: Result) -> Look:
        work, deferred = [], []
        for name, partition, next_time, later in result.rows:
            if later:
                deferred.append((str(name), int(partition)))
            else:
                work.append(((str(name), int(partition)), next_time))
        return Look(work, deferred)

    return Query(
        "look_for_work",
        {
            "serving": list(serving),
            "names": [name for name, _ in suspects],
            "partitions": [partition for _, partition in suspects],
            "whole": list(whole),
            "limit": limit,
        },
        read,
    )


class BatchFailed(Exception):
    """The events of a batch failed: a handler raised, or the transaction of a
    transactional batch failed to commit because of what the handlers wrote (a deferred
    constraint they broke, say). Nothing of the batch committed. `partition` is the
    partition whose handlers raised (the chosen one when the commit failed), `events` how
    many events of it the batch held, `last_position` the last of them, `error` what was
    raised, and `position` and `generation` where the subscription stood in it when the
    batch read it (failures are recorded only if it still stands there). `shared`: the
    batch carried other partitions too."""

    def __init__(
        self,
        error: Exception,
        events: int,
        last_position: int,
        position: int,
        generation: int,
        partition: int,
        shared: bool,
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.events = events
        self.last_position = last_position
        self.position = position
        self.generation = generation
        self.partition = partition
        self.shared = shared


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
) -> list[BatchOutcome] | None:
    """`process_batch` for the worker: at most `size` events (default: the subscription's
    batch size), from the partition and, for a transactional subscription, from up to
    `companions` more of its partitions with work (see the `lock_batch` query); the
    outcome of each partition the batch moved, the chosen one first. A failure of the
    batch's events arrives as `BatchFailed`.

    Only the handlers' own exceptions, and a commit that fails because of their writes,
    are the events' failures. Any other error (reading the batch, moving the position,
    the connection) propagates as it is: it says nothing about the events.
    """
    size = size or subscription.batch_size
    if subscription.ack == "transactional":
        return _transactional_batch(db, subscription, partition, size, companions)
    batch: _Batch | None = None
    try:
        with db.transaction():
            batch = _next_batch(db, subscription, partition, size, 0)
            if batch is not None and batch.parts and batch.parts[0].gap is not None:
                return _commit_positions(db, subscription, batch)  # with the gap's record
    except psycopg.Error as error:
        # a commit that fails after a gap handler ran fails for what it wrote
        if batch is None or subscription.gap is None or database_trouble(error):
            raise
        raise _failed(error, batch, batch.parts[0]) from error
    if batch is None:
        return None
    if batch.missing is not None:
        raise batch.missing
    _run_handlers(subscription, batch, None)
    with db.transaction():
        return _commit_positions(db, subscription, batch)


def _transactional_batch(
    db: Db,
    subscription: Subscription,
    partition: int,
    size: int,
    companions: int,
) -> list[BatchOutcome] | None:
    batch: _Batch | None = None
    handled = False
    outcomes: list[BatchOutcome] | None = None
    try:
        with db.transaction():
            batch = _next_batch(db, subscription, partition, size, companions)
            if batch is not None and batch.missing is None:
                _run_handlers(subscription, batch, db.conn)
                handled = True
                outcomes = _commit_positions(db, subscription, batch)
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


def _run_handlers(
    subscription: Subscription, batch: _Batch, conn: psycopg.Connection[Any] | None
) -> None:
    for part in batch.parts:  # each partition's events in one call: its order is kept
        try:
            subscription.handle(part.events, conn)
        except Exception as error:
            if database_trouble(error):
                raise  # a database error is never the events' failure (invariant 8)
            raise _failed(error, batch, part) from error


def database_trouble(error: BaseException) -> bool:
    """Whether an error is the database's trouble (a lost connection, a timeout, a
    cancelled query, a serialization failure or deadlock, a shutdown, a lack of
    resources), which a retry may cure and which says nothing about the events. Also
    for SQLAlchemy's wrappers of such errors, which handlers may raise."""
    original = getattr(error, "orig", None)
    if isinstance(original, psycopg.Error):
        error = original
    return isinstance(error, psycopg.OperationalError | psycopg.InterfaceError)


def _failed(error: Exception, batch: _Batch, part: _Part) -> BatchFailed:
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


def _next_batch(
    db: Db,
    subscription: Subscription,
    partition: int,
    size: int,
    companions: int,
) -> _Batch | None:
    """Lock the chosen partition's position row and read the events after it
    (`lock_batch`), then, when it leaves room in the batch and `companions` allows, the
    rows and events of other partitions of the subscription (`lock_companions`); None if
    the partition is stopped or the subscription paused.

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
    room = size - len(chosen.events)
    if companions and room > 0 and attempts == 0 and chosen.next_time is None:
        rows = db.run(
            Query(
                "lock_companions",
                {**params, "room": room, "companions": companions},
                lambda result: result.rows,
            )
        )
        parts.extend(part for part, _ in _parts(rows) if part is not None)
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
    floor = db.run(
        Query(
            "partition_floor",
            {"stream": subscription.stream, "partition": partition},
            lambda result: int(result.rows[0][0]),
        )
    )
    if old + 1 >= floor:
        last = found - 1 if found is not None else head
        missing = PositionsMissing(subscription.name, subscription.stream, partition, old + 1, last)
        db.run(stop_partition(subscription.name, partition, old, generation, missing))
        return _Batch([], missing)
    gap = Tombstone(subscription.stream, partition, old + 1, floor - 1, floor)
    if subscription.on_gap == "stop":
        stopped = StoppedAtGap(subscription.name, gap)
        db.run(stop_partition(subscription.name, partition, old, generation, stopped))
        return _Batch([], stopped)
    if subscription.gap is not None:
        try:
            subscription.handle_gap(gap, db.conn)
        except Exception as error:
            if database_trouble(error):
                raise
            raise BatchFailed(error, 0, old, old, generation, partition, False) from error
    try:
        action = "handled" if subscription.gap else "skipped"
        db.run(_record_gap(subscription.name, generation, gap, action))
    except psycopg.Error as error:
        if subscription.gap is None or database_trouble(error):
            raise
        # the gap handler left the transaction aborted (an SQL error it caught)
        raise BatchFailed(error, 0, old, old, generation, partition, False) from error
    return _Batch([_Part(partition, old, generation, [], None, gap)])


def _record_gap(name: str, generation: int, gap: Tombstone, action: str) -> Query[None]:
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


def _parts(rows: Sequence[Row]) -> list[tuple[_Part | None, int | None]]:
    """The parts of a batch from the rows of lock_batch or lock_companions (a
    partition's rows after the other): each partition's events up to the first hole in
    their positions and its next stored event's time; None for a partition whose next
    position is missing (then with the first position found after it, if any)."""
    parts: list[tuple[_Part | None, int | None]] = []
    # a partition's rows repeat its first seven columns: its number tells them apart
    for _, grouped in groupby(rows, key=itemgetter(0)):
        group = list(grouped)
        part_partition, old, generation, _, _, _, take = group[0][:7]
        events = stored_events(row[7:] for row in group if row[7] is not None)
        dense = min(take, len(events))
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


def _commit_positions(db: Db, subscription: Subscription, batch: _Batch) -> list[BatchOutcome]:
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
    return [
        BatchOutcome(part.partition, len(part.events), new, moved[part.partition], part.gap)
        for part, new in zip(batch.parts, news, strict=True)
    ]


def stop_partition(
    name: str,
    partition: int,
    position: int,
    generation: int,
    error: BaseException | None = None,
) -> Query[bool]:
    """Halt a partition of a subscription still at (position, generation), recording
    `error` as its last error when given; False when the position moved (fenced)."""
    return Query(
        "stop_partition",
        {
            "name": name,
            "partition": partition,
            "position": position,
            "generation": generation,
            "error": None if error is None else error_text(error),
        },
        lambda result: result.rowcount == 1,
    )


class _EventGone(Exception):
    """The failing event is no longer stored: nothing to dead-letter."""


def error_text(error: BaseException) -> str:
    """An exception as stored in last_error and dead_letters.error."""
    return f"{type(error).__name__}: {error}"[:_MAX_ERROR_LENGTH]


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed batch as recorded: its attempt, and what the error policy did (`retry`:
    nothing yet; `stopped`; `dead_lettered`: the failing event was recorded and skipped;
    `missing`: the failing event is no longer stored, so the partition stopped before it;
    `fenced`: nothing, because the position moved since the batch read it)."""

    attempts: int
    action: Literal["retry", "stopped", "dead_lettered", "missing", "fenced"]


def postpone_batch(db: Db, subscription: Subscription, failed: BatchFailed) -> bool:
    """Make a partition wait before its next batch, because a handler raised RetryLater;
    False when the position moved since the batch read it (a reset or another worker:
    nothing is recorded)."""
    error = failed.error
    seconds = error.seconds if isinstance(error, RetryLater) else 0.0
    params = {
        "name": subscription.name,
        "partition": failed.partition,
        "position": failed.position,
        "generation": failed.generation,
        "error": error_text(error),
        "seconds": seconds,
    }
    with db.transaction():
        return db.run(Query("postpone_batch", params, first_row)) is not None


def record_failure(
    db: Db,
    subscription: Subscription,
    partition: int,
    failed: BatchFailed,
    settings: Settings,
) -> Failure:
    """Count a failed attempt of the event after the position and apply the error policy
    at the last one. Call it for a batch of that one event only (a failed batch of several
    is first handled one event at a time, to find the failing one).

    Every write is fenced like the position (invariant 3): when a reset or another worker
    moved the position since the batch read it, nothing is recorded, so a failure is never
    charged to an event of another generation.
    """
    text = error_text(failed.error)
    where = {
        "name": subscription.name,
        "partition": partition,
        "position": failed.position,
        "generation": failed.generation,
    }
    with db.transaction():
        attempts_row = db.run(
            Query(
                "record_failure",
                {
                    **where,
                    "error": text,
                    "delay": settings.retry_delay,
                    "delay_max": settings.retry_delay_max,
                },
                first_row,
            )
        )
        if attempts_row is None:
            return Failure(0, "fenced")
        # the row is locked from here on: the writes below cannot be fenced
        attempts = int(attempts_row[0])
        if attempts < subscription.max_attempts:
            return Failure(attempts, "retry")
        # a gap has no event to dead-letter: a failing gap handler stops the partition,
        # in state gap, with its error
        if subscription.on_error == "stop" or failed.events == 0:
            db.run(stop_partition(subscription.name, partition, failed.position, failed.generation))
            return Failure(attempts, "stopped")
        # dead_letter: the event after the position is the failing one
        failing = failed.position + 1
        try:
            with db.transaction():  # the older open dead letter stays open if none follows
                db.run(Query("supersede_dead_letters", {**where, "position": failing}, nothing))
                recorded = db.run(
                    Query(
                        "dead_letter",
                        {
                            **where,
                            "stream": subscription.stream,
                            "position": failing,
                            "error": text,
                            "attempts": attempts,
                        },
                        first_row,
                    )
                )
                if recorded is None:
                    raise _EventGone
        except _EventGone:
            missing = PositionsMissing(
                subscription.name, subscription.stream, partition, failing, failing
            )
            db.run(
                stop_partition(
                    subscription.name, partition, failed.position, failed.generation, missing
                )
            )
            return Failure(attempts, "missing")
        db.run(Query("skip_event", where, nothing))
        return Failure(attempts, "dead_lettered")
