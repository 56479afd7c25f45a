"""`subengine worker` as real processes: signals, crashes, fencing, resets, fatal errors.

The workers run `tests/apps/worker_app.py`, which records each event's effect in the
table `effects` (no unique constraint) inside the batch's transaction.
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import (
    APPS,
    README,
    Proxy,
    WorkerProcesses,
    assert_each_effect_once_in_key_order,
    free_port,
    run_subengine,
    start_subengine,
    wait_for,
    write_readme_app,
)

import subengine
from subengine import NewEvent


@pytest.fixture
def app_env(worker_app_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The worker app's environment, noting where each batch starts in a file."""
    return dict(worker_app_env, WORKER_APP_MARKS=str(tmp_path / "marks"))


@pytest.fixture
def engine_of(dsn: str) -> Iterator[subengine.Engine]:
    with subengine.Engine(dsn) as engine:
        yield engine


@pytest.fixture
def workers(app_env: dict[str, str], tmp_path: Path) -> Iterator[WorkerProcesses]:
    workers = WorkerProcesses(app_env, tmp_path)
    yield workers
    workers.kill_all()


def effect_count(sql: psycopg.Connection[Any]) -> int:
    return sql.execute("SELECT count(*) FROM effects").fetchone()[0]  # type: ignore[no-any-return, index]


def positions(sql: psycopg.Connection[Any]) -> dict[int, int]:
    return dict(
        sql.execute(
            "SELECT partition, position FROM subengine.subscription_positions"
            " WHERE subscription = 'effects' ORDER BY 1"
        ).fetchall()
    )


def marks(env: dict[str, str]) -> list[tuple[int, ...]]:
    path = Path(env["WORKER_APP_MARKS"])
    if not path.exists():
        return []
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()]


def advisory_locks(sql: psycopg.Connection[Any]) -> int:
    return sql.execute(  # type: ignore[no-any-return, index]
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchone()[0]


# fatal conditions


@pytest.mark.parametrize(
    ("app", "status", "message"),
    [
        ("no_such_module:app", 1, "cannot import 'no_such_module': ModuleNotFoundError"),
        ("worker_app:nothing", 1, "module 'worker_app' has no attribute 'nothing'"),
        ("worker_app:os", 1, "'os' is a module, not a subengine.App"),
        ("worker_app", 2, "is not MODULE:ATTR"),
    ],
)
def test_a_bad_app_path_exits_with_a_clear_message(
    app_env: dict[str, str], app: str, status: int, message: str
) -> None:
    result = run_subengine(app_env, "worker", "--app", app, cwd=APPS, timeout=60)
    assert result.returncode == status
    assert message in result.stderr


def test_an_unknown_subscription_exits_with_a_clear_message(
    app_env: dict[str, str], engine_of: subengine.Engine
) -> None:
    engine_of.create_stream("orders", partitions=2)
    result = run_subengine(
        app_env, "worker", "--app", "worker_app:app", "--subscription", "nope", cwd=APPS, timeout=60
    )
    assert result.returncode == 1
    assert "the app declares no subscription 'nope'" in result.stderr


def test_a_database_unreachable_at_start_exits_non_zero(app_env: dict[str, str]) -> None:
    port = free_port()
    env = dict(
        app_env,
        SUBENGINE_DSN=f"postgresql://postgres@127.0.0.1:{port}/postgres",
        SUBENGINE_CONNECT_TIMEOUT="2",
    )
    result = run_subengine(env, "worker", "--app", "worker_app:app", cwd=APPS, timeout=60)
    assert result.returncode == 1
    assert "could not connect to PostgreSQL within 2 s" in result.stderr


def test_a_database_lost_for_longer_than_the_outage_timeout_exits_non_zero(
    app_env: dict[str, str],
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
) -> None:
    engine_of.create_stream("orders", partitions=2)
    engine_of.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(10)])
    with Proxy(app_env["SUBENGINE_DSN"]) as proxy:
        worker = workers.start(
            SUBENGINE_DSN=proxy.dsn(app_env["SUBENGINE_DSN"]),
            SUBENGINE_OUTAGE_TIMEOUT="3",
            SUBENGINE_CONNECT_TIMEOUT="2",
        )
        wait_for(lambda: effect_count(sql) == 10, what="the events to be handled")
    # the proxy is gone: every connection of the worker broke and none can be made
    assert worker.wait(timeout=60) == 1
    assert "the database was unreachable for 3 s" in workers.log(worker)


