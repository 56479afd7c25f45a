"""How fast subengine's worker consumes, next to a plain psycopg loop and depeche-db.

Run it from the repository root:

    .venv/bin/python bench/consume.py            # about 6 minutes on 2 cores
    .venv/bin/python bench/consume.py --quick    # about a minute, for a smoke test
    .venv/bin/python bench/consume.py --dsn postgresql://...   # or set SUBENGINE_DSN

Without a DSN it uses the embedded PostgreSQL (`subengine.Engine()`), which keeps running
afterwards (stop it with `.venv/bin/subengine db stop`). Every run creates a database of
its own on that server (`bench_consume_<pid>`), migrates it, and drops it at the end, so it
disturbs no other database there. Worker settings (poll interval, heartbeat, ...) come
from the environment as usual (`SUBENGINE_POLL_INTERVAL`, ...); the header prints them.

`--quick` only shows that everything runs: with its 5,000-event backlog a worker's start
(registration, the lock engine, the first look for work) is a large share of each timed
run, so its throughput ratios say little.

depeche-db conflicts with subengine's dependencies (it pins PALs below 0.4), so it runs in
an interpreter of its own, given with `--depeche-python` (default: this interpreter). Make
one with, for example:

    python3 -m venv /tmp/depeche-env
    /tmp/depeche-env/bin/pip install 'depeche-db[psycopg]==0.13.*' 'sqlalchemy<2.1' \
        pydantic sniffio
    .venv/bin/python bench/consume.py --depeche-python /tmp/depeche-env/bin/python

(depeche-db 0.13 imports pydantic and asyncer's sniffio without declaring them, and its
SQLAlchemy-Utils does not import under SQLAlchemy 2.1.) Without depeche-db the script
says so and leaves its rows out.

What each figure means
----------------------
Throughput (msgs/s). One stream with `--partitions` partitions holds a backlog of
`--backlog` events (small order events, about 150 bytes of JSON each, over 1,000 keys).
For every scenario a fresh subscription starts at the beginning, so every scenario
consumes the same backlog. The clock starts when the worker processes, already started
and with their imports done (the worker's module included, which `App.run_worker` would
otherwise import on its first call, after the clock started), are told to go, and stops
when a poll (every 25 ms) sees every partition's position at its head. msgs/s is the
backlog divided by that time. Each scenario runs `--rounds` times (3), every round in
an order rotated by one from the round before, so that the machine's drift and noise
fall on every scenario alike; the report gives the median, min and max of its rounds,
and each ratio is of medians. Handlers:

* no-op: `handler(event, conn)` does nothing;
* one INSERT: `handler(event, conn)` inserts one row (event id, partition, position)
  into an application table in the worker's transaction (exactly once);
* executemany: a batch handler inserts the batch's rows with one `executemany`.

Each runs with 1 and 2 worker processes (`App.run_worker(..., concurrency=1)` in each),
batch size `--batch-size`. After the INSERT scenarios the script checks that the table
holds each event exactly once.

The plain psycopg loop is the limit of this machine for the same SQL work: each process
owns a share of the partitions (partition % processes) and per batch runs `SELECT position
... FOR UPDATE` on a positions table of its own, reads the next `--batch-size` events of
the partition (every column, as the worker does), does the handler's INSERTs (none, one
per event, or one executemany), `UPDATE`s the position and commits. It has no locks
between processes, no notifications and no candidate search: everything subengine does
beyond that is subengine's cost.

depeche-db 0.13 does the one-INSERT work exactly once as its documentation describes
("Exactly once Delivery"): the handler opens a connection, inserts, calls
`message.ack.execute(conn=conn)` and commits; `AckStrategy.SINGLE`, batch size
`--batch-size`, run by depeche-db's `Executor` (with the stream's projector registered
too, as its documentation shows) in 1 and 2 processes. Its backlog (`--depeche-backlog`,
smaller because it is far slower) is written to one message stream per key and projected
into its aggregated stream (same partition count) before the clock starts, so the
projection is not timed. Rates are per second, so they compare across backlog sizes.

xacts/100 is the number of transactions (pg_stat_database xact_commit + xact_rollback
of the benchmark database) the consumers committed per 100 events (the median of the
rounds; a worker's autocommit statements on its lock connection count): the polls of this
script are subtracted, and the counters are read only after every client backend of the
database has exited, so they are complete.

Latency. One worker process (concurrency 1, listening) runs a subscription that starts at
the end of a second stream, while this script appends single-event transactions to it at
`--latency-rate` events/s. For each event the latency is from the moment the producer's
`commit()` returned (time.time()) to the moment the handler was called (time.time(),
its first statement); both processes run on this machine, so the clocks agree. The
commit's return is used rather than a `clock_timestamp()` taken inside the transaction:
an event is not visible before its commit, and the commit itself (a WAL flush) is not
subscription latency. The event becomes visible somewhere inside the commit call, so the
report also gives the percentiles from the moment `commit()` was called: an upper bound.
(A producer descheduled right after its commit can even see a handler start before
commit() returned; the report counts those.) Percentiles are over `--latency-events`
events after 200 warm-up events (50 with `--quick`).

Idle cost. One worker process (concurrency 1) on a subscription with nothing to do. The
worker process records the time of every statement it sends through a psycopg cursor
(its queries and its partition locks alike; BEGIN and COMMIT are not statements), and
the figure is the statements per second after its first seconds of start-up: that is the
one the goal judges. As a cross-check from the server's side, the script counts the
database's transactions during a short and a long run of the worker and divides the
difference by the difference in duration, so start and stop cancel out, after
subtracting the count of a run without any worker; it vacuums the scratch database and
turns autovacuum off for its tables first, since autovacuum's transactions count there too.

Goals: no-op handler with 2 workers >= 100,000 msgs/s and >= 0.9x the plain loop
(2 processes); one-INSERT handler with 2 workers >= 10x depeche-db's exactly-once rate
(with 2 processes) and >= 0.35x the plain loop; executemany handler >= 0.7x the plain
loop (same process count); latency p50 <= 3 ms and p99 <= 15 ms; idle <= 1 query/s per
worker. Each goal is judged on the medians of the rounds (PASS or MISS). The machine's
other load distorts every figure: the script prints the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import hashlib
import json
import logging
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote, urlencode

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

# This module runs under two interpreters: subengine's, and depeche-db's (which cannot
# install subengine's dependencies). So subengine and depeche_db are imported where they
# are used, never here.
if TYPE_CHECKING:
    import subengine

STREAM = "bench"
LIVE_STREAM = "bench-live"
# the plain loop and the polls name it; every Engine here is given it, whatever
# SUBENGINE_SCHEMA says
SCHEMA = "subengine"
EFFECTS = "bench_effects"
PLAIN_POSITIONS = "bench_plain_positions"
DATABASE_PREFIX = "bench_consume_"
POLL_SECONDS = 0.025
STALL_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 60.0
APPEND_BATCH = 1000
KEYS = 1000
HANDLERS = ("no-op", "one INSERT", "executemany")
DEPECHE_MISSING = "depeche-db not installed (pip install 'depeche-db==0.13.*')"
SKUS = tuple(f"SKU-{n:05d}" for n in range(0, 50_000, 97))
CHANNELS = ("web", "app", "store", "phone")
# Plain strings, not composed SQL: psycopg renders a composed query on every execute, and
# the handlers and the plain loop run these tens of thousands of times.
INSERT_EFFECT = "INSERT INTO bench_effects (event_id, partition, position) VALUES (%s, %s, %s)"
PLAIN_LOCK = (
    "SELECT position FROM bench_plain_positions"
    " WHERE subscription = %s AND partition = %s FOR UPDATE"
)
PLAIN_READ = (
    "SELECT id, stream, partition, position, key, key_version, type, data, metadata,"
    " occurred_at, recorded_at FROM subengine.events"
    " WHERE stream = %s AND partition = %s AND position > %s ORDER BY position LIMIT %s"
)
PLAIN_UPDATE = (
    "UPDATE bench_plain_positions SET position = %s WHERE subscription = %s AND partition = %s"
)

Connection = psycopg.Connection[tuple[Any, ...]]
StartPoint = Literal["beginning", "end"]


@dataclass(frozen=True, slots=True)
class Config:
    backlog: int
    depeche_backlog: int
    partitions: int
    batch_size: int
    processes: tuple[int, ...]
    rounds: int
    latency_events: int
    latency_warmup: int
    latency_rate: float
    idle_seconds: float
    idle_short_seconds: float
    seed: int


@dataclass(frozen=True, slots=True)
class Database:
    """The benchmark's own database, and the server's maintenance database for stats."""

    admin_dsn: str
    name: str
    dsn: str


@dataclass(frozen=True, slots=True)
class Throughput:
    runner: str
    handler: str
    processes: int
    events: int
    seconds: float
    xacts: int
    note: str = ""

    @property
    def rate(self) -> float:
        return self.events / self.seconds

    @property
    def xacts_per_100(self) -> float:
        return 100 * self.xacts / self.events


@dataclass(frozen=True, slots=True)
class Spread:
    """Median, min and max of some measurements."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))


