"""How subengine's worker scales to 1,024 partitions and 100 subscriptions (issue 12).

Run it from the repository root:

    .venv/bin/python bench/scale.py            # about 10 minutes on 2 cores
    .venv/bin/python bench/scale.py --quick    # about 2 minutes, for a smoke test
    .venv/bin/python bench/scale.py --dsn postgresql://...   # or set SUBENGINE_DSN

Without a DSN it uses the embedded PostgreSQL, which keeps running afterwards (stop it with
`.venv/bin/subengine db stop`). Like bench/consume.py, every run creates databases of its
own on that server (`bench_scale_<pid>`, and `bench_scale_<pid>_fresh<n>` for the fresh
database figures), migrates them and drops them at the end. Worker settings come from the
environment as usual (`SUBENGINE_POLL_INTERVAL`, ...); the header prints them.

Every load below is bounded in count and in time: where today's code is slow, a figure is
a rate over a fixed window, or the looks that fit in a time budget, never "until done".
Each measured variant runs `--rounds` times (at least 3), the variants of a round in an
order rotated by one from the round before, all in one database; the report gives the
median, min and max over the rounds (for looks: over every look of every round).

What each figure means
----------------------
Partition choice. The worker's look for work (`one_look`, below: the `look_for_work`
query and its commit), timed in this process, on one long-lived connection per variant
set up as the worker's own connections are (see worker_connection_settings). The Worker
(the class `App.run_worker` runs) is made for 100 subscriptions (`--subscriptions`) of
one stream of 1,024 partitions (`--partitions`) and never run; concurrency 1, so a look
asks for 4 candidates. Variants:

* backlog S and backlog L: every subscription starts at the beginning of a stream holding
  `--backlog-small` (S) or `--backlog-large` (L) events in every partition, so every
  (subscription, partition) pair has work. Goal: <= 5 ms per look, and L / S near 1.
* nothing to do: the subscriptions start at the end of a third such stream, so the look
  finds nothing (shown, no goal: an idle worker does not look).
* nothing to do, the idle worker's poll: what an idle worker sends every poll interval
  instead (`one_poll`: the `poll_for_work` query, without the heartbeat), on that
  stream. Goal: <= 1 ms per poll.

A round takes `--looks` looks of each, or as many as fit in `--look-seconds`.

Fan-out. 100 fresh subscriptions (start at the beginning, no-op handler, batches of
`--batch-size`) of a stream holding `--fanout-events` events, run by `--processes` worker
processes (`App.run_worker`, concurrency 1, all 100 subscriptions in each), at 8 and at
1,024 partitions. Effects are handler calls committed, read from the subscription
positions; effects/s is their growth over `--window` seconds that begin `--warmup` seconds
after the started processes are told to go (or up to the moment all is consumed, if
sooner). Goal: the rate at 1,024 partitions >= 0.5x the rate at 8 in the same round.

Latency. One worker process (concurrency 1, listening) runs one subscription that starts at
the end of a live stream of 8 or 1,024 partitions, while this script appends single-event
transactions to it at `--latency-rate` events/s. Each event's latency is from the return of
the producer's `commit()` to the call of the handler (both `time.time()`, one machine),
over `--latency-events` events after `--latency-warmup` ones. "1,024 after load" is the
1,024-partition run started the moment the fan-out at 1,024 partitions has stopped (its
processes have exited), in the database it left behind. Goal: p50 <= 1.5 ms, p99 <= 8 ms.

Idle statements. A worker process with concurrency 1 and one with concurrency 4, side by
side, each running the 100 subscriptions with nothing to do; each counts, as consume.py
does, the statements it sends through a psycopg cursor (BEGIN and COMMIT are not
statements), from `--idle-skip` seconds after it was told to go, for `--idle-seconds`.
Goal: <= 0.2 statements/s whatever the concurrency.

Fresh database. A new database (autovacuum off for subengine's tables, so that only this
script analyses them) with one stream of 1,024 partitions and 100 subscriptions that start
at the beginning. One Engine and one look connection are kept from the first step to the
last, so plans cached early stay, as in a worker started on an empty database. At each
step: the look (as above), single-event appends (`--fresh-singles` transactions) and the
rate of the batch appends (100 events each) that grew the stream to the step's size. The
steps: empty, no statistics; grown to `--fresh-early` events; ANALYZE ("early
statistics"); grown step by step to `--fresh-events` without analysing; ANALYZE again,
the reference. Repeated `--rounds` times, each on a database of its own. Goal: no
collapse, so every step's look is within the choice goal (5 ms) and every step's append
rates are >= 0.5x those of the analysed reference.

The machine's other load distorts every figure: the script prints the load average.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from typing import TYPE_CHECKING, Any, Literal

import psycopg
from consume import (
    Database,
    Processes,
    database_dsn,
    drop_database,
    order_data,
    progress,
    server_facts,
    stop_processes,
    verdict,
    wait_for_go,
)
from psycopg import sql

if TYPE_CHECKING:
    import subengine
    from subengine.db._sql import Db
    from subengine.worker._worker import Worker

# every Engine here is given it, whatever SUBENGINE_SCHEMA says: the polls name it
SCHEMA = "subengine"
DATABASE_PREFIX = "bench_scale_"
SMALL_PARTITIONS = 8
APPEND_BATCH = 100
LIVE_KEYS = 1000
STOP_TIMEOUT_SECONDS = 60.0
CATCH_UP_SECONDS = 60.0
# The fan-out's polls of the positions read ~100,000 rows: seldom, and on one core.
POLL_SECONDS = 1.0
FRESH_STREAM = "fresh"
# Goals of issue 12.
LOOK_GOAL_MS = 5.0
IDLE_LOOK_GOAL_MS = 1.0
FANOUT_GOAL = 0.5
LATENCY_P50_GOAL_MS = 1.5
LATENCY_P99_GOAL_MS = 8.0
IDLE_GOAL = 0.2
FRESH_APPEND_GOAL = 0.5

Handler = Literal["no-op", "record"]
StartPoint = Literal["beginning", "end"]


def one_look(worker: Worker, db: Db) -> int:
    """The worker's look for work, once; the number of candidates it found.

    The only place this script reaches into the worker: adapt it when the look changes.
    """
    from subengine.subscriptions._subscriptions import look_for_work

    look = look_for_work(list(worker.subscriptions), [], [], worker._look_limit)
    found = db.run(look)
    db.conn.commit()
    return len(found.work)


def one_poll(worker: Worker, db: Db) -> int:
    """The statement an idle worker sends every poll interval (the heads' sums and
    whether any partition has work; no heartbeat), once; 1 if it says there is work."""
    from subengine.db._sql import Query

    query = Query(
        "poll_for_work",
        {
            **worker._registration(),
            "serving": list(worker.subscriptions),
            "streams": sorted(worker.streams),
            "beat": False,
        },
        lambda result: bool(result.rows[0][1]),
    )
    has_work = db.run(query)
    db.conn.commit()
    return int(has_work)


@dataclass(frozen=True, slots=True)
class Config:
    partitions: int
    subscriptions: int
    rounds: int
    backlog_small: int
    backlog_large: int
    looks: int
    look_seconds: float
    fanout_events: int
    processes: int
    batch_size: int
    window: float
    warmup: float
    latency_events: int
    latency_warmup: int
    latency_rate: float
    idle_seconds: float
    idle_skip: float
    fresh_early: int
    fresh_events: int
    fresh_singles: int
    seed: int


@dataclass(frozen=True, slots=True)
class Spread:
    """Median, min and max of some measurements."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, digits: int = 2, unit: str = "") -> str:
        return (
            f"{self.median:,.{digits}f}{unit} (min {self.low:,.{digits}f}, "
            f"max {self.high:,.{digits}f}, n={self.count})"
        )