def test_a_host_that_stops_answering_new_connections_ends_in_the_outage_exit(
    app_env: dict[str, str],
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
) -> None:
    # Every connection the worker opens must give up after SUBENGINE_CONNECT_TIMEOUT: once
    # the host has gone silent, the server ends the worker's connections, so that the
    # poller and the slots must all open new ones.
    engine_of.create_stream("orders", partitions=2)
    with Proxy(app_env["SUBENGINE_DSN"]) as proxy:
        worker = workers.start(
            SUBENGINE_DSN=proxy.dsn(app_env["SUBENGINE_DSN"]),
            SUBENGINE_OUTAGE_TIMEOUT="3",
            SUBENGINE_CONNECT_TIMEOUT="2",
        )
        wait_for(
            lambda: sql.execute("SELECT count(*) FROM subengine.workers").fetchone()[0] == 1,  # type: ignore[index]
            what="the worker to register",
        )
        proxy.silent = True
        sql.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name LIKE 'subengine worker %' AND datname = current_database()"
        )
        engine_of.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(10)])
        assert worker.wait(timeout=90) == 1
    assert "the database was unreachable for 3 s" in workers.log(worker)
    assert effect_count(sql) == 0


def test_migrate_gives_up_on_a_host_that_never_answers(cli_env: dict[str, str]) -> None:
    with Proxy(cli_env["SUBENGINE_DSN"]) as proxy:
        proxy.silent = True
        env = dict(
            cli_env,
            SUBENGINE_DSN=proxy.dsn(cli_env["SUBENGINE_DSN"]),
            SUBENGINE_CONNECT_TIMEOUT="2",
        )
        result = run_subengine(env, "migrate", timeout=90)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ")


def test_a_busy_partition_never_starves_an_older_event_of_another(
    app_env: dict[str, str],
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
) -> None:
    # Invariant 7, the reproduction: 4 partitions, batches of 10, 10 ms per event,
    # one slot, about 200 appends a second to one key (twice what the slot can handle),
    # then one event to a key in another partition.
    engine_of.create_stream("orders", partitions=4)
    busy, quiet = (
        next(f"{p}{n}" for n in range(1000) if subengine.partition_for(f"{p}{n}", 4) == partition)
        for p, partition in (("busy", 0), ("quiet", 1))
    )
    worker = workers.start("--concurrency", "1", WORKER_APP_BATCH="10", WORKER_APP_SLEEP="0.01")
    wait_for(
        lambda: sql.execute("SELECT count(*) FROM subengine.workers").fetchone()[0] == 1,  # type: ignore[index]
        what="the worker to register",
    )
    total, appended = 600, []

    def produce() -> None:
        with subengine.Engine(app_env["SUBENGINE_DSN"]) as producer:
            started = time.monotonic()
            for n in range(total):
                appended.append(producer.append("orders", [NewEvent(busy, "T", {})]))
                time.sleep(max(0.0, started + (n + 1) / 200 - time.monotonic()))

    producer = threading.Thread(target=produce)
    producer.start()
    wait_for(lambda: len(appended) >= 200, what="a backlog in the busy partition")
    [lonely] = engine_of.append("orders", [NewEvent(quiet, "T", {})])
    producer.join(timeout=60)
    wait_for(lambda: effect_count(sql) == total + 1, timeout=120, what="every event")
    assert worker.poll() is None
    rows = sql.execute(
        "SELECT e.key, e.occurred_at FROM effects f JOIN subengine.events e ON e.id = f.event_id"
        " ORDER BY f.seq"
    ).fetchall()
    handled_at = next(i for i, (key, _) in enumerate(rows) if key == quiet)
    lonely_time = rows[handled_at][1]
    younger_first = [t for key, t in rows[:handled_at] if t > lonely_time]
    # at most the batch that was running when its event became the oldest
    assert len(younger_first) <= 10, (len(younger_first), lonely.position)


# signals


def _sigterm_mid_batch(
    engine: subengine.Engine,
    app_env: dict[str, str],
    workers: WorkerProcesses,
    *,
    events: int,
    sleep: str,
) -> subprocess.Popen[bytes]:
    """A worker over `events` events of one partition in batches of 10 (each handler
    sleeping `sleep` seconds), sent SIGTERM once its first batch started."""
    engine.create_stream("orders", partitions=1)
    engine.append("orders", [NewEvent("k", "T", {}) for _ in range(events)])
    worker = workers.start(WORKER_APP_BATCH="10", WORKER_APP_SLEEP=sleep)
    wait_for(lambda: marks(app_env), what="a batch to start")
    worker.send_signal(signal.SIGTERM)
    return worker


