"""What operators do to subscriptions: look at them, pause and resume them, and deal with
their dead letters. The views behind these (subscription_status, stream_status,
workers_status, dead_letters) are documented for plain SQL use too."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from subengine.db._sql import Db, Query, Row, first_row, nothing
from subengine.model._declarations import Subscription
from subengine.model._errors import InvalidInput, SubscriptionNotFound
from subengine.model._events import Event
from subengine.model._names import (
    BIGINT_MAX,
    INTEGER_MAX,
    validate_stream_name,
    validate_whole_number,
)
from subengine.model._records import (
    DeadLetter,
    PartitionStatus,
    StoredSubscription,
    SubscriptionSummary,
    WorkerRegistration,
    WorkerStatus,
)
from subengine.streams._read import read_after
from subengine.subscriptions._failures import error_text
from subengine.subscriptions._handlers import run_handlers


def _check_name(name: str | None) -> None:
    if name is not None:
        validate_stream_name(name)


def subscriptions() -> Query[list[StoredSubscription]]:
    return Query(
        "list_subscriptions",
        {},
        lambda result: [StoredSubscription(*row) for row in result.rows],
    )


def summary(db: Db, name: str | None = None) -> list[SubscriptionSummary]:
    _check_name(name)
    rows: Sequence[Row] = db.run(Query("subscription_summary", {"name": name}))
    if name is not None and not rows:
        _require(db, name)
    # the lag is a sum, which SQL gives as numeric
    return [
        SubscriptionSummary(subscription, stream, partitions, int(lag), *rest)
        for subscription, stream, partitions, lag, *rest in rows
    ]


def status(db: Db, name: str | None = None) -> list[PartitionStatus]:
    _check_name(name)
    rows: Sequence[Row] = db.run(Query("subscription_status", {"name": name}))
    if name is not None and not rows:
        _require(db, name)
    return [PartitionStatus(*row) for row in rows]


def set_paused(db: Db, name: str, paused: bool) -> list[int]:
    """Pause, or resume (which also restarts stopped partitions); the restarted ones."""
    validate_stream_name(name)
    with db.transaction():
        _require(db, name)
        rows: Sequence[Row] = db.run(Query("set_paused", {"name": name, "paused": paused}))
        return sorted(partition for (partition,) in rows)


def workers() -> Query[list[WorkerStatus]]:
    return Query("workers_status", {}, lambda result: [WorkerStatus(*row) for row in result.rows])


# A worker that has just registered may not have opened its own connections yet.
PRUNE_GRACE_SECONDS = 10.0


def prune_workers() -> Query[list[WorkerRegistration]]:
    """Remove the registrations of workers whose connections are all gone (killed, or on
    a host that went away) and that have not beaten for PRUNE_GRACE_SECONDS; the rows
    removed. A live worker pruned by mistake registers again at its next heartbeat."""
    return Query(
        "prune_workers",
        {"grace": PRUNE_GRACE_SECONDS},
        lambda result: [WorkerRegistration(*row) for row in result.rows],
    )


def register_worker(db: Db, registration: dict[str, Any]) -> list[WorkerRegistration]:
    """Record a worker (id, host, pid, names, serves_metrics), for inspection, after
    removing the registrations of workers that are gone (`prune_workers`); those."""
    pruned = db.run(prune_workers())
    db.run(Query("register_worker", registration, nothing))
    return pruned


def unregister_worker(db: Db, worker_id: uuid.UUID) -> None:
    db.run(Query("unregister_worker", {"id": worker_id}, nothing))


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """One reading of a subscription in one partition; `halted`: stopped or paused;
    `reported`: this worker exports the subscription's lag gauges (one worker does)."""

    subscription: str
    partition: int
    position: int
    head: int
    halted: bool
    reported: bool = True

    @property
    def lag(self) -> int:
        """Events behind: head - position."""
        return max(self.head - self.position, 0)


def read_lag(db: Db, names: Sequence[str], worker: uuid.UUID) -> list[PartitionLag]:
    """Position and head of every partition of the named subscriptions, in one query, and
    whether `worker` reports each subscription's lag."""
    return db.run(
        Query(
            "subscription_lag",
            {"names": list(names), "worker": str(worker)},
            lambda result: [PartitionLag(*row) for row in result.rows],
        )
    )


def dead_letters(name: str | None = None, everything: bool = False) -> Query[list[DeadLetter]]:
    _check_name(name)
    return Query(
        "list_dead_letters",
        {"name": name, "all": everything},
        lambda result: [DeadLetter(*row) for row in result.rows],
    )


def discard_dead_letter(db: Db, name: str, partition: int, position: int) -> None:
    """Mark a dead letter discarded: it stays in the table, resolved."""
    with db.transaction():
        _lock_dead_letter(db, name, partition, position)
        _resolve(db, name, partition, position, "discarded")


class _HandlerFailed(Exception):
    """A dead letter's handlers failed again (rolls its retry back)."""


def retry_dead_letter(
    db: Db, subscription: Subscription, partition: int, position: int
) -> str | None:
    """Run a dead-lettered event through the subscription's handlers again.

    One transaction holds the dead letter's row, the handlers' writes (at-least-once
    handlers get no connection) and its resolution. Returns None on success; when the
    handlers fail, their error, which is recorded (retries + 1, error). Bad arguments raise
    InvalidInput and record nothing.
    """
    try:
        with db.transaction():
            stream = _lock_dead_letter(db, subscription.name, partition, position)
            if stream != subscription.stream:
                raise InvalidInput(
                    f"subscription {subscription.name!r} is stored on stream {stream!r}, "
                    f"but the app declares it on {subscription.stream!r}"
                )
            events = [
                item
                for item in db.run(read_after(stream, partition, position - 1, 1))
                if isinstance(item, Event)  # not the tombstone of its removal
            ]
            if not events or events[0].position != position:
                raise InvalidInput(
                    f"the event at position {position} of partition {partition} is no longer stored"
                )
            try:
                run_handlers(db, subscription, events, subscription.ack == "transactional")
            except Exception as error:
                raise _HandlerFailed(error_text(error)) from error
            _resolve(db, subscription.name, partition, position, "retried")
    except _HandlerFailed as failed:
        text = str(failed)
        with db.transaction():
            db.run(
                Query(
                    "dead_letter_retry_failed",
                    {
                        "name": subscription.name,
                        "partition": partition,
                        "position": position,
                        "error": text,
                    },
                    nothing,
                )
            )
        return text
    return None


def _lock_dead_letter(db: Db, name: str, partition: int, position: int) -> str:
    validate_stream_name(name)
    validate_whole_number(partition, "partition", 0, INTEGER_MAX)
    validate_whole_number(position, "position", 1, BIGINT_MAX)
    params = {"name": name, "partition": partition, "position": position}
    row = db.run(Query("lock_dead_letter", params, first_row))
    if row is None:
        raise InvalidInput(
            f"subscription {name!r} has no unresolved dead letter at partition {partition} "
            f"position {position}"
        )
    return str(row[1])


def _resolve(db: Db, name: str, partition: int, position: int, resolution: str) -> None:
    params = {"name": name, "partition": partition, "position": position, "resolution": resolution}
    db.run(Query("resolve_dead_letter", params, nothing))


def _require(db: Db, name: str) -> None:
    if db.run(Query("subscription_exists", {"name": name}, first_row)) is None:
        raise SubscriptionNotFound(f"no subscription named {name!r}")
