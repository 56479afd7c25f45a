"""Deleting a stream: refused while it has subscriptions, complete when forced, safe
against appends that race with it, finished by a second run after an interruption, and
the name free again for a stream of a new epoch."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from helpers import stored_events, wait_for

import subengine
from subengine import NewEvent


def rows_of_stream(sql: psycopg.Connection[Any], stream: str) -> dict[str, int]:
    """For every table of the schema that can hold something of `stream` (a `stream`
    column, or a `subscription` column naming a subscription of it, or the stream's own
    row), how many rows it holds; found from the catalogue, so a new table is counted."""
    subscriptions = [
        name
        for (name,) in sql.execute(
            "SELECT name FROM subengine.subscriptions WHERE stream = %s", (stream,)
        )
    ]
    counts = {
        "streams": sql.execute(
            "SELECT count(*) FROM subengine.streams WHERE name = %s", (stream,)
        ).fetchone()[0]  # type: ignore[index]
    }
    columns = sql.execute(
        "SELECT c.table_name, c.column_name FROM information_schema.columns c"
        " JOIN information_schema.tables t USING (table_schema, table_name)"
        " WHERE c.table_schema = 'subengine' AND t.table_type = 'BASE TABLE'"
        "   AND c.column_name IN ('stream', 'subscription')"
    ).fetchall()
    assert {"events", "partitions", "subscriptions", "subscription_positions"} <= {
        table for table, _ in columns
    }
    for table, column in columns:
        query = psycopg.sql.SQL("SELECT count(*) FROM subengine.{} WHERE {} = ANY(%s)").format(
            psycopg.sql.Identifier(table), psycopg.sql.Identifier(column)
        )
        names = [stream] if column == "stream" else subscriptions
        found = sql.execute(query, (names,)).fetchone()[0]  # type: ignore[index]
        counts[table] = counts.get(table, 0) + found
    return counts


def everything(sql: psycopg.Connection[Any]) -> list[list[tuple[Any, ...]]]:
    """Every row of every table of the schema (but the workers'), to compare."""
    tables = [
        table
        for (table,) in sql.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'subengine'"
            " AND table_type = 'BASE TABLE' AND table_name NOT IN ('workers', 'alembic_version',"
            " 'subengine_migrations') ORDER BY 1"
        )
    ]
    return [
        sorted(
            sql.execute(
                psycopg.sql.SQL("SELECT * FROM subengine.{}").format(psycopg.sql.Identifier(t))
            ).fetchall(),
            key=repr,
        )
        for t in tables
    ]


def fill(engine: subengine.Engine, stream: str, events: int = 20) -> list[subengine.Appended]:
    return engine.append(stream, [NewEvent(f"k{n}", "T", {"n": n}) for n in range(events)])


def subscribe(engine: subengine.Engine, name: str, stream: str) -> None:
    engine.ensure_subscription(subengine.App().subscription(name, stream=stream))


