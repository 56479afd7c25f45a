"""How fast subengine's worker consumes, next to a plain psycopg loop and depeche-db: the
throughput of no-op, one-INSERT and executemany handlers over a backlog (1 and 2
processes), with each partition lock provider (pals, the default; builtin; rows), the
latency from an append's commit to its handler, and an idle worker's statements per
second. The README's performance section explains each figure.

    .venv/bin/python bench/consume.py            # about 6 minutes on 2 cores
    .venv/bin/python bench/consume.py --quick    # about a minute, for a smoke test
    .venv/bin/python bench/consume.py --providers pals,builtin   # some providers only
    .venv/bin/python bench/consume.py --dsn postgresql://...   # or set SUBENGINE_DSN

Every run creates a database of its own (`bench_consume_<pid>`) and drops it at the end.
depeche-db conflicts with subengine's dependencies, so it runs in an interpreter of its
own, given with `--depeche-python`; make one with

    python3 -m venv /tmp/depeche-env
    /tmp/depeche-env/bin/pip install 'depeche-db[psycopg]==0.13.*' 'sqlalchemy<2.1' \
        pydantic sniffio

Without depeche-db the script says so and leaves its rows out.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from typing import Any

import _depeche
import _harness as bench
import _workers as workers
import psycopg
from _harness import Database, Spread, progress, verdict
from _workers import Live, Processes, WorkerJob
from psycopg import sql

from subengine.model._settings import LOCK_PROVIDERS

STREAM = "bench"
LIVE_STREAM = "bench-live"
KEYS = 1000
HANDLERS = ("no-op", "one INSERT", "executemany")
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
PLAIN_DONE = "SELECT sum(position) FROM bench_plain_positions WHERE subscription = ANY (%s)"
# handler, goal for the worker / plain loop ratio, and whether only the most processes
# are judged (the others are for reading)
PLAIN_GOALS = (("no-op", 0.9, True), ("one INSERT", 0.35, True), ("executemany", 0.7, False))
NO_OP_RATE_GOAL = 100_000  # the no-op handler's rate with the most processes
WORKER = "subengine worker"
DEFAULT_PROVIDER = "pals"  # Settings.lock_provider's default: the runner the goals judge


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
    providers: tuple[str, ...]


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


Runner = Callable[[SpawnContext, Database, "Config", str, int, int], Throughput]


def variants(rows: Sequence[Throughput]) -> list[Variant]:
    """The rows grouped by scenario, in the order each scenario first ran."""
    grouped: dict[tuple[str, str, int], list[Throughput]] = {}
    for r in rows:
        grouped.setdefault((r.runner, r.handler, r.processes), []).append(r)
    return [Variant(*key, tuple(group)) for key, group in grouped.items()]


@dataclass(frozen=True, slots=True)
class Idle:
    statements_per_second: float  # counted in the worker process, after its start
    per_second: float  # transactions, pg_stat_database
    baseline_per_second: float
    short_run: int
    long_run: int
    seconds: float


# the benchmark database


def prepare(database: Database, config: Config) -> float:
    """subengine's schema and streams, the application's tables and the backlog (in
    transactions of 1,000 events); the seconds the backlog took."""
    import subengine

    with psycopg.connect(database.dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE bench_effects (event_id uuid PRIMARY KEY, partition int, position bigint)"
        )
        conn.execute(
            "CREATE TABLE bench_plain_positions (subscription text, partition int,"
            " position bigint NOT NULL, PRIMARY KEY (subscription, partition))"
        )
    rng = random.Random(config.seed)
    keys = bench.order_keys(KEYS)
    with subengine.Engine(database.dsn, schema=bench.SCHEMA) as engine:
        engine.create_stream(STREAM, config.partitions)
        engine.create_stream(LIVE_STREAM, config.partitions)
        return bench.append_orders(engine, STREAM, config.backlog, rng, lambda _: rng.choice(keys))


# throughput: subengine's worker and the plain loop


def timed_run(
    context: SpawnContext,
    database: Database,
    config: Config,
    target: Callable[..., None],
    jobs: Sequence[Any],
    done_query: sql.Composable | str,
    name: str,
    runner: str,
    handler: str,
) -> Throughput:
    """Start one process per job, time them until `done_query` reaches the backlog."""
    workers.truncate_effects(database.dsn)
    group = Processes.new(context)
    # read before the processes connect: connecting costs no transaction
    before = bench.settled_xacts(database)
    try:
        for job in jobs:
            group.start(target, job)
        with psycopg.connect(database.dsn, autocommit=True) as monitor:
            started = group.begin()
            finished, polls = workers.wait_for_total(
                monitor, done_query, ([name],), config.backlog, group.started
            )
    finally:
        group.finish()
    xacts = bench.settled_xacts(database) - before - polls
    note = workers.check_effects(database.dsn, config.backlog) if handler != "no-op" else ""
    return Throughput(runner, handler, len(jobs), config.backlog, finished - started, xacts, note)


def subengine_runner(provider: str) -> Runner:
    """The worker with the partition locks of `provider` (docs/pooler.md); the default
    provider's runner is "subengine worker", which the goals judge."""
    label = WORKER if provider == DEFAULT_PROVIDER else f"{WORKER}, {provider}"

    def run_subengine(
        context: SpawnContext, database: Database, config: Config, handler: str,
        processes: int, round_: int,
    ) -> Throughput:  # fmt: skip
        name = f"throughput-{handler.replace(' ', '-')}-{provider}-{processes}-{round_}"
        workers.ensure_subscriptions(database.dsn, [name], STREAM, "beginning")
        job = WorkerJob(
            database.dsn, (name,), STREAM, "beginning", handler, config.batch_size,
            lock_provider=provider,
        )  # fmt: skip
        return timed_run(
            context, database, config, workers.worker_entry, [job] * processes,
            workers.positions_query(), name, label, handler,
        )  # fmt: skip

    return run_subengine


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
        workers.wait_for_go(go)
        for partition in job.partitions:
            while True:
                row = conn.execute(PLAIN_LOCK, (job.name, partition)).fetchone()
                old = row[0] if row else 0
                rows = conn.execute(PLAIN_READ, (STREAM, partition, old, job.batch_size)).fetchall()
                if job.handler == "one INSERT":
                    for event in rows:
                        conn.execute(workers.INSERT_EFFECT, (event[0], event[2], event[3]))
                elif job.handler == "executemany" and rows:
                    with conn.cursor() as cursor:
                        cursor.executemany(
                            workers.INSERT_EFFECT, [(e[0], e[2], e[3]) for e in rows]
                        )
                if rows:
                    conn.execute(PLAIN_UPDATE, (rows[-1][3], job.name, partition))
                conn.commit()
                if len(rows) < job.batch_size:
                    break