@dataclass
class Results:
    looks: dict[str, list[list[float]]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )  # variant -> per round, seconds per look
    found: dict[str, set[int]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(set)
    )
    fanout: dict[int, list[float]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )  # partitions -> effects/s per round
    fanout_done: dict[int, list[bool]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )
    latency: dict[str, list[list[float]]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )  # variant -> per round, seconds per event
    latency_rate: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )
    idle: dict[int, list[float]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )  # concurrency -> statements/s per round
    idle_kinds: dict[int, collections.Counter[str]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    fresh: list[list[FreshStep]] = dataclasses.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FreshStep:
    label: str
    events: int
    looks: list[float]  # seconds
    found: int
    singles_per_second: float
    batch_per_second: float | None  # the appends that grew the stream to this step


# the benchmark's streams and subscriptions


def look_names(variant: str, count: int) -> list[str]:
    return [f"look-{variant}-{n:03d}" for n in range(count)]


def fanout_names(partitions: int, round_: int, count: int) -> list[str]:
    return [f"fan-{partitions}-r{round_}-{n:03d}" for n in range(count)]


def partition_keys(partitions: int, prefix: str) -> list[str]:
    """One key per partition of a stream of `partitions`: key i lands in partition i."""
    from subengine import partition_for

    keys: list[str | None] = [None] * partitions
    missing, n = partitions, 0
    while missing:
        key = f"{prefix}-{n}"
        n += 1
        partition = partition_for(key, partitions)
        if keys[partition] is None:
            keys[partition] = key
            missing -= 1
    return [k for k in keys if k is not None]


def fill(engine: subengine.Engine, stream: str, partitions: int, events: int, seed: int) -> float:
    """Append `events` events spread evenly over every partition, in batches of
    APPEND_BATCH; the events per second."""
    import subengine

    rng = random.Random(seed)
    keys = partition_keys(partitions, stream)
    order = list(range(partitions))
    rng.shuffle(order)
    started = time.perf_counter()
    for first in range(0, events, APPEND_BATCH):
        batch = []
        for n in range(first, min(events, first + APPEND_BATCH)):
            key = keys[order[n % partitions]]
            batch.append(subengine.NewEvent(key, "OrderUpdated", order_data(rng, key)))
        engine.append(stream, batch)
    return events / max(time.perf_counter() - started, 1e-9)


def ensure_subscriptions(
    engine: subengine.Engine, names: Sequence[str], stream: str, start: StartPoint
) -> None:
    """Store subscriptions before their workers start, so polls find their positions."""
    import subengine

    for name in names:
        engine.ensure_subscription(subengine.Subscription(name, stream, start))


def monitor(dsn: str) -> psycopg.Connection[Any]:
    """This script's connection for polls, kept to one core: the workers need the others."""
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("SET max_parallel_workers_per_gather = 0")
    return conn


def total_position(conn: psycopg.Connection[Any], names: Sequence[str]) -> int:
    row = conn.execute(
        sql.SQL(
            "SELECT coalesce(sum(position), 0) FROM {}.subscription_positions"
            " WHERE subscription = ANY (%s)"
        ).format(sql.Identifier(SCHEMA)),
        (list(names),),
    ).fetchone()
    return int(row[0]) if row else 0


def create_database(admin_dsn: str, name: str) -> Database:
    """A new, empty database of this run (consume.py's create_database names its own)."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8'").format(
                sql.Identifier(name)
            )
        )
    return Database(admin_dsn, name, database_dsn(admin_dsn, name))


def quiet_autovacuum(conn: psycopg.Connection[Any]) -> None:
    """Keep autovacuum from analysing subengine's tables: only this script does."""
    tables = conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relkind = 'r' AND n.nspname = %s",
        (SCHEMA,),
    ).fetchall()
    for (table,) in tables:
        conn.execute(
            sql.SQL("ALTER TABLE {}.{} SET (autovacuum_enabled = off)").format(
                sql.Identifier(SCHEMA), sql.Identifier(table)
            )
        )


