"""Worker processes for bench/consume.py and bench/scale.py: started together, set up and
waiting for `go`, stopped by SIGTERM; the handlers they run, a producer of live events,
and the latency and idle-cost scenarios both benchmarks measure.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import TYPE_CHECKING, Any, Literal

import psycopg
from _harness import SCHEMA
from psycopg import sql

if TYPE_CHECKING:
    import subengine

StartPoint = Literal["beginning", "end"]
STOP_TIMEOUT = 60.0
STALL_SECONDS = 120.0
LIVE_KEYS = 1000
# the application table of the INSERT handlers (and of depeche-db's); a plain string,
# not composed SQL: psycopg would render a composed query on every execute
EFFECTS = "bench_effects"
INSERT_EFFECT = "INSERT INTO bench_effects (event_id, partition, position) VALUES (%s, %s, %s)"

Connection = psycopg.Connection[Any]


# the handlers

_handler_starts: list[tuple[int, float]] = []


def ignore(event: Any, conn: Any) -> None:
    """The no-op handler."""


def insert_one(event: Any, conn: Connection) -> None:
    conn.execute(INSERT_EFFECT, (event.id, event.partition, event.position))


def insert_batch(events: Sequence[Any], conn: Connection) -> None:
    with conn.cursor() as cursor:
        cursor.executemany(INSERT_EFFECT, [(e.id, e.partition, e.position) for e in events])


def record_start(event: Any, conn: Any) -> None:
    _handler_starts.append((event.data["seq"], time.time()))


HANDLERS: dict[str, Callable[..., None]] = {
    "no-op": ignore,
    "one INSERT": insert_one,
    "record": record_start,
}


def build_app(
    handler: str, names: Sequence[str], stream: str, start: StartPoint, batch_size: int
) -> subengine.App:
    import subengine

    app = subengine.App()
    for name in names:
        subscription = app.subscription(name, stream=stream, start=start, batch_size=batch_size)
        if handler == "executemany":
            subscription.batch_handler()(insert_batch)
        else:
            subscription.handler()(HANDLERS[handler])
    return app


def ensure_subscriptions(dsn: str, names: Sequence[str], stream: str, start: StartPoint) -> None:
    """Store subscriptions before their workers start, so polls find their positions."""
    import subengine

    with subengine.Engine(dsn, schema=SCHEMA) as engine:
        for name in names:
            engine.ensure_subscription(subengine.Subscription(name, stream, start))


# the worker processes


@dataclass(frozen=True, slots=True)
class WorkerJob:
    dsn: str
    names: tuple[str, ...]
    stream: str
    start: StartPoint
    handler: str
    batch_size: int
    concurrency: int = 1
    count_statements: bool = False
    lock_provider: str | None = None  # None: the settings' (SUBENGINE_LOCK_PROVIDER)


def count_statements(kinds: list[tuple[float, str]]) -> None:
    """Record when this process sends each statement through a psycopg cursor, and its
    first words. Every query of the worker goes through `Cursor.execute` or
    `executemany`, its locks' included; BEGIN and COMMIT do not, so these are statements."""
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


def wait_for_go(go: Any) -> None:
    # Polled, not waited on: a process that dies while it waits on a multiprocessing
    # Event makes the Event's set() block for ever.
    while not go.is_set():
        time.sleep(0.001)


def worker_process(job: WorkerJob, results: Any, ready: Any, go: Any) -> None:
    """One worker process running the job's subscriptions, until SIGTERM; then it puts
    its handler starts and statements on `results`."""
    logging.basicConfig(level=logging.WARNING)
    import subengine
    import subengine.worker._worker  # run_worker imports it: done before the clock starts

    app = build_app(job.handler, job.names, job.stream, job.start, job.batch_size)
    statements: list[tuple[float, str]] = []
    if job.count_statements:
        count_statements(statements)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    settings = subengine.Settings.from_env(
        dsn=job.dsn, schema=SCHEMA, lock_provider=job.lock_provider
    )
    with subengine.Engine(settings=settings) as engine:
        ready.set()
        wait_for_go(go)
        app.run_worker(engine, list(job.names), concurrency=job.concurrency, stop=stop)
    if results is not None:
        results.put({"starts": _handler_starts, "statements": statements})


def worker_entry(job: WorkerJob, ready: Any, go: Any) -> None:
    worker_process(job, None, ready, go)