@dataclass(frozen=True, slots=True)
class Variant:
    """The rounds of one throughput scenario (runner, handler, processes)."""

    runner: str
    handler: str
    processes: int
    rows: tuple[Throughput, ...]

    @property
    def rate(self) -> Spread:
        return Spread.of([r.rate for r in self.rows])

    @property
    def xacts_per_100(self) -> float:
        return statistics.median(r.xacts_per_100 for r in self.rows)

    @property
    def notes(self) -> str:
        return "; ".join(sorted({r.note for r in self.rows if r.note}))


def variants(rows: Sequence[Throughput]) -> list[Variant]:
    """The rows grouped by scenario, in the order each scenario first ran."""
    grouped: dict[tuple[str, str, int], list[Throughput]] = {}
    for r in rows:
        grouped.setdefault((r.runner, r.handler, r.processes), []).append(r)
    return [Variant(*key, tuple(group)) for key, group in grouped.items()]


@dataclass(frozen=True, slots=True)
class Latency:
    samples: list[float]  # seconds from the return of the append's commit()
    from_commit_call: list[float]  # seconds from the call of that commit()
    rate: float  # events/s the producer achieved
    worker_xacts_per_event: float

    def percentile(self, fraction: float, samples: list[float] | None = None) -> float:
        ordered = sorted(self.samples if samples is None else samples)
        return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


@dataclass(frozen=True, slots=True)
class Idle:
    statements_per_second: float  # counted in the worker process, after its start
    per_second: float  # transactions, pg_stat_database
    baseline_per_second: float
    short_run: int
    long_run: int
    seconds: float


# connection strings


def database_dsn(admin_dsn: str, name: str) -> str:
    return make_conninfo(admin_dsn, dbname=name)


def psycopg_url(dsn: str) -> str:
    """`dsn` as a `postgresql+psycopg://` URL, the form depeche-db's listener parses.

    Every parameter goes in the query string but the user, which keeps the authority part
    non-empty (depeche-db re-assembles the URL with urlunparse, which drops an empty one);
    libpq's default user is the operating system's, as here.
    """
    params = conninfo_to_dict(dsn)
    user = str(params.pop("user", None) or getpass.getuser())
    return f"postgresql+psycopg://{quote(user, safe='')}@/?{urlencode(params)}"


# the benchmark database


def create_database(admin_dsn: str) -> Database:
    name = f"{DATABASE_PREFIX}{os.getpid()}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8'").format(
                sql.Identifier(name)
            )
        )
    return Database(admin_dsn, name, database_dsn(admin_dsn, name))


def drop_database(database: Database) -> None:
    with psycopg.connect(database.admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database.name))
        )


