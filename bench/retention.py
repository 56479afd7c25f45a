"""How fast retention prunes a large stream, and what pruning costs the appends beside it:
prune rates per batch size, single-event appends with and without a pruner process at
work (rate and p99 against the no-pruning figures of the same run), and what a batched
DELETE and VACUUM cost against dropping a table. The README's performance section
explains each figure.

    .venv/bin/python bench/retention.py            # 3 to 6 minutes on 2 cores
    .venv/bin/python bench/retention.py --quick    # 500,000 events, under a minute
    .venv/bin/python bench/retention.py --dsn postgresql://...   # or set SUBENGINE_DSN

It works in a scratch schema (`--schema`, default `bench_retention`), dropped and migrated
on every run (never one it did not make). The stream is filled by one INSERT ... SELECT
with the rows appends would store, only faster.
"""

from __future__ import annotations

import gc
import inspect
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import _harness as bench
import psycopg
from _harness import Spread
from psycopg import sql

import subengine
from subengine import NewEvent, Retention, partition_for

STREAM = "bench-retained"
OTHER_STREAM = "bench-other"  # pruned beside appends to STREAM: contention without locks
DROP_TABLES = ("bench_delete_me", "bench_drop_me")
# The fixed part of the filled events' ids (UUIDv7 layout), one per stream or table.
ID_PREFIXES = {
    STREAM: "01940000-0000-7000-8001-",
    OTHER_STREAM: "01940000-0000-7000-8002-",
    DROP_TABLES[0]: "01940000-0000-7000-8003-",
    DROP_TABLES[1]: "01940000-0000-7000-8004-",
}
FILL_KEYS_PER_PARTITION = 1000
LIVE_KEYS = 1000
DELETE_BATCH = 5000
# A pruning window lasts as long as its prune; this only bounds a pathological one.
PRUNING_WINDOW_LIMIT = 120.0
# Goals of the issue: appends beside pruning against appends without it.
RATE_GOAL = 0.9
P99_GOAL = 2.0

Connection = psycopg.Connection[Any]


@dataclass(frozen=True, slots=True)
class Config:
    events: int
    partitions: int
    batches: tuple[int, ...]
    rounds: int
    slice: int
    window: float
    window_slice: int
    drop_rows: int
    seed: int


@dataclass(slots=True)
class AppendRound:
    appends: int
    seconds: float
    pruned: int = 0
    pruning_seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.appends / self.seconds


@dataclass(slots=True)
class AppendVariant:
    name: str
    batch: int
    pruner: Pruner | None  # None: no pruning
    rounds: list[AppendRound] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


# filling


FILL = """
INSERT INTO {table} (stream, partition, position, id, key, key_version, type, data,
                     metadata, occurred_at, recorded_at)
SELECT %(stream)s, k.partition, g.n / %(partitions)s + 1,
       -- time-ordered like subengine's default ids: each insert lands at the index's end
       (%(id_prefix)s || lpad(to_hex(g.n), 12, '0'))::uuid, k.key,
       g.n / %(partitions)s / %(keys)s + 1,
       'OrderPlaced',
       jsonb_build_object('order', k.key, 'customer', 'customer-' || (g.n %% 100000),
                          'sku', 'SKU-' || lpad((g.n %% 50000)::text, 5, '0'),
                          'quantity', 1 + g.n %% 5, 'unit_price', '12.34',
                          'currency', 'EUR', 'channel', 'web'),
       '{{"source": "bench"}}'::jsonb,
       %(start)s::timestamptz + (g.n / %(partitions)s) * interval '1 microsecond',
       %(start)s::timestamptz + (g.n / %(partitions)s) * interval '1 microsecond'
  FROM generate_series(0, %(events)s - 1) AS g(n)
  JOIN fill_keys k
    ON k.partition = g.n %% %(partitions)s
   AND k.slot = g.n / %(partitions)s %% %(keys)s
"""


