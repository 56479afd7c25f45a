"""The worker loop, run in a thread against a real PostgreSQL."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from helpers import (
    Running,
    count,
    key_in,
    poisoned_app,
    record,
    reset_waiting_for_the_batch,
    stored_events,
    wait_for,
    wait_for_a_reset_replay,
)
from psycopg.sql import SQL, Identifier

import subengine
from subengine import NewEvent
from subengine.model._declarations import OnError
from subengine.worker._worker import Worker


def test_a_worker_handles_every_event_once_and_stops_cleanly(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(100)])
    app = subengine.App()
    app.subscription("billing", stream="orders", batch_size=7).handler()(record)
    with Running(app, fast_engine, concurrency=2):
        fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(50)])
        wait_for(lambda: count(sql) == 150)
    assert sql.execute("SELECT count(DISTINCT event_id) FROM effects").fetchone()[0] == 150  # type: ignore[index]
    positions = {p.partition: p.position for p in fast_engine.subscription_positions("billing")}
    assert positions == fast_engine.heads("orders")
    locks = sql.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchone()
    assert locks[0] == 0  # type: ignore[index]
    assert count(sql, "subengine.workers") == 0


def test_polling_alone_delivers_everything(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    with Running(app, fast_engine, listen=False):
        fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(20)])
        wait_for(lambda: count(sql) == 20)


# the listening connection of this test's worker (pg_stat_activity shows every database)
LISTENING = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE query LIKE 'LISTEN%' AND datname = current_database()"
)


@contextmanager
def push_only_worker(dsn: str, sql: psycopg.Connection[Any]) -> Iterator[subengine.Engine]:
    """A running worker whose poll interval is far longer than a test: only notifications
    can deliver in time. Yields its engine, with a 2-partition stream 'orders'. Its
    heartbeat (a poll) is as rare, so LISTEN stays the last statement of its poller."""
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    settings = subengine.Settings(dsn=dsn, poll_interval=600, heartbeat_interval=600)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("orders", partitions=2)
        app = subengine.App()
        app.subscription("billing", stream="orders").handler()(record)
        with Running(app, engine):
            yield engine


def test_the_listening_connection_is_terminated_again_and_again(
    dsn: str, sql: psycopg.Connection[Any]
) -> None:
    listening = LISTENING
    with push_only_worker(dsn, sql) as engine:
        for round_ in range(3):
            wait_for(lambda: sql.execute(listening).fetchone()[0] == 1)  # type: ignore[index]
            sql.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN%'"
                " AND datname = current_database()"
            )
            engine.append("orders", [NewEvent(f"r{round_}-{n}", "T", {}) for n in range(5)])
            wait_for(lambda r=round_: count(sql) == 5 * (r + 1))  # type: ignore[misc]


def test_a_reconnected_poller_finds_work_whose_mark_was_lost(
    dsn: str, sql: psycopg.Connection[Any]
) -> None:
    # A look's marks (a position row's next_time) commit asynchronously: a server crash
    # may lose one, leaving a row with work that neither the index nor the heads show.
    # Every connection of the poller makes every partition a suspect, so the first look
    # after it finds such rows. Here the lost mark is made by hand: positions back to 0
    # without their next times (the events are handled again: the count doubles).
    with push_only_worker(dsn, sql) as engine:
        engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(5)])
        wait_for(lambda: count(sql) == 5)
        sql.execute("UPDATE subengine.subscription_positions SET position = 0, next_time = NULL")
        time.sleep(1)  # no notification, no poll: nothing shows the work
        assert count(sql) == 5
        sql.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN%'"
            " AND datname = current_database()"
        )
        wait_for(lambda: count(sql) == 10)


@pytest.mark.parametrize("policy", ["stop", "dead_letter"])
def test_a_poison_event_is_retried_then_handled_by_policy(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], policy: OnError
) -> None:
    keys = [f"k{n}" for n in range(12)]
    stored = fast_engine.append("orders", [NewEvent(k, "T", {"n": n}) for n, k in enumerate(keys)])
    poison = stored[5]
    app = poisoned_app("orders", poison, max_attempts=3, on_error=policy)
    with Running(app, fast_engine):
        if policy == "stop":
            # the poison's partition halts at it; the other partitions go on
            handled = [
                a for a in stored if a.partition != poison.partition or a.position < poison.position
            ]
            wait_for(lambda: count(sql) == len(handled))
            wait_for(
                lambda: (
                    [p.stopped for p in fast_engine.subscription_positions("billing")].count(True)
                    == 1
                )
            )
        else:
            wait_for(lambda: count(sql) == 11 and count(sql, "subengine.dead_letters") == 1)
    [row] = [
        p for p in fast_engine.subscription_positions("billing") if p.partition == poison.partition
    ]
    if policy == "stop":
        assert (row.stopped, row.attempts, row.position) == (True, 3, poison.position - 1)
        assert "ValueError: cannot handle this one" in row.last_error  # type: ignore[operator]
    else:
        dead = sql.execute(
            "SELECT event_id, position, attempts, error FROM subengine.dead_letters"
        ).fetchone()
        assert dead[:3] == (poison.id, poison.position, 3)  # type: ignore[index]
        assert row.position == fast_engine.heads("orders")[poison.partition]
        assert not row.stopped and row.attempts == 0


def test_a_single_attempt_dead_letters_the_failing_event_not_the_batch_head(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # One partition, the poison event in the middle of the first batch: with one attempt
    # allowed, the failed batch of 10 must not send its first event to the dead letters.
    fast_engine.create_stream("single", partitions=1)
    stored = fast_engine.append("single", [NewEvent("k", "T", {"n": n}) for n in range(10)])
    poison = stored[6]
    app = poisoned_app("single", poison, batch_size=10, max_attempts=1, on_error="dead_letter")
    with Running(app, fast_engine):
        wait_for(lambda: count(sql) == 9 and count(sql, "subengine.dead_letters") == 1)
    dead = sql.execute("SELECT event_id, position FROM subengine.dead_letters").fetchall()
    assert dead == [(poison.id, poison.position)]
    handled = sql.execute("SELECT position FROM effects ORDER BY 1").fetchall()
    assert [p for (p,) in handled] == [p for p in range(1, 11) if p != poison.position]


def test_a_failing_event_deep_in_a_batch_waits_for_no_retry_delay_of_the_events_before_it(
    dsn: str, sql: psycopg.Connection[Any]
) -> None:
    # With retries an hour apart, reaching the poison (40th of a batch of 50) and sending
    # it to the dead letters in time means the 39 events before it were handled at once,
    # one by one, and the failure was counted against the poison alone.
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    settings = subengine.Settings(
        dsn=dsn, poll_interval=0.2, retry_delay=3600, retry_delay_max=3600
    )
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("single", partitions=1)
        stored = engine.append("single", [NewEvent("k", "T", {"n": n}) for n in range(50)])
        poison = stored[39]
        app = poisoned_app("single", poison, batch_size=50, max_attempts=1, on_error="dead_letter")
        with Running(app, engine):
            wait_for(lambda: count(sql) == 49 and count(sql, "subengine.dead_letters") == 1)
        [position] = engine.subscription_positions("billing")
    dead = sql.execute("SELECT event_id, position, attempts FROM subengine.dead_letters").fetchall()
    assert dead == [(poison.id, poison.position, 1)]
    assert (position.position, position.attempts, position.stopped) == (50, 0, False)


def test_a_batch_whose_commit_fails_is_split_like_one_whose_handler_raises(
    dsn: str, sql: psycopg.Connection[Any]
) -> None:
    # The poison's write breaks a deferred unique constraint, so its batch fails only at
    # commit. With retries an hour apart, it reaches the dead letters in time only if the
    # commit failure splits the batch too, and is pinned on the poison, not the batch head.
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    sql.execute("CREATE TABLE numbers (n int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    sql.execute("INSERT INTO numbers VALUES (-1)")
    settings = subengine.Settings(
        dsn=dsn, poll_interval=0.2, retry_delay=3600, retry_delay_max=3600
    )
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("single", partitions=1)
        numbers = [-1 if n == 39 else n for n in range(50)]
        stored = engine.append("single", [NewEvent("k", "T", {"n": n}) for n in numbers])
        app = subengine.App()
        sub = app.subscription(
            "billing", stream="single", batch_size=50, max_attempts=1, on_error="dead_letter"
        )

        @sub.handler()
        def handle(event: subengine.Event, conn: Any) -> None:
            conn.execute("INSERT INTO numbers VALUES (%s)", (event.data["n"],))
            record(event, conn)

        with Running(app, engine):
            wait_for(lambda: count(sql) == 49 and count(sql, "subengine.dead_letters") == 1)
    dead = sql.execute("SELECT event_id, position, attempts FROM subengine.dead_letters").fetchall()
    assert dead == [(stored[39].id, stored[39].position, 1)]


def test_the_partition_with_the_oldest_next_event_goes_first(fast_engine: subengine.Engine) -> None:
    # Invariant 7: keys in two partitions; the later-appended partition holds older events.
    new_key = next(f"n{i}" for i in range(100) if subengine.partition_for(f"n{i}", 4) == 0)
    old_key = next(f"o{i}" for i in range(100) if subengine.partition_for(f"o{i}", 4) == 3)
    now = datetime.now(UTC)
    fast_engine.append("orders", [NewEvent(new_key, "T", {}, occurred_at=now) for _ in range(3)])
    fast_engine.append(
        "orders",
        [NewEvent(old_key, "T", {}, occurred_at=now - timedelta(hours=1)) for _ in range(3)],
    )
    order = []
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(
        lambda event, conn: order.append(event.partition)
    )
    with Running(app, fast_engine, concurrency=1):
        wait_for(lambda: len(order) == 6)
    assert order == [3, 3, 3, 0, 0, 0]


@pytest.mark.parametrize("start", ["beginning", "end", "time", "positions"])
def test_each_start_point_through_the_worker(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], start: Any
) -> None:
    old = [fast_engine.append("orders", [NewEvent(f"k{n}", "T", {"n": n})])[0] for n in range(12)]
    middle = old[6]
    [event] = stored_events(fast_engine.read("orders", middle.partition, middle.position - 1, 1))
    declared = {
        "beginning": "beginning",
        "end": "end",
        "time": event.recorded_at,  # the events recorded from then on
        "positions": {middle.partition: middle.position - 1},  # one partition's tail
    }[start]
    expected = {
        "beginning": old,
        "end": [],
        "time": old[6:],
        "positions": [
            a for a in old if a.partition != middle.partition or a.position >= middle.position
        ],
    }[start]
    app = subengine.App()
    sub = app.subscription("billing", stream="orders", start=declared)  # type: ignore[arg-type]
    sub.handler()(record)
    fast_engine.ensure_subscription(sub)  # stored now: "end" means the heads of now
    with Running(app, fast_engine):
        new = fast_engine.append("orders", [NewEvent(f"n{n}", "T", {}) for n in range(5)])
        wanted = {a.id for a in expected} | {a.id for a in new}
        wait_for(lambda: count(sql) == len(wanted))
        time.sleep(0.3)  # longer than a poll: nothing else arrives
    handled = {row[0] for row in sql.execute("SELECT event_id FROM effects")}
    assert handled == wanted
    assert count(sql) == len(wanted)


def test_at_least_once_handlers_run_outside_the_transaction_and_may_repeat(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    stored = fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(20)])
    calls = []
    app = subengine.App()
    sub = app.subscription("mailer", stream="orders", ack="at_least_once", batch_size=5)
    reset_once = threading.Event()

    @sub.handler()
    def send(event: subengine.Event, conn: Any) -> None:
        assert conn is None  # no transaction to write in: the effect is outside
        calls.append(event.id)
        if not reset_once.is_set():
            # a reset while the batch's handlers run: the position it read is stale, so
            # its compare-and-set fails and the position stays where the reset put it
            reset_once.set()
            fast_engine.reset_subscription("mailer", "beginning")

    with Running(app, fast_engine):
        wait_for(
            lambda: (
                {p.partition: p.position for p in fast_engine.subscription_positions("mailer")}
                == fast_engine.heads("orders")
            )
        )
    # every event at least once; the fenced batch's events a second time
    assert set(calls) == {a.id for a in stored}
    assert len(calls) > len(stored)
    assert all(p.generation == 2 for p in fast_engine.subscription_positions("mailer"))


def worker_warned(caplog: pytest.LogCaptureFixture) -> bool:
    return any(
        r.name == "subengine.worker" and r.levelno >= logging.WARNING for r in caplog.records
    )


@pytest.mark.parametrize("where", ["reading the batch", "moving the position"])
def test_a_database_error_is_retried_and_never_counted_against_the_events(
    dsn: str, sql: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture, where: str
) -> None:
    # Invariant 8: with one attempt allowed and on_error="stop", counting a database error
    # as the events' failure would stop a partition whose events no handler ever saw.
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    role = f"worker_{sql.info.dbname}"
    grant = [
        "CREATE ROLE {role}",
        "GRANT USAGE ON SCHEMA subengine TO {role}",
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA subengine TO {role}",
        "GRANT INSERT ON effects TO {role}",
    ]
    if where == "reading the batch":
        # the worker may read what choosing a partition needs, but no event's data
        grant += [
            "REVOKE SELECT ON subengine.events FROM {role}",
            "GRANT SELECT (stream, partition, position, occurred_at) ON subengine.events TO {role}",
        ]
        repair = "GRANT SELECT ON subengine.events TO {role}"
    else:
        # moving the position takes longer than the worker's statement timeout
        grant += [
            "CREATE FUNCTION slow_move() RETURNS trigger LANGUAGE plpgsql"
            " AS $$ BEGIN PERFORM pg_sleep(2); RETURN NEW; END $$",
            "CREATE TRIGGER slow_move BEFORE UPDATE ON subengine.subscription_positions"
            " FOR EACH ROW WHEN (OLD.position <> NEW.position) EXECUTE FUNCTION slow_move()",
        ]
        repair = "DROP TRIGGER slow_move ON subengine.subscription_positions"
    for statement in grant:
        sql.execute(SQL(statement).format(role=Identifier(role)))
    worker_dsn = psycopg.conninfo.make_conninfo(
        dsn, options=f"-c role={role} -c statement_timeout=500"
    )
    settings = subengine.Settings(
        dsn=worker_dsn, poll_interval=0.2, retry_delay=0.05, retry_delay_max=0.2
    )
    try:
        with subengine.Engine(dsn) as admin, subengine.Engine(settings=settings) as engine:
            admin.create_stream("orders", partitions=2)
            stored = admin.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(6)])
            app = subengine.App()
            app.subscription("billing", stream="orders", max_attempts=1).handler()(record)
            with Running(app, engine):
                wait_for(lambda: worker_warned(caplog))
                sql.execute(SQL(repair).format(role=Identifier(role)))
                wait_for(lambda: count(sql) == len(stored))
            rows = engine.subscription_positions("billing")
        assert [(p.stopped, p.attempts, p.last_error) for p in rows] == [(False, 0, None)] * 2
        assert count(sql, "subengine.dead_letters") == 0
        assert sql.execute("SELECT count(DISTINCT event_id) FROM effects").fetchone()[0] == 6  # type: ignore[index]
    finally:
        sql.execute(SQL("DROP OWNED BY {role}; DROP ROLE {role}").format(role=Identifier(role)))


def test_missing_positions_stop_the_partition_with_an_error_naming_them(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    fast_engine.create_stream("single", partitions=1)
    fast_engine.append("single", [NewEvent("k", "T", {"n": n}) for n in range(10)])
    app = subengine.App()
    app.subscription("billing", stream="single").handler()(record)
    fast_engine.ensure_subscription(app.subscriptions["billing"])
    # as retention does it: the events go and the floor rises
    sql.execute("DELETE FROM subengine.events WHERE stream = 'single' AND position <= 5")
    sql.execute("UPDATE subengine.partitions SET floor = 6 WHERE stream = 'single'")
    with Running(app, fast_engine):
        wait_for(lambda: fast_engine.subscription_positions("billing")[0].stopped)
    [row] = fast_engine.subscription_positions("billing")
    assert (row.position, row.attempts) == (0, 0)
    assert "retention removed positions 1 to 5 of partition 0 of stream 'single'" in row.last_error  # type: ignore[operator]
    assert count(sql) == 0  # the handler saw none of 6..10
    [(state,)] = sql.execute("SELECT state FROM subengine.subscription_status").fetchall()
    assert state == "gap"  # below the floor: retention removed what it had not handled


def test_a_partition_whose_every_event_is_gone_stops_too(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    fast_engine.create_stream("single", partitions=1)
    fast_engine.append("single", [NewEvent("k", "T", {}) for _ in range(3)])
    sql.execute("DELETE FROM subengine.events WHERE stream = 'single'")
    app = subengine.App()
    sub = app.subscription("billing", stream="single")
    sub.handler()(record)
    fast_engine.ensure_subscription(sub)
    with pytest.raises(subengine.PositionsMissing, match="positions 1 to 3") as missing:
        fast_engine.process_batch(sub, 0)
    assert (missing.value.first, missing.value.last) == (1, 3)
    [row] = fast_engine.subscription_positions("billing")
    assert (row.position, row.stopped) == (0, True)


def test_a_dead_letter_clears_the_failure_state_of_its_partition(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # the poison is the partition's last event: no later batch clears the state for it
    stored = fast_engine.append("orders", [NewEvent("k", "T", {"n": n}) for n in range(3)])
    app = poisoned_app("orders", stored[2], max_attempts=2, on_error="dead_letter")
    with Running(app, fast_engine):
        wait_for(lambda: count(sql) == 2 and count(sql, "subengine.dead_letters") == 1)
    [row] = [
        p
        for p in fast_engine.subscription_positions("billing")
        if p.partition == stored[0].partition
    ]
    assert (row.position, row.attempts, row.last_error) == (3, 0, None)
    [(state,)] = sql.execute(
        "SELECT state FROM subengine.subscription_status WHERE partition = %s",
        (stored[0].partition,),
    ).fetchall()
    assert state == "idle"


def test_a_failing_event_that_is_gone_is_not_skipped_by_its_dead_letter(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], dsn: str
) -> None:
    stored = fast_engine.append("orders", [NewEvent("k", "T", {"n": n}) for n in range(3)])
    poison = stored[1]
    app = subengine.App()
    sub = app.subscription("billing", stream="orders", max_attempts=1, on_error="dead_letter")

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        if event.id == poison.id:
            with psycopg.connect(dsn, autocommit=True) as other:
                other.execute("DELETE FROM subengine.events WHERE id = %s", (poison.id,))
            raise ValueError("poison")
        record(event, conn)

    with Running(app, fast_engine):
        wait_for(lambda: any(p.stopped for p in fast_engine.subscription_positions("billing")))
    [row] = [p for p in fast_engine.subscription_positions("billing") if p.stopped]
    assert row.position == poison.position - 1
    assert f"no longer stores position {poison.position}," in row.last_error  # type: ignore[operator]
    assert count(sql, "subengine.dead_letters") == 0
    assert count(sql) == 1  # the event after the gone one waits behind it


@pytest.mark.parametrize("policy", ["dead_letter", "stop"])
def test_a_reset_during_a_failing_retry_charges_nothing_to_the_new_generation(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], dsn: str, policy: OnError
) -> None:
    fast_engine.create_stream("single", partitions=1)
    stored = fast_engine.append("single", [NewEvent("k", "T", {"n": n}) for n in range(8)])
    poison = stored[4]
    resets: list[threading.Thread] = []
    app = subengine.App()
    sub = app.subscription(
        "billing", stream="single", batch_size=1, max_attempts=1, on_error=policy
    )

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        if event.id != poison.id:
            return record(event, conn)
        if not resets:
            resets.append(reset_waiting_for_the_batch(dsn))
        raise ValueError("poison")

    with Running(app, fast_engine):
        if policy == "dead_letter":
            wait_for_a_reset_replay(sql, fast_engine, 4 + 7)
        else:
            # stopped in the new generation: a stop of the first one, recorded before the
            # waiting reset took the row, is replaced by the reset
            wait_for(
                lambda: any(
                    p.stopped and p.generation == 2
                    for p in fast_engine.subscription_positions("billing")
                )
            )
        resets[0].join()
    [row] = fast_engine.subscription_positions("billing")
    assert row.generation == 2
    dead = sql.execute("SELECT position, generation FROM subengine.dead_letters").fetchall()
    if policy == "dead_letter":
        # Only the poison, in the generation that failed on it after the reset, and maybe
        # in the first too: the worker may record the first failure before the waiting
        # reset takes the row (then against the poison itself, in generation 1).
        assert {position for position, _ in dead} == {poison.position}
        assert (poison.position, 2) in dead
        assert row.position == 8
    else:
        assert dead == []
        assert (row.position, row.stopped) == (poison.position - 1, True)


def test_a_rebuild_records_a_repeated_dead_letter_and_goes_on(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    fast_engine.create_stream("single", partitions=1)
    stored = fast_engine.append("single", [NewEvent("k", "T", {"n": n}) for n in range(5)])
    app = poisoned_app("single", stored[2], max_attempts=1, on_error="dead_letter")
    with Running(app, fast_engine):
        wait_for(lambda: count(sql) == 4 and count(sql, "subengine.dead_letters") == 1)
        fast_engine.reset_subscription("billing", "beginning")
        wait_for(lambda: count(sql) == 8 and count(sql, "subengine.dead_letters") == 2)
    letters = sql.execute(
        "SELECT position, generation, resolution FROM subengine.dead_letters ORDER BY 2"
    ).fetchall()
    assert letters == [(3, 1, "superseded"), (3, 2, None)]
    assert [d.generation for d in fast_engine.dead_letters("billing")] == [2]
    [row] = fast_engine.subscription_positions("billing")
    assert (row.position, row.generation, row.stopped) == (5, 2, False)


def test_an_unexpected_error_in_one_partition_leaves_the_worker_and_the_others_running(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    # Recording the dead letter fails: the poison's partition waits and tries again; the
    # other partitions go on; the worker does not stop.
    sql.execute(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql"
        " AS $$ BEGIN RAISE EXCEPTION 'not today'; END $$;"
        " CREATE TRIGGER refuse BEFORE INSERT ON subengine.dead_letters"
        " FOR EACH ROW EXECUTE FUNCTION refuse()"
    )
    poison = fast_engine.append("orders", [NewEvent(key_in(0), "T", {})])[0]
    app = poisoned_app("orders", poison, max_attempts=1, on_error="dead_letter")
    with Running(app, fast_engine):
        wait_for(lambda: worker_warned(caplog))
        others = fast_engine.append("orders", [NewEvent(key_in(p), "T", {}) for p in (1, 2, 3)])
        wait_for(lambda: count(sql) == len(others))
        sql.execute("DROP TRIGGER refuse ON subengine.dead_letters")
        wait_for(lambda: count(sql, "subengine.dead_letters") == 1)
    assert any("not today" in r.getMessage() for r in caplog.records)


def test_the_listener_survives_a_notification_it_cannot_parse(
    dsn: str, sql: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    with push_only_worker(dsn, sql) as engine:
        listening = LISTENING
        wait_for(lambda: sql.execute(listening).fetchone()[0] == 1)  # type: ignore[index]
        sql.execute("SELECT pg_notify('subengine', repeat('[', 7000))")
        engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(5)])
        wait_for(lambda: count(sql) == 5)
    assert any("a notification that does not parse" in r.getMessage() for r in caplog.records)


def slow_backlog(
    engine: subengine.Engine, sql: psycopg.Connection[Any], events: int = 400
) -> subengine.App:
    """One partition with a backlog that takes a few seconds, and an app handling it."""
    engine.create_stream("single", partitions=1)
    engine.append("single", [NewEvent("k", "T", {}) for _ in range(events)])
    app = subengine.App()
    sub = app.subscription("billing", stream="single", batch_size=5)

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        conn.execute("SELECT pg_sleep(0.005)")
        record(event, conn)

    return app


def lock_holders(sql: psycopg.Connection[Any]) -> set[int]:
    return {
        pid
        for (pid,) in sql.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
    }


def test_a_worker_whose_connections_are_all_ended_goes_on(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    app = slow_backlog(fast_engine, sql)
    with Running(app, fast_engine):
        wait_for(lambda: lock_holders(sql) and 20 < count(sql) < 200)
        sql.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name LIKE 'subengine worker %' AND datname = current_database()"
        )
        wait_for(lambda: count(sql) == 400)
    assert sql.execute("SELECT count(DISTINCT event_id) FROM effects").fetchone()[0] == 400  # type: ignore[index]


def test_a_held_lock_whose_connection_ended_is_taken_again(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # the slot keeps a partition's lock between batches; when the lock's connection ends,
    # the lock is gone (another worker could take the partition): the slot must notice
    app = slow_backlog(fast_engine, sql)
    with Running(app, fast_engine):
        wait_for(lambda: lock_holders(sql) and 20 < count(sql) < 200)
        [holder] = lock_holders(sql)
        sql.execute("SELECT pg_terminate_backend(%s)", (holder,))
        wait_for(lambda: lock_holders(sql) - {holder} and count(sql) < 400)


def test_a_pause_stops_a_partition_the_slot_holds(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    app = slow_backlog(fast_engine, sql)
    with Running(app, fast_engine):
        wait_for(lambda: 20 < count(sql) < 200)
        fast_engine.pause_subscription("billing")
        # the batch in flight may finish; then nothing moves, over several polls
        wait_for(lambda: lock_holders(sql) == set())
        paused_at = count(sql)
        time.sleep(1)
        assert count(sql) == paused_at < 400
        fast_engine.resume_subscription("billing")
        wait_for(lambda: count(sql) == 400)


def test_a_handler_that_swallows_a_database_error_fails_its_batch(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # The handler catches its statement's error, so the batch's transaction is aborted
    # and moving the position fails: that failure is the handlers' doing, and counts.
    # The poison is the batch's last event, so no later statement of the handlers meets
    # the aborted transaction first.
    fast_engine.create_stream("single", partitions=1)
    stored = fast_engine.append("single", [NewEvent("k", "T", {"n": n}) for n in range(4)])
    poison = stored[3]
    app = subengine.App()
    sub = app.subscription("billing", stream="single", max_attempts=1, on_error="stop")

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        if event.id == poison.id:
            try:
                conn.execute("SELECT 1 / 0")
            except psycopg.errors.DivisionByZero:
                return  # the transaction is aborted all the same
        record(event, conn)

    fast_engine.ensure_subscription(sub)
    with Running(app, fast_engine):
        wait_for(lambda: fast_engine.subscription_positions("billing")[0].stopped)
    [row] = fast_engine.subscription_positions("billing")
    assert row.position == poison.position - 1
    assert "InFailedSqlTransaction" in row.last_error  # type: ignore[operator]
    assert count(sql) == poison.position - 1


def test_a_database_error_raised_by_a_handler_is_not_counted_either(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # the handler's own statement times out twice (a lock held elsewhere, say), then works
    fast_engine.create_stream("single", partitions=1)
    stored = fast_engine.append("single", [NewEvent("k", "T", {"n": n}) for n in range(6)])
    timeouts: list[Any] = []
    app = subengine.App()
    sub = app.subscription("billing", stream="single", max_attempts=1, on_error="stop")

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        if event.id == stored[3].id and len(timeouts) < 2:
            timeouts.append(event.id)
            conn.execute("SET LOCAL statement_timeout = 10")
            conn.execute("SELECT pg_sleep(1)")
        record(event, conn)

    with Running(app, fast_engine):
        wait_for(lambda: count(sql) == len(stored))
    [row] = fast_engine.subscription_positions("billing")
    assert (row.position, row.stopped, row.attempts, row.last_error) == (6, False, 0, None)
    assert len(timeouts) == 2


def test_a_reset_during_a_split_ends_the_split(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], dsn: str
) -> None:
    # The batch of positions 401..450 fails once; while it runs, a reset to the beginning
    # waits for its row lock. The split that follows must not replay the whole stream one
    # event per transaction.
    fast_engine.create_stream("single", partitions=1)
    fast_engine.append("single", [NewEvent("k", "T", {}) for _ in range(500)])
    sizes: list[int] = []
    resets: list[threading.Thread] = []
    app = subengine.App()
    sub = app.subscription("billing", stream="single", batch_size=50)

    @sub.batch_handler()
    def handle(events: Sequence[subengine.Event], conn: Any) -> None:
        sizes.append(len(events))
        if events[-1].position == 450 and not resets:
            resets.append(reset_waiting_for_the_batch(dsn))
            raise ValueError("once")

    fast_engine.ensure_subscription(sub)
    with Running(app, fast_engine):
        wait_for(
            lambda: (
                resets
                and fast_engine.subscription_positions("billing")[0].position == 500
                and fast_engine.subscription_positions("billing")[0].generation == 2
            )
        )
        resets[0].join()
    # one at a time only within the failed batch (a few of its events may go before the
    # reset lands), never the replay of everything before it
    assert sizes.count(1) < 50, sizes


def deadlocks(sql: psycopg.Connection[Any]) -> int:
    return sql.execute(  # type: ignore[no-any-return, index]
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()[0]


def test_a_forced_delete_while_a_dead_letter_is_recorded_does_not_deadlock(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # The dead letter's insert is slowed down by a trigger; the delete comes in meanwhile
    # and must wait for it, not deadlock with it.
    sql.execute(
        "CREATE FUNCTION slowly() RETURNS trigger LANGUAGE plpgsql"
        " AS $$ BEGIN PERFORM pg_sleep(1); RETURN NEW; END $$;"
        " CREATE TRIGGER slowly BEFORE INSERT ON subengine.dead_letters"
        " FOR EACH ROW EXECUTE FUNCTION slowly()"
    )
    poison = fast_engine.append("orders", [NewEvent("k", "T", {})])[0]
    app = poisoned_app("orders", poison, max_attempts=1, on_error="dead_letter")
    before = deadlocks(sql)
    with Running(app, fast_engine):
        sleeping = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
            " AND datname = current_database()"
        )
        wait_for(lambda: sql.execute(sleeping).fetchone()[0] == 1)  # type: ignore[index]
        deleted = fast_engine.delete_subscription("billing", force=True)
    assert (deleted.partitions, deleted.dead_letters) == (4, 1)
    assert deadlocks(sql) == before
    assert count(sql, "subengine.subscriptions") == 0


def test_an_event_gone_on_replay_leaves_its_older_dead_letter_open(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], dsn: str
) -> None:
    fast_engine.create_stream("single", partitions=1)
    stored = fast_engine.append("single", [NewEvent("k", "T", {}) for _ in range(3)])
    poison = stored[1]
    replays = []
    app = subengine.App()
    # batches of one event: the failing one is recorded at once, without a split (whose
    # next read would find the gap itself)
    sub = app.subscription(
        "billing", stream="single", max_attempts=1, on_error="dead_letter", batch_size=1
    )

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        if event.id == poison.id:
            if fast_engine.subscription_positions("billing")[0].generation == 2:
                replays.append(event.id)  # on the replay, the event goes before it fails
                with psycopg.connect(dsn, autocommit=True) as other:
                    other.execute("DELETE FROM subengine.events WHERE id = %s", (poison.id,))
            raise ValueError("poison")
        record(event, conn)

    with Running(app, fast_engine):
        wait_for(lambda: count(sql, "subengine.dead_letters") == 1 and count(sql) == 2)
        fast_engine.reset_subscription("billing", "beginning")
        wait_for(lambda: fast_engine.subscription_positions("billing")[0].stopped)
    letters = sql.execute(
        "SELECT position, generation, resolution FROM subengine.dead_letters"
    ).fetchall()
    assert letters == [(poison.position, 1, None)]
    assert replays == [poison.id]


def test_a_subscription_declared_anew_on_another_stream_is_left_alone(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    fast_engine.create_stream("other", partitions=2)
    with Running(app, fast_engine):
        fast_engine.append("orders", [NewEvent("k", "T", {})])
        wait_for(lambda: count(sql) == 1)
        fast_engine.delete_subscription("billing", force=True)
        fast_engine.ensure_subscription(subengine.Subscription("billing", "other"))
        fast_engine.append("other", [NewEvent(f"k{n}", "T", {}) for n in range(6)])
        fast_engine.append("orders", [NewEvent("k", "T", {})])
        time.sleep(1)  # several polls and notifications
    assert count(sql) == 1  # this worker's billing is the one on 'orders', deleted
    assert [p.position for p in fast_engine.subscription_positions("billing")] == [0, 0]


def test_retry_later_postpones_the_whole_batch_for_every_worker(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # A handler that cannot deliver now (a webhook's callback is down) raises RetryLater:
    # the batch is not split into single events, no error policy applies (one attempt
    # allowed and on_error="stop" would otherwise stop the partition), and the partition
    # waits in the database, where every worker sees it.
    fast_engine.create_stream("one", partitions=1)
    fast_engine.append("one", [NewEvent("k", "T", {"n": n}) for n in range(6)])
    batches: list[list[int]] = []
    app = subengine.App()
    sub = app.subscription(
        "pusher", stream="one", ack="at_least_once", batch_size=6, max_attempts=1
    )

    @sub.batch_handler()
    def push(events: Sequence[subengine.Event], conn: Any) -> None:
        batches.append([event.position for event in events])
        if len(batches) == 1:
            raise subengine.RetryLater(3.0, "callback down")

    def row() -> tuple[Any, ...] | None:
        return sql.execute(
            "SELECT attempts, last_error, retry_at > now(), stopped"
            " FROM subengine.subscription_positions WHERE subscription = 'pusher'"
        ).fetchone()

    with Running(app, fast_engine):
        # the postponement commits after the handler raised: wait for it
        wait_for(lambda: (row() or (None, None))[1] is not None, "the postponement")
        assert row() == (0, "RetryLater: callback down", True, False)
        wait_for(lambda: fast_engine.subscription_positions("pusher")[0].position == 6)
    assert batches == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]


def test_a_mark_a_commit_overwrote_does_not_strand_the_event_it_marked(
    dsn: str, sql: psycopg.Connection[Any]
) -> None:
    # The race: a batch's commit statement takes its snapshot before event E2 commits,
    # then waits for the position row, which a look (of another slot) holds while it
    # marks E2 there (next_time) after taking E2's suspect. The commit, re-checked on the
    # new row version, still computes next_time in its old snapshot: NULL. The mark is
    # gone, the suspect was taken, and the heads the worker knows match the database's:
    # nothing but a later append would find E2. Polls are made rare here, so that only
    # the worker itself can notice.
    settings = subengine.Settings(dsn=dsn, poll_interval=300, heartbeat_interval=300)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("one", partitions=1)
        engine.append("one", [NewEvent("k", "T", {"n": 1})])
        app = subengine.App()
        sub = app.subscription("racer", stream="one", ack="at_least_once")
        handled: list[int] = []
        holder = psycopg.connect(dsn)
        worker: Worker | None = None  # made below, once the handler is registered

        def interleave() -> None:
            # wait until the batch's commit waits for the row this connection holds
            wait_for(
                lambda: (
                    sql.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND application_name LIKE 'subengine worker %'"
                    ).fetchone()
                    == (1,)
                ),
                "the commit to wait",
            )
            assert worker is not None
            board = worker._board
            before = board.news()
            engine.append("one", [NewEvent("k", "T", {"n": 2})])  # E2: notified
            wait_for(lambda: board.news() > before, "the notification")
            board.take()  # its suspect, as another slot's look would
            holder.execute(
                "UPDATE subengine.subscription_positions"
                " SET next_time = subengine.next_event_time('one', 0, position)"
                " WHERE subscription = 'racer'"
            )
            holder.commit()  # the mark; the commit overwrites it

        @sub.batch_handler()
        def handle(events: Sequence[subengine.Event], conn: Any) -> None:
            handled.extend(event.data["n"] for event in events)
            if len(handled) == 1:
                holder.execute(
                    "SELECT FROM subengine.subscription_positions"
                    " WHERE subscription = 'racer' FOR UPDATE"
                )
                threading.Thread(target=interleave, daemon=True).start()

        worker = Worker(engine, [sub])
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop,))
        thread.start()
        try:
            wait_for(lambda: handled == [1, 2], "the second event", timeout=30)
        finally:
            stop.set()
            thread.join(30)
            holder.close()


@pytest.mark.parametrize("ack", ["at_least_once", "transactional"])
def test_an_append_during_a_batchs_commit_is_handled_though_another_slot_looked_meanwhile(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], ack: Any
) -> None:
    # A batch that drains its partition stores next_time NULL, from its commit
    # statement's snapshot. An event appended after that snapshot but before the commit
    # ends wakes the worker's other slot, whose look takes the partition as a suspect
    # while the row still shows the batch's old next_time (not NULL: not a suspect to
    # mark, not held to defer). Nothing may then leave the row unmarked for good: the
    # event must be handled without any further append.
    fast_engine.create_stream("one", partitions=1)
    sql.execute(
        """
        CREATE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END $$;
        CREATE CONSTRAINT TRIGGER hold_commit AFTER UPDATE ON subengine.subscription_positions
          DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
          WHEN (NEW.subscription = 'pusher' AND OLD.position = 0 AND NEW.position = 1)
          EXECUTE FUNCTION hold_commit();
        """
    )
    handled: list[int] = []
    app = subengine.App()
    sub = app.subscription("pusher", stream="one", ack=ack)

    @sub.handler()
    def push(event: subengine.Event, conn: Any) -> None:
        handled.append(event.position)

    waiting = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242"
        " AND NOT granted AND database = (SELECT oid FROM pg_database"
        " WHERE datname = current_database())"
    )
    with psycopg.connect(sql.info.dsn, password=sql.info.password, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(4242)")  # the first batch's commit waits
        fast_engine.append("one", [NewEvent("k", "T", {"n": 1})])
        with Running(app, fast_engine, concurrency=2):
            wait_for(lambda: sql.execute(waiting).fetchone()[0] == 1)  # type: ignore[index]
            # after the commit statement's snapshot, before its commit
            fast_engine.append("one", [NewEvent("k", "T", {"n": 2})])
            time.sleep(0.5)  # the other slot looks (notification, polls)
            holder.execute("SELECT pg_advisory_unlock(4242)")
            wait_for(lambda: handled == [1, 2], "the second event", timeout=5)
