"""The worker's behaviours, run over both workers: `Worker` with plain handlers and
`AsyncWorker` with async ones (DESIGN.md, "Layers": each pair of twins passes one
contract test module). Each test runs once per kind (`workers`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from helpers import (
    count,
    free_port,
    reset_waiting_for_the_batch,
    scrape,
    value,
    wait_for,
    wait_for_a_reset_replay,
)
from worker_twins import Effects, WorkerTwin, record
from worker_twins import workers_fixture as workers_fixture

import subengine
from subengine import NewEvent, Retention


def test_every_event_is_handled_once_in_order_per_partition(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], workers: WorkerTwin
) -> None:
    sql.execute("ALTER TABLE effects ADD COLUMN seq bigserial")
    fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(100)])
    app = subengine.App()
    workers.handler(app.subscription("billing", stream="orders", batch_size=7), record)
    with workers.running(app, fast_engine, concurrency=2):
        fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(50)])
        wait_for(lambda: count(sql) == 150)
    assert sql.execute("SELECT count(DISTINCT event_id) FROM effects").fetchone()[0] == 150  # type: ignore[index]
    rows = sql.execute("SELECT partition, position FROM effects ORDER BY seq").fetchall()
    for partition, head in fast_engine.heads("orders").items():
        assert [p for q, p in rows if q == partition] == list(range(1, head + 1))
    positions = {p.partition: p.position for p in fast_engine.subscription_positions("billing")}
    assert positions == fast_engine.heads("orders")
    locks = sql.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchone()
    assert locks[0] == 0  # type: ignore[index]
    assert count(sql, "subengine.workers") == 0


def poisoned(poison: subengine.Appended) -> Any:
    def body(event: subengine.Event) -> Effects:
        if event.id == poison.id:
            raise ValueError("cannot handle this one")
        return record(event)

    return body


@pytest.mark.parametrize("policy", ["stop", "dead_letter", "park"])
def test_a_poison_event_is_retried_then_handled_by_policy(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], workers: WorkerTwin, policy: Any
) -> None:
    fast_engine.create_stream("single", partitions=1)
    keys = ["a", "b", "a", "b", "a", "b"]
    stored = fast_engine.append("single", [NewEvent(k, "T", {}) for k in keys])
    poison = stored[2]  # key a: with parking, a's later event waits too
    app = subengine.App()
    sub = app.subscription(
        "billing", stream="single", batch_size=10, max_attempts=2, on_error=policy
    )
    workers.handler(sub, poisoned(poison))
    expected = {
        "stop": [1, 2],
        "dead_letter": [1, 2, 4, 5, 6],
        "park": [1, 2, 4, 6],
    }[policy]
    with workers.running(app, fast_engine):
        wait_for(lambda: count(sql) == len(expected))
        if policy == "stop":
            wait_for(lambda: fast_engine.subscription_positions("billing")[0].stopped)
        else:
            wait_for(lambda: fast_engine.subscription_positions("billing")[0].position == 6)
    handled = sql.execute("SELECT position FROM effects ORDER BY position").fetchall()
    assert [p for (p,) in handled] == expected
    [row] = fast_engine.subscription_positions("billing")
    if policy == "stop":
        assert (row.stopped, row.attempts, row.position) == (True, 2, 2)
        assert "ValueError: cannot handle this one" in (row.last_error or "")
    elif policy == "dead_letter":
        dead = sql.execute("SELECT event_id, attempts FROM subengine.dead_letters").fetchall()
        assert dead == [(poison.id, 2)]
    else:
        [key] = fast_engine.parked_keys("billing")
        assert key.key == "a"


def test_a_failing_event_in_a_batch_leaves_the_effects_before_it_once(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], workers: WorkerTwin
) -> None:
    # the batch's writes before the poison roll back with it, then commit once when the
    # batch is handled again one event at a time
    fast_engine.create_stream("single", partitions=1)
    stored = fast_engine.append("single", [NewEvent("k", "T", {}) for _ in range(10)])
    app = subengine.App()
    sub = app.subscription(
        "billing", stream="single", batch_size=10, max_attempts=1, on_error="dead_letter"
    )
    workers.handler(sub, poisoned(stored[6]))
    with workers.running(app, fast_engine):
        wait_for(lambda: count(sql) == 9 and count(sql, "subengine.dead_letters") == 1)
    handled = sql.execute("SELECT position FROM effects ORDER BY 1").fetchall()
    assert [p for (p,) in handled] == [p for p in range(1, 11) if p != 7]


def test_a_batch_handler_gets_each_partitions_events_in_order(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], workers: WorkerTwin
) -> None:
    sql.execute("CREATE TABLE batches (partition int, positions bigint[])")
    fast_engine.append("orders", [NewEvent(f"k{n % 5}", "T", {}) for n in range(40)])
    app = subengine.App()

    def body(events: Sequence[subengine.Event]) -> Effects:
        assert len({event.partition for event in events}) == 1
        positions = [event.position for event in events]
        return [
            ("INSERT INTO batches VALUES (%s, %s)", (events[0].partition, positions)),
            *(effect for event in events for effect in record(event)),
        ]

    workers.batch_handler(app.subscription("billing", stream="orders", batch_size=4), body)
    with workers.running(app, fast_engine):
        wait_for(lambda: count(sql) == 40)
    rows = sql.execute("SELECT partition, positions FROM batches").fetchall()
    for partition, head in fast_engine.heads("orders").items():
        seen = [p for q, positions in rows if q == partition for p in positions]
        assert seen == list(range(1, head + 1))
    assert all(1 <= len(positions) <= 4 for _, positions in rows)


def test_retry_later_postpones_the_whole_batch(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], workers: WorkerTwin
) -> None:
    fast_engine.create_stream("one", partitions=1)
    fast_engine.append("one", [NewEvent("k", "T", {}) for _ in range(6)])
    calls: list[list[int]] = []
    app = subengine.App()

    def body(events: Sequence[subengine.Event]) -> Effects:
        calls.append([event.position for event in events])
        if len(calls) == 1:
            raise subengine.RetryLater(1.0, "callback down")
        return [effect for event in events for effect in record(event)]

    sub = app.subscription("pusher", stream="one", batch_size=6, max_attempts=1)
    workers.batch_handler(sub, body)
    with workers.running(app, fast_engine):
        wait_for(lambda: count(sql) == 6)
    assert calls == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]
    [row] = fast_engine.subscription_positions("pusher")
    assert (row.position, row.attempts, row.stopped) == (6, 0, False)


def test_a_gap_reaches_the_gap_handler_once_in_the_batch_transaction(
    dsn: str, sql: psycopg.Connection[Any], workers: WorkerTwin
) -> None:
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    sql.execute("CREATE TABLE gaps (gap_from bigint, gap_to bigint)")
    settings = subengine.Settings(dsn=dsn, poll_interval=0.2, retention_interval=0)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("capped", partitions=1, retention=Retention(max_events=3))
        app = subengine.App()
        sub = app.subscription("billing", stream="capped")
        workers.handler(sub, record)
        workers.gap_handler(
            sub, lambda gap: [("INSERT INTO gaps VALUES (%s, %s)", (gap.gap_from, gap.gap_to))]
        )
        engine.ensure_subscription(sub)  # from position 0: retention passes it
        engine.append("capped", [NewEvent("k", "T", {}) for _ in range(10)])
        engine.run_retention()
        with workers.running(app, engine):
            wait_for(lambda: count(sql) == 3)
    assert sql.execute("SELECT * FROM gaps").fetchall() == [(1, 7)]
    handled = sql.execute("SELECT position FROM effects ORDER BY 1").fetchall()
    assert [p for (p,) in handled] == [8, 9, 10]


def test_a_database_error_moving_the_position_is_never_counted_against_the_events(
    dsn: str, sql: psycopg.Connection[Any], workers: WorkerTwin, caplog: pytest.LogCaptureFixture
) -> None:
    # Invariant 8: with one attempt and on_error="stop", counting the statement timeout of
    # the position's compare-and-set as the events' failure would stop the partition.
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    sql.execute(
        "CREATE FUNCTION slow_move() RETURNS trigger LANGUAGE plpgsql"
        " AS $$ BEGIN PERFORM pg_sleep(2); RETURN NEW; END $$"
    )
    sql.execute(
        "CREATE TRIGGER slow_move BEFORE UPDATE ON subengine.subscription_positions"
        " FOR EACH ROW WHEN (OLD.position <> NEW.position) EXECUTE FUNCTION slow_move()"
    )
    worker_dsn = psycopg.conninfo.make_conninfo(dsn, options="-c statement_timeout=500")
    settings = subengine.Settings(
        dsn=worker_dsn, poll_interval=0.2, retry_delay=0.05, retry_delay_max=0.2
    )
    with subengine.Engine(dsn) as admin, subengine.Engine(settings=settings) as engine:
        admin.create_stream("orders", partitions=2)
        stored = admin.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(6)])
        app = subengine.App()
        workers.handler(app.subscription("billing", stream="orders", max_attempts=1), record)
        with workers.running(app, engine):
            wait_for(
                lambda: any(
                    r.name == "subengine.worker" and r.levelno >= logging.WARNING
                    for r in caplog.records
                )
            )
            assert count(sql) == 0  # every batch's effects rolled back with its position
            sql.execute("DROP TRIGGER slow_move ON subengine.subscription_positions")
            wait_for(lambda: count(sql) == len(stored))
        rows = engine.subscription_positions("billing")
    assert [(p.stopped, p.attempts, p.last_error) for p in rows] == [(False, 0, None)] * 2
    assert count(sql, "subengine.dead_letters") == 0
    assert sql.execute("SELECT count(DISTINCT event_id) FROM effects").fetchone()[0] == 6  # type: ignore[index]


def test_the_partition_with_the_oldest_next_event_goes_first(
    fast_engine: subengine.Engine, workers: WorkerTwin
) -> None:
    # invariant 7: the later-appended partition holds the older events
    new_key = next(f"n{i}" for i in range(100) if subengine.partition_for(f"n{i}", 4) == 0)
    old_key = next(f"o{i}" for i in range(100) if subengine.partition_for(f"o{i}", 4) == 3)
    now = datetime.now(UTC)
    fast_engine.append("orders", [NewEvent(new_key, "T", {}, occurred_at=now) for _ in range(3)])
    fast_engine.append(
        "orders",
        [NewEvent(old_key, "T", {}, occurred_at=now - timedelta(hours=1)) for _ in range(3)],
    )
    order: list[int] = []
    app = subengine.App()

    def body(event: subengine.Event) -> Effects:
        order.append(event.partition)
        return []

    workers.handler(app.subscription("billing", stream="orders"), body)
    with workers.running(app, fast_engine, concurrency=1):
        wait_for(lambda: len(order) == 6)
    assert order == [3, 3, 3, 0, 0, 0]


# the listening connections of this test's database
LISTENING = "pg_stat_activity WHERE query LIKE 'LISTEN%' AND datname = current_database()"


def test_a_notification_delivers_without_waiting_for_a_poll(
    dsn: str, sql: psycopg.Connection[Any], workers: WorkerTwin
) -> None:
    # polls an hour apart: only the listener can bring the events in time
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    settings = subengine.Settings(dsn=dsn, poll_interval=3600, heartbeat_interval=3600)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("orders", partitions=2)
        app = subengine.App()
        workers.handler(app.subscription("billing", stream="orders"), record)
        with workers.running(app, engine):
            wait_for(lambda: count(sql, LISTENING) > 0)
            engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(10)])
            wait_for(lambda: count(sql) == 10, timeout=30)


def test_a_reset_during_a_failing_batch_charges_nothing_to_the_new_generation(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], dsn: str, workers: WorkerTwin
) -> None:
    # fencing by generation: the failure the old generation met is recorded against it
    # or not at all, and the new generation handles every event again
    fast_engine.create_stream("single", partitions=1)
    stored = fast_engine.append("single", [NewEvent("k", "T", {}) for _ in range(8)])
    poison = stored[4]
    resets: list[threading.Thread] = []
    app = subengine.App()

    def body(event: subengine.Event) -> Effects:
        if event.id != poison.id:
            return record(event)
        if not resets:
            resets.append(reset_waiting_for_the_batch(dsn))
        raise ValueError("poison")

    sub = app.subscription(
        "billing", stream="single", batch_size=1, max_attempts=1, on_error="dead_letter"
    )
    workers.handler(sub, body)
    with workers.running(app, fast_engine):
        wait_for_a_reset_replay(sql, fast_engine, 4 + 7)
        resets[0].join()
    [row] = fast_engine.subscription_positions("billing")
    assert (row.generation, row.position) == (2, 8)
    dead = sql.execute("SELECT position, generation FROM subengine.dead_letters").fetchall()
    assert {position for position, _ in dead} == {poison.position}
    assert (poison.position, 2) in dead


def test_metrics_and_the_status_view_show_the_work(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], workers: WorkerTwin
) -> None:
    stored = fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(12)])
    app = subengine.App()
    sub = app.subscription("billing", stream="orders", max_attempts=1, on_error="dead_letter")
    workers.handler(sub, poisoned(stored[3]))
    port = free_port()
    with workers.running(app, fast_engine, metrics_port=port, metrics_address="127.0.0.1"):
        wait_for(lambda: count(sql) == 11 and count(sql, "subengine.dead_letters") == 1)
        wait_for(
            lambda: (
                value(scrape(port), "subengine_events_processed_total", subscription="billing")
                == 11
            )
        )
        samples = scrape(port)
        status = fast_engine.subscription_status("billing")
    assert value(samples, "subengine_dead_letters_total", subscription="billing") == 1
    assert [p.lag for p in status] == [0] * 4
    assert {p.state for p in status} <= {"ok", "idle"}


def test_a_database_error_raised_by_a_handler_is_not_counted_against_the_events(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], workers: WorkerTwin
) -> None:
    # the handler's own statement times out twice (a lock held elsewhere, say), then works
    fast_engine.create_stream("single", partitions=1)
    stored = fast_engine.append("single", [NewEvent("k", "T", {}) for _ in range(6)])
    timeouts: list[Any] = []
    app = subengine.App()

    def body(event: subengine.Event) -> Effects:
        if event.id == stored[3].id and len(timeouts) < 2:
            timeouts.append(event.id)
            return [("SET LOCAL statement_timeout = 10", ()), ("SELECT pg_sleep(1)", ())]
        return record(event)

    sub = app.subscription("billing", stream="single", max_attempts=1, on_error="stop")
    workers.handler(sub, body)
    with workers.running(app, fast_engine):
        wait_for(lambda: count(sql) == len(stored))
    [row] = fast_engine.subscription_positions("billing")
    assert (row.position, row.stopped, row.attempts, row.last_error) == (6, False, 0, None)
    assert len(timeouts) == 2


def test_a_worker_whose_connections_are_all_ended_goes_on_exactly_once(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], workers: WorkerTwin
) -> None:
    # every connection of the worker, its batches' (sync or async) included, ended mid-run
    fast_engine.create_stream("single", partitions=1)
    fast_engine.append("single", [NewEvent("k", "T", {}) for _ in range(400)])
    app = subengine.App()

    def body(event: subengine.Event) -> Effects:
        return [("SELECT pg_sleep(0.005)", ()), *record(event)]

    workers.handler(app.subscription("billing", stream="single", batch_size=5), body)
    with workers.running(app, fast_engine):
        wait_for(lambda: 20 < count(sql) < 200)
        sql.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name LIKE 'subengine worker %' AND datname = current_database()"
        )
        wait_for(lambda: count(sql) == 400)
    assert sql.execute("SELECT count(DISTINCT event_id) FROM effects").fetchone()[0] == 400  # type: ignore[index]