def stop_processes(processes: Sequence[SpawnProcess]) -> None:
    """SIGTERM the processes that still run (each stops cleanly on it), then join them."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(STOP_TIMEOUT)
        if process.is_alive():
            process.kill()
            process.join()


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

    def failed(self) -> bool:
        return any(p.exitcode for p in self.started)

    def finish(self) -> None:
        stop_processes(self.started)


class Stalled(RuntimeError):
    pass


def wait_for_total(
    conn: Connection,
    statement: sql.Composable,
    params: Sequence[Any],
    target: int,
    processes: Sequence[SpawnProcess] = (),
    poll: float = 0.025,
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
        time.sleep(poll)


def positions_query() -> sql.Composable:
    """The sum of the positions of the subscriptions named by the one parameter (a list)."""
    return sql.SQL(
        "SELECT coalesce(sum(position), 0) FROM {}.subscription_positions"
        " WHERE subscription = ANY (%s)"
    ).format(sql.Identifier(SCHEMA))


# the effects of the INSERT handlers


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


# latency: live events appended while one worker listens


@dataclass(frozen=True, slots=True)
class Live:
    """The measured live events: seconds from the return of each append's commit() to
    its handler's start, and from the call of that commit(); the producer's rate."""

    samples: list[float]
    from_commit_call: list[float]
    rate: float
    polls: int  # of the database, by this process


def produce(dsn: str, stream: str, total: int, rate: float, seed: int) -> Live:
    """Append `total` single-event transactions at `rate` per second (samples: the times
    each commit() was called and returned, by seq)."""
    import subengine

    rng = random.Random(seed)
    called: list[float] = []
    committed: list[float] = []
    interval = 1 / rate
    with psycopg.connect(dsn) as conn:
        started = time.perf_counter()
        for seq in range(total):
            delay = started + seq * interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            key = f"live-{rng.randrange(LIVE_KEYS):05d}"
            event = subengine.NewEvent(key, "Tick", {"seq": seq})
            subengine.append(conn, stream, [event], schema=SCHEMA)
            called.append(time.time())
            conn.commit()
            committed.append(time.time())
        achieved = total / (time.perf_counter() - started)
    return Live(committed, called, achieved, 0)


def live_latency(
    context: SpawnContext,
    dsn: str,
    stream: str,
    subscription: str,
    events: tuple[int, int],
    rate: float,
    seed: int,
    batch_size: int,
) -> Live:
    """One listening worker on `subscription` (stored, starting at the end) while
    `events` (warm-up, measured) live events are appended at `rate`."""
    warmup, measured = events
    total = warmup + measured
    job = WorkerJob(dsn, (subscription,), stream, "end", "record", batch_size)
    results = context.Queue()
    group = Processes.new(context)
    try:
        group.start(worker_process, job, results)
        with psycopg.connect(dsn, autocommit=True) as monitor:
            monitor.execute("SET max_parallel_workers_per_gather = 0")
            (base,) = monitor.execute(positions_query(), ([subscription],)).fetchone() or (0,)
            group.begin()
            time.sleep(1.0)  # the worker has looked once, found nothing, and listens
            produced = produce(dsn, stream, total, rate, seed)
            _, polls = wait_for_total(
                monitor, positions_query(), ([subscription],), base + total, group.started
            )
        stop_processes(group.started)  # the worker sends its handler times as it stops
        starts = dict(results.get(timeout=STOP_TIMEOUT)["starts"])
    finally:
        group.finish()
    seqs = range(warmup, total)
    return Live(
        [starts[seq] - produced.samples[seq] for seq in seqs],
        [starts[seq] - produced.from_commit_call[seq] for seq in seqs],
        produced.rate,
        polls + 2,  # and the SET and the base
    )


# idle cost: statements of workers with nothing to do


def idle_statements(
    context: SpawnContext, jobs: Sequence[WorkerJob], seconds: float, skip: float
) -> list[tuple[float, collections.Counter[str]]]:
    """Idle workers side by side, one per job, for `seconds`: each one's statements per
    second after its first `skip` seconds, and their kinds."""
    queues = [context.Queue() for _ in jobs]
    group = Processes.new(context)
    try:
        for job, queue in zip(jobs, queues, strict=True):
            group.start(worker_process, dataclasses.replace(job, count_statements=True), queue)
        group.begin()
        began = time.monotonic()
        time.sleep(seconds)
        ended = time.monotonic()
        stop_processes(group.started)
        reports = [queue.get(timeout=STOP_TIMEOUT) for queue in queues]
    finally:
        group.finish()
    result = []
    for report in reports:
        counted = [kind for t, kind in report["statements"] if began + skip <= t < ended]
        result.append((len(counted) / (ended - began - skip), collections.Counter(counted)))
    return result