def fill(
    conn: Connection, schema: str, table: str, stream: str, events: int, partitions: int
) -> None:
    """`events` rows of `stream` in `table`, round robin over the partitions: what
    appends of single events would store (see the module's docstring)."""
    conn.execute(
        "CREATE TEMPORARY TABLE IF NOT EXISTS fill_keys"
        " (partition int, slot int, key text, PRIMARY KEY (partition, slot))"
    )
    conn.execute("TRUNCATE fill_keys")
    slots: dict[int, int] = {}
    rows: list[tuple[int, int, str]] = []
    n = 0
    while len(rows) < partitions * FILL_KEYS_PER_PARTITION:
        key = f"old-{n}"
        partition = partition_for(key, partitions)
        if slots.get(partition, 0) < FILL_KEYS_PER_PARTITION:
            rows.append((partition, slots.get(partition, 0), key))
            slots[partition] = slots.get(partition, 0) + 1
        n += 1
    with conn.cursor() as cursor:
        cursor.executemany("INSERT INTO fill_keys VALUES (%s, %s, %s)", rows)
    conn.execute(
        sql.SQL(FILL).format(table=sql.Identifier(schema, table)),
        {
            "stream": stream,
            "partitions": partitions,
            "keys": FILL_KEYS_PER_PARTITION,
            "events": events,
            "start": "2026-01-01T00:00:00Z",
            "id_prefix": ID_PREFIXES[stream if table == "events" else table],
        },
    )


def set_heads(conn: Connection, schema: str, stream: str) -> None:
    conn.execute(
        sql.SQL(
            "UPDATE {partitions} p SET head = e.head, head_time = e.head_time"
            "  FROM (SELECT partition, max(position) AS head, max(recorded_at) AS head_time"
            "          FROM {events} WHERE stream = %s GROUP BY partition) e"
            " WHERE p.stream = %s AND p.partition = e.partition"
        ).format(
            partitions=sql.Identifier(schema, "partitions"),
            events=sql.Identifier(schema, "events"),
        ),
        (stream, stream),
    )


def autovacuums(conn: Connection, schema: str) -> int:
    row = conn.execute(
        "SELECT autovacuum_count FROM pg_stat_user_tables"
        " WHERE schemaname = %s AND relname = 'events'",
        (schema,),
    ).fetchone()
    return int(row[0]) if row else 0


# pruning


