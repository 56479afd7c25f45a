"""Batches that carry several partitions of one subscription (the `lock_batch` query):
what they take, that each handler call sees one partition's events in order, that they
commit together, and that a failure or a gap in one partition stays in that partition."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from helpers import Running, count, key_in, poisoned_app, record, wait_for

import subengine
from subengine import NewEvent, Subscription
from subengine.subscriptions._batches import handle_batch


def events_in(engine: subengine.Engine, per_partition: dict[int, int]) -> None:
    """Append `per_partition[p]` events to each partition p of 'orders' (4 partitions)."""
    batch = [
        NewEvent(key_in(partition), "Step", {"partition": partition, "n": n})
        for partition, events in per_partition.items()
        for n in range(events)
    ]
    engine.append("orders", batch)


Calls = list[tuple[int, list[int], int]]


def billing(engine: subengine.Engine, batch_size: int) -> tuple[Subscription, Calls]:
    """billing of 'orders', stored, with a batch handler that records, per call, the
    partition, the positions and the transaction id (in the list returned with it)."""
    calls: Calls = []
    app = subengine.App()
    sub = app.subscription("billing", stream="orders", batch_size=batch_size)

    @sub.batch_handler()
    def handle(events: Any, conn: Any) -> None:
        (txid,) = conn.execute("SELECT txid_current()").fetchone()
        calls.append((events[0].partition, [e.position for e in events], txid))
        assert len({e.partition for e in events}) == 1

    engine.ensure_subscription(sub)
    return sub, calls


def test_a_batch_takes_the_oldest_partitions_of_its_subscription_up_to_its_size(
    fast_engine: subengine.Engine,
) -> None:
    events_in(fast_engine, {0: 3, 1: 3, 2: 3, 3: 3})
    sub, calls = billing(fast_engine, batch_size=8)
    with fast_engine.db() as db:
        outcomes = handle_batch(db, sub, 2, companions=8)
    assert outcomes is not None
    # the chosen partition first, then the others by their next event (all appended
    # together: by partition), until 8 events; the last one only in part
    assert [(o.partition, o.handled, o.position) for o in outcomes] == [
        (2, 3, 3), (0, 3, 3), (1, 2, 2),
    ]  # fmt: skip
    assert [(o.next_time is None) for o in outcomes] == [True, True, False]
    assert [(partition, positions) for partition, positions, _ in calls] == [
        (2, [1, 2, 3]), (0, [1, 2, 3]), (1, [1, 2]),
    ]  # fmt: skip
    assert len({txid for *_, txid in calls}) == 1, "one transaction for the batch"
    stored = {p.partition: p.position for p in fast_engine.subscription_positions("billing")}
    assert stored == {0: 3, 1: 2, 2: 3, 3: 0}


def test_a_partition_with_a_full_batch_takes_no_other(fast_engine: subengine.Engine) -> None:
    events_in(fast_engine, {0: 5, 1: 5})
    sub, calls = billing(fast_engine, batch_size=4)
    with fast_engine.db() as db:
        outcomes = handle_batch(db, sub, 1, companions=8)
    assert outcomes is not None
    assert [(o.partition, o.handled) for o in outcomes] == [(1, 4)]
    assert [(partition, positions) for partition, positions, _ in calls] == [(1, [1, 2, 3, 4])]


def test_a_batch_never_takes_a_partition_another_batch_holds(
    fast_engine: subengine.Engine,
) -> None:
    events_in(fast_engine, {0: 1, 1: 1, 2: 1, 3: 1})
    sub, calls = billing(fast_engine, batch_size=10)
    with psycopg.connect(fast_engine.dsn) as holder:
        holder.execute(
            "SELECT 1 FROM subengine.subscription_positions"
            " WHERE subscription = 'billing' AND partition = 1 FOR UPDATE"
        )
        with fast_engine.db() as db:
            outcomes = handle_batch(db, sub, 0, companions=8)
    assert outcomes is not None
    assert sorted(o.partition for o in outcomes) == [0, 2, 3]
    assert sorted(partition for partition, _, _ in calls) == [0, 2, 3]


def test_a_batch_stops_at_a_hole_and_the_next_batch_stops_the_partition_there(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # An event deleted in the middle of a partition: the batch handles the events before
    # the hole, never the ones after it, and the partition's next batch stops it,
    # naming the missing position. (The batch used to handle 1 and 3 and say nothing.)
    events_in(fast_engine, {1: 3})
    sql.execute("DELETE FROM subengine.events WHERE partition = 1 AND position = 2")
    sub, calls = billing(fast_engine, batch_size=10)
    assert fast_engine.process_batch(sub, 1) == subengine.BatchOutcome(1, 1, 1, calls_time(sql))
    with pytest.raises(subengine.PositionsMissing) as missing:
        fast_engine.process_batch(sub, 1)
    assert (missing.value.first, missing.value.last) == (2, 2)
    assert [(partition, positions) for partition, positions, _ in calls] == [(1, [1])]
    stored = {
        p.partition: (p.position, p.stopped) for p in fast_engine.subscription_positions("billing")
    }
    assert stored[1] == (1, True)


def calls_time(sql: psycopg.Connection[Any]) -> Any:
    """The time of the event at position 3 of partition 1."""
    row = sql.execute(
        "SELECT occurred_at FROM subengine.events WHERE partition = 1 AND position = 3"
    ).fetchone()
    assert row is not None
    return row[0]


def test_a_partition_whose_next_position_is_missing_is_left_to_its_own_batch(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    events_in(fast_engine, {0: 2, 1: 3, 2: 2})
    sql.execute("DELETE FROM subengine.events WHERE partition = 1 AND position = 1")
    sub, calls = billing(fast_engine, batch_size=10)
    with fast_engine.db() as db:
        outcomes = handle_batch(db, sub, 0, companions=8)
    assert outcomes is not None
    assert sorted(o.partition for o in outcomes) == [0, 2]
    assert sorted(partition for partition, _, _ in calls) == [0, 2]
    # its own batch stops it before the missing position, naming it
    with fast_engine.db() as db, pytest.raises(subengine.PositionsMissing) as missing:
        handle_batch(db, sub, 1, companions=8)
    assert (missing.value.first, missing.value.last) == (1, 1)
    stored = {
        p.partition: (p.position, p.stopped) for p in fast_engine.subscription_positions("billing")
    }
    assert stored[1] == (0, True)


def test_an_event_that_fails_in_a_batch_of_several_partitions_fails_alone(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    # The failing event is in a partition the worker's batches carry along: every other
    # event is handled once, and the failure is charged to that event only.
    events_in(fast_engine, {0: 3, 1: 3, 2: 3, 3: 2})
    poison = fast_engine.append("orders", [NewEvent(key_in(3), "Step", {})])[0]
    events_in(fast_engine, {3: 2})
    app = poisoned_app("orders", poison, batch_size=50, max_attempts=1, on_error="dead_letter")
    with Running(app, fast_engine):
        wait_for(lambda: count(sql) == 13)
        wait_for(lambda: count(sql, "subengine.dead_letters") == 1)
    assert sql.execute("SELECT count(DISTINCT event_id) FROM effects").fetchone() == (13,)
    dead = sql.execute(
        "SELECT partition, position, attempts FROM subengine.dead_letters"
    ).fetchall()
    assert dead == [(3, poison.position, 1)]
    assert any("a batch of several partitions failed" in r.getMessage() for r in caplog.records)
    heads = fast_engine.heads("orders")
    stored = {p.partition: p.position for p in fast_engine.subscription_positions("billing")}
    assert stored == heads


# an idle worker woken by a notification takes the notified partitions without a look


def test_events_appended_while_paused_are_handled_after_resuming(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # The notification of an append to a paused subscription wakes the idle worker,
    # which finds the partition halted. The row must still be marked for the looks:
    # after the resume nothing new is appended, and only the look can find the events.
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    with Running(app, fast_engine):
        wait_for(lambda: count(sql, "subengine.workers") == 1)
        fast_engine.pause_subscription("billing")
        fast_engine.append("orders", [NewEvent(key_in(1), "T", {})])
        time.sleep(1)  # the notification, the woken slot, several polls
        assert count(sql) == 0
        fast_engine.resume_subscription("billing")
        wait_for(lambda: count(sql) == 1, timeout=20)


def test_a_notified_partition_waits_for_its_retry(dsn: str, sql: psycopg.Connection[Any]) -> None:
    # A failed event is retried an hour later; appends to its partition in the meantime
    # must not run it again at once (which would count attempts and dead-letter it).
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    settings = subengine.Settings(
        dsn=dsn, poll_interval=0.2, retry_delay=3600, retry_delay_max=3600
    )
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("orders", partitions=4)
        key = key_in(2)
        poison = engine.append("orders", [NewEvent(key, "T", {})])[0]
        app = poisoned_app("orders", poison, max_attempts=3, on_error="dead_letter")
        with Running(app, engine):
            wait_for(lambda: attempts(sql) == 1)
            for _ in range(5):
                engine.append("orders", [NewEvent(key, "T", {})])
                time.sleep(0.2)
            time.sleep(1)
        assert attempts(sql) == 1
        assert count(sql, "subengine.dead_letters") == 0


def attempts(sql: psycopg.Connection[Any]) -> int:
    row = sql.execute(
        "SELECT attempts FROM subengine.subscription_positions"
        " WHERE subscription = 'billing' AND partition = 2"
    ).fetchone()
    return int(row[0]) if row else 0


def test_a_database_error_in_another_partition_of_a_batch_is_not_charged_to_the_chosen_one(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    # Partition 1's handler always meets a statement timeout (the database's trouble, not
    # its events'). A batch of partition 0 that carried partition 1 fails with it; the
    # worker must then try partition 0 alone, not back it off (a backed-off partition 0
    # would take partition 1 along again on every try, and never commit).
    events_in(fast_engine, {0: 1, 1: 1})
    app = subengine.App()

    @app.subscription("billing", stream="orders", batch_size=10).handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        if event.partition == 1:
            conn.execute("SET LOCAL statement_timeout = '1ms'")
            conn.execute("SELECT pg_sleep(0.05)")
        record(event, conn)

    with Running(app, fast_engine):
        wait_for(lambda: count(sql) == 1)
        wait_for(
            lambda: any("partition 1: database error" in r.getMessage() for r in caplog.records),
            what="partition 1's own database error",
        )
    assert sql.execute("SELECT partition FROM effects").fetchall() == [(0,)]
    assert not any("partition 0: database error" in r.getMessage() for r in caplog.records)