def run_plain(
    context: SpawnContext, database: Database, config: Config, handler: str, processes: int,
    round_: int,
) -> Throughput:  # fmt: skip
    name = f"plain-{handler.replace(' ', '-')}-{processes}-{round_}"
    with psycopg.connect(database.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO bench_plain_positions SELECT %s, p, 0 FROM generate_series(0, %s) AS p",
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
        context, database, config, plain_process, jobs, PLAIN_DONE, name,
        "plain psycopg loop", handler,
    )  # fmt: skip


def measure_throughput(
    context: SpawnContext, database: Database, config: Config, skip: Sequence[str]
) -> list[Throughput]:
    """Every scenario, `config.rounds` times, each round in an order rotated by one."""
    runners = [subengine_runner(p) for p in config.providers]
    runners += [] if "plain" in skip else [run_plain]
    scenarios = [
        (handler, runner, processes)
        for handler in HANDLERS
        for runner in runners
        for processes in config.processes
    ]
    rows = []
    for round_, (handler, runner, processes) in bench.rotating(scenarios, config.rounds):
        row = runner(context, database, config, handler, processes, round_)
        progress(
            f"round {round_ + 1}: {row.runner}, {handler}, {processes} proc: {row.rate:,.0f} msgs/s"
        )
        rows.append(row)
    return rows


def run_depeche(python: str, database: Database, config: Config) -> list[Throughput] | str:
    """depeche-db's rows, from a child interpreter; or why there are none."""
    report = _depeche.run_child(
        python, database, config.depeche_backlog, config.partitions, config.batch_size,
        list(config.processes), config.seed,
    )  # fmt: skip
    if isinstance(report, str):
        return report
    progress(f"depeche-db backlog written and projected in {report['write_seconds']:.1f} s")
    return [Throughput(**row) for row in report["rows"]]


# latency and idle cost


def run_latency(context: SpawnContext, database: Database, config: Config) -> tuple[Live, float]:
    """The live events' latencies, and the worker's transactions per event."""
    name = "latency"
    workers.ensure_subscriptions(database.dsn, [name], LIVE_STREAM, "end")
    before = bench.settled_xacts(database)
    live = workers.live_latency(
        context, database.dsn, LIVE_STREAM, name,
        (config.latency_warmup, config.latency_events), config.latency_rate, config.seed + 1,
        config.batch_size,
    )  # fmt: skip
    total = config.latency_warmup + config.latency_events
    # the producer's appends are one transaction each
    worker_xacts = bench.settled_xacts(database) - before - live.polls - total
    return live, worker_xacts / total