def test_sigterm_finishes_the_current_batch_releases_locks_and_exits_0(
    app_env: dict[str, str],
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
) -> None:
    worker = _sigterm_mid_batch(engine_of, app_env, workers, events=60, sleep="0.1")
    assert worker.wait(timeout=60) == 0
    assert "finishing the current batches" in workers.log(worker)
    # the batch that was running when the signal came committed whole, and no other began
    last = marks(app_env)[-1][3]
    assert positions(sql) == {0: last}, workers.log(worker)
    assert effect_count(sql) == last
    assert advisory_locks(sql) == 0
    assert sql.execute("SELECT count(*) FROM subengine.workers").fetchone()[0] == 0  # type: ignore[index]


@pytest.mark.parametrize(
    ("end", "said"),
    [
        (
            "pg_cancel_backend",
            "subscription effects partition 0: the batch in progress failed (QueryCanceled: "
            "canceling statement due to user request) while the worker stops: it is not tried "
            "again",
        ),
        ("pg_terminate_backend", "database connection lost while the worker stops"),
    ],
)
def test_a_batch_that_fails_while_the_worker_stops_is_said_and_left_to_the_next_worker(
    end: str,
    said: str,
    app_env: dict[str, str],
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
) -> None:
    # The batch running when SIGTERM came meets a database error (its statement
    # cancelled, its connection ended): a stopping worker tries nothing again, but it
    # says that the batch rolled back (it once ended such a batch without a word).
    worker = _sigterm_mid_batch(engine_of, app_env, workers, events=20, sleep="3")
    wait_for(lambda: "finishing the current batches" in workers.log(worker), what="the signal")
    ended = psycopg.sql.SQL(
        "SELECT count({}(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event = 'PgSleep'"
    ).format(psycopg.sql.Identifier(end))
    wait_for(lambda: sql.execute(ended).fetchone()[0] == 1, what="the batch's statement")  # type: ignore[index]
    assert worker.wait(timeout=60) == 0
    assert said in workers.log(worker), workers.log(worker)
    assert positions(sql) == {0: 0}
    assert effect_count(sql) == 0
    assert advisory_locks(sql) == 0
    # the next worker does the whole backlog, once each
    workers.start()
    wait_for(lambda: positions(sql) == {0: 20}, what="the next worker to finish")
    assert_each_effect_once_in_key_order(sql, engine_of)


def test_a_second_signal_exits_at_once_and_the_batch_rolls_back(
    app_env: dict[str, str],
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
) -> None:
    engine_of.create_stream("orders", partitions=1)
    engine_of.append("orders", [NewEvent("k", "T", {}) for _ in range(20)])
    worker = workers.start(WORKER_APP_BATCH="10", WORKER_APP_SLEEP="3")
    wait_for(lambda: marks(app_env), what="a batch to start")
    worker.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=10) == 128 + signal.SIGTERM
    assert "SIGTERM again: exiting at once" in workers.log(worker)
    assert positions(sql) == {0: 0}
    # the next worker finds the database consistent and does everything exactly once
    workers.start()
    wait_for(lambda: positions(sql) == {0: 20}, what="the next worker to finish")
    assert_each_effect_once_in_key_order(sql, engine_of)


# crashes and fencing


