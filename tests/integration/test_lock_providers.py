"""The partition lock providers' contract (db/_locks.py, docs/pooler.md "Lock providers"):
every provider runs a worker's subscriptions with every event's effect exactly once and in
order per partition (invariant 3: that never rested on locks); the exclusive ones keep a
partition's lock to one slot at a time, release the one held when they take another, and
leave the lock connection in autocommit, idle (DESIGN.md, known pitfalls: pals)."""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import two_workers_drain_once_in_order

import subengine
from subengine import Subscription
from subengine.db._connection import connect
from subengine.db._locks import lock_key, partition_locks
from subengine.db._sql import SQL, Db
from subengine.model._settings import LOCK_PROVIDERS
from subengine.worker._worker import Worker

EXCLUSIVE = [provider for provider in LOCK_PROVIDERS if provider != "rows"]


@pytest.fixture
def lock_connections(dsn: str) -> Iterator[list[Db]]:
    conns = [connect(dsn, 5, autocommit=True) for _ in range(2)]
    try:
        yield [Db(conn, SQL("subengine")) for conn in conns]
    finally:
        for conn in conns:
            conn.close()


def _advisory_holders(sql: psycopg.Connection[Any], key: int) -> list[int]:
    rows = sql.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND classid = %s AND objid = %s AND objsubid = 1"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
    ).fetchall()
    return [row[0] for row in rows]


@pytest.mark.parametrize("provider", EXCLUSIVE)
def test_an_exclusive_provider_keeps_a_partition_to_one_holder(
    provider: str, lock_connections: list[Db], sql: psycopg.Connection[Any]
) -> None:
    first_db, second_db = lock_connections
    first, second = (partition_locks(provider, db) for db in lock_connections)
    key, other = lock_key("subengine", "effects", 0), lock_key("subengine", "effects", 1)
    assert first.take(key, None)
    assert not second.take(key, None)
    assert _advisory_holders(sql, key) == [first_db.conn.info.backend_pid]
    assert first.take(other, key)  # a switch gives the held lock back
    assert _advisory_holders(sql, key) == []
    assert second.take(key, None)
    second.release(key)
    assert _advisory_holders(sql, key) == []
    for db in (first_db, second_db):  # the lock connections stay autocommit and idle
        assert db.conn.autocommit
        assert db.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


@pytest.mark.parametrize("providers", [("pals", "builtin"), ("builtin", "pals")])
def test_the_advisory_providers_exclude_each_other(
    providers: tuple[str, str], lock_connections: list[Db], sql: psycopg.Connection[Any]
) -> None:
    # the same lock keys: workers of either provider, and the gateway's delivery slots
    # (builtin where the setting says pals), never hold one partition together
    first, second = (
        partition_locks(p, db) for p, db in zip(providers, lock_connections, strict=True)
    )
    key = lock_key("subengine", "effects", 0)
    assert first.take(key, None)
    assert not second.take(key, None)
    first.release(key)
    assert second.take(key, None)
    assert not first.take(key, None)
    second.release(key)
    assert _advisory_holders(sql, key) == []


def test_the_rows_provider_takes_no_advisory_lock(
    lock_connections: list[Db], sql: psycopg.Connection[Any]
) -> None:
    first, second = (partition_locks("rows", db) for db in lock_connections)
    key = lock_key("subengine", "effects", 0)
    assert first.take(key, None) and second.take(key, None)
    assert _advisory_holders(sql, key) == []


def test_an_unknown_provider_is_a_configuration_error() -> None:
    with pytest.raises(subengine.ConfigurationError, match="lock_provider must be one of"):
        subengine.Settings(lock_provider="zookeeper")


@pytest.mark.parametrize("provider", LOCK_PROVIDERS)
def test_workers_handle_every_event_once_in_order_with_each_provider(
    provider: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    settings = subengine.Settings(dsn=dsn, lock_provider=provider, poll_interval=0.5)
    two_workers_drain_once_in_order(sql, settings)


def test_without_partition_locks_an_at_least_once_subscription_is_refused(dsn: str) -> None:
    """Its handlers run after its batch's first transaction committed: with no lock, a
    second slot could run the same batch meanwhile."""
    settings = subengine.Settings(dsn=dsn, lock_provider="rows")
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("orders", partitions=2)
        sub = Subscription("mailer", "orders", ack="at_least_once")
        sub.handler()(lambda event, conn: None)
        stop = threading.Event()
        stop.set()  # (were it not refused, the worker would stop at once)
        with pytest.raises(subengine.ConfigurationError, match="'mailer' acknowledges at least"):
            Worker(engine, [sub]).run(stop)


@pytest.mark.parametrize("provider", LOCK_PROVIDERS)
def test_closed_providers_leave_nothing_for_the_garbage_collector(
    provider: str, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """pals' locks and SQLAlchemy's pool have finalizers: left to the garbage collector
    after their connection closed, they ran at random moments later (inside another
    test's `ast.parse` once, which CPython 3.11 turned into a SystemError) and logged a
    failed rollback on the closed connection."""
    conn = connect(dsn, 5, autocommit=True)
    locks = partition_locks(provider, Db(conn, SQL("subengine")))
    key, other = lock_key("subengine", "effects", 0), lock_key("subengine", "effects", 1)
    assert locks.take(key, None) and locks.take(other, key)
    locks.close()
    conn.close()
    del locks
    gc.collect()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("provider", EXCLUSIVE)
def test_a_provider_on_a_terminated_connection_raises_psycopgs_operational_error(
    provider: str, lock_connections: list[Db], sql: psycopg.Connection[Any]
) -> None:
    """The slot tells a lost connection (reconnect, count the outage) from its own
    failure (stop the worker) by psycopg's classes, whatever the provider: SQLAlchemy's
    wrapping of psycopg's errors never reaches it, not even from pals' first connect,
    which asks the server for its version."""
    db = lock_connections[0]
    sql.execute("SELECT pg_terminate_backend(%s)", (db.conn.info.backend_pid,))
    key = lock_key("subengine", "effects", 0)
    with pytest.raises(psycopg.OperationalError):
        partition_locks(provider, db).take(key, None)