class Pruner:
    """Lowers the stream's max_events by a slice per partition and prunes it."""

    def __init__(self, engine: subengine.Engine, stream: str, partitions: int, events: int) -> None:
        self.engine = engine
        self.stream = stream
        self.keep = events // partitions  # per partition; the stream holds that many now

    def lower(self, slice_: int) -> None:
        """Lower the policy so that the next run removes `slice_` events per partition."""
        self.keep -= slice_
        if self.keep < 1:
            raise SystemExit("bench/retention.py: the stream ran out of events; use --events")
        self.engine.set_retention(self.stream, Retention(max_events=self.keep))

    def prune(self, slice_: int, batch: int) -> tuple[int, float]:
        """Remove the oldest `slice_` events of every partition, in this process;
        (removed, seconds)."""
        self.lower(slice_)
        gc.collect()
        started = time.perf_counter()
        run = self.engine.run_retention(self.stream, batch=batch)
        elapsed = time.perf_counter() - started
        if run.locked:
            raise SystemExit("bench/retention.py: another pruner holds the retention lock")
        return run.removed, elapsed

    def start_elsewhere(self, slice_: int, batch: int) -> subprocess.Popen[str]:
        """A pruner process, as a worker or `subengine retention run` is (a thread of the
        appending process would compete with the appends for the GIL), connected and
        waiting for a line on its stdin to remove the next `slice_` events per partition;
        it then prints what it removed, the seconds and whether the lock was taken."""
        self.lower(slice_)
        process = subprocess.Popen(
            [sys.executable, "-c", PRUNE_PROCESS, self.stream, str(batch)],
            env={
                **os.environ,
                "SUBENGINE_DSN": self.engine.dsn,
                "SUBENGINE_SCHEMA": self.engine.schema,
            },
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        if process.stdout.readline().strip() != "ready":
            raise SystemExit("bench/retention.py: the pruner process did not start")
        return process


PRUNE_PROCESS = """
import sys, time, subengine
stream, batch = sys.argv[1], int(sys.argv[2])
with subengine.Engine() as engine:
    engine.streams()
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.perf_counter()
    run = engine.run_retention(stream, batch=batch)
    print(run.removed, time.perf_counter() - started, int(run.locked), flush=True)
"""


def append_window(
    engine: subengine.Engine, variant: AppendVariant, config: Config, rng: random.Random
) -> None:
    """One round of a variant: appends for the window without pruning, or for as long as
    the pruner takes to remove its slice (at most PRUNING_WINDOW_LIMIT seconds)."""
    pruner = variant.pruner
    keys = [f"live-{n}" for n in range(LIVE_KEYS)]
    pruned: list[tuple[int, float]] = []
    finished = threading.Event()

    def prune(process: subprocess.Popen[str]) -> None:
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write("go\n")
            process.stdin.flush()
            removed, seconds, locked = process.stdout.readline().split()
            if int(locked):
                raise SystemExit("bench/retention.py: another pruner holds the retention lock")
            pruned.append((int(removed), float(seconds)))
        finally:
            finished.set()
            process.wait()

    thread = None
    window = config.window
    if pruner is not None:
        process = pruner.start_elsewhere(config.window_slice, variant.batch)
        thread = threading.Thread(target=prune, args=(process,))
        window = PRUNING_WINDOW_LIMIT
    clock = time.perf_counter
    latencies = []
    gc.collect()
    started = clock()
    if thread is not None:
        thread.start()
    deadline = started + window
    while not finished.is_set():
        before = clock()
        if before >= deadline:
            break
        engine.append(STREAM, [NewEvent(rng.choice(keys), "Live", {"at": before})])
        latencies.append(clock() - before)
    elapsed = clock() - started
    if thread is not None:
        thread.join()
    round_ = AppendRound(len(latencies), elapsed)
    if pruned:
        round_.pruned, round_.pruning_seconds = pruned[0]
    variant.rounds.append(round_)
    variant.latencies.extend(latencies)


# delete or drop


def delete_or_drop(engine: subengine.Engine, rows: int, partitions: int) -> dict[str, float]:
    schema = engine.schema
    times: dict[str, float] = {}
    with psycopg.connect(engine.dsn, autocommit=True) as conn:
        for table in DROP_TABLES:
            conn.execute(
                sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(
                    sql.Identifier(schema, table), sql.Identifier(schema, "events")
                )
            )
            fill(conn, schema, table, STREAM, rows, partitions)
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, table)))
        delete = sql.SQL(
            "DELETE FROM {} WHERE stream = %s AND partition = %s"
            " AND position >= %s AND position < %s"
        ).format(sql.Identifier(schema, DROP_TABLES[0]))
        started = time.perf_counter()
        per_partition = -(-rows // partitions)
        deleted = 0
        for partition in range(partitions):
            for start in range(1, per_partition + 1, DELETE_BATCH):
                cursor = conn.execute(delete, (STREAM, partition, start, start + DELETE_BATCH))
                deleted += cursor.rowcount
        times["delete"] = time.perf_counter() - started
        if deleted != rows:
            raise SystemExit(f"bench/retention.py: deleted {deleted:,} rows, not {rows:,}")
        started = time.perf_counter()
        conn.execute(sql.SQL("VACUUM {}").format(sql.Identifier(schema, DROP_TABLES[0])))
        times["vacuum"] = time.perf_counter() - started
        started = time.perf_counter()
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(schema, DROP_TABLES[1])))
        times["drop"] = time.perf_counter() - started
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(schema, DROP_TABLES[0])))
    return times


# output


