"""The parts of bench/scale.py timed in its own process: the worker's look for work and
the idle worker's poll, on a Worker that is never run (the only place a benchmark reaches
into the worker: adapt `one_look` and `one_poll` when the look changes), and a fresh
database growing from empty without statistics.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from typing import TYPE_CHECKING, Any

import _harness as bench
import _workers as workers
import psycopg
from _harness import SCHEMA, Database
from _workers import Processes, WorkerJob

if TYPE_CHECKING:
    import subengine
    from subengine.db._sql import Db
    from subengine.worker._worker import Worker

FRESH_STREAM = "fresh"
# The fan-out's polls of the positions read ~100,000 rows: seldom, and on one core.
POLL_SECONDS = 1.0
APPEND_BATCH = 100


def one_look(worker: Worker, db: Db) -> int:
    """The worker's look for work, once; the number of candidates it found."""
    from subengine.subscriptions._work import find_work

    found = find_work(db, list(worker.subscriptions), [], [], worker._look_limit)
    db.conn.commit()
    return len(found.work)


def one_poll(worker: Worker, db: Db) -> int:
    """The statement an idle worker sends every poll interval (the heads' sums and
    whether any partition has work; no heartbeat), once; 1 if it says there is work."""
    from subengine.subscriptions._work import poll_for_work

    registration = worker._registration()
    _, has_work = poll_for_work(
        db, registration, list(worker.subscriptions), sorted(worker.streams), False
    )
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
    sparse_events: int
    fanout_only: bool
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


# the fan-out's runs and what they cost


def fanout_stream(partitions: int, events: int, config: Config) -> str:
    return f"fan-{partitions}" + ("" if events == config.fanout_events else "-sparse")


def fanout_names(stream: str, round_: int, count: int) -> list[str]:
    return [f"{stream}-r{round_}-{n:03d}" for n in range(count)]


def monitor(dsn: str) -> psycopg.Connection[Any]:
    """This script's connection for polls, kept to one core: the workers need the others."""
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("SET max_parallel_workers_per_gather = 0")
    return conn


def total_position(conn: psycopg.Connection[Any], names: Sequence[str]) -> int:
    row = conn.execute(workers.positions_query(), (list(names),)).fetchone()
    return int(row[0]) if row else 0


def run_fanout(
    context: SpawnContext, database: Database, config: Config, partitions: int, events: int,
    round_: int,
) -> FanoutRun:  # fmt: skip
    """Effects/s of the processes over the window, whether they consumed everything, and
    the CPU they and the server used."""
    stream = fanout_stream(partitions, events, config)
    names = fanout_names(stream, round_, config.subscriptions)
    workers.ensure_subscriptions(database.dsn, names, stream, "beginning")
    job = WorkerJob(database.dsn, tuple(names), stream, "beginning", "no-op", config.batch_size)
    target = events * len(names)
    group = Processes.new(context)
    cpu = cpu_meter(database.dsn)
    cpu_before = cpu()
    try:
        for _ in range(config.processes):
            group.start(workers.worker_entry, job)
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
    workers_after, server_after = cpu()
    server = None if server_after is None else server_after - (cpu_before[1] or 0.0)
    used = (workers_after - cpu_before[0], server, os.getloadavg()[0])
    if done and closed == opened:  # finished within the warm-up: rate over the whole run
        return FanoutRun(last / max(closed - began, 1e-9), True, *used)
    return FanoutRun((last - first) / (closed - opened), done, *used)


@dataclass(frozen=True, slots=True)
class FanoutRun:
    """One fan-out run: effects/s, whether everything was consumed, the CPU seconds its
    worker processes and the PostgreSQL server used (None: not a local server this user
    may read), and the 1-minute load average at its end."""

    rate: float
    done: bool
    worker_cpu: float
    server_cpu: float | None
    load: float


def cpu_meter(dsn: str) -> Callable[[], tuple[float, float | None]]:
    """A clock of CPU seconds: of this process's reaped children (the worker processes
    once they are joined) and of the PostgreSQL server, when it runs on this machine and
    its processes are readable (its postmaster, its live processes and those it reaped)."""
    with psycopg.connect(dsn) as conn:  # read while its backend lives
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        backend = _stat(int(row[0])) if row else None
    postmaster = backend[1] if backend else None
    ticks = os.sysconf("SC_CLK_TCK")

    def server() -> float | None:
        if postmaster is None:
            return None
        own = _stat(postmaster)
        if own is None:
            return None
        total = sum(own[2:6])  # its utime, stime and its reaped children's
        for entry in os.scandir("/proc"):
            child = _stat(int(entry.name)) if entry.name.isdigit() else None
            if child is not None and child[1] == postmaster:
                total += child[2] + child[3]
        return total / ticks

    def now() -> tuple[float, float | None]:
        times = os.times()
        return times.children_user + times.children_system, server()

    return now