def test_delete_is_refused_while_the_stream_has_subscriptions(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    fill(engine, orders)
    subscribe(engine, "billing", orders)
    subscribe(engine, "audit", orders)
    before = everything(sql)
    with pytest.raises(subengine.InvalidInput) as refused:
        engine.delete_stream(orders)
    assert "subscriptions: audit, billing" in str(refused.value)
    assert "--force" in str(refused.value)
    assert everything(sql) == before
    fill(engine, orders, 1)  # the stream still takes events


def test_a_forced_delete_leaves_nothing_of_the_stream(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    stored = fill(engine, orders)
    epoch = engine.stream(orders).epoch
    subscribe(engine, "billing", orders)
    subscribe(engine, "audit", orders)
    # a dead letter and a gap of the stream, as a failing worker and a pruner leave them
    sql.execute(
        "INSERT INTO subengine.dead_letters"
        " (subscription, partition, position, generation, event_id, error, attempts)"
        " VALUES ('billing', %s, %s, 1, %s, 'ValueError: test', 5)",
        (stored[0].partition, stored[0].position, stored[0].id),
    )
    sql.execute(
        "INSERT INTO subengine.gaps (subscription, stream, partition, generation, gap_from,"
        " gap_to, floor, reason, action) VALUES ('audit', %s, 0, 1, 1, 2, 3, 'test', 'skipped')",
        (orders,),
    )
    # a key parked by a subscription of it, as a worker with on_error="park" leaves it
    sql.execute(
        "INSERT INTO subengine.parked_keys"
        " (subscription, partition, key, generation, position, event_id, error, attempts)"
        " VALUES ('billing', %s, %s, 1, %s, %s, 'ValueError: test', 5)",
        (stored[0].partition, "k0", stored[0].position, stored[0].id),
    )
    # a remote worker's lease and the stored policy of remote workers (docs/remote-workers.md)
    sql.execute(
        "INSERT INTO subengine.remote_leases (id, subscription, partition, worker, generation,"
        " position, through, deadline) VALUES (gen_random_uuid(), 'billing', 0, 'remote', 1,"
        " 0, 1, now() + interval '1 minute')"
    )
    sql.execute("INSERT INTO subengine.remote_policies (subscription) VALUES ('billing')")
    # another stream with a subscription: untouched
    engine.create_stream("payments", partitions=2)
    fill(engine, "payments", 5)
    subscribe(engine, "ledger", "payments")
    other = rows_of_stream(sql, "payments")
    # every table holds something of it, but the Durable Streams catalog's, which hold
    # only streams made through /ds (docs/durable-streams.md)
    held = rows_of_stream(sql, orders)
    assert all(count for table, count in held.items() if not table.startswith("durable_stream"))

    deleted = engine.delete_stream(orders, force=True, batch=3)

    assert deleted == subengine.DeletedStream(orders, epoch, len(stored), ("audit", "billing"))
    assert rows_of_stream(sql, orders) == dict.fromkeys(rows_of_stream(sql, orders), 0)
    assert rows_of_stream(sql, "payments") == other
    with pytest.raises(subengine.StreamNotFound):
        engine.stream(orders)
    assert [s.name for s in engine.streams()] == ["payments"]


def test_a_recreated_stream_has_a_new_epoch_and_starts_at_position_one(
    engine: subengine.Engine, orders: str
) -> None:
    fill(engine, orders)
    old = engine.stream(orders)
    engine.delete_stream(orders)
    new = engine.create_stream(orders, partitions=2)
    assert new.epoch > old.epoch
    assert engine.heads(orders) == {0: 0, 1: 0}
    appended = engine.append(orders, [NewEvent("order-1", "Placed", {"total": 1})])
    assert [(a.position, a.key_version) for a in appended] == [(1, 1)]
    [event] = stored_events(engine.read(orders, appended[0].partition))
    assert (event.position, event.data) == (1, {"total": 1})
    subscribe(engine, "billing", orders)
    assert {p.position for p in engine.subscription_positions("billing")} == {0}


def test_a_stream_being_deleted_takes_no_append_subscription_or_new_creation(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    stored = fill(engine, orders)
    # the delete's first step, committed, then an interruption
    sql.execute("DELETE FROM subengine.partitions WHERE stream = %s", (orders,))
    before = everything(sql)
    with pytest.raises(subengine.StreamBeingDeleted, match="is being deleted"):
        fill(engine, orders, 1)
    retried = NewEvent(stored[0].id.hex, "T", {}, id=stored[0].id)  # a retried append
    with pytest.raises(subengine.StreamBeingDeleted):
        engine.append(orders, [retried])
    with pytest.raises(subengine.StreamBeingDeleted):
        subscribe(engine, "billing", orders)
    with pytest.raises(subengine.StreamBeingDeleted, match="stream delete orders"):
        engine.create_stream(orders, partitions=4)
    with pytest.raises(subengine.StreamBeingDeleted):
        engine.read(orders, stored[0].partition)
    with pytest.raises(psycopg.DatabaseError, match="being deleted") as plain_sql:
        sql.execute("SELECT * FROM subengine.append(%s, 'k', 'T', '{}')", (orders,))
    assert plain_sql.value.sqlstate == "SE404"
    assert everything(sql) == before


def test_a_second_delete_finishes_an_interrupted_one(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    stored = fill(engine, orders)
    epoch = engine.stream(orders).epoch
    sql.execute("DELETE FROM subengine.partitions WHERE stream = %s", (orders,))
    sql.execute(  # and a few batches of events
        "DELETE FROM subengine.events WHERE stream = %s AND position <= 2", (orders,)
    )
    left = sql.execute(
        "SELECT count(*) FROM subengine.events WHERE stream = %s", (orders,)
    ).fetchone()[0]  # type: ignore[index]
    assert 0 < left < len(stored)
    deleted = engine.delete_stream(orders)
    assert (deleted.epoch, deleted.events, deleted.subscriptions) == (epoch, left, ())
    assert rows_of_stream(sql, orders) == dict.fromkeys(rows_of_stream(sql, orders), 0)
    assert engine.create_stream(orders, partitions=4).epoch > epoch


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def waiting_for_locks(sql: psycopg.Connection[Any]) -> int:
    row = sql.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchone()
    return int(row[0])  # type: ignore[index]


def test_an_append_in_flight_lands_before_the_delete_and_goes_with_it(
    engine: subengine.Engine, orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    fill(engine, orders)
    with psycopg.connect(dsn) as appender:
        subengine.append(appender, orders, [NewEvent("late", "T", {})])  # holds its head
        thread, outcome = in_thread(lambda: engine.delete_stream(orders))
        wait_for(lambda: waiting_for_locks(sql) == 1)
        time.sleep(0.2)
        assert thread.is_alive()  # the delete waits for the append
        appender.commit()
    thread.join(30)
    assert outcome["value"].events == 21  # the late event went with the others
    assert rows_of_stream(sql, orders) == dict.fromkeys(rows_of_stream(sql, orders), 0)


def test_an_append_that_waits_behind_the_delete_fails_cleanly(
    engine: subengine.Engine, orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    fill(engine, orders)
    key = next(f"k{n}" for n in range(99) if subengine.partition_for(f"k{n}", 4) == 0)
    with psycopg.connect(dsn) as holder:
        # hold partition 0's head, so that the delete queues for it, then an append behind
        holder.execute(
            "SELECT FROM subengine.partitions WHERE stream = %s AND partition = 0 FOR UPDATE",
            (orders,),
        )
        deleting, deleted = in_thread(lambda: engine.delete_stream(orders))
        wait_for(lambda: waiting_for_locks(sql) == 1)
        appending, appended = in_thread(lambda: engine.append(orders, [NewEvent(key, "T", {})]))
        wait_for(lambda: waiting_for_locks(sql) == 2)
    deleting.join(30)
    appending.join(30)
    assert deleted["value"].events == 20
    assert isinstance(appended.get("error"), subengine.StreamBeingDeleted), appended
    assert rows_of_stream(sql, orders) == dict.fromkeys(rows_of_stream(sql, orders), 0)


def test_appends_racing_with_a_delete_land_before_it_or_fail_cleanly(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    fill(engine, orders, 200)
    results: list[object] = []
    stop = threading.Event()

    def keep_appending() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                results.append(engine.append(orders, [NewEvent(f"r{n}", "T", {})]))
            except subengine.StreamNotFound as error:  # StreamBeingDeleted, or gone
                results.append(error)

    appenders = [threading.Thread(target=keep_appending) for _ in range(3)]
    for thread in appenders:
        thread.start()
    wait_for(lambda: len(results) > 30)
    deleted = engine.delete_stream(orders, batch=7)
    stop.set()
    for thread in appenders:
        thread.join(30)
    landed = sum(1 for r in results if isinstance(r, list))
    assert deleted.events == 200 + landed
    assert any(isinstance(r, subengine.StreamBeingDeleted) for r in results)
    assert all(isinstance(r, list | subengine.StreamNotFound) for r in results)
    assert rows_of_stream(sql, orders) == dict.fromkeys(rows_of_stream(sql, orders), 0)


def test_deleting_a_stream_that_does_not_exist_says_so(engine: subengine.Engine) -> None:
    with pytest.raises(subengine.StreamNotFound, match="'nope' does not exist"):
        engine.delete_stream("nope")


def test_the_async_engine_deletes_a_stream(
    engine: subengine.Engine, orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    fill(engine, orders)
    subscribe(engine, "billing", orders)

    async def delete() -> subengine.DeletedStream:
        async with subengine.AsyncEngine(dsn) as engine:
            with pytest.raises(subengine.InvalidInput, match="billing"):
                await engine.delete_stream(orders)
            return await engine.delete_stream(orders, force=True)

    deleted = asyncio.run(delete())
    assert (deleted.events, deleted.subscriptions) == (20, ("billing",))
    assert rows_of_stream(sql, orders) == dict.fromkeys(rows_of_stream(sql, orders), 0)
