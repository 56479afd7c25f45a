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
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from subengine._app import Subscription, describe_start
from subengine._errors import Fenced, InvalidInput, SubscriptionMismatch
from subengine._queries import query
from subengine._read import get_stream, partition_states, read_after


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


def ensure_subscription(
    conn: psycopg.Connection[Any], schema: str, subscription: Subscription
) -> None:
    """Store `subscription` if it is new; check it agrees with the stored one if not."""
    with conn.transaction():
        get_stream(conn, schema, subscription.stream)  # raises StreamNotFound
        start = subscription.start_json
        if start["kind"] == "positions":
            _check_start_positions(conn, schema, subscription)
        created = conn.execute(
            query(schema, "create_subscription"),
            {"name": subscription.name, "stream": subscription.stream, "start": Jsonb(start)},
        ).fetchone()
        if created is not None:
            conn.execute(
                query(schema, "create_positions"),
                {
                    "name": subscription.name,
                    "stream": subscription.stream,
                    "kind": start["kind"],
                    "time": start.get("time"),
                    "positions": json.dumps(start.get("positions", {})),
                },
            )
            return
        stored = conn.execute(
            query(schema, "get_subscription"), {"name": subscription.name}
        ).fetchone()
        if stored is None:  # deleted between the two statements: nothing to agree with
            raise SubscriptionMismatch(f"subscription {subscription.name!r} vanished; try again")
        name, stream, stored_start, _generation, _paused = stored
        if (stream, stored_start) != (subscription.stream, start):
            raise SubscriptionMismatch(
                f"subscription {name!r} is stored with stream {stream!r} and start "
                f"{describe_start(stored_start)}, but the app declares stream "
                f"{subscription.stream!r} and start {describe_start(start)}; declare it as "
                "stored, reset it, or give the new one another name"
            )


def _check_start_positions(
    conn: psycopg.Connection[Any], schema: str, subscription: Subscription
) -> None:
    heads = {s.partition: s.head for s in partition_states(conn, schema, subscription.stream)}
    for partition, position in subscription.start_json["positions"].items():
        head = heads.get(int(partition))
        if head is None:
            raise InvalidInput(
                f"start names partition {partition}, but stream {subscription.stream!r} has "
                f"partitions 0..{len(heads) - 1}"
            )
        if position > head:
            raise InvalidInput(
                f"start position {position} of partition {partition} is past its head {head}"
            )


def positions(conn: psycopg.Connection[Any], schema: str, name: str) -> list[SubscriptionPosition]:
    """Every partition's position of a stored subscription, by partition."""
    rows = conn.execute(query(schema, "subscription_positions"), {"name": name}).fetchall()
    return [SubscriptionPosition(*row) for row in rows]


def process_batch(
    conn: psycopg.Connection[Any], schema: str, subscription: Subscription, partition: int
) -> BatchOutcome | None:
    """Handle the next batch of one partition in one transaction, exactly once.

    Returns None when the partition is stopped. A handler's exception rolls the whole
    batch back and propagates; `Fenced` means the position moved under us (nothing of
    this batch was committed).
    """
    name = subscription.name
    with conn.transaction():
        locked = conn.execute(
            query(schema, "lock_position"), {"name": name, "partition": partition}
        ).fetchone()
        if locked is None:
            raise InvalidInput(
                f"subscription {name!r} is not stored or has no partition {partition}"
            )
        old, generation, stopped = locked
        if stopped:
            return None
        size = subscription.batch_size
        events = read_after(conn, schema, subscription.stream, partition, old, size + 1)
        batch, following = events[:size], events[size:]
        if batch:
            subscription.handle(batch, conn)
        new = batch[-1].position if batch else old
        next_time = following[0].occurred_at if following else None
        moved = conn.execute(
            query(schema, "commit_position"),
            {
                "name": name,
                "partition": partition,
                "old": old,
                "generation": generation,
                "new": new,
                "next_time": next_time,
            },
        )
        if moved.rowcount != 1:
            raise Fenced(
                f"the position of {name!r} in partition {partition} moved during the batch; "
                "nothing of it was committed"
            )
    return BatchOutcome(partition, len(batch), new, next_time)
