"""The worker loop, run in a thread against a real PostgreSQL."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

import subengine
from subengine import NewEvent


def record(event, conn):
    conn.execute(
        "INSERT INTO effects VALUES (%s, %s, %s)", (event.id, event.partition, event.position)
    )


def poisoned_app(stream, poison, **options):
    """Subscription billing of `stream`, recording every event but `poison`, which raises."""
    app = subengine.App()
    sub = app.subscription("billing", stream=stream, **options)

    @sub.handler()
    def handle(event, conn):
        if event.id == poison.id:
            raise ValueError("cannot handle this one")
        record(event, conn)

    return app


class Running:
    """A worker in a thread, stopped (and joined) on exit; `error` is what it raised."""

    def __init__(self, app, engine, **options):
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(app, engine, options))

    def _run(self, app, engine, options):
        try:
            app.run_worker(engine, stop=self.stop, **options)
        except BaseException as error:
            self.error = error

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the worker did not stop"
        assert self.error is None, self.error


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def count(sql, table="effects"):
    return sql.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # noqa: S608


def test_a_worker_handles_every_event_once_and_stops_cleanly(fast_engine, sql):
    fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(100)])
    app = subengine.App()
    app.subscription("billing", stream="orders", batch_size=7).handler()(record)
    with Running(app, fast_engine, concurrency=2):
        fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(50)])
        wait_for(lambda: count(sql) == 150)
    assert sql.execute("SELECT count(DISTINCT event_id) FROM effects").fetchone()[0] == 150
    positions = {p.partition: p.position for p in fast_engine.subscription_positions("billing")}
    assert positions == fast_engine.heads("orders")
    locks = sql.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()
    assert locks[0] == 0
    assert count(sql, "subengine.workers") == 0


def test_polling_alone_delivers_everything(fast_engine, sql):
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    with Running(app, fast_engine, listen=False):
        fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(20)])
        wait_for(lambda: count(sql) == 20)


def test_the_listening_connection_is_terminated_again_and_again(dsn, sql):
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    # a poll interval far longer than the test: only notifications can deliver in time
    settings = subengine.Settings(dsn=dsn, poll_interval=600)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("orders", partitions=2)
        app = subengine.App()
        app.subscription("billing", stream="orders").handler()(record)
        with Running(app, engine):
            for round_ in range(3):
                wait_for(
                    lambda: (
                        sql.execute(
                            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%'"
                        ).fetchone()[0]
                        == 1
                    )
                )
                sql.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE query LIKE 'LISTEN%'"
                )
                engine.append("orders", [NewEvent(f"r{round_}-{n}", "T", {}) for n in range(5)])
                wait_for(lambda r=round_: count(sql) == 5 * (r + 1))


@pytest.mark.parametrize("policy", ["stop", "dead_letter"])
def test_a_poison_event_is_retried_then_handled_by_policy(fast_engine, sql, policy):
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
        assert "ValueError: cannot handle this one" in row.last_error
    else:
        dead = sql.execute(
            "SELECT event_id, position, attempts, error FROM subengine.dead_letters"
        ).fetchone()
        assert dead[:3] == (poison.id, poison.position, 3)
        assert row.position == fast_engine.heads("orders")[poison.partition]
        assert not row.stopped and row.attempts == 0


def test_a_single_attempt_dead_letters_the_failing_event_not_the_batch_head(fast_engine, sql):
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


def test_a_failing_event_deep_in_a_batch_waits_for_no_retry_delay_of_the_events_before_it(dsn, sql):
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


def test_a_batch_whose_commit_fails_is_split_like_one_whose_handler_raises(dsn, sql):
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
        def handle(event, conn):
            conn.execute("INSERT INTO numbers VALUES (%s)", (event.data["n"],))
            record(event, conn)

        with Running(app, engine):
            wait_for(lambda: count(sql) == 49 and count(sql, "subengine.dead_letters") == 1)
    dead = sql.execute("SELECT event_id, position, attempts FROM subengine.dead_letters").fetchall()
    assert dead == [(stored[39].id, stored[39].position, 1)]


def test_the_partition_with_the_oldest_next_event_goes_first(fast_engine):
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
def test_each_start_point_through_the_worker(fast_engine, sql, start):
    old = [fast_engine.append("orders", [NewEvent(f"k{n}", "T", {"n": n})])[0] for n in range(12)]
    middle = old[6]
    [event] = fast_engine.read("orders", middle.partition, middle.position - 1, 1)
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
    sub = app.subscription("billing", stream="orders", start=declared)
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


def test_at_least_once_handlers_run_outside_the_transaction_and_may_repeat(fast_engine, sql):
    stored = fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(20)])
    calls = []
    app = subengine.App()
    sub = app.subscription("mailer", stream="orders", ack="at_least_once", batch_size=5)
    reset_once = threading.Event()

    @sub.handler()
    def send(event, conn):
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