def settled_xacts(database: Database, timeout: float = 30.0) -> int:
    """The database's transaction count once no client is connected to it.

    A backend reports its pending statistics when it exits, so with every client gone
    the count is complete. Autovacuum is not a client and may still add to it.
    """
    deadline = time.monotonic() + timeout
    with psycopg.connect(database.admin_dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = %s AND backend_type = 'client backend'",
                (database.name,),
            ).fetchone()
            if row is not None and row[0] == 0:
                break
            if time.monotonic() > deadline:
                progress(
                    f"warning: clients still connected to {database.name}; counts may be short"
                )
                break
            time.sleep(0.05)
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            (database.name,),
        ).fetchone()
    return int(row[0]) if row else 0


def prepare_tables(database: Database, partitions: int) -> None:
    """subengine's schema and streams, and the application's tables."""
    import subengine

    with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
        engine.migrate()
        engine.create_stream(STREAM, partitions)
        engine.create_stream(LIVE_STREAM, partitions)
    with psycopg.connect(database.dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (event_id uuid PRIMARY KEY, partition int, position bigint)"
            ).format(sql.Identifier(EFFECTS))
        )
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (subscription text, partition int, position bigint NOT NULL,"
                " PRIMARY KEY (subscription, partition))"
            ).format(sql.Identifier(PLAIN_POSITIONS))
        )


def order_data(rng: random.Random, key: str) -> dict[str, Any]:
    return {
        "order": key,
        "customer": f"customer-{rng.randrange(100_000):05d}",
        "sku": rng.choice(SKUS),
        "quantity": rng.randint(1, 5),
        "unit_price": f"{rng.randint(99, 99_999) / 100:.2f}",
        "currency": "EUR",
        "channel": rng.choice(CHANNELS),
    }


def append_backlog(database: Database, config: Config) -> float:
    """Append the backlog in transactions of APPEND_BATCH events; the seconds it took."""
    import subengine

    rng = random.Random(config.seed)
    keys = [f"order-{n:05d}" for n in range(KEYS)]
    started = time.perf_counter()
    with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
        for first in range(0, config.backlog, APPEND_BATCH):
            batch = []
            for _ in range(min(APPEND_BATCH, config.backlog - first)):
                key = rng.choice(keys)
                batch.append(subengine.NewEvent(key, "OrderUpdated", order_data(rng, key)))
            engine.append(STREAM, batch)
    return time.perf_counter() - started


def truncate_effects(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(EFFECTS)))


def check_effects(dsn: str, expected: int) -> str:
    """'' if the application table holds `expected` distinct rows, else what is wrong."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*), count(DISTINCT event_id) FROM {}").format(
                sql.Identifier(EFFECTS)
            )
        ).fetchone()
    rows, distinct = row if row else (0, 0)
    if rows == distinct == expected:
        return ""
    return f"EFFECTS WRONG: {rows} rows, {distinct} distinct, {expected} expected"


# waiting for consumers


class Stalled(RuntimeError):
    pass


def wait_for_total(
    conn: Connection,
    statement: sql.Composable,
    params: Sequence[Any],
    target: int,
    processes: Sequence[SpawnProcess] = (),
) -> tuple[float, int]:
    """Poll `statement` (one number) until it reaches `target`: the time and the polls.

    Raises Stalled when the number stops growing, a consumer fails, or every consumer has
    exited (checked before the poll, so that a consumer that finished and exited counts).
    """
    polls = 0
    best, progressed = -1, time.monotonic()
    while True:
        exited = [p.exitcode for p in processes if p.exitcode is not None]
        polls += 1
        row = conn.execute(statement, params).fetchone()
        total = int(row[0]) if row and row[0] is not None else 0
        if total >= target:
            return time.perf_counter(), polls
        if any(exited) or (processes and len(exited) == len(processes)):
            raise Stalled(f"consumer processes exited ({exited}) at {total} of {target}")
        now = time.monotonic()
        if total > best:
            best, progressed = total, now
        elif now - progressed > STALL_SECONDS:
            raise Stalled(f"no progress for {STALL_SECONDS:g} s at {total} of {target}")
        time.sleep(POLL_SECONDS)


def subengine_done_query() -> sql.Composable:
    return sql.SQL(
        "SELECT sum(position) FROM {}.subscription_positions WHERE subscription = %s"
    ).format(sql.Identifier(SCHEMA))


def plain_done_query() -> sql.Composable:
    return sql.SQL("SELECT sum(position) FROM {} WHERE subscription = %s").format(
        sql.Identifier(PLAIN_POSITIONS)
    )


def stop_processes(processes: Sequence[SpawnProcess]) -> None:
    """SIGTERM the processes that still run (each stops cleanly on it), then join them."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(STOP_TIMEOUT_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()


# subengine's side: the handlers and the worker processes

_handler_starts: list[tuple[int, float]] = []


def ignore(event: Any, conn: Any) -> None:
    """The no-op handler."""


def insert_one(event: Any, conn: Connection) -> None:
    conn.execute(INSERT_EFFECT, (event.id, event.partition, event.position))


def insert_batch(events: Sequence[Any], conn: Connection) -> None:
    with conn.cursor() as cursor:
        cursor.executemany(INSERT_EFFECT, [(e.id, e.partition, e.position) for e in events])


def record_start(event: Any, conn: Any) -> None:
    now = time.time()
    _handler_starts.append((event.data["seq"], now))


def build_app(
    handler: str, name: str, stream: str, start: StartPoint, batch_size: int
) -> subengine.App:
    import subengine

    app = subengine.App()
    subscription = app.subscription(name, stream=stream, start=start, batch_size=batch_size)
    if handler == "executemany":
        subscription.batch_handler()(insert_batch)
    else:
        functions = {"no-op": ignore, "one INSERT": insert_one, "record": record_start}
        subscription.handler()(functions[handler])
    return app