def prepare(database: Database, config: Config) -> None:
    """The look streams and their subscriptions, and the fan-out and live streams."""
    import subengine

    with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
        engine.migrate()
        for variant, per_partition in (
            ("small", config.backlog_small),
            ("large", config.backlog_large),
            ("idle", config.backlog_small),
        ):
            stream = f"look-{variant}"
            engine.create_stream(stream, config.partitions)
            rate = fill(
                engine, stream, config.partitions, per_partition * config.partitions, config.seed
            )
            start: StartPoint = "end" if variant == "idle" else "beginning"
            ensure_subscriptions(engine, look_names(variant, config.subscriptions), stream, start)
            progress(
                f"stream {stream}: {per_partition * config.partitions:,} events "
                f"({rate:,.0f} events/s), {config.subscriptions} subscriptions at the {start}"
            )
        for partitions in sorted({SMALL_PARTITIONS, config.partitions}):
            engine.create_stream(f"fan-{partitions}", partitions)
            fill(engine, f"fan-{partitions}", partitions, config.fanout_events, config.seed + 1)
            engine.create_stream(f"live-{partitions}", partitions)
        progress(f"fan-out streams: {config.fanout_events:,} events each")
    with psycopg.connect(database.dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


# worker processes

_handler_starts: list[tuple[int, float]] = []


def ignore(event: Any, conn: Any) -> None:
    """The no-op handler."""


def record_start(event: Any, conn: Any) -> None:
    _handler_starts.append((event.data["seq"], time.time()))


def count_statements(kinds: list[tuple[float, str]]) -> None:
    """Record when this process sends each statement through a psycopg cursor, and its
    first words (which query it is). As consume.py's count_statements, with the kind."""
    for method in ("execute", "executemany"):
        original = getattr(psycopg.Cursor, method)

        def counted(
            self: Any, query: Any, *args: Any, _original: Any = original, **kwargs: Any
        ) -> Any:
            if isinstance(query, sql.Composable):
                text = query.as_string(self)
            elif isinstance(query, bytes):
                text = query.decode()
            else:
                text = str(query)
            kinds.append((time.monotonic(), " ".join(text.split())[:48]))
            return _original(self, query, *args, **kwargs)

        setattr(psycopg.Cursor, method, counted)


@dataclass(frozen=True, slots=True)
class WorkerJob:
    dsn: str
    names: tuple[str, ...]
    stream: str
    start: StartPoint
    handler: Handler
    batch_size: int
    concurrency: int = 1
    count_statements: bool = False


def worker_process(job: WorkerJob, results: Any, ready: Any, go: Any) -> None:
    """One worker process running the job's subscriptions, until SIGTERM."""
    logging.basicConfig(level=logging.WARNING)
    import subengine

    app = subengine.App()
    handler = record_start if job.handler == "record" else ignore
    for name in job.names:
        declared = app.subscription(
            name, stream=job.stream, start=job.start, batch_size=job.batch_size
        )
        declared.handler()(handler)
    statements: list[tuple[float, str]] = []
    if job.count_statements:
        count_statements(statements)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    with subengine.Engine(job.dsn, schema=SCHEMA) as engine:
        ready.set()
        wait_for_go(go)
        app.run_worker(engine, list(job.names), concurrency=job.concurrency, stop=stop)
    if results is not None:
        results.put({"starts": _handler_starts, "statements": statements})


def worker_entry(job: WorkerJob, ready: Any, go: Any) -> None:
    worker_process(job, None, ready, go)


# partition choice


@dataclass
class Looker:
    """A Worker that is never run and the connection its looks go through."""

    worker: Worker
    conn: psycopg.Connection[Any]
    db: Db
    poll: bool  # time the idle worker's poll instead of the look

    @classmethod
    @contextmanager
    def open(
        cls, engine: subengine.Engine, names: Sequence[str], stream: str, poll: bool = False
    ) -> Iterator[Looker]:
        import subengine
        from subengine.db._sql import Db, Query, first_row
        from subengine.worker._worker import Worker

        app = subengine.App()
        for name in names:
            app.subscription(name, stream=stream).handler()(ignore)
        worker = Worker(engine, [app.subscriptions[name] for name in names], concurrency=1)
        with engine.connect() as conn:
            # as a slot's lock connection, where the worker looks, or its poller's
            engine.sql.run(conn, Query("worker_connection_settings", {}, first_row))
            conn.commit()
            yield cls(worker, conn, Db(conn, engine.sql), poll)

    def looks(self, count: int, budget: float) -> tuple[list[float], int]:
        """Up to `count` looks, as many as fit in `budget` seconds (at least one): the
        seconds of each, and the candidates the last one found."""
        times: list[float] = []
        found = 0
        deadline = time.perf_counter() + budget
        while len(times) < count and (not times or time.perf_counter() < deadline):
            started = time.perf_counter()
            found = (one_poll if self.poll else one_look)(self.worker, self.db)
            times.append(time.perf_counter() - started)
        return times, found


# fan-out


def run_fanout(
    context: SpawnContext, database: Database, config: Config, partitions: int, round_: int
) -> tuple[float, bool]:
    """Effects/s of the processes over the window, and whether they consumed everything."""
    import subengine

    names = fanout_names(partitions, round_, config.subscriptions)
    stream = f"fan-{partitions}"
    with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
        ensure_subscriptions(engine, names, stream, "beginning")
    job = WorkerJob(database.dsn, tuple(names), stream, "beginning", "no-op", config.batch_size)
    target = config.fanout_events * len(names)
    group = Processes.new(context)
    try:
        for _ in range(config.processes):
            group.start(worker_entry, job)
        with monitor(database.dsn) as polls:
            began = group.begin()
            time.sleep(config.warmup)
            first, opened = total_position(polls, names), time.perf_counter()
            deadline = began + config.warmup + config.window
            done = first >= target
            last, closed = first, opened
            while not done and time.perf_counter() < deadline:
                if any(p.exitcode for p in group.started):
                    raise RuntimeError(
                        f"a worker process failed during the fan-out at {partitions}"
                    )
                time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.perf_counter())))
                last, closed = total_position(polls, names), time.perf_counter()
                done = last >= target
    finally:
        group.finish()
    if done and closed == opened:  # finished within the warm-up: rate over the whole run
        return last / max(closed - began, 1e-9), True
    return (last - first) / (closed - opened), done