def run_idle(context: SpawnContext, database: Database, config: Config) -> Idle:
    """Statements of one idle worker, counted in it, and the database's transactions of
    a short and a long idle run (their difference cancels start and stop)."""
    name = "idle"
    with psycopg.connect(database.dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        bench.autovacuum_off(conn, None)  # autovacuum's transactions count too
    workers.ensure_subscriptions(database.dsn, [name], STREAM, "end")
    job = WorkerJob(database.dsn, (name,), STREAM, "end", "no-op", config.batch_size)
    short_seconds, extra = config.idle_short_seconds, config.idle_seconds
    before = bench.settled_xacts(database)
    time.sleep(extra)
    baseline = bench.settled_xacts(database) - before
    runs = []
    for seconds, skip in ((short_seconds, 0.0), (short_seconds + extra, short_seconds)):
        before = bench.settled_xacts(database)
        [(statements, _)] = workers.idle_statements(context, [job], seconds, skip)
        runs.append(bench.settled_xacts(database) - before)
    short, long = runs
    return Idle(statements, (long - short - baseline) / extra, baseline / extra, short, long, extra)


# output


def find(found: Sequence[Variant], runner: str, handler: str, processes: int) -> Variant | None:
    for v in found:
        if (v.runner, v.handler, v.processes) == (runner, handler, processes):
            return v
    return None


def plain_ratio(found: Sequence[Variant], variant: Variant) -> float | None:
    """A worker scenario's median rate over the plain loop's, same handler and processes."""
    if not variant.runner.startswith(WORKER):
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


def goal_ratios(
    found: Sequence[Variant], depeche: list[Throughput] | str, most: int
) -> list[tuple[str, float, float]]:
    """Worker / plain loop (medians) per handler and process count, and worker /
    depeche-db, with their goals (0: none)."""
    ratios = []
    for handler, goal, only_most in PLAIN_GOALS:
        for processes in sorted({v.processes for v in found}):
            ours = find(found, "subengine worker", handler, processes)
            ratio = None if ours is None else plain_ratio(found, ours)
            if ratio is None:
                continue
            label = f"{handler}, {processes} proc: worker / plain loop"
            ratios.append((label, ratio, goal if not only_most or processes == most else 0.0))
    if not ratios:
        print("  worker vs plain loop: not measured (--skip plain)")
    ours = find(found, "subengine worker", "one INSERT", most)
    if isinstance(depeche, list) and depeche and ours is not None:
        theirs = max(depeche, key=lambda r: (r.processes == most, r.processes))
        ratios.append(
            (f"one INSERT, {most} proc: worker / depeche-db ({theirs.processes} proc)",
             ours.rate.median / theirs.rate, 10.0)
        )  # fmt: skip
    return ratios


def print_goals(
    found: Sequence[Variant], depeche: list[Throughput] | str, latency: Live, idle: Idle,
    config: Config,
) -> None:  # fmt: skip
    most = max(config.processes)
    print(f"goals (medians of {config.rounds} rounds)")
    no_op = find(found, "subengine worker", "no-op", most)
    if no_op is not None:
        rate = no_op.rate.median
        print(
            f"  {f'no-op, {most} proc: worker msgs/s':<58} {rate:8,.0f}  "
            f"(goal >= {NO_OP_RATE_GOAL:,})  {verdict(rate >= NO_OP_RATE_GOAL)}"
        )
    for label, ratio, goal in goal_ratios(found, depeche, most):
        judged = f"(goal >= {goal:g})  {verdict(ratio >= goal)}" if goal else "(no goal)"
        print(f"  {label:<58} {ratio:8.3f}  {judged}")
    if isinstance(depeche, str):
        print(f"  one INSERT vs depeche-db: not measured: {depeche}")
    p50, p99 = (bench.percentile(latency.samples, f) * 1000 for f in (0.5, 0.99))
    print(f"  {'latency p50 (ms)':<58} {p50:8.2f}  (goal <= 3)  {verdict(p50 <= 3)}")
    print(f"  {'latency p99 (ms)':<58} {p99:8.2f}  (goal <= 15)  {verdict(p99 <= 15)}")
    rate = idle.statements_per_second
    print(f"  {'idle worker, queries/s':<58} {rate:8.2f}  (goal <= 1)  {verdict(rate <= 1)}")


def print_latency(latency: Live, xacts_per_event: float, config: Config) -> None:
    ms = [s * 1000 for s in latency.samples]
    p50, p95, p99 = (bench.percentile(ms, f) for f in (0.5, 0.95, 0.99))
    print(
        f"latency, append commit -> handler start, {len(ms):,} events after "
        f"{config.latency_warmup} warm-up, producer at {latency.rate:.0f} events/s, "
        "1 worker process:"
    )
    print(
        f"  p50 {p50:.2f} ms   p95 {p95:.2f} ms   p99 {p99:.2f} ms"
        f"   max {max(ms):.2f} ms   min {min(ms):.2f} ms   mean {statistics.fmean(ms):.2f} ms"
    )
    bound = latency.from_commit_call
    print(
        f"  from the call of commit() instead (an upper bound): p50 "
        f"{bench.percentile(bound, 0.5) * 1000:.2f} ms   p99 "
        f"{bench.percentile(bound, 0.99) * 1000:.2f} ms; handler before commit() returned: "
        f"{sum(1 for s in latency.samples if s < 0)} events"
    )
    print(f"  worker transactions per live event: {xacts_per_event:.1f}")


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


def parse_args(argv: Sequence[str] | None) -> tuple[Any, Config]:
    parser = bench.arguments(
        "Benchmark subengine's worker against a plain psycopg loop and depeche-db."
    )
    add = parser.add_argument
    add("--backlog", type=int, help="events in the backlog (100000)")
    add("--depeche-backlog", type=int, help="depeche-db's backlog (10000)")
    add("--depeche-python", default=sys.executable, help="depeche-db's Python")
    add("--partitions", type=int, default=8, help="partitions (8)")
    add("--batch-size", type=int, default=100, help="events per batch (100)")
    add("--latency-events", type=int, help="measured live events (2000)")
    add("--latency-rate", type=float, default=200.0, help="events/s (200)")
    add("--idle-seconds", type=float, help="measured idle seconds (20)")
    add("--seed", type=int, default=20261122, help="seed of the event data")
    add("--skip", action="append", default=[], choices=("depeche", "plain"))
    add(
        "--providers", default=",".join(LOCK_PROVIDERS),
        help=f"the partition lock providers to run the worker with ({','.join(LOCK_PROVIDERS)})",
    )  # fmt: skip
    args = bench.parse(parser, argv)
    providers = tuple(p for p in args.providers.split(",") if p)
    if not providers or set(providers) - set(LOCK_PROVIDERS) or DEFAULT_PROVIDER not in providers:
        parser.error(
            f"--providers: some of {', '.join(LOCK_PROVIDERS)}, {DEFAULT_PROVIDER} among them"
        )
    config = Config(
        backlog=bench.sized(args, "backlog", 5_000, 100_000),
        depeche_backlog=bench.sized(args, "depeche_backlog", 1_000, 10_000),
        partitions=args.partitions,
        batch_size=args.batch_size,
        processes=(1, 2),
        rounds=args.rounds,
        latency_events=bench.sized(args, "latency_events", 300, 2_000),
        latency_warmup=50 if args.quick else 200,
        latency_rate=args.latency_rate,
        idle_seconds=bench.sized(args, "idle_seconds", 4.0, 20.0),
        idle_short_seconds=2.0 if args.quick else 5.0,
        seed=args.seed,
        providers=providers,
    )
    return args, config


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse_args(argv)
    import subengine

    context = multiprocessing.get_context("spawn")
    load_before = os.getloadavg()[0]
    with bench.benchmark_database(bench.dsn_of(args), "bench_consume_", migrate=True) as database:
        seconds = prepare(database, config)
        progress(f"appended {config.backlog:,} events in {seconds:.1f} s")
        rows = measure_throughput(context, database, config, args.skip)
        depeche: list[Throughput] | str = "skipped (--skip depeche)"
        if "depeche" not in args.skip:
            depeche = run_depeche(args.depeche_python, database, config)
        latency, xacts_per_event = run_latency(context, database, config)
        progress("latency measured")
        idle = run_idle(context, database, config)
        progress("idle cost measured")
        facts = bench.server_facts(database.dsn)
    settings = subengine.Settings.from_env()
    print()
    print(bench.machine(facts, load_before))
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
    print_throughput(variants([*rows, *(depeche if isinstance(depeche, list) else [])]))
    if isinstance(depeche, str):
        print(depeche)
    print()
    print_latency(latency, xacts_per_event, config)
    print()
    print_idle(idle, config)
    print()
    print_goals(variants(rows), depeche, latency, idle, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