def ensure_subscription(database: Database, name: str, stream: str, start: StartPoint) -> None:
    """Store the subscription before the workers start, so polls find its positions."""
    import subengine

    with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
        engine.ensure_subscription(subengine.Subscription(name, stream, start))


@dataclass(frozen=True, slots=True)
class WorkerJob:
    dsn: str
    handler: str
    name: str
    stream: str
    start: StartPoint
    batch_size: int
    count_statements: bool = False


def count_statements(times: list[float]) -> None:
    """Record when this process sends each statement through a psycopg cursor.

    Every query of the worker goes through `Cursor.execute` or `executemany`, its locks'
    included; BEGIN and COMMIT do not, so these are statements proper.
    """
    for method in ("execute", "executemany"):
        original = getattr(psycopg.Cursor, method)

        def counted(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            times.append(time.monotonic())
            return _original(self, *args, **kwargs)

        setattr(psycopg.Cursor, method, counted)


def wait_for_go(go: Any) -> None:
    # Polled, not waited on: a process that dies while it waits on a multiprocessing
    # Event makes the Event's set() block for ever.
    while not go.is_set():
        time.sleep(0.001)


def worker_process(job: WorkerJob, results: Any, ready: Any, go: Any) -> None:
    """One subengine worker process: set up, wait for `go`, work until SIGTERM."""
    logging.basicConfig(level=logging.WARNING)
    import subengine
    import subengine.worker._worker  # imports are done before the clock starts

    app = build_app(job.handler, job.name, job.stream, job.start, job.batch_size)
    statements: list[float] = []
    if job.count_statements:
        count_statements(statements)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    with subengine.Engine(job.dsn, schema=SCHEMA) as engine:
        ready.set()
        wait_for_go(go)
        app.run_worker(engine, [job.name], concurrency=1, stop=stop)
    if results is not None:
        results.put({"starts": _handler_starts, "statements": statements})


@dataclass
class Processes:
    """Processes started together, each set up and waiting for `go`."""

    context: SpawnContext
    go: Any
    started: list[SpawnProcess] = dataclasses.field(default_factory=list)

    @classmethod
    def new(cls, context: SpawnContext) -> Processes:
        return cls(context, context.Event())

    def start(self, target: Callable[..., None], *args: Any) -> None:
        ready = self.context.Event()
        process = self.context.Process(target=target, args=(*args, ready, self.go))
        process.start()
        while not ready.wait(0.1):
            if not process.is_alive():
                raise RuntimeError(f"a consumer process failed to start ({process.exitcode})")
        self.started.append(process)

    def begin(self) -> float:
        self.go.set()
        return time.perf_counter()

    def finish(self) -> None:
        stop_processes(self.started)


def worker_process_entry(job: WorkerJob, ready: Any, go: Any) -> None:
    worker_process(job, None, ready, go)


def run_subengine(
    context: SpawnContext,
    database: Database,
    config: Config,
    handler: str,
    processes: int,
    round_: int,
) -> Throughput:
    name = f"throughput-{handler.replace(' ', '-')}-{processes}-{round_}"
    ensure_subscription(database, name, STREAM, "beginning")
    job = WorkerJob(database.dsn, handler, name, STREAM, "beginning", config.batch_size)
    return timed_run(
        context, database, config, worker_process_entry, [job] * processes, subengine_done_query(),
        name, "subengine worker", handler,
    )  # fmt: skip


def timed_run(
    context: SpawnContext,
    database: Database,
    config: Config,
    target: Callable[..., None],
    jobs: Sequence[Any],
    done_query: sql.Composable,
    name: str,
    runner: str,
    handler: str,
) -> Throughput:
    """Start one process per job, time them until `done_query` reaches the backlog."""
    truncate_effects(database.dsn)
    group = Processes.new(context)
    # read before the processes connect: connecting costs no transaction
    before = settled_xacts(database)
    try:
        for job in jobs:
            group.start(target, job)
        with psycopg.connect(database.dsn, autocommit=True) as monitor:
            started = group.begin()
            finished, polls = wait_for_total(
                monitor, done_query, (name,), config.backlog, group.started
            )
    finally:
        group.finish()
    xacts = settled_xacts(database) - before - polls
    note = check_effects(database.dsn, config.backlog) if handler != "no-op" else ""
    return Throughput(runner, handler, len(jobs), config.backlog, finished - started, xacts, note)


# the plain psycopg loop


@dataclass(frozen=True, slots=True)
class PlainJob:
    dsn: str
    handler: str
    name: str
    partitions: tuple[int, ...]
    batch_size: int


def plain_process(job: PlainJob, ready: Any, go: Any) -> None:
    """Consume the job's partitions to their end with the least SQL that does the work."""
    with psycopg.connect(job.dsn) as conn:
        ready.set()
        wait_for_go(go)
        for partition in job.partitions:
            while True:
                row = conn.execute(PLAIN_LOCK, (job.name, partition)).fetchone()
                old = row[0] if row else 0
                rows = conn.execute(PLAIN_READ, (STREAM, partition, old, job.batch_size)).fetchall()
                if job.handler == "one INSERT":
                    for event in rows:
                        conn.execute(INSERT_EFFECT, (event[0], event[2], event[3]))
                elif job.handler == "executemany" and rows:
                    with conn.cursor() as cursor:
                        cursor.executemany(INSERT_EFFECT, [(e[0], e[2], e[3]) for e in rows])
                if rows:
                    conn.execute(PLAIN_UPDATE, (rows[-1][3], job.name, partition))
                conn.commit()
                if len(rows) < job.batch_size:
                    break


def run_plain(
    context: SpawnContext,
    database: Database,
    config: Config,
    handler: str,
    processes: int,
    round_: int,
) -> Throughput:
    name = f"plain-{handler.replace(' ', '-')}-{processes}-{round_}"
    with psycopg.connect(database.dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {} SELECT %s, p, 0 FROM generate_series(0, %s) AS p").format(
                sql.Identifier(PLAIN_POSITIONS)
            ),
            (name, config.partitions - 1),
        )
    jobs = [
        PlainJob(
            database.dsn,
            handler,
            name,
            tuple(p for p in range(config.partitions) if p % processes == n),
            config.batch_size,
        )
        for n in range(processes)
    ]
    return timed_run(
        context, database, config, plain_process, jobs, plain_done_query(), name,
        "plain psycopg loop", handler,
    )  # fmt: skip


