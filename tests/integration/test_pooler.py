"""Behind a connection pooler in transaction mode (docs/pooler.md): a real PgBouncer
process between the engine and the test database, pool of 2 server sessions.

Appends and reads work through it (psycopg's prepared statements are off on its
connections); what needs a session of its own goes to SUBENGINE_DIRECT_DSN, and without
one the worker and the pruner refuse to start and tails poll."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psycopg
import pytest
import web
from helpers import GatewayProcess, two_workers_drain_once_in_order, wait_for

import subengine
from subengine import NewEvent
from subengine.db._connection import connect, pooled


def test_connections_through_the_pooler_are_found_out_and_prepare_nothing(
    dsn: str, bouncer: str
) -> None:
    with connect(dsn, 5) as direct, connect(bouncer, 5) as through:
        assert not pooled(direct) and direct.prepare_threshold is not None
        assert pooled(through) and through.prepare_threshold is None


def test_appends_and_reads_work_through_the_pooler(bouncer: str) -> None:
    """psycopg prepares a statement at its 5th run: behind a transaction-mode pooler the
    6th run failed ('_pg3_0 already exists') or found it missing on another session."""
    with subengine.Engine(bouncer) as engine:
        engine.create_stream("orders", partitions=2)
        for n in range(20):
            engine.append("orders", [NewEvent(f"k{n % 3}", "T", {"n": n})])
            assert sum(len(engine.read("orders", p, limit=100)) for p in (0, 1)) == n + 1


def test_without_a_direct_dsn_the_pruner_refuses_to_start(bouncer: str) -> None:
    with (
        subengine.Engine(bouncer) as engine,
        pytest.raises(subengine.ConfigurationError, match="the pruner's lock"),
    ):
        engine.run_retention()


@pytest.mark.parametrize("direct", [True, False], ids=["direct-dsn", "no-direct-dsn"])
def test_workers_behind_the_pooler_handle_every_event_once_in_order(
    direct: bool,
    dsn: str,
    bouncer: str,
    sql: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a direct DSN the workers lock and listen there; without one they take no
    advisory lock, poll, and leave no session setting behind in the pooled sessions."""
    settings = subengine.Settings(
        dsn=bouncer, direct_dsn=dsn if direct else None, poll_interval=0.5
    )
    locks_seen: set[int] = set()

    def count_advisory_locks() -> None:
        row = sql.execute(  # this database's: a shared server holds other tests' too
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database ="
            " (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
        locks_seen.add(row[0] if row else 0)

    two_workers_drain_once_in_order(sql, settings, count_advisory_locks)
    if direct:
        assert max(locks_seen) > 0  # the slots held their partitions' locks
    else:
        assert locks_seen == {0}
        assert "takes no partition locks" in caplog.text
        with psycopg.connect(bouncer, prepare_threshold=None, autocommit=True) as through:
            for _ in range(4):  # the pool's 2 server sessions, whichever comes
                shown = through.execute(
                    "SELECT current_setting('synchronous_commit'),"
                    " current_setting('plan_cache_mode')"
                ).fetchone()
                assert shown == ("on", "auto")


def test_with_a_direct_dsn_tails_are_pushed_to(dsn: str, bouncer: str) -> None:
    """The listener connects to the direct DSN: an event reaches a tail long before its
    next poll (a minute away)."""
    settings = subengine.Settings(dsn=bouncer, direct_dsn=dsn, poll_interval=60)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("orders", partitions=2)
        with engine.tail("orders") as tail:
            assert tail.next_event(timeout=0.5) is None  # its first poll, done
            wait_for(lambda: engine.listener.connects >= 1, "the listener", timeout=30)
            engine.append("orders", [NewEvent("k", "T", {"n": 1})])
            event = tail.next_event(timeout=20)
            assert isinstance(event, subengine.Event) and event.data == {"n": 1}


def test_tails_poll_when_no_connection_can_listen(bouncer: str) -> None:
    settings = subengine.Settings(dsn=bouncer, poll_interval=0.2)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("orders", partitions=2)
        with engine.tail("orders") as tail:
            engine.append("orders", [NewEvent("k", "T", {"n": 1})])
            event = tail.next_event(timeout=30)
            assert isinstance(event, subengine.Event) and event.data == {"n": 1}
            assert engine.listener.connects == 0  # never listened through the pooler


def test_async_tails_poll_when_no_connection_can_listen(bouncer: str) -> None:
    async def scenario() -> None:
        settings = subengine.Settings(dsn=bouncer, poll_interval=0.2)
        async with subengine.AsyncEngine(settings=settings) as engine:
            await engine.create_stream("orders", partitions=2)
            async with engine.tail("orders") as tail:
                await engine.append("orders", [NewEvent("k", "T", {"n": 1})])
                event = await tail.next_event(timeout=30)
                assert isinstance(event, subengine.Event) and event.data == {"n": 1}
                assert engine.listener.connects == 0

    asyncio.run(scenario())


def test_the_gateway_serves_through_the_pooler(
    engine: subengine.Engine, bouncer: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """No LISTEN: appends and reads still work, and the gateway says what is degraded."""
    engine.create_stream("orders", partitions=2)
    env = {**cli_env, "SUBENGINE_DSN": bouncer, "SUBENGINE_POLL_INTERVAL": "0.2"}
    with GatewayProcess(env, tmp=tmp_path) as gateway:
        url = f"{gateway.url}/v1/streams/orders/events"
        for n in range(8):  # past psycopg's prepare threshold
            appended = web.post(url, json=[{"key": "k", "type": "T", "data": {"n": n}}])
            assert appended.status_code == 201, appended.text
            read = web.get(url, params={"limit": 100})
            assert read.status_code == 200, read.text
            assert len(read.json()["events"]) == n + 1
        output = gateway.output()
    assert "goes through a connection pooler" in output
    assert "get no notifications" in output