# latency


def live_producer(dsn: str, stream: str, total: int, rate: float, seed: int) -> dict[int, float]:
    """Append `total` single-event transactions at `rate` per second: when each
    commit() returned, by seq."""
    import subengine

    rng = random.Random(seed)
    committed: dict[int, float] = {}
    interval = 1 / rate
    with psycopg.connect(dsn) as conn:
        started = time.perf_counter()
        for seq in range(total):
            delay = started + seq * interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            key = f"live-{rng.randrange(LIVE_KEYS):05d}"
            subengine.append(conn, stream, [subengine.NewEvent(key, "Tick", {"seq": seq})],
                             schema=SCHEMA)  # fmt: skip
            conn.commit()
            committed[seq] = time.time()
    return committed


def run_latency(
    context: SpawnContext,
    database: Database,
    config: Config,
    partitions: int,
    name: str,
    round_: int,
) -> list[float]:
    """Seconds from each measured event's commit to its handler's start."""
    import subengine

    stream = f"live-{partitions}"
    subscription = f"lat-{name}-r{round_}"
    total = config.latency_warmup + config.latency_events
    with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
        ensure_subscriptions(engine, [subscription], stream, "end")
    job = WorkerJob(database.dsn, (subscription,), stream, "end", "record", config.batch_size)
    results = context.Queue()
    group = Processes.new(context)
    try:
        group.start(worker_process, job, results)
        with monitor(database.dsn) as polls:
            base = total_position(polls, [subscription])
            group.begin()
            time.sleep(1.0)  # the worker has looked once, found nothing, and listens
            committed = live_producer(
                database.dsn, stream, total, config.latency_rate, config.seed + round_
            )
            deadline = time.monotonic() + CATCH_UP_SECONDS
            while total_position(polls, [subscription]) - base < total:
                if time.monotonic() > deadline or any(p.exitcode for p in group.started):
                    raise RuntimeError(f"the latency worker ({name}) did not catch up")
                time.sleep(0.05)
        stop_processes(group.started)  # the worker sends its handler times as it stops
        starts = dict(results.get(timeout=STOP_TIMEOUT_SECONDS)["starts"])
    finally:
        group.finish()
    return [starts[seq] - committed[seq] for seq in range(config.latency_warmup, total)]


# idle statements