# latency and idle cost


@dataclass(frozen=True, slots=True)
class Produced:
    """When each live event's commit() was called and when it returned, by seq."""

    commit_called: dict[int, float]
    committed: dict[int, float]
    rate: float


def live_producer(database: Database, config: Config) -> Produced:
    """Append single-event transactions at the configured rate."""
    import subengine

    rng = random.Random(config.seed + 1)
    total = config.latency_warmup + config.latency_events
    called: dict[int, float] = {}
    committed: dict[int, float] = {}
    interval = 1 / config.latency_rate
    with psycopg.connect(database.dsn) as conn:
        started = time.perf_counter()
        for seq in range(total):
            delay = started + seq * interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            key = f"live-{rng.randrange(KEYS):05d}"
            event = subengine.NewEvent(key, "Tick", {"seq": seq})
            subengine.append(conn, LIVE_STREAM, [event], schema=SCHEMA)
            called[seq] = time.time()
            conn.commit()
            committed[seq] = time.time()
        rate = total / (time.perf_counter() - started)
    return Produced(called, committed, rate)


def run_latency(context: SpawnContext, database: Database, config: Config) -> Latency:
    name = "latency"
    ensure_subscription(database, name, LIVE_STREAM, "end")
    job = WorkerJob(database.dsn, "record", name, LIVE_STREAM, "end", config.batch_size)
    results = context.Queue()
    group = Processes.new(context)
    total = config.latency_warmup + config.latency_events
    before = settled_xacts(database)
    try:
        group.start(worker_process, job, results)
        group.begin()
        time.sleep(1.0)  # the worker has caught up (nothing to do) and listens
        produced = live_producer(database, config)
        with psycopg.connect(database.dsn, autocommit=True) as monitor:
            _, polls = wait_for_total(
                monitor, subengine_done_query(), (name,), total, group.started
            )
        stop_processes(group.started)  # the worker sends its handler times as it stops
        starts = dict(results.get(timeout=STOP_TIMEOUT_SECONDS)["starts"])
    finally:
        group.finish()
    # the producer's appends are one transaction each
    worker_xacts = settled_xacts(database) - before - polls - total
    measured = range(config.latency_warmup, total)
    return Latency(
        [starts[seq] - produced.committed[seq] for seq in measured],
        [starts[seq] - produced.commit_called[seq] for seq in measured],
        produced.rate,
        worker_xacts / total,
    )


