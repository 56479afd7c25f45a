"""How many PostgreSQL connections each part of subengine holds: a worker process by
concurrency (while it drains a backlog, and idle after), a gateway process (idle, and
after a burst of concurrent requests), and an application's Engine (appending, and with
a tail). Counted from pg_stat_activity (client backends of the run's own database), not
timed; the totals for 10 and 100 worker processes follow. docs/pooler.md, "Connection
budget", shows the table this prints.

    .venv/bin/python bench/connections.py            # about a minute
    .venv/bin/python bench/connections.py --dsn postgresql://...   # or set SUBENGINE_DSN

Every run creates a database of its own (`bench_connections_<pid>`) and drops it at the end.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _harness as bench
import _workers as workers
import httpx
import psycopg
from _harness import Child, Database, progress
from _workers import Processes, WorkerJob

STREAM = "orders"
BACKLOG = 20_000
CONCURRENCIES = (1, 2, 4)
BURST = 50  # concurrent requests to a gateway


def count(conn: psycopg.Connection[Any], database: Database) -> int:
    return bench.client_count(conn, database) - 1  # not the monitor's own


def kinds(conn: psycopg.Connection[Any], database: Database) -> str:
    """The client backends by what they are: the pool's ("subengine"), a worker's own
    connections, the listener's, ..."""
    rows = conn.execute(
        "SELECT CASE WHEN application_name LIKE 'subengine worker %%' THEN 'worker own'"
        " ELSE application_name END, count(*) FROM pg_stat_activity"
        " WHERE datname = %s AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        " GROUP BY 1 ORDER BY 1",
        (database.name,),
    ).fetchall()
    return ", ".join(f"{name or '(unnamed)'} {n}" for name, n in rows)


def peak_while(
    conn: psycopg.Connection[Any], database: Database, busy: Callable[[], bool], limit: float
) -> int:
    """The most connections seen, every 20 ms, while `busy()` (at most `limit` seconds)."""
    most, deadline = 0, time.monotonic() + limit
    while busy() and time.monotonic() < deadline:
        most = max(most, count(conn, database))
        time.sleep(0.02)
    return most


def settle(conn: psycopg.Connection[Any], database: Database, seconds: float = 3.0) -> int:
    """The count once it held still for `seconds` (at most 30 s)."""
    deadline, last, since = time.monotonic() + 30, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = count(conn, database)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= seconds:
            break
        time.sleep(0.1)
    return last


def drained(database: Database, name: str) -> Callable[[], bool]:
    def busy() -> bool:
        with psycopg.connect(database.dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT coalesce(sum(position), 0) FROM subengine.subscription_positions"
                " WHERE subscription = %s",
                (name,),
            ).fetchone()
        return (row[0] if row else 0) < BACKLOG

    return busy


def measure_worker(
    context: Any, database: Database, monitor: psycopg.Connection[Any], concurrency: int
) -> tuple[int, int]:
    name = f"connections-{concurrency}"
    workers.ensure_subscriptions(database.dsn, [name], STREAM, "beginning")
    job = WorkerJob(database.dsn, (name,), STREAM, "beginning", "no-op", 100, concurrency)
    group = Processes.new(context)
    try:
        group.start(workers.worker_entry, job)
        group.begin()
        busy = peak_while(monitor, database, drained(database, name), 120)
        idle = settle(monitor, database)
        progress(f"worker, concurrency {concurrency}, idle: {kinds(monitor, database)}")
    finally:
        group.finish()
    return busy, idle


def measure_gateway(database: Database, monitor: psycopg.Connection[Any]) -> tuple[int, int]:
    env = {**os.environ, "SUBENGINE_DSN": database.dsn, "SUBENGINE_SCHEMA": bench.SCHEMA}
    with tempfile.TemporaryDirectory() as logs:
        gateway = Child("gateway", bench.subengine_serve(), env, Path(logs)).started()
        try:
            idle = settle(monitor, database)
            progress(f"gateway, idle: {kinds(monitor, database)}")
            url = f"{gateway.url}/v1/streams/{STREAM}/events?limit=100"
            most = [0]
            done = threading.Event()

            def watch() -> None:
                while not done.is_set():
                    most[0] = max(most[0], count(monitor, database))
                    time.sleep(0.02)

            watcher = threading.Thread(target=watch)
            watcher.start()
            with httpx.Client(timeout=30) as client, ThreadPoolExecutor(BURST) as pool:
                for _ in range(5):
                    list(pool.map(lambda _: client.get(url).status_code, range(BURST)))
            progress(f"gateway, after the burst: {kinds(monitor, database)}")
            done.set()
            watcher.join()
        finally:
            gateway.stop()
    return most[0], idle


def measure_application(database: Database, monitor: psycopg.Connection[Any]) -> tuple[int, int]:
    import subengine

    with subengine.Engine(database.dsn, schema=bench.SCHEMA) as engine:
        engine.append(STREAM, [subengine.NewEvent("k", "T", {})])
        appending = settle(monitor, database, 1.0)
        progress(f"application, appending: {kinds(monitor, database)}")
        with engine.tail(STREAM) as tail:
            tail.next_event(timeout=0.5)
            tailing = settle(monitor, database, 1.0)
            progress(f"application, tailing: {kinds(monitor, database)}")
    return appending, tailing


def print_table(rows: Sequence[tuple[str, int, int]], defaults: str) -> None:
    print(f"connections per process ({defaults})")
    header = f"{'process':<34} {'busy (peak)':>11} {'idle':>6}"
    print(header)
    print("-" * len(header))
    for what, busy, idle in rows:
        print(f"{what:<34} {busy:>11} {idle:>6}")


def print_totals(workers_by_concurrency: dict[int, tuple[int, int]], gateway: int) -> None:
    print()
    print("totals: N worker processes (busy peak each) + 2 gateway processes (peak each)")
    header = f"{'concurrency':>11} {'10 workers':>11} {'100 workers':>12}"
    print(header)
    print("-" * len(header))
    for concurrency, (busy, _) in workers_by_concurrency.items():
        print(f"{concurrency:>11} {10 * busy + 2 * gateway:>11} {100 * busy + 2 * gateway:>12}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench.arguments("Count the connections of subengine's processes.", rounds=None)
    args = bench.parse(parser, argv)
    import subengine

    context = multiprocessing.get_context("spawn")
    with bench.benchmark_database(bench.dsn_of(args), "bench_connections_", migrate=True) as db:
        with subengine.Engine(db.dsn, schema=bench.SCHEMA) as engine:
            engine.create_stream(STREAM, 8)
            engine.append(STREAM, [subengine.NewEvent(f"k{n}", "T", {}) for n in range(BACKLOG)])
        with psycopg.connect(db.dsn, autocommit=True) as monitor:
            by_concurrency = {}
            for concurrency in CONCURRENCIES:
                by_concurrency[concurrency] = measure_worker(context, db, monitor, concurrency)
                progress(f"worker, concurrency {concurrency}: {by_concurrency[concurrency]}")
            gateway = measure_gateway(db, monitor)
            progress(f"gateway: {gateway}")
            application = measure_application(db, monitor)
    settings = subengine.Settings.from_env()
    rows = [
        *((f"worker, concurrency {c}", busy, idle) for c, (busy, idle) in by_concurrency.items()),
        (f"gateway ({BURST} concurrent reads)", *gateway),
        ("application Engine: append / +tail", *application),
    ]
    print()
    print_table(
        rows,
        f"pool_min_size {settings.pool_min_size}, pool_max_size {settings.pool_max_size}, "
        f"lock_provider {settings.lock_provider}",
    )
    print_totals(by_concurrency, gateway[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