def run_idle(
    context: SpawnContext, database: Database, config: Config
) -> dict[int, tuple[float, collections.Counter[str]]]:
    """Statements/s of an idle worker at concurrency 1 and 4, run side by side."""
    names = tuple(look_names("idle", config.subscriptions))
    concurrencies = (1, 4)
    queues = {c: context.Queue() for c in concurrencies}
    group = Processes.new(context)
    try:
        for concurrency in concurrencies:
            job = WorkerJob(
                database.dsn, names, "look-idle", "end", "no-op", config.batch_size,
                concurrency, count_statements=True,
            )  # fmt: skip
            group.start(worker_process, job, queues[concurrency])
        group.begin()
        began = time.monotonic()
        time.sleep(config.idle_skip + config.idle_seconds)
        ended = time.monotonic()
        stop_processes(group.started)
        reports = {c: queues[c].get(timeout=STOP_TIMEOUT_SECONDS) for c in concurrencies}
    finally:
        group.finish()
    result = {}
    for concurrency, report in reports.items():
        counted = [
            kind for t, kind in report["statements"] if began + config.idle_skip <= t < ended
        ]
        result[concurrency] = (
            len(counted) / (ended - began - config.idle_skip),
            collections.Counter(counted),
        )
    return result


# a fresh database


class FreshGrowth:
    """A fresh database's stream as it grows, measured step by step (module docstring)."""

    def __init__(self, engine: subengine.Engine, looker: Looker, config: Config, seed: int):
        self.engine = engine
        self.looker = looker
        self.config = config
        self.rng = random.Random(seed)
        self.keys = partition_keys(config.partitions, FRESH_STREAM)
        self.events = 0
        self.steps: list[FreshStep] = []

    def grow(self, to: int) -> float:
        """Append batches of APPEND_BATCH events until the stream holds `to`: events/s."""
        import subengine

        started, before = time.perf_counter(), self.events
        while self.events < to:
            batch = []
            for _ in range(min(APPEND_BATCH, to - self.events)):
                key = self.rng.choice(self.keys)
                batch.append(subengine.NewEvent(key, "OrderUpdated", order_data(self.rng, key)))
            self.engine.append(FRESH_STREAM, batch)
            self.events += len(batch)
        return (self.events - before) / max(time.perf_counter() - started, 1e-9)

    def measure(self, label: str, batch_rate: float | None) -> None:
        """Looks, then single-event appends, as the step `label`."""
        import subengine

        looks, found = self.looker.looks(self.config.looks, self.config.look_seconds)
        at = self.events
        started = time.perf_counter()
        for _ in range(self.config.fresh_singles):
            key = self.rng.choice(self.keys)
            self.engine.append(FRESH_STREAM, [subengine.NewEvent(key, "Tick", {})])
        singles = self.config.fresh_singles / (time.perf_counter() - started)
        self.events += self.config.fresh_singles
        self.steps.append(FreshStep(label, at, looks, found, singles, batch_rate))


def fresh_round(admin_dsn: str, config: Config, round_: int) -> list[FreshStep]:
    """The looks and append rates of a new database as it grows (module docstring)."""
    import subengine

    database = create_database(admin_dsn, f"{DATABASE_PREFIX}{os.getpid()}_fresh{round_}")
    names = [f"fresh-{n:03d}" for n in range(config.subscriptions)]
    try:
        with (
            subengine.Engine(database.dsn, schema=SCHEMA) as engine,
            psycopg.connect(database.dsn, autocommit=True) as admin,
        ):
            engine.migrate()
            quiet_autovacuum(admin)
            engine.create_stream(FRESH_STREAM, config.partitions)
            ensure_subscriptions(engine, names, FRESH_STREAM, "beginning")
            with Looker.open(engine, names, FRESH_STREAM) as looker:
                growth = FreshGrowth(engine, looker, config, config.seed + 100 + round_)
                growth.measure("empty, no statistics", None)
                growth.measure("no statistics", growth.grow(config.fresh_early))
                admin.execute("ANALYZE")
                growth.measure("early statistics", None)
                size = config.fresh_early
                while size < config.fresh_events:
                    size = min(size * 4, config.fresh_events)
                    growth.measure("stale statistics", growth.grow(size))
                admin.execute("ANALYZE")
                # the reference: appends as the stale steps' once the statistics are right
                growth.measure(
                    "analysed (reference)", growth.grow(growth.events + config.fresh_early)
                )
    finally:
        drop_database(database)
    return growth.steps


# the report


def ms(seconds: float) -> float:
    return seconds * 1000


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def goal_line(label: str, value: str, goal: str, ok: bool | None) -> None:
    judged = "" if ok is None else verdict(ok)
    print(f"  {label:<52} {value:>10}  {goal:<22} {judged}")


