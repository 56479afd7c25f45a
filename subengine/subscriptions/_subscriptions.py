"""Storing subscriptions and moving their positions by hand: creating (on first use),
resetting, deleting, accepting a gap, and reading where they stand.

A subscription is stored on first use, with a position per partition chosen by its start
point; a later declaration that disagrees on stream or start is an error, never a
silent change. The batches that move positions as events are handled are `_batches`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from subengine.db._sql import Db, Query, Result, Row, first_row, nothing, rowcount
from subengine.model._declarations import (
    Start,
    Subscription,
    describe_start,
    start_to_json,
)
from subengine.model._errors import (
    InvalidInput,
    StreamBeingDeleted,
    SubscriptionMismatch,
    SubscriptionNotFound,
)
from subengine.model._events import Tombstone, gap_reason
from subengine.model._names import INTEGER_MAX, validate_stream_name, validate_whole_number
from subengine.streams._streams import get_stream, partition_states
from subengine.subscriptions._batches import record_gap
from subengine.subscriptions._parking import release_parked_keys


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
    only the partitions it names, the others keep their position, generation, failure
    state and parked keys. One transaction: it waits for the batches in flight on the
    partitions it moves (they hold their position rows), then moves them at once, clears
    their failure state and releases their parked keys (superseded: from the new
    positions their events are handled again, or skipped). A batch that read the old
    generation fails its compare-and-set (`Fenced`) and commits nothing. The stored start
    point is unchanged: it records where the subscription began. Returns the position of
    every partition after the reset; with `dry_run`, what they would be, and nothing
    changes.
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
        db.run(release_parked_keys(name, list(moved)))
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
        position, generation, stream, floor, head, aged_through, capped_through = row
        if position >= floor - 1:
            raise InvalidInput(
                f"partition {partition} of subscription {name!r} has no gap: its position "
                f"{position} is at or past the floor's eve ({floor - 1}); nothing to skip"
            )
        reason = gap_reason(position + 1, aged_through, capped_through)
        gap = Tombstone(stream, partition, position + 1, floor - 1, floor, reason, head)
        db.run(record_gap(name, generation, gap, "accepted"))
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