def quiet_autovacuum(database: Database) -> None:
    """Vacuum the scratch database now and keep autovacuum out of it from now on.

    Autovacuum's own transactions count in pg_stat_database; after the backlog it would
    run during the idle measurement and swamp a worker's few transactions.
    """
    with psycopg.connect(database.dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        tables = conn.execute(
            "SELECT n.nspname, c.relname FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relkind = 'r' AND n.nspname NOT IN ('pg_catalog', 'information_schema')"
        ).fetchall()
        for schema, table in tables:
            conn.execute(
                sql.SQL("ALTER TABLE {}.{} SET (autovacuum_enabled = off)").format(
                    sql.Identifier(schema), sql.Identifier(table)
                )
            )


def idle_run(
    context: SpawnContext, database: Database, job: WorkerJob, seconds: float, skip: float
) -> tuple[int, float]:
    """One idle worker for `seconds`: the database's transactions meanwhile, and the
    statements per second the worker sent after its first `skip` seconds."""
    group = Processes.new(context)
    results = context.Queue()
    before = settled_xacts(database)
    try:
        group.start(worker_process, job, results)
        group.begin()
        began = time.monotonic()
        time.sleep(seconds)
        ended = time.monotonic()
        stop_processes(group.started)
        statements = results.get(timeout=STOP_TIMEOUT_SECONDS)["statements"]
    finally:
        group.finish()
    counted = sum(1 for t in statements if began + skip <= t < ended)
    return settled_xacts(database) - before, counted / (ended - began - skip)


def run_idle(context: SpawnContext, database: Database, config: Config) -> Idle:
    name = "idle"
    quiet_autovacuum(database)
    ensure_subscription(database, name, STREAM, "end")
    job = WorkerJob(database.dsn, "no-op", name, STREAM, "end", config.batch_size, True)
    short_seconds, extra = config.idle_short_seconds, config.idle_seconds
    before = settled_xacts(database)
    time.sleep(extra)
    baseline = settled_xacts(database) - before
    short, _ = idle_run(context, database, job, short_seconds, 0.0)
    long, statements = idle_run(context, database, job, short_seconds + extra, short_seconds)
    return Idle(statements, (long - short - baseline) / extra, baseline / extra, short, long, extra)


# depeche-db: runs in its own interpreter (`--depeche-child`), reports JSON on stdout


def key_partition(key: str, partitions: int) -> int:
    """subengine's partition of a key (README), without importing subengine."""
    digest = hashlib.md5(key.encode()).digest()
    return (int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF) % partitions


@dataclass(frozen=True, slots=True)
class DepecheJob:
    dsn: str
    name: str
    partitions: int
    batch_size: int


@dataclass(frozen=True, slots=True)
class DepecheEvent:
    """A depeche-db message: the same order payload as subengine's events."""

    message_id: uuid.UUID
    occurred_at: datetime
    data: dict[str, Any]

    def get_message_id(self) -> uuid.UUID:
        return self.message_id

    def get_message_time(self) -> datetime:
        return self.occurred_at


class DepecheSerializer:
    def serialize(self, message: DepecheEvent) -> dict[str, Any]:
        return {
            "id": str(message.message_id),
            "at": message.occurred_at.isoformat(),
            "data": message.data,
        }

    def deserialize(self, stored: dict[str, Any]) -> DepecheEvent:
        return DepecheEvent(
            uuid.UUID(stored["id"]), datetime.fromisoformat(stored["at"]), stored["data"]
        )


class DepechePartitioner:
    def __init__(self, partitions: int) -> None:
        self.partitions = partitions

    def get_partition(self, message: Any) -> int:
        return key_partition(message.stream, self.partitions)


@dataclass(frozen=True, slots=True)
class DepecheObjects:
    engine: Any
    store: Any
    stream: Any
    subscription: Any


def depeche_objects(job: DepecheJob) -> DepecheObjects:
    """depeche-db's store, aggregated stream and exactly-once subscription."""
    import sqlalchemy
    from depeche_db import MessageHandlerRegister, MessageStore, SubscriptionMessage

    dsn = job.dsn
    engine = sqlalchemy.create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
    store = MessageStore[DepecheEvent](name="bench", engine=engine, serializer=DepecheSerializer())
    stream = store.aggregated_stream(
        name="bench_agg",
        partitioner=DepechePartitioner(job.partitions),
        stream_wildcards=["order-%"],
        update_batch_size=APPEND_BATCH,
    )
    insert = sqlalchemy.text(
        "INSERT INTO bench_effects (event_id, partition, position)"
        " VALUES (:id, :partition, :position)"
    )

    def handle(message: Any) -> None:
        # exactly once, as depeche-db's documentation shows: the effect and the ack
        # commit in one transaction of the handler's own
        with engine.connect() as conn:
            conn.execute(
                insert,
                {
                    "id": message.stored_message.message_id,
                    "partition": message.partition,
                    "position": message.position,
                },
            )
            message.ack.execute(conn=conn)
            conn.commit()

    handlers = MessageHandlerRegister[DepecheEvent]()
    handlers.register_manual(handle, SubscriptionMessage[DepecheEvent])
    subscription = stream.subscription(name=job.name, handlers=handlers, batch_size=job.batch_size)
    return DepecheObjects(engine, store, stream, subscription)


def depeche_executor(job: DepecheJob, ready: Any, go: Any) -> None:
    """One process running depeche-db's Executor; SIGTERM stops it."""
    from depeche_db import Executor

    objects = depeche_objects(job)
    executor = Executor(db_dsn=psycopg_url(job.dsn))
    executor.register(objects.stream.projector)
    executor.register(objects.subscription.runner)
    ready.set()
    wait_for_go(go)
    executor.run()


def depeche_write_backlog(job: DepecheJob, events: int, seed: int) -> float:
    """Write `events` messages, one stream per key, and project them; the seconds."""
    rng = random.Random(seed)
    keys = [f"order-{n:05d}" for n in range(KEYS)]
    objects = depeche_objects(job)
    started = time.perf_counter()
    with objects.engine.connect() as conn:
        for n in range(events):
            key = rng.choice(keys)
            message = DepecheEvent(uuid.uuid4(), datetime.now(UTC), order_data(rng, key))
            objects.store.write(stream=key, message=message, conn=conn)
            if n % APPEND_BATCH == APPEND_BATCH - 1:
                conn.commit()
        conn.commit()
    objects.stream.projector.update_full()
    objects.engine.dispose()
    return time.perf_counter() - started


def depeche_done_query(name: str) -> sql.Composable:
    # depeche-db numbers positions from 0 and stores the last one handled
    return sql.SQL("SELECT sum(position + 1) FROM {} WHERE partition >= 0").format(
        sql.Identifier(f"depeche_subscriptions_{name}")
    )


def depeche_child(params: dict[str, Any]) -> dict[str, Any]:
    try:
        import depeche_db  # noqa: F401
    except ImportError as error:
        return {"missing": f"{error}"}
    database = Database(**params["database"])
    config = Config(**{**params["config"], "processes": tuple(params["config"]["processes"])})
    context = multiprocessing.get_context("spawn")
    base = DepecheJob(database.dsn, "sub", config.partitions, config.batch_size)
    write_seconds = depeche_write_backlog(base, config.depeche_backlog, config.seed)
    rows = []
    for processes in config.processes:
        job = dataclasses.replace(base, name=f"sub{processes}")
        depeche_objects(job).engine.dispose()  # creates the subscription's state table
        rows.append(depeche_run(context, database, config, job, processes))
    return {"write_seconds": write_seconds, "rows": [dataclasses.asdict(r) for r in rows]}


def depeche_run(
    context: SpawnContext, database: Database, config: Config, job: DepecheJob, processes: int
) -> Throughput:
    truncate_effects(database.dsn)
    group = Processes.new(context)
    before = settled_xacts(database)
    try:
        for _ in range(processes):
            group.start(depeche_executor, job)
        with psycopg.connect(database.dsn, autocommit=True) as monitor:
            started = group.begin()
            finished, polls = wait_for_total(
                monitor, depeche_done_query(job.name), (), config.depeche_backlog,
                group.started,
            )  # fmt: skip
    finally:
        group.finish()  # SIGTERM: the Executor's own way to stop, too
    xacts = settled_xacts(database) - before - polls
    return Throughput(
        "depeche-db executor",
        "one INSERT",
        processes,
        config.depeche_backlog,
        finished - started,
        xacts,
        check_effects(database.dsn, config.depeche_backlog),
    )


def run_depeche(python: str, database: Database, config: Config) -> list[Throughput] | str:
    """depeche-db's rows, from a child interpreter; or why there are none."""
    params = {"database": dataclasses.asdict(database), "config": dataclasses.asdict(config)}
    try:
        completed = subprocess.run(
            [python, os.path.abspath(__file__), "--depeche-child"],
            input=json.dumps(params),
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as error:
        return f"{DEPECHE_MISSING}: cannot run --depeche-python {python}: {error.strerror}"
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        return f"depeche-db run failed (exit status {completed.returncode})"
    report = json.loads(lines[-1])
    if "missing" in report:
        return DEPECHE_MISSING
    progress(f"depeche-db backlog written and projected in {report['write_seconds']:.1f} s")
    return [Throughput(**row) for row in report["rows"]]


# output


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def server_facts(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        values = []
        for setting in ("server_version", "fsync", "synchronous_commit"):
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(setting))).fetchone()
            values.append(str(row[0]) if row else "?")
    return f"PostgreSQL {values[0]}, fsync={values[1]}, synchronous_commit={values[2]}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def find(found: Sequence[Variant], runner: str, handler: str, processes: int) -> Variant | None:
    for v in found:
        if (v.runner, v.handler, v.processes) == (runner, handler, processes):
            return v
    return None


def plain_ratio(found: Sequence[Variant], variant: Variant) -> float | None:
    """A worker scenario's median rate over the plain loop's, same handler and processes."""
    if variant.runner != "subengine worker":
        return None
    plain = find(found, "plain psycopg loop", variant.handler, variant.processes)
    return None if plain is None else variant.rate.median / plain.rate.median


def print_throughput(found: Sequence[Variant]) -> None:
    header = (
        f"{'handler':<12} {'runner':<20} {'procs':>5} {'rounds':>6} {'median':>8} {'min':>8} "
        f"{'max':>8} {'xacts/100':>9} {'/ plain':>7}  note"
    )
    print(header)
    print("-" * len(header))
    for v in found:
        ratio = plain_ratio(found, v)
        rate = v.rate
        print(
            f"{v.handler:<12} {v.runner:<20} {v.processes:>5} {len(v.rows):>6} "
            f"{rate.median:>8,.0f} {rate.low:>8,.0f} {rate.high:>8,.0f} "
            f"{v.xacts_per_100:>9.1f} {'' if ratio is None else f'{ratio:.2f}':>7}  {v.notes}"
        )


# handler, goal for the worker / plain loop ratio, and whether only the most processes
# are judged (the others are for reading)
PLAIN_GOALS = (("no-op", 0.9, True), ("one INSERT", 0.35, True), ("executemany", 0.7, False))
# the no-op handler's rate with the most processes
NO_OP_RATE_GOAL = 100_000


def plain_ratios(found: Sequence[Variant], most: int) -> list[tuple[str, float, float]]:
    """Worker / plain loop (medians) per handler and process count, with their goals
    (0: none)."""
    ratios = []
    for handler, goal, only_most in PLAIN_GOALS:
        for processes in sorted({v.processes for v in found}):
            ours = find(found, "subengine worker", handler, processes)
            ratio = None if ours is None else plain_ratio(found, ours)
            if ratio is None:
                continue
            label = f"{handler}, {processes} proc: worker / plain loop"
            judged = goal if not only_most or processes == most else 0.0
            ratios.append((label, ratio, judged))
    return ratios


def print_goals(
    found: Sequence[Variant],
    depeche: list[Throughput] | str,
    latency: Latency | None,
    idle: Idle | None,
    config: Config,
) -> None:
    most = max(config.processes)
    print(f"goals (medians of {config.rounds} rounds)")
    no_op = find(found, "subengine worker", "no-op", most)
    if no_op is not None:
        rate = no_op.rate.median
        print(
            f"  {f'no-op, {most} proc: worker msgs/s':<58} {rate:8,.0f}  "
            f"(goal >= {NO_OP_RATE_GOAL:,})  {verdict(rate >= NO_OP_RATE_GOAL)}"
        )
    ratios = plain_ratios(found, most)
    if not ratios:
        print("  worker vs plain loop: not measured (--skip plain)")
    ours = find(found, "subengine worker", "one INSERT", most)
    if isinstance(depeche, list) and depeche and ours is not None:
        theirs = max(depeche, key=lambda r: (r.processes == most, r.processes))
        ratios.append(
            (f"one INSERT, {most} proc: worker / depeche-db ({theirs.processes} proc)",
             ours.rate.median / theirs.rate, 10.0)
        )  # fmt: skip
    for label, ratio, goal in ratios:
        judged = f"(goal >= {goal:g})  {verdict(ratio >= goal)}" if goal else "(no goal)"
        print(f"  {label:<58} {ratio:8.3f}  {judged}")
    if isinstance(depeche, str):
        print(f"  one INSERT vs depeche-db: not measured: {depeche}")
    if latency is not None:
        p50, p99 = latency.percentile(0.5) * 1000, latency.percentile(0.99) * 1000
        print(f"  {'latency p50 (ms)':<58} {p50:8.2f}  (goal <= 3)  {verdict(p50 <= 3)}")
        print(f"  {'latency p99 (ms)':<58} {p99:8.2f}  (goal <= 15)  {verdict(p99 <= 15)}")
    if idle is not None:
        rate = idle.statements_per_second
        print(f"  {'idle worker, queries/s':<58} {rate:8.2f}  (goal <= 1)  {verdict(rate <= 1)}")


def print_latency(latency: Latency, config: Config) -> None:
    ms = [s * 1000 for s in latency.samples]
    print(
        f"latency, append commit -> handler start, {len(ms):,} events after "
        f"{config.latency_warmup} warm-up, producer at {latency.rate:.0f} events/s, "
        "1 worker process:"
    )
    print(
        f"  p50 {latency.percentile(0.5) * 1000:.2f} ms   p95 "
        f"{latency.percentile(0.95) * 1000:.2f} ms   p99 {latency.percentile(0.99) * 1000:.2f} ms"
        f"   max {max(ms):.2f} ms   min {min(ms):.2f} ms   mean {statistics.fmean(ms):.2f} ms"
    )
    bound = latency.from_commit_call
    print(
        f"  from the call of commit() instead (an upper bound): p50 "
        f"{latency.percentile(0.5, bound) * 1000:.2f} ms   p99 "
        f"{latency.percentile(0.99, bound) * 1000:.2f} ms; handler before commit() returned: "
        f"{sum(1 for s in latency.samples if s < 0)} events"
    )
    print(f"  worker transactions per live event: {latency.worker_xacts_per_event:.1f}")


def print_idle(idle: Idle, config: Config) -> None:
    print("idle worker (1 process, concurrency 1):")
    print(
        f"  {idle.statements_per_second:.2f} statements/s, counted in the worker over "
        f"{idle.seconds:g} s after its first {config.idle_short_seconds:g} s"
    )
    print(
        f"  {idle.per_second:.2f} transactions/s in pg_stat_database (runs of "
        f"{config.idle_short_seconds:g} s and {config.idle_short_seconds + idle.seconds:g} s: "
        f"{idle.short_run} and {idle.long_run} transactions; "
        f"{idle.baseline_per_second:.2f}/s without a worker, subtracted)"
    )


# the run


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        description="Benchmark subengine's worker against a plain psycopg loop and depeche-db."
    )
    parser.add_argument("--dsn", help="PostgreSQL URL or conninfo (default: SUBENGINE_DSN)")
    parser.add_argument("--quick", action="store_true", help="a small run, for a smoke test")
    parser.add_argument("--backlog", type=int, help="events in the backlog (100000)")
    parser.add_argument("--depeche-backlog", type=int, help="depeche-db's backlog (10000)")
    parser.add_argument("--depeche-python", default=sys.executable, help="depeche-db's Python")
    parser.add_argument("--partitions", type=int, default=8, help="partitions (8)")
    parser.add_argument("--batch-size", type=int, default=100, help="events per batch (100)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each scenario (3)")
    parser.add_argument("--latency-events", type=int, help="measured live events (2000)")
    parser.add_argument("--latency-rate", type=float, default=200.0, help="events/s (200)")
    parser.add_argument("--idle-seconds", type=float, help="measured idle seconds (20)")
    parser.add_argument("--seed", type=int, default=20261122, help="seed of the event data")
    parser.add_argument("--skip", action="append", default=[], choices=("depeche", "plain"))
    parser.add_argument("--depeche-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick

    def chosen(given: Any, quick_default: Any, default: Any) -> Any:
        return given if given is not None else quick_default if quick else default

    config = Config(
        backlog=chosen(args.backlog, 5_000, 100_000),
        depeche_backlog=chosen(args.depeche_backlog, 1_000, 10_000),
        partitions=args.partitions,
        batch_size=args.batch_size,
        processes=(1, 2),
        rounds=args.rounds,
        latency_events=chosen(args.latency_events, 300, 2_000),
        latency_warmup=50 if quick else 200,
        latency_rate=args.latency_rate,
        idle_seconds=chosen(args.idle_seconds, 4.0, 20.0),
        idle_short_seconds=2.0 if quick else 5.0,
        seed=args.seed,
    )
    return args, config


@contextmanager
def benchmark_database(dsn: str | None) -> Iterator[Database]:
    import subengine

    with subengine.Engine(dsn) as engine:  # the embedded server when no DSN is given
        admin_dsn = engine.dsn
    database = create_database(admin_dsn)
    try:
        yield database
    finally:
        drop_database(database)


def measure_throughput(
    context: SpawnContext, database: Database, config: Config, skip: Sequence[str]
) -> list[Throughput]:
    """Every scenario, `config.rounds` times, each round in an order rotated by one."""
    runners = [run_subengine] + ([] if "plain" in skip else [run_plain])
    scenarios = [
        (handler, runner, processes)
        for handler in HANDLERS
        for runner in runners
        for processes in config.processes
    ]
    rows = []
    for round_ in range(config.rounds):
        shift = round_ % len(scenarios)
        for handler, runner, processes in scenarios[shift:] + scenarios[:shift]:
            row = runner(context, database, config, handler, processes, round_)
            progress(
                f"round {round_ + 1}: {row.runner}, {handler}, {processes} proc: "
                f"{row.rate:,.0f} msgs/s"
            )
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.depeche_child:
        print(json.dumps(depeche_child(json.loads(sys.stdin.read()))))
        return 0
    import subengine

    dsn = args.dsn or os.environ.get("SUBENGINE_DSN") or None
    context = multiprocessing.get_context("spawn")
    load_before = os.getloadavg()
    with benchmark_database(dsn) as database:
        prepare_tables(database, config.partitions)
        seconds = append_backlog(database, config)
        progress(f"appended {config.backlog:,} events in {seconds:.1f} s")
        rows = measure_throughput(context, database, config, args.skip)
        depeche: list[Throughput] | str = "skipped (--skip depeche)"
        if "depeche" not in args.skip:
            depeche = run_depeche(args.depeche_python, database, config)
        latency = run_latency(context, database, config)
        progress("latency measured")
        idle = run_idle(context, database, config)
        progress("idle cost measured")
        facts = server_facts(database.dsn)
    settings = subengine.Settings.from_env()
    print()
    print(
        f"{facts}; {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    print(
        f"worker settings: poll_interval {settings.poll_interval:g} s, heartbeat_interval "
        f"{settings.heartbeat_interval:g} s; batch size {config.batch_size}; "
        f"{config.partitions} partitions"
    )
    print()
    print(
        f"throughput (msgs/s over {config.rounds} rounds): backlog {config.backlog:,} events "
        f"(depeche-db: {config.depeche_backlog:,} in one round, its rates are per second all "
        "the same)"
    )
    found = variants(rows)
    print_throughput(variants([*rows, *(depeche if isinstance(depeche, list) else [])]))
    if isinstance(depeche, str):
        print(depeche)
    print()
    print_latency(latency, config)
    print()
    print_idle(idle, config)
    print()
    print_goals(found, depeche, latency, idle, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