def print_report(results: Results, config: Config) -> None:
    print("partition choice: ms per look (median, min, max over every look of every round)")
    look_median: dict[str, float] = {}
    labels = {
        "small": f"work everywhere, backlog S ({config.backlog_small}/partition)",
        "large": f"work everywhere, backlog L ({config.backlog_large}/partition)",
        "idle": "nothing to do",
        "poll": "nothing to do: the idle worker's poll",
    }
    for variant, label in labels.items():
        rounds = results.looks[variant]
        pooled = [ms(t) for times in rounds for t in times]
        spread = Spread.of(pooled)
        look_median[variant] = spread.median
        round_medians = ", ".join(f"{statistics.median(times) * 1000:.2f}" for times in rounds)
        found = ",".join(str(n) for n in sorted(results.found[variant]))
        print(f"  {label:<40} {spread.text(2, ' ms')}")
        print(f"  {'':<40} round medians {round_medians}; candidates found {found}")
    print(f"  backlog L / backlog S: {look_median['large'] / look_median['small']:.2f}")
    print()
    print(
        f"fan-out: effects/s of {config.subscriptions} subscriptions x "
        f"{config.fanout_events:,} events, {config.processes} worker processes, "
        f"{config.window:g} s windows after {config.warmup:g} s"
    )
    fan = {p: Spread.of(rates) for p, rates in results.fanout.items()}
    for partitions, spread in sorted(fan.items()):
        done = sum(results.fanout_done[partitions])
        note = f"; consumed everything in {done} round(s)" if done else ""
        print(f"  {partitions:>5} partitions: {spread.text(0, ' effects/s')}{note}")
    per_round = [
        large / small
        for small, large in zip(
            results.fanout[SMALL_PARTITIONS], results.fanout[config.partitions], strict=True
        )
    ]
    ratio = Spread.of(per_round)
    print(f"  {config.partitions} / {SMALL_PARTITIONS}, per round: {ratio.text(4)}")
    print()
    print(
        f"latency: append commit -> handler start, ms, {config.latency_events:,} events per "
        f"round after {config.latency_warmup} warm-up, at {config.latency_rate:g} events/s"
    )
    latency_figures: dict[str, tuple[float, float]] = {}
    for variant, rounds in results.latency.items():
        p50s = [ms(percentile(r, 0.5)) for r in rounds]
        p99s = [ms(percentile(r, 0.99)) for r in rounds]
        pooled = [ms(s) for r in rounds for s in r]
        latency_figures[variant] = (statistics.median(p50s), statistics.median(p99s))
        print(
            f"  {variant:<17} p50 {Spread.of(p50s).text(2)}   p99 {Spread.of(p99s).text(2)}"
            f"   all rounds: p50 {percentile(pooled, 0.5):.2f}, p99 "
            f"{percentile(pooled, 0.99):.2f}, max {max(pooled):.2f}"
        )
    print()
    print(
        f"idle worker statements/s ({config.subscriptions} subscriptions with nothing to do, "
        f"{config.partitions} partitions; {config.idle_seconds:g} s after {config.idle_skip:g} s)"
    )
    for concurrency, rates in sorted(results.idle.items()):
        kinds = results.idle_kinds[concurrency]
        total = sum(kinds.values())
        top = "; ".join(f"{n} x {kind}" for kind, n in kinds.most_common(4))
        print(f"  concurrency {concurrency}: {Spread.of(rates).text(3)}")
        print(f"    {total} statements over the rounds: {top}")
    print()
    fresh_goals = print_fresh(results.fresh)
    print()
    print("goals (medians over the rounds)")
    goal_line(
        "choice, work everywhere, backlog S (ms/look)", f"{look_median['small']:.2f}",
        f"<= {LOOK_GOAL_MS:g}", look_median["small"] <= LOOK_GOAL_MS,
    )  # fmt: skip
    goal_line(
        "choice, work everywhere, backlog L (ms/look)", f"{look_median['large']:.2f}",
        f"<= {LOOK_GOAL_MS:g}", look_median["large"] <= LOOK_GOAL_MS,
    )  # fmt: skip
    flat = look_median["large"] / look_median["small"]
    goal_line("choice, backlog L / backlog S", f"{flat:.2f}", "flat (~1)", None)
    goal_line("choice, nothing to do (ms/look)", f"{look_median['idle']:.2f}", "-", None)
    goal_line(
        "nothing to do: the idle worker's poll (ms/poll)", f"{look_median['poll']:.2f}",
        f"<= {IDLE_LOOK_GOAL_MS:g}", look_median["poll"] <= IDLE_LOOK_GOAL_MS,
    )  # fmt: skip
    goal_line(
        f"fan-out, {config.partitions} / {SMALL_PARTITIONS} partitions (effects/s)",
        f"{ratio.median:.4f}", f">= {FANOUT_GOAL:g}", ratio.median >= FANOUT_GOAL,
    )  # fmt: skip
    for variant, (p50, p99) in latency_figures.items():
        goal_line(
            f"latency p50, {variant} (ms)", f"{p50:.2f}", f"<= {LATENCY_P50_GOAL_MS:g}",
            p50 <= LATENCY_P50_GOAL_MS,
        )  # fmt: skip
        goal_line(
            f"latency p99, {variant} (ms)", f"{p99:.2f}", f"<= {LATENCY_P99_GOAL_MS:g}",
            p99 <= LATENCY_P99_GOAL_MS,
        )  # fmt: skip
    for concurrency, rates in sorted(results.idle.items()):
        rate = statistics.median(rates)
        goal_line(
            f"idle worker, concurrency {concurrency} (statements/s)", f"{rate:.3f}",
            f"<= {IDLE_GOAL:g}", rate <= IDLE_GOAL,
        )  # fmt: skip
    worst_look, worst_singles, worst_batch = fresh_goals
    goal_line(
        "fresh database: worst step's choice (ms/look)", f"{worst_look:.2f}",
        f"<= {LOOK_GOAL_MS:g}", worst_look <= LOOK_GOAL_MS,
    )  # fmt: skip
    goal_line(
        "fresh database: worst single appends / analysed", f"{worst_singles:.2f}",
        f">= {FRESH_APPEND_GOAL:g}", worst_singles >= FRESH_APPEND_GOAL,
    )  # fmt: skip
    goal_line(
        "fresh database: worst batch appends / analysed", f"{worst_batch:.2f}",
        f">= {FRESH_APPEND_GOAL:g}", worst_batch >= FRESH_APPEND_GOAL,
    )  # fmt: skip