def print_report(
    config: Config,
    facts: str,
    fill_seconds: float,
    prune_rates: dict[int, list[float]],
    variants: list[AppendVariant],
    drop: dict[str, float],
    vacuum: tuple[int, float],
    autovacuum_runs: int,
) -> None:
    print(facts)
    print(
        f"{config.events:,} events in {config.partitions} partitions, filled by "
        f"INSERT ... SELECT in {fill_seconds:.1f} s (with ANALYZE); {config.rounds} rounds "
        f"in rotating order; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print()
    print(
        f"prune rate alone, {config.slice:,} events per partition per run "
        f"({config.slice * config.partitions:,} per run), events/s, median (min, max):"
    )
    for batch, rates in prune_rates.items():
        default = "  (the default)" if batch == subengine_default_batch() else ""
        print(f"  batch {batch:>6,}: {Spread.of(rates).text()}{default}")
    print()
    plain = variants[0]
    plain_rate = Spread.of([r.rate for r in plain.rounds])
    plain_p99 = bench.percentile(plain.latencies, 0.99)
    print(
        f"single-event appends for up to {config.window:.0f} s per round, beside a pruner "
        f"removing {config.window_slice:,} events per partition or not "
        f"(goals: rate >= {RATE_GOAL}x, p99 <= {P99_GOAL}x the no-pruning figures):"
    )
    header = (
        f"  {'variant':<22} {'appends/s, median (min, max)':<34} {'ratio':>6} {'goal':<11}"
        f" {'p50 ms':>7} {'p99 ms':>7} {'ratio':>6} {'goal':<11} {'pruned/s':>9} {'coverage':>8}"
    )
    print(header)
    for variant in variants:
        rate = Spread.of([r.rate for r in variant.rounds])
        p50 = bench.percentile(variant.latencies, 0.5)
        p99 = bench.percentile(variant.latencies, 0.99)
        if variant.pruner is None:
            rate_goal = p99_goal = "(reference)"
            rate_ratio = p99_ratio = "1.00"
            pruned = coverage = "-"
        else:
            rate_ratio_value = rate.median / plain_rate.median
            p99_ratio_value = p99 / plain_p99
            rate_ratio = f"{rate_ratio_value:.2f}"
            p99_ratio = f"{p99_ratio_value:.2f}"
            rate_goal = f">= {RATE_GOAL} {bench.verdict(rate_ratio_value >= RATE_GOAL)}"
            p99_goal = f"<= {P99_GOAL} {bench.verdict(p99_ratio_value <= P99_GOAL)}"
            pruned_rate = statistics.median(r.pruned / r.pruning_seconds for r in variant.rounds)
            pruned = f"{pruned_rate:,.0f}"
            covered = [min(1.0, r.pruning_seconds / r.seconds) for r in variant.rounds]
            coverage = f"{statistics.median(covered):.0%}"
        print(
            f"  {variant.name:<22} {rate.text():<34} {rate_ratio:>6} {rate_goal:<11}"
            f" {p50 * 1000:>7.2f} {p99 * 1000:>7.2f} {p99_ratio:>6} {p99_goal:<11}"
            f" {pruned:>9} {coverage:>8}"
        )
    print(
        "  (rates per round: "
        + "; ".join(f"{v.name}: " + ", ".join(f"{r.rate:,.0f}" for r in v.rounds) for v in variants)
        + ")"
    )
    print()
    rows = config.drop_rows
    print(f"delete or drop, {rows:,} rows in a table shaped like events:")
    print(
        f"  batched DELETE ({DELETE_BATCH:,} positions each): {drop['delete']:.2f} s"
        f" ({rows / drop['delete']:,.0f} rows/s), then VACUUM {drop['vacuum']:.2f} s"
    )
    print(
        f"  DROP TABLE: {drop['drop'] * 1000:.1f} ms;"
        f" delete + vacuum / drop = {(drop['delete'] + drop['vacuum']) / drop['drop']:,.0f}x"
    )
    removed, seconds = vacuum
    print(
        f"  VACUUM of the stream's events after the run pruned {removed:,} events: "
        f"{seconds:.2f} s; autovacuum ran on events {autovacuum_runs} time(s) during the run"
    )


def subengine_default_batch() -> int:
    """`Engine.run_retention`'s default batch, read from its signature (public API)."""
    default: int = inspect.signature(subengine.Engine.run_retention).parameters["batch"].default
    return default


# the run


def parse_args(argv: Sequence[str] | None) -> tuple[Any, Config]:
    parser = bench.arguments(
        "Benchmark retention pruning and appends beside it.",
        quick="500,000 events, for a smoke test",
        schema="bench_retention",
    )
    parser.add_argument("--events", type=int, help="events (5,000,000; quick 500,000)")
    parser.add_argument("--partitions", type=int, default=8, help="partitions (8)")
    parser.add_argument(
        "--batches", default="1000,5000,20000", help="prune batch sizes (1000,5000,20000)"
    )
    parser.add_argument(
        "--slice", type=int, help="events per partition a prune-rate run removes (1%% of all)"
    )
    parser.add_argument("--window", type=float, default=3.0, help="seconds without pruning (3)")
    parser.add_argument(
        "--window-slice",
        type=int,
        help="events per partition the pruner beside appends removes (5%% of all)",
    )
    parser.add_argument("--drop-rows", type=int, help="rows of the delete-or-drop tables (10%%)")
    parser.add_argument("--seed", type=int, default=20261123, help="seed of the live keys")
    args = bench.parse(parser, argv)
    events = bench.sized(args, "events", 500_000, 5_000_000)
    per_partition = events // args.partitions
    config = Config(
        events=events,
        partitions=args.partitions,
        batches=tuple(int(b) for b in args.batches.split(",")),
        rounds=args.rounds,
        slice=args.slice or max(1, per_partition // 100),
        window=args.window,
        window_slice=args.window_slice or max(1, per_partition * 5 // 100),
        drop_rows=args.drop_rows or max(1, events // 10),
        seed=args.seed,
    )
    needed = config.rounds * len(config.batches) * (config.slice + config.window_slice)
    if needed >= per_partition:
        parser.error(
            f"the runs would remove {needed:,} events per partition of {per_partition:,}:"
            " lower --slice or --window-slice, or raise --events"
        )
    return args, config


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse_args(argv)
    run_started = time.perf_counter()
    rng = random.Random(config.seed)
    with bench.scratch_engine(args, "bench/retention.py") as engine:
        engine.create_stream(STREAM, config.partitions)
        engine.create_stream(OTHER_STREAM, config.partitions)
        other_events = config.partitions * (config.rounds * config.window_slice + 1)
        schema = engine.schema
        with psycopg.connect(engine.dsn, autocommit=True) as conn:
            settings = ("server_version", "synchronous_commit", "autovacuum", "shared_buffers")
            facts = ", ".join(
                f"{name}={value}"
                for name, value in bench.server_settings(engine.dsn, settings).items()
            )
            started = time.perf_counter()
            fill(conn, schema, "events", STREAM, config.events, config.partitions)
            set_heads(conn, schema, STREAM)
            conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(schema, "events")))
            fill_seconds = time.perf_counter() - started
            fill(conn, schema, "events", OTHER_STREAM, other_events, config.partitions)
            set_heads(conn, schema, OTHER_STREAM)
            conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(schema, "events")))
            print(f"filled in {time.perf_counter() - started:.1f} s", file=sys.stderr)
            vacuums_before = autovacuums(conn, schema)

        pruner = Pruner(engine, STREAM, config.partitions, config.events)
        other = Pruner(engine, OTHER_STREAM, config.partitions, other_events)
        prune_rates: dict[int, list[float]] = {batch: [] for batch in config.batches}
        for number in range(config.rounds):
            for batch in bench.rotated(config.batches, number):
                removed, seconds = pruner.prune(config.slice, batch)
                prune_rates[batch].append(removed / seconds)
            print(f"prune rate round {number + 1} of {config.rounds} done", file=sys.stderr)

        default = subengine_default_batch()
        variants = [
            AppendVariant("no pruning", default, None),
            *(AppendVariant(f"pruning, batch {b:,}", b, pruner) for b in config.batches),
            AppendVariant(f"other stream, {default:,}", default, other),
        ]
        for _ in range(200):  # warm up: pool, prepared statements, plans
            engine.append(STREAM, [NewEvent(f"live-{rng.randrange(LIVE_KEYS)}", "Live", {})])
        for number in range(config.rounds):
            for variant in bench.rotated(variants, number):
                append_window(engine, variant, config, rng)
            print(f"append round {number + 1} of {config.rounds} done", file=sys.stderr)

        drop = delete_or_drop(engine, config.drop_rows, config.partitions)
        with psycopg.connect(engine.dsn, autocommit=True) as conn:
            autovacuum_runs = autovacuums(conn, schema) - vacuums_before
            removed_row = conn.execute(
                sql.SQL("SELECT sum(floor - 1) FROM {} WHERE stream = %s").format(
                    sql.Identifier(schema, "partitions")
                ),
                (STREAM,),
            ).fetchone()
            started = time.perf_counter()
            conn.execute(sql.SQL("VACUUM {}").format(sql.Identifier(schema, "events")))
            vacuum = (int(removed_row[0]) if removed_row else 0, time.perf_counter() - started)

    print_report(config, facts, fill_seconds, prune_rates, variants, drop, vacuum, autovacuum_runs)
    print(f"run time {time.perf_counter() - run_started:.0f} s, with setup")
    return 0


if __name__ == "__main__":
    sys.exit(main())