def _stat(pid: int) -> tuple[int, int, int, int, int, int] | None:
    """(pid, parent, utime, stime, cutime, cstime) of a process; None if it is gone or
    unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return pid, int(fields[1]), *(int(f) for f in fields[11:15])  # type: ignore[return-value]


def print_fanout(
    fanout: dict[tuple[int, int], list[FanoutRun]], small: int, large: int
) -> dict[int, float]:
    """Each density's rates, CPU and load, and its ratio of `large` to `small` partitions
    per round; the ratios' medians by events per subscription."""
    ratios: dict[int, float] = {}
    for events in sorted({events for _, events in fanout}, reverse=True):
        print(f"  {events:,} events per subscription:")
        for partitions in (small, large):
            runs = fanout[partitions, events]
            rate = bench.Spread.of([r.rate for r in runs])
            done = sum(r.done for r in runs)
            note = f"; consumed everything in {done} round(s)" if done else ""
            print(f"    {partitions:>5} partitions: {rate.text(0, ' effects/s', count=True)}{note}")
            cpu = bench.Spread.of([r.worker_cpu for r in runs])
            served = [r.server_cpu for r in runs if r.server_cpu is not None]
            server = f", server {bench.Spread.of(served).span(1, 1)}" if served else ""
            loads = bench.Spread.of([r.load for r in runs]).span(1, 1)
            print(f"    {'':>5}  CPU s per run: workers {cpu.span(1, 1)}{server}; load {loads}")
        per_round = [
            b.rate / a.rate
            for a, b in zip(fanout[small, events], fanout[large, events], strict=True)
        ]
        ratio = bench.Spread.of(per_round)
        ratios[events] = ratio.median
        print(f"    {large} / {small}, per round: {ratio.text(4, count=True)}")
    return ratios


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
        from subengine.db._sql import Db
        from subengine.subscriptions._work import prepare_worker_connection
        from subengine.worker._worker import Worker

        app = subengine.App()
        for name in names:
            app.subscription(name, stream=stream).handler()(workers.ignore)
        worker = Worker(engine, [app.subscriptions[name] for name in names], concurrency=1)
        with engine.connect() as conn:
            db = Db(conn, engine.sql)
            # as a slot's lock connection, where the worker looks, or its poller's
            prepare_worker_connection(db)
            conn.commit()
            yield cls(worker, conn, db, poll)

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


@dataclass(frozen=True, slots=True)
class FreshStep:
    label: str
    events: int
    looks: list[float]  # seconds
    found: int
    singles_per_second: float
    batch_per_second: float | None  # the appends that grew the stream to this step


# a fresh database


class FreshGrowth:
    """A fresh database's stream as it grows, measured step by step."""

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
        count, rng = to - self.events, self.rng
        seconds = bench.append_orders(
            self.engine, FRESH_STREAM, count, rng, lambda _: rng.choice(self.keys), APPEND_BATCH
        )
        self.events = to
        return count / max(seconds, 1e-9)

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


def fresh_round(admin_dsn: str, config: Config, round_: int, prefix: str) -> list[FreshStep]:
    """The looks and append rates of a new database as it grows from empty: one Engine
    and one look connection from the first step to the last, so that plans cached early
    stay, as in a worker started on an empty database."""
    import subengine

    database = bench.create_database(admin_dsn, f"{prefix}{os.getpid()}_fresh{round_}")
    names = [f"fresh-{n:03d}" for n in range(config.subscriptions)]
    try:
        with (
            subengine.Engine(database.dsn, schema=SCHEMA) as engine,
            psycopg.connect(database.dsn, autocommit=True) as admin,
        ):
            engine.migrate()
            bench.autovacuum_off(admin)  # only this script analyses
            engine.create_stream(FRESH_STREAM, config.partitions)
            workers.ensure_subscriptions(database.dsn, names, FRESH_STREAM, "beginning")
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
        bench.drop_database(database)
    return growth.steps


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
        looks = bench.Spread.of([statistics.median(s.looks) * 1000 for s in step])
        singles = bench.Spread.of([s.singles_per_second for s in step])
        batch_rates = [s.batch_per_second for s in step if s.batch_per_second is not None]
        batch = bench.Spread.of(batch_rates) if batch_rates else None
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