def print_fresh(rounds: list[list[FreshStep]]) -> tuple[float, float, float]:
    """The fresh database's steps (medians over the rounds); the worst look's median in ms,
    and the worst single-event and batch append rates over those of the analysed step."""
    print(
        "fresh database, growing from empty (medians over the rounds, min-max in brackets;"
        " looks: median ms per look)"
    )
    print(
        f"  {'step':<22} {'events':>8} {'look ms':>22} {'found':>5} "
        f"{'1-event appends/s':>22} {'100-event batches, ev/s':>26}"
    )
    worst_look, worst_singles, worst_batch = 0.0, math.inf, math.inf
    steps = len(rounds[0])
    reference_singles = statistics.median(r[-1].singles_per_second for r in rounds)
    reference_batch = statistics.median(r[-1].batch_per_second or math.nan for r in rounds)
    for n in range(steps):
        step = [r[n] for r in rounds]
        looks = Spread.of([statistics.median(s.looks) * 1000 for s in step])
        singles = Spread.of([s.singles_per_second for s in step])
        batch_rates = [s.batch_per_second for s in step if s.batch_per_second is not None]
        batch = Spread.of(batch_rates) if batch_rates else None
        worst_look = max(worst_look, looks.median)
        worst_singles = min(worst_singles, singles.median / reference_singles)
        if batch is not None:
            worst_batch = min(worst_batch, batch.median / reference_batch)
        batch_text = f"{batch.median:,.0f} [{batch.low:,.0f}-{batch.high:,.0f}]" if batch else "-"
        print(
            f"  {step[0].label:<22} {step[0].events:>8,} "
            f"{f'{looks.median:.2f} [{looks.low:.2f}-{looks.high:.2f}]':>22} "
            f"{step[0].found:>5} "
            f"{f'{singles.median:,.0f} [{singles.low:,.0f}-{singles.high:,.0f}]':>22} "
            f"{batch_text:>26}"
        )
    return worst_look, worst_singles, worst_batch


# the run


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        description="Measure the worker at 1,024 partitions and 100 subscriptions (issue 12)."
    )
    parser.add_argument("--dsn", help="PostgreSQL URL or conninfo (default: SUBENGINE_DSN)")
    parser.add_argument("--quick", action="store_true", help="a small run, for a smoke test")
    add = parser.add_argument
    add("--partitions", type=int, default=1024, help="partitions of the large streams (1024)")
    add("--subscriptions", type=int, default=100, help="subscriptions per worker (100)")
    add("--rounds", type=int, default=3, help="rounds of every variant, at least 3 (3)")
    add("--backlog-small", type=int, help="events per partition, backlog S (5)")
    add("--backlog-large", type=int, help="events per partition, backlog L (100)")
    add("--looks", type=int, help="looks per variant and round, at most (50)")
    add("--look-seconds", type=float, help="seconds of looks per variant and round (6)")
    add("--fanout-events", type=int, default=20_000, help="events of the fan-out (20000)")
    add("--processes", type=int, default=2, help="worker processes of the fan-out (2)")
    add("--batch-size", type=int, default=100, help="events per batch (100)")
    add("--window", type=float, help="seconds of a fan-out rate window (20)")
    add("--warmup", type=float, help="seconds before a fan-out window opens (3)")
    add("--latency-events", type=int, help="measured live events per round (1000)")
    add("--latency-rate", type=float, default=200.0, help="live events/s (200)")
    add("--idle-seconds", type=float, help="measured idle seconds per round (20)")
    add("--fresh-events", type=int, help="events the fresh database grows to (65536)")
    add("--seed", type=int, default=20261122, help="seed of the event data")
    args = parser.parse_args(argv)
    quick = args.quick

    def chosen(given: Any, quick_default: Any, default: Any) -> Any:
        return given if given is not None else quick_default if quick else default

    config = Config(
        partitions=args.partitions,
        subscriptions=args.subscriptions,
        rounds=args.rounds,
        backlog_small=chosen(args.backlog_small, 2, 5),
        backlog_large=chosen(args.backlog_large, 10, 100),
        looks=chosen(args.looks, 10, 50),
        look_seconds=chosen(args.look_seconds, 1.0, 6.0),
        fanout_events=args.fanout_events if not quick else min(args.fanout_events, 2_000),
        processes=args.processes,
        batch_size=args.batch_size,
        window=chosen(args.window, 3.0, 20.0),
        warmup=chosen(args.warmup, 1.0, 3.0),
        latency_events=chosen(args.latency_events, 100, 1_000),
        latency_warmup=20 if quick else 100,
        latency_rate=args.latency_rate,
        idle_seconds=chosen(args.idle_seconds, 6.0, 20.0),
        idle_skip=2.0 if quick else 5.0,
        fresh_early=256 if quick else 1024,
        fresh_events=chosen(args.fresh_events, 4096, 65_536),
        fresh_singles=30 if quick else 100,
        seed=args.seed,
    )
    if config.rounds < 3:
        parser.error("--rounds must be at least 3")
    return args, config


