"""What a failed batch leaves behind: the attempt counted, the retry delay, and at the last
attempt the error policy's stopped partition, dead letter or parked key, each fenced like
the position (invariant 3); and which errors are the events' failures at all (invariant
8)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Literal

import psycopg

from subengine.db._sql import Db, Query, first_row, nothing
from subengine.model._declarations import Subscription
from subengine.model._errors import PositionsMissing, RetryLater

_MAX_ERROR_LENGTH = 4000


class _EventGone(Exception):
    """The failing event is no longer stored: nothing to dead-letter."""


def error_text(error: BaseException) -> str:
    """An exception as stored in last_error and dead_letters.error."""
    return f"{type(error).__name__}: {error}"[:_MAX_ERROR_LENGTH]


def database_trouble(error: BaseException) -> bool:
    """Whether an error is the database's trouble (a lost connection, a timeout, a
    cancelled query, a serialization failure or deadlock, a shutdown, a lack of
    resources, an async handler's task cancelled), which a retry may cure and which
    says nothing about the events. Also for SQLAlchemy's wrappers of such errors, which
    handlers may raise."""
    if isinstance(error, concurrent.futures.CancelledError | asyncio.CancelledError):
        return True  # an async handler's task was cancelled: its loop is shutting down
    original = getattr(error, "orig", None)
    if isinstance(original, psycopg.Error):
        error = original
    return isinstance(error, psycopg.OperationalError | psycopg.InterfaceError)


class BatchFailed(Exception):
    """The events of a batch failed: a handler raised, or the transaction of a
    transactional batch failed to commit because of what the handlers wrote (a deferred
    constraint they broke, say). Nothing of the batch committed. `partition` is the
    partition whose handlers raised (the chosen one when the commit failed), `events` how
    many events of it the batch held, `last_position` the last of them (of a gap, its
    end), `error` what was raised, and `position` and `generation` where the
    subscription stood in it when the batch read it (failures are recorded only if it
    still stands there). `shared`: the batch carried other partitions too."""

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


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed batch as recorded: its attempt, and what the error policy did (`retry`:
    nothing yet; `stopped`; `dead_lettered`: the failing event was recorded and skipped;
    `parked`: the failing event's `key` was parked, the event set aside under it and
    skipped; `missing`: the failing event is no longer stored, so the partition stopped
    before it; `fenced`: nothing, because the position moved since the batch read it)."""

    attempts: int
    action: Literal["retry", "stopped", "dead_lettered", "parked", "missing", "fenced"]
    key: str | None = None


def postpone_batch(db: Db, subscription: Subscription, failed: BatchFailed) -> bool:
    """Make a partition wait before its next batch, because a handler raised RetryLater,
    and keep the batch's bounds (its next attempt is the same batch); False when the
    position moved since the batch read it (a reset or another worker: nothing is
    recorded)."""
    error = failed.error
    seconds = error.seconds if isinstance(error, RetryLater) else 0.0
    params = {
        "name": subscription.name,
        "partition": failed.partition,
        "position": failed.position,
        "generation": failed.generation,
        "error": error_text(error),
        "seconds": seconds,
        "through": failed.last_position,
    }
    with db.transaction():
        return db.run(Query("postpone_batch", params, first_row)) is not None


def record_failure(
    db: Db,
    subscription: Subscription,
    partition: int,
    failed: BatchFailed,
    delay: float,
    delay_max: float,
) -> Failure:
    """Count a failed attempt of the event after the position and apply the error policy
    at the last one; before the last, the event is tried again after `delay` seconds,
    doubled for every earlier attempt, at most `delay_max` (0: at once). Call it for a
    batch of that one event only (a failed batch of several is first handled one event
    at a time, to find the failing one).

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
                    "delay": delay,
                    "delay_max": delay_max,
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
        # dead_letter or park: the event after the position is the failing one
        failing = failed.position + 1
        key: str | None = None
        try:
            with db.transaction():  # the older open dead letter stays open if none follows
                if subscription.on_error == "park":
                    key = db.run(
                        park_key(
                            subscription.name, subscription.stream, partition, failing,
                            failed.generation, text, attempts,
                        )
                    )  # fmt: skip
                    recorded = key is not None
                else:
                    recorded = _dead_letter(db, subscription, where, failing, text, attempts)
                if not recorded:
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
        if key is not None:
            return Failure(attempts, "parked", key)
        return Failure(attempts, "dead_lettered")


def _dead_letter(
    db: Db,
    subscription: Subscription,
    where: dict[str, object],
    failing: int,
    text: str,
    attempts: int,
) -> bool:
    """Record the failing event as a dead letter, closing its older open ones; False when
    the event is no longer stored."""
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
    return recorded is not None


def park_key(
    name: str,
    stream: str,
    partition: int,
    position: int,
    generation: int,
    error: str,
    attempts: int,
) -> Query[str | None]:
    """Park the key of the event at `position` (its last attempt failed with `error`), in
    `generation`, with the event as the first set aside under it: the key, or None when
    the event is no longer stored (see the `park_key` query)."""
    params = {
        "name": name,
        "stream": stream,
        "partition": partition,
        "position": position,
        "generation": generation,
        "error": error,
        "attempts": attempts,
    }
    return Query("park_key", params, lambda result: str(result.rows[0][0]) if result.rows else None)
