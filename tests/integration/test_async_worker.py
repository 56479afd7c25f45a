"""What only the async worker has: handlers awaited in the application's event loop, an
AsyncSession in the batch's transaction, sync and async subscriptions in one worker, and
the sync-only calls that refuse async handlers (the behaviours both workers share are in
test_worker_contract.py)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from helpers import Running, count, record, wait_for
from twins import EventLoopThread

import subengine
from subengine import NewEvent

ROOT = Path(__file__).resolve().parents[2]


def test_async_session_writes_commit_with_the_position_exactly_once(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    from sqlalchemy import text

    fast_engine.create_stream("single", partitions=1)
    stored = fast_engine.append("single", [NewEvent("k", "T", {"n": n}) for n in range(8)])
    app = subengine.App()
    sub = app.subscription("billing", stream="single", batch_size=8, max_attempts=1,
                           on_error="dead_letter")  # fmt: skip

    @sub.handler()
    async def handle(event: subengine.Event, conn: Any) -> None:
        async with subengine.async_sqlalchemy_session(conn) as session:
            await session.execute(
                text("INSERT INTO effects VALUES (:id, :partition, :position)"),
                {"id": event.id, "partition": event.partition, "position": event.position},
            )
        if event.data["n"] == 5:
            raise ValueError("after its write: the write must roll back")

    with Running(app, fast_engine):
        wait_for(lambda: count(sql) == 7 and count(sql, "subengine.dead_letters") == 1)
    handled = sql.execute("SELECT position FROM effects ORDER BY 1").fetchall()
    assert [p for (p,) in handled] == [1, 2, 3, 4, 5, 7, 8]
    assert sql.execute("SELECT event_id FROM subengine.dead_letters").fetchall() == [
        (stored[5].id,)
    ]


def test_a_cancelled_async_handler_is_not_counted_against_its_event(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # an application's shutdown may cancel every task of its loop, a handler's too: that
    # says nothing about the event, which must not be dead-lettered for it
    fast_engine.create_stream("single", partitions=1)
    fast_engine.append("single", [NewEvent("k", "T", {"n": n}) for n in range(3)])
    app = subengine.App()
    sub = app.subscription("billing", stream="single", max_attempts=1, on_error="dead_letter")
    cancelled: list[int] = []

    @sub.handler()
    async def handle(event: subengine.Event, conn: Any) -> None:
        if event.data["n"] == 1 and len(cancelled) < 2:  # in its batch, then alone
            cancelled.append(event.position)
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)  # cancelled here
        await conn.execute(
            "INSERT INTO effects VALUES (%s, %s, %s)", (event.id, event.partition, event.position)
        )

    with Running(app, fast_engine):
        wait_for(lambda: count(sql) == 3, "every event's effect")
    assert cancelled == [2, 2]
    assert count(sql, "subengine.dead_letters") == 0
    handled = sql.execute("SELECT position FROM effects ORDER BY 1").fetchall()
    assert [p for (p,) in handled] == [1, 2, 3]


def test_one_worker_runs_sync_and_async_subscriptions_side_by_side(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    sql.execute("CREATE TABLE async_effects (event_id uuid)")
    fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(30)])
    app = subengine.App()
    app.subscription("plain", stream="orders").handler()(record)

    @app.subscription("awaited", stream="orders").handler()
    async def handle(event: subengine.Event, conn: Any) -> None:
        await conn.execute("INSERT INTO async_effects VALUES (%s)", (event.id,))

    with Running(app, fast_engine, concurrency=2):
        wait_for(lambda: count(sql) == 30 and count(sql, "async_effects") == 30)
    for name in ("plain", "awaited"):
        positions = {p.partition: p.position for p in fast_engine.subscription_positions(name)}
        assert positions == fast_engine.heads("orders")


def test_handlers_are_awaited_in_the_loop_that_runs_the_async_worker(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    loops: set[int] = set()
    app = subengine.App()

    @app.subscription("billing", stream="orders").handler()
    async def handle(event: subengine.Event, conn: Any) -> None:
        loops.add(id(asyncio.get_running_loop()))
        await conn.execute("INSERT INTO effects VALUES (%s, %s, %s)",
                           (event.id, event.partition, event.position))  # fmt: skip

    fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(10)])
    thread = EventLoopThread()
    try:
        worker = subengine.AsyncWorker(fast_engine, list(app.subscriptions.values()))

        async def run_until_done() -> None:
            task = asyncio.create_task(worker.run())
            while count(sql) < 10:  # bounded by the test's timeout below
                await asyncio.sleep(0.05)
            task.cancel()  # a cancellation stops it cleanly too
            with pytest.raises(asyncio.CancelledError):
                await task

        thread.run(lambda: asyncio.wait_for(run_until_done(), 60))
    finally:
        thread.close()
    assert loops == {id(thread.loop)}
    assert count(sql, "subengine.workers") == 0


def test_the_fastapi_lifespan_example_runs_the_worker_while_the_app_serves(
    dsn: str, sql: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    sql.execute("CREATE TABLE order_totals (key text PRIMARY KEY, total int)")
    monkeypatch.setenv("SUBENGINE_DSN", dsn)
    spec = importlib.util.spec_from_file_location(
        "async_worker_app", ROOT / "examples" / "async_worker_app.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with subengine.Engine(dsn) as engine:
        engine.create_stream("orders", partitions=2)
        engine.append("orders", [NewEvent(f"o{n % 3}", "OrderPlaced", {"total": n})
                                 for n in range(12)])  # fmt: skip

    async def serve() -> None:
        async with example.app.router.lifespan_context(example.app):
            for _ in range(600):
                rows = sql.execute("SELECT sum(total) FROM order_totals").fetchone()
                if rows and rows[0] == sum(range(12)):
                    break
                await asyncio.sleep(0.05)
            transport = httpx.ASGITransport(app=example.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                health = (await client.get("/health")).json()
            assert health["worker"] is not None  # the app serves while its worker runs

    asyncio.run(serve())
    totals = dict(sql.execute("SELECT key, total FROM order_totals").fetchall())
    assert totals == {f"o{k}": sum(n for n in range(12) if n % 3 == k) for k in range(3)}
    assert count(sql, "subengine.workers") == 0


def test_engine_calls_outside_a_worker_await_async_handlers_on_a_loop_of_their_own(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # process_batch and a dead letter's retry, for a subscription with async handlers
    fast_engine.create_stream("single", partitions=1)
    stored = fast_engine.append("single", [NewEvent("k", "T", {}) for _ in range(3)])
    failing = {stored[1].id}
    sub = subengine.Subscription("billing", "single", max_attempts=1, on_error="dead_letter")

    @sub.handler()
    async def handle(event: subengine.Event, conn: Any) -> None:
        await conn.execute("INSERT INTO effects VALUES (%s, %s, %s)",
                           (event.id, event.partition, event.position))  # fmt: skip
        if event.id in failing:
            raise ValueError("not yet")

    fast_engine.ensure_subscription(sub)
    app = subengine.App()
    app.subscriptions["billing"] = sub
    with Running(app, fast_engine):
        wait_for(lambda: count(sql, "subengine.dead_letters") == 1 and count(sql) == 2)
    failing.clear()
    assert fast_engine.retry_dead_letter(sub, 0, stored[1].position) is None
    fast_engine.append("single", [NewEvent("k", "T", {})])
    outcome = fast_engine.process_batch(sub, 0)
    assert outcome is not None and (outcome.handled, outcome.position) == (1, 4)
    handled = sql.execute("SELECT position FROM effects ORDER BY 1").fetchall()
    assert [p for (p,) in handled] == [1, 2, 3, 4]


def test_a_parked_key_of_async_handlers_is_retried_once_each_in_order(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    sql.execute("ALTER TABLE effects ADD COLUMN seq bigserial")
    fast_engine.create_stream("single", partitions=1)
    keys = ["a", "b", "a", "b", "a"]
    stored = fast_engine.append("single", [NewEvent(k, "T", {}) for k in keys])
    broken = {stored[0].id}
    app = subengine.App()
    sub = app.subscription("billing", stream="single", max_attempts=1, on_error="park")

    @sub.handler()
    async def handle(event: subengine.Event, conn: Any) -> None:
        if event.id in broken:
            raise ValueError("not yet")
        await conn.execute("INSERT INTO effects VALUES (%s, %s, %s)",
                           (event.id, event.partition, event.position))  # fmt: skip

    fast_engine.ensure_subscription(sub)
    with Running(app, fast_engine):
        wait_for(lambda: fast_engine.subscription_positions("billing")[0].position == 5)
    assert [p for (p,) in sql.execute("SELECT position FROM effects ORDER BY seq")] == [2, 4]
    broken.clear()
    retried = fast_engine.retry_parked_key(sub, "a")
    assert (retried.replayed, retried.error) == (3, None)
    assert [p for (p,) in sql.execute("SELECT position FROM effects ORDER BY seq")] == [
        2, 4, 1, 3, 5
    ]  # fmt: skip
    assert fast_engine.parked_keys("billing") == []