@contextmanager
def benchmark_database(dsn: str | None) -> Iterator[Database]:
    import subengine

    with subengine.Engine(dsn) as engine:  # the embedded server when no DSN is given
        admin_dsn = engine.dsn
    database = create_database(admin_dsn, f"{DATABASE_PREFIX}{os.getpid()}")
    try:
        yield database
    finally:
        drop_database(database)


def run_rounds(context: SpawnContext, database: Database, config: Config, results: Results) -> None:
    import subengine

    large = config.partitions
    with (
        subengine.Engine(database.dsn, schema=SCHEMA) as engine,
        contextlib.ExitStack() as stack,
    ):
        by_variant = {
            v: stack.enter_context(
                Looker.open(engine, look_names(v, config.subscriptions), f"look-{v}")
            )
            for v in ("small", "large", "idle")
        }
        by_variant["poll"] = stack.enter_context(
            Looker.open(engine, look_names("idle", config.subscriptions), "look-idle", True)
        )

        def looks(variant: str) -> Callable[[int], None]:
            def run(round_: int) -> None:
                times, found = by_variant[variant].looks(config.looks, config.look_seconds)
                results.looks[variant].append(times)
                results.found[variant].add(found)
                progress(
                    f"round {round_}: look, {variant}: {statistics.median(times) * 1000:.2f} "
                    f"ms median of {len(times)}"
                )

            return run

        def fanout(partitions: int, then_latency: bool) -> Callable[[int], None]:
            def run(round_: int) -> None:
                rate, done = run_fanout(context, database, config, partitions, round_)
                results.fanout[partitions].append(rate)
                results.fanout_done[partitions].append(done)
                progress(f"round {round_}: fan-out, {partitions} partitions: {rate:,.0f} effects/s")
                if then_latency:
                    latency(large, f"{large} after load")(round_)

            return run

        def latency(partitions: int, variant: str) -> Callable[[int], None]:
            def run(round_: int) -> None:
                name = variant.replace(" ", "-")
                samples = run_latency(context, database, config, partitions, name, round_)
                results.latency[variant].append(samples)
                progress(
                    f"round {round_}: latency, {variant}: p50 "
                    f"{percentile(samples, 0.5) * 1000:.2f} ms, p99 "
                    f"{percentile(samples, 0.99) * 1000:.2f} ms"
                )

            return run

        def idle(round_: int) -> None:
            for concurrency, (rate, kinds) in run_idle(context, database, config).items():
                results.idle[concurrency].append(rate)
                results.idle_kinds[concurrency].update(kinds)
                progress(
                    f"round {round_}: idle, concurrency {concurrency}: {rate:.3f} statements/s"
                )

        variants: list[Callable[[int], None]] = [
            looks("small"),
            looks("large"),
            looks("idle"),
            looks("poll"),
            fanout(SMALL_PARTITIONS, False),
            fanout(large, True),  # then the latency at 1,024 right after it
            latency(SMALL_PARTITIONS, f"{SMALL_PARTITIONS}"),
            latency(large, f"{large}"),
            idle,
        ]
        # the after-load latency is reported after the plain ones
        results.latency[f"{SMALL_PARTITIONS}"] = []
        results.latency[f"{large}"] = []
        for round_ in range(config.rounds):
            shift = round_ % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                variant(round_)


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse_args(argv)
    import subengine

    dsn = args.dsn or os.environ.get("SUBENGINE_DSN") or None
    context = multiprocessing.get_context("spawn")
    load_before = os.getloadavg()
    started = time.monotonic()
    results = Results()
    with benchmark_database(dsn) as database:
        prepare(database, config)
        run_rounds(context, database, config, results)
        for round_ in range(config.rounds):
            results.fresh.append(fresh_round(database.admin_dsn, config, round_))
            progress(f"round {round_}: fresh database measured")
        facts = server_facts(database.dsn)
    settings = subengine.Settings.from_env()
    print()
    print(
        f"{facts}; {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after; {time.monotonic() - started:.0f} s"
    )
    print(
        f"worker settings: poll_interval {settings.poll_interval:g} s, heartbeat_interval "
        f"{settings.heartbeat_interval:g} s, progress_interval "
        f"{settings.progress_interval:g} s; batch size {config.batch_size}"
    )
    print(
        "run settings: "
        + ", ".join(f"{f.name} {getattr(config, f.name)}" for f in dataclasses.fields(config))
        + (" (--quick)" if args.quick else "")
    )
    print()
    print_report(results, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
