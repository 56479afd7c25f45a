"""What operators do to subscriptions: look at them, pause and resume them, and deal with
their dead letters. The views behind these (subscription_status, stream_status,
workers_status, dead_letters) are documented for plain SQL use too."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

from subengine._app import Subscription
from subengine._errors import InvalidInput, SubscriptionNotFound
from subengine._names import BIGINT_MAX, INTEGER_MAX, validate_stream_name, validate_whole_number
from subengine._queries import query
from subengine._read import read_after
from subengine._records import (
    DeadLetter,
    PartitionStatus,
    StoredSubscription,
    SubscriptionSummary,
    WorkerRegistration,
    WorkerStatus,
)
from subengine._sql import SQL
from subengine._subscriptions import error_text

Row = dict[str, Any]


def _rows(conn: psycopg.Connection[Any], sql: bytes, params: dict[str, Any]) -> list[Row]:
    with conn.cursor(row_factory=dict_row) as cursor:
        return cursor.execute(sql, params).fetchall()


def _check_name(name: str | None) -> None:
    if name is not None:
        validate_stream_name(name)


def subscriptions(conn: psycopg.Connection[Any], schema: str) -> list[StoredSubscription]:
    return [
        StoredSubscription(**row) for row in _rows(conn, query(schema, "list_subscriptions"), {})
    ]


def summary(
    conn: psycopg.Connection[Any], schema: str, name: str | None = None
) -> list[SubscriptionSummary]:
    _check_name(name)
    rows = _rows(conn, query(schema, "subscription_summary"), {"name": name})
    if name is not None and not rows:
        _require(conn, schema, name)
    # the lag is a sum, which SQL gives as numeric
    return [SubscriptionSummary(**{**row, "lag": int(row["lag"])}) for row in rows]


def status(
    conn: psycopg.Connection[Any], schema: str, name: str | None = None
) -> list[PartitionStatus]:
    _check_name(name)
    rows = _rows(conn, query(schema, "subscription_status"), {"name": name})
    if name is not None and not rows:
        _require(conn, schema, name)
    return [PartitionStatus(**row) for row in rows]


def set_paused(conn: psycopg.Connection[Any], schema: str, name: str, paused: bool) -> list[int]:
    """Pause, or resume (which also restarts stopped partitions); the restarted ones."""
    validate_stream_name(name)
    with conn.transaction():
        _require(conn, schema, name)
        rows = conn.execute(query(schema, "set_paused"), {"name": name, "paused": paused})
        return sorted(partition for (partition,) in rows.fetchall())


def workers(conn: psycopg.Connection[Any], schema: str) -> list[WorkerStatus]:
    return [WorkerStatus(**row) for row in _rows(conn, query(schema, "workers_status"), {})]


# A worker that has just registered may not have opened its own connections yet.
PRUNE_GRACE_SECONDS = 10.0


def prune_workers(conn: psycopg.Connection[Any], schema: str) -> list[WorkerRegistration]:
    """Remove the registrations of workers whose connections are all gone (killed, or on
    a host that went away) and that have not beaten for PRUNE_GRACE_SECONDS; the rows
    removed. A live worker pruned by mistake registers again at its next heartbeat."""
    rows = _rows(conn, query(schema, "prune_workers"), {"grace": PRUNE_GRACE_SECONDS})
    return [WorkerRegistration(**row) for row in rows]


def dead_letters(
    conn: psycopg.Connection[Any], schema: str, name: str | None = None, everything: bool = False
) -> list[DeadLetter]:
    _check_name(name)
    rows = _rows(conn, query(schema, "list_dead_letters"), {"name": name, "all": everything})
    return [DeadLetter(**row) for row in rows]


def discard_dead_letter(
    conn: psycopg.Connection[Any], schema: str, name: str, partition: int, position: int
) -> None:
    """Mark a dead letter discarded: it stays in the table, resolved."""
    with conn.transaction():
        _lock_dead_letter(conn, schema, name, partition, position)
        _resolve(conn, schema, name, partition, position, "discarded")


class _HandlerFailed(Exception):
    """A dead letter's handlers failed again (rolls its retry back)."""


def retry_dead_letter(
    conn: psycopg.Connection[Any],
    schema: str,
    subscription: Subscription,
    partition: int,
    position: int,
) -> str | None:
    """Run a dead-lettered event through the subscription's handlers again.

    One transaction holds the dead letter's row, the handlers' writes (at-least-once
    handlers get no connection) and its resolution. Returns None on success; when the
    handlers fail, their error, which is recorded (retries + 1, error). Bad arguments raise
    InvalidInput and record nothing.
    """
    connection = conn if subscription.ack == "transactional" else None
    try:
        with conn.transaction():
            stream = _lock_dead_letter(conn, schema, subscription.name, partition, position)
            if stream != subscription.stream:
                raise InvalidInput(
                    f"subscription {subscription.name!r} is stored on stream {stream!r}, "
                    f"but the app declares it on {subscription.stream!r}"
                )
            events = SQL(schema).run(conn, read_after(stream, partition, position - 1, 1))
            if not events or events[0].position != position:
                raise InvalidInput(
                    f"the event at position {position} of partition {partition} is no longer stored"
                )
            try:
                subscription.handle(events, connection)
            except Exception as error:
                raise _HandlerFailed(error_text(error)) from error
            _resolve(conn, schema, subscription.name, partition, position, "retried")
    except _HandlerFailed as failed:
        text = str(failed)
        with conn.transaction():
            conn.execute(
                query(schema, "dead_letter_retry_failed"),
                {
                    "name": subscription.name,
                    "partition": partition,
                    "position": position,
                    "error": text,
                },
            )
        return text
    return None


def _lock_dead_letter(
    conn: psycopg.Connection[Any], schema: str, name: str, partition: int, position: int
) -> str:
    validate_stream_name(name)
    validate_whole_number(partition, "partition", 0, INTEGER_MAX)
    validate_whole_number(position, "position", 1, BIGINT_MAX)
    row = conn.execute(
        query(schema, "lock_dead_letter"),
        {"name": name, "partition": partition, "position": position},
    ).fetchone()
    if row is None:
        raise InvalidInput(
            f"subscription {name!r} has no unresolved dead letter at partition {partition} "
            f"position {position}"
        )
    return str(row[1])


def _resolve(
    conn: psycopg.Connection[Any],
    schema: str,
    name: str,
    partition: int,
    position: int,
    resolution: str,
) -> None:
    conn.execute(
        query(schema, "resolve_dead_letter"),
        {"name": name, "partition": partition, "position": position, "resolution": resolution},
    )


def _require(conn: psycopg.Connection[Any], schema: str, name: str) -> None:
    if conn.execute(query(schema, "subscription_exists"), {"name": name}).fetchone() is None:
        raise SubscriptionNotFound(f"no subscription named {name!r}")