def test_exactly_once_while_workers_are_killed_at_random(
    app_env: dict[str, str],
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
) -> None:
    engine_of.create_stream("orders", partitions=8)
    rng = random.Random(7)
    running = [workers.start("--concurrency", "2") for _ in range(3)]
    total, appended = 20_000, threading.Event()

    def produce() -> None:
        keys = [f"order-{n}" for n in range(400)]
        with subengine.Engine(app_env["SUBENGINE_DSN"]) as producer:
            for _ in range(total // 20):
                producer.append("orders", [NewEvent(rng.choice(keys), "T", {}) for _ in range(20)])
                time.sleep(0.01)
        appended.set()

    producer = threading.Thread(target=produce)
    producer.start()
    kills = 0

    def caught_up() -> bool:
        return appended.is_set() and sum(positions(sql).values()) == total

    while not caught_up() or kills < 5:
        time.sleep(rng.uniform(1.0, 2.0))
        victim = running.pop(rng.randrange(len(running)))
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        kills += 1
        running.append(workers.start("--concurrency", "2"))
        if kills > 200:
            raise AssertionError("the workers never caught up")
    producer.join()
    assert sum(engine_of.heads("orders").values()) == total
    assert_each_effect_once_in_key_order(sql, engine_of)


@pytest.mark.parametrize("terminated", ["lock", "batch"])
def test_a_worker_that_loses_a_connection_mid_batch_never_duplicates(
    app_env: dict[str, str],
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
    terminated: str,
) -> None:
    # One partition, slow batches. While the first worker is inside a batch, terminate
    # either the connection holding its advisory lock (so a second worker takes the
    # partition while the batch runs) or the connection running the batch (which rolls
    # back). Each event is still handled exactly once.
    engine_of.create_stream("orders", partitions=1)
    engine_of.append("orders", [NewEvent(f"k{n % 3}", "T", {}) for n in range(30)])
    first = workers.start(WORKER_APP_BATCH="5", WORKER_APP_SLEEP="0.2")
    wait_for(lambda: marks(app_env), what="a batch to start")
    target = (
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        if terminated == "lock"
        else "SELECT pid FROM pg_stat_activity WHERE query LIKE '%pg_sleep%'"
        " AND state = 'active' AND pid <> pg_backend_pid() AND datname = current_database()"
    )
    # The handler notes its batch before it sends its first pg_sleep, so the batch's
    # backend may not be sleeping yet when the mark shows: wait until it is.
    found: list[tuple[int]] = []

    def target_found() -> bool:
        found[:] = sql.execute(target).fetchall()
        return bool(found)

    wait_for(target_found, what=f"the {terminated} connection")
    [(pid,)] = found
    sql.execute("SELECT pg_terminate_backend(%s)", (pid,))
    second = workers.start(WORKER_APP_BATCH="5", WORKER_APP_SLEEP="0.2")
    wait_for(lambda: positions(sql) == {0: 30}, what="both workers to finish")
    assert_each_effect_once_in_key_order(sql, engine_of)
    assert first.poll() is None and second.poll() is None


# reset


def test_reset_while_a_worker_runs(
    app_env: dict[str, str],
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
) -> None:
    engine_of.create_stream("orders", partitions=4)
    engine_of.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(40)])
    workers.start()
    wait_for(lambda: effect_count(sql) == 40, what="the first pass")
    result = run_subengine(app_env, "subscription", "reset", "effects", "--to", "beginning")
    assert result.returncode == 0, result.stderr
    wait_for(lambda: effect_count(sql) == 80, what="the second pass")
    twice = sql.execute(  # type: ignore[index]
        "SELECT count(*) FROM (SELECT event_id FROM effects GROUP BY 1 HAVING count(*) = 2) x"
    ).fetchone()[0]
    assert twice == 40
    result = run_subengine(app_env, "subscription", "reset", "effects", "--to", "end")
    assert result.returncode == 0, result.stderr
    engine_of.append("orders", [NewEvent("new", "T", {})])
    wait_for(lambda: effect_count(sql) == 81, what="the new event")
    time.sleep(1)  # a poll interval: nothing old comes back
    assert effect_count(sql) == 81
    generations = sql.execute(
        "SELECT DISTINCT generation FROM subengine.subscription_positions"
    ).fetchall()
    assert generations == [(3,)]


# helpers


def test_the_readme_example_app_runs_as_written(
    cli_env: dict[str, str],
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
    tmp_path: Path,
) -> None:
    write_readme_app(tmp_path)
    command = next(
        line
        for line in README.read_text().splitlines()
        if line.startswith("subengine worker --app myproject")
    )
    sql.execute("CREATE TABLE invoices (order_id text, total int)")
    engine_of.create_stream("orders", partitions=8)
    engine_of.append(
        "orders", [NewEvent(f"order-{n}", "OrderPlaced", {"total": n}) for n in range(50)]
    )
    engine_of.append("orders", [NewEvent(f"order-{n}", "OrderPaid", {}) for n in range(50)])
    worker = start_subengine(
        *command.split()[1:],
        cwd=tmp_path,
        env=dict(cli_env, SUBENGINE_POLL_INTERVAL="0.5"),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: (
                sql.execute("SELECT count(*), sum(total) FROM invoices").fetchone()
                == (50, sum(range(50)))
            ),
            what="the invoices",
        )
        wait_for(
            lambda: (
                {p.partition: p.position for p in engine_of.subscription_positions("billing")}
                == engine_of.heads("orders")
            ),
            what="billing to reach the heads",
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stderr
    assert "started: subscriptions billing (orders), concurrency 4" in stderr
