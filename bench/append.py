"""How fast `Engine.append` is, next to plain psycopg inserts of the same rows: batches of
`--batch-size` events per transaction against `executemany` and `COPY`, and single-event
transactions against an INSERT and commit per row (and one in autocommit, the floor).
The README's performance section explains each figure.

    .venv/bin/python bench/append.py            # under a minute on 2 cores
    .venv/bin/python bench/append.py --quick    # a few seconds, for a smoke test
    .venv/bin/python bench/append.py --dsn postgresql://...   # or set SUBENGINE_DSN

It works in a scratch schema (`--schema`, default `bench_append`), dropped and migrated on
every run (never one it did not make), beside plain tables made `LIKE events INCLUDING
ALL`; at the end it checks that every plain table holds exactly the rows subengine stored.
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import _harness as bench
import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

import subengine
from subengine import NewEvent, partition_for

PLAIN_TABLE = "bench_plain"
COPY_TABLE = "bench_plain_copy"
AUTOCOMMIT_TABLE = "bench_plain_autocommit"
BATCHED_STREAM = "bench-batched"
SINGLE_STREAM = "bench-single"
COLUMNS = (
    "stream",
    "partition",
    "position",
    "id",
    "key",
    "key_version",
    "type",
    "data",
    "metadata",
    "occurred_at",
    "recorded_at",
)
FOLLOW_UP_TYPES = ("ItemAdded", "ItemRemoved", "OrderPaid", "OrderShipped")

T = TypeVar("T")
Connection = psycopg.Connection[tuple[Any, ...]]
PlainRow = tuple[Any, ...]  # every column but occurred_at and recorded_at


@dataclass(frozen=True, slots=True)
class Config:
    rounds: int
    batches: int
    batch_size: int
    singles: int
    warmup_batches: int
    warmup_singles: int
    keys: int
    partitions: int
    seed: int


@dataclass(frozen=True, slots=True)
class Transaction:
    """One transaction's events, as `engine.append` takes them and as plain rows."""

    stream: str
    events: list[NewEvent]
    rows: list[PlainRow]


@dataclass(slots=True)
class StreamData:
    """Events of one stream, numbered the way subengine numbers them."""

    stream: str
    keys: list[str]
    partitions: int
    rng: random.Random
    heads: dict[int, int] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    id_counter: int = 0
    id_millis: int = field(default_factory=lambda: time.time_ns() // 1_000_000)

    def _next_id(self) -> uuid.UUID:
        # Time-ordered like subengine's default ids (UUIDv7 layout: milliseconds, version,
        # variant), with a counter in place of the random bits so that they stay ordered.
        self.id_counter += 1
        value = (self.id_millis << 80) | (0x7 << 76) | (0x2 << 62) | self.id_counter
        return uuid.UUID(int=value)

    def transaction(self, size: int) -> Transaction:
        events: list[NewEvent] = []
        rows: list[PlainRow] = []
        for _ in range(size):
            key = self.rng.choice(self.keys)
            version = self.versions.get(key, 0) + 1
            self.versions[key] = version
            partition = partition_for(key, self.partitions)
            position = self.heads.get(partition, 0) + 1
            self.heads[partition] = position
            event_type = "OrderPlaced" if version == 1 else self.rng.choice(FOLLOW_UP_TYPES)
            data = bench.order_data(self.rng, key)
            metadata = {"source": "bench", "correlation": f"req-{self.rng.getrandbits(48):012x}"}
            event_id = self._next_id()
            events.append(NewEvent(key, event_type, data, metadata, id=event_id))
            rows.append(
                (
                    self.stream,
                    partition,
                    position,
                    event_id,
                    key,
                    version,
                    event_type,
                    Jsonb(data),
                    Jsonb(metadata),
                )
            )
        return Transaction(self.stream, events, rows)

    def transactions(self, count: int, size: int) -> list[Transaction]:
        return [self.transaction(size) for _ in range(count)]


@dataclass(frozen=True, slots=True)
class Workload:
    """Every transaction of the run, generated before anything is timed."""

    batched_warmup: list[Transaction]
    batched_rounds: list[list[Transaction]]
    single_warmup: list[Transaction]
    single_rounds: list[list[Transaction]]


def make_workload(config: Config) -> Workload:
    rng = random.Random(config.seed)
    batched = StreamData(
        BATCHED_STREAM,
        [f"order-b{n:06d}" for n in range(config.keys)],
        config.partitions,
        rng,
    )
    single = StreamData(
        SINGLE_STREAM,
        [f"order-s{n:06d}" for n in range(config.keys)],
        config.partitions,
        rng,
    )
    # Each plain table receives these transactions in this same order, so the positions
    # and key versions numbered here are the ones subengine gives the same events.
    return Workload(
        batched_warmup=batched.transactions(config.warmup_batches, config.batch_size),
        batched_rounds=[
            batched.transactions(config.batches, config.batch_size) for _ in range(config.rounds)
        ],
        single_warmup=single.transactions(config.warmup_singles, 1),
        single_rounds=[single.transactions(config.singles, 1) for _ in range(config.rounds)],
    )


@dataclass(slots=True)
class Measurement:
    """The rounds of one variant: events, seconds and per-transaction latencies."""

    name: str
    events: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def rates(self) -> list[float]:
        return [n / s for n, s in zip(self.events, self.seconds, strict=True)]

    def rate(self) -> float:
        return statistics.median(self.rates())


Runner = Callable[[list[Transaction], list[float] | None], None]


class Bench:
    """The database side: the engine, a plain connection, and one runner per variant."""

    def __init__(self, engine: subengine.Engine, plain: Connection) -> None:
        self.engine = engine
        self.plain = plain
        schema = sql.Identifier(engine.schema)
        column_list = sql.SQL(", ").join(sql.Identifier(c) for c in COLUMNS)
        self.insert_plain, self.insert_autocommitted = (
            sql.SQL("INSERT INTO {}.{} ({}) VALUES ({})").format(
                schema,
                sql.Identifier(table),
                column_list,
                sql.SQL(", ").join(sql.Placeholder() * len(COLUMNS)),
            )
            for table in (PLAIN_TABLE, AUTOCOMMIT_TABLE)
        )
        self.copy_plain = sql.SQL("COPY {}.{} ({}) FROM STDIN").format(
            schema, sql.Identifier(COPY_TABLE), column_list
        )

    def append(self, transactions: list[Transaction], latencies: list[float] | None) -> None:
        engine = self.engine
        clock = time.perf_counter
        for transaction in transactions:
            started = clock()
            engine.append(transaction.stream, transaction.events)
            if latencies is not None:
                latencies.append(clock() - started)

    def executemany(self, transactions: list[Transaction], latencies: list[float] | None) -> None:
        conn = self.plain
        clock = time.perf_counter
        for transaction in transactions:
            started = clock()
            now = datetime.now(UTC)
            with conn.cursor() as cursor:
                cursor.executemany(
                    self.insert_plain, [(*row, now, now) for row in transaction.rows]
                )
            conn.commit()
            if latencies is not None:
                latencies.append(clock() - started)

    def copy(self, transactions: list[Transaction], latencies: list[float] | None) -> None:
        conn = self.plain
        clock = time.perf_counter
        for transaction in transactions:
            started = clock()
            now = datetime.now(UTC)
            with conn.cursor() as cursor, cursor.copy(self.copy_plain) as copy:
                for row in transaction.rows:
                    copy.write_row((*row, now, now))
            conn.commit()
            if latencies is not None:
                latencies.append(clock() - started)

    def insert_autocommit(
        self, transactions: list[Transaction], latencies: list[float] | None
    ) -> None:
        self.plain.autocommit = True
        try:
            self.insert(transactions, latencies, self.insert_autocommitted)
        finally:
            self.plain.autocommit = False

    def insert(
        self,
        transactions: list[Transaction],
        latencies: list[float] | None,
        statement: sql.Composed | None = None,
    ) -> None:
        conn = self.plain
        clock = time.perf_counter
        statement = statement or self.insert_plain
        for transaction in transactions:
            started = clock()
            now = datetime.now(UTC)
            for row in transaction.rows:
                conn.execute(statement, (*row, now, now))
            conn.commit()  # nothing to send in autocommit
            if latencies is not None:
                latencies.append(clock() - started)


def measure(measurement: Measurement, runner: Runner, transactions: list[Transaction]) -> None:
    gc.collect()
    started = time.perf_counter()
    runner(transactions, measurement.latencies)
    elapsed = time.perf_counter() - started
    measurement.events.append(sum(len(t.events) for t in transactions))
    measurement.seconds.append(elapsed)


# database setup and checks


def prepare(engine: subengine.Engine, partitions: int) -> None:
    """The plain tables beside subengine's events table, and the streams."""
    schema = sql.Identifier(engine.schema)
    with psycopg.connect(engine.dsn, autocommit=True) as conn:
        for table in (PLAIN_TABLE, COPY_TABLE, AUTOCOMMIT_TABLE):
            conn.execute(
                sql.SQL("CREATE TABLE {}.{} (LIKE {}.events INCLUDING ALL)").format(
                    schema, sql.Identifier(table), schema
                )
            )
    for stream in (BATCHED_STREAM, SINGLE_STREAM):
        engine.create_stream(stream, partitions)


def differing_rows(conn: Connection, schema: str, table: str, stream: str) -> int:
    """Rows of `stream` that are in only one of subengine's events table and `table`."""
    compared = sql.SQL(", ").join(sql.Identifier(c) for c in COLUMNS[:9])
    statement = sql.SQL(
        "SELECT count(*) FROM ("
        " (SELECT {cols} FROM {s}.events WHERE stream = %(stream)s"
        "  EXCEPT ALL SELECT {cols} FROM {s}.{t} WHERE stream = %(stream)s)"
        " UNION ALL"
        " (SELECT {cols} FROM {s}.{t} WHERE stream = %(stream)s"
        "  EXCEPT ALL SELECT {cols} FROM {s}.events WHERE stream = %(stream)s)) AS d"
    ).format(cols=compared, s=sql.Identifier(schema), t=sql.Identifier(table))
    row = conn.execute(statement, {"stream": stream}).fetchone()
    conn.commit()
    return int(row[0]) if row else -1


# output


def print_report(
    config: Config,
    facts: dict[str, str],
    embedded: bool,
    batched: list[Measurement],
    singles: list[Measurement],
    mismatches: int,
) -> None:
    where = "embedded" if embedded else "--dsn/SUBENGINE_DSN"
    print(
        f"PostgreSQL {facts['server_version']} ({where}); fsync={facts['fsync']}, "
        f"synchronous_commit={facts['synchronous_commit']}, "
        f"wal_sync_method={facts['wal_sync_method']}"
    )
    print(
        f"{config.keys} keys, {config.partitions} partitions, {config.rounds} rounds "
        "in rotating order; events/s: median, min and max of the rounds"
    )
    print()
    header = (
        f"{'variant':<32} {'events/round':>12} {'median ev/s':>11} {'min':>9} {'max':>9}"
        "   each round (events/s)"
    )
    print(header)
    print("-" * len(header))
    for m in [*batched, *singles]:
        spread = " ".join(f"{r:,.0f}" for r in m.rates())
        print(
            f"{m.name:<32} {m.events[0]:>12,} {m.rate():>11,.0f} {min(m.rates()):>9,.0f} "
            f"{max(m.rates()):>9,.0f}   {spread}"
        )
    print()
    for m in singles:
        print(
            f"latency {m.name + ':':<33} p50 {bench.percentile(m.latencies, 0.5) * 1000:.3f} ms, "
            f"p99 {bench.percentile(m.latencies, 0.99) * 1000:.3f} ms"
        )
    print()
    append_batched, *plain_batched = batched
    fastest_plain = max(plain_batched, key=Measurement.rate)
    append_single, plain_single, plain_autocommit = singles
    print("ratio of medians (range: the ratios of the rounds), against the goals of issue 16")
    for label, ours, theirs, goal in (
        ("batched append / " + fastest_plain.name, append_batched, fastest_plain, 0.8),
        ("single append / " + plain_single.name, append_single, plain_single, 0.9),
        ("single append / " + plain_autocommit.name, append_single, plain_autocommit, None),
    ):
        ratio = ours.rate() / theirs.rate()
        rounds = [a / b for a, b in zip(ours.rates(), theirs.rates(), strict=True)]
        judged = (
            "(no goal)" if goal is None else f"(goal >= {goal})  " + bench.verdict(ratio >= goal)
        )
        print(f"{label:<58} {ratio:5.2f}  ({min(rounds):.2f}-{max(rounds):.2f})  {judged}")
    print()
    same = "yes" if mismatches == 0 else f"NO, {mismatches} rows differ"
    print(f"plain tables hold exactly the rows subengine stored: {same}")


# the run


def parse_args(argv: Sequence[str] | None) -> tuple[Any, Config]:
    parser = bench.arguments(
        "Benchmark Engine.append against plain psycopg inserts of the same rows.",
        schema="bench_append",
    )
    add = parser.add_argument
    add("--batches", type=int, help="batched transactions per round (40)")
    add("--batch-size", type=int, default=500, help="events per batch (500)")
    add("--singles", type=int, help="single-event transactions per round (3000)")
    add("--keys", type=int, default=1000, help="distinct keys per stream (1000)")
    add("--partitions", type=int, default=8, help="partitions per stream (8)")
    add("--seed", type=int, default=20261121, help="seed of the event data")
    args = bench.parse(parser, argv)
    quick = args.quick

    config = Config(
        rounds=args.rounds,
        batches=bench.sized(args, "batches", 4, 40),
        batch_size=args.batch_size,
        singles=bench.sized(args, "singles", 200, 3000),
        warmup_batches=2 if quick else 4,
        warmup_singles=50 if quick else 300,
        keys=args.keys,
        partitions=args.partitions,
        seed=args.seed,
    )
    for name in ("rounds", "batches", "batch_size", "singles", "keys", "partitions"):
        if getattr(config, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args, config


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse_args(argv)
    started = time.perf_counter()
    workload = make_workload(config)
    print(
        f"generated {sum(len(t.events) for r in workload.batched_rounds for t in r):,} batched "
        f"and {config.rounds * config.singles:,} single events in "
        f"{time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )
    with bench.scratch_engine(args, "bench/append.py") as engine:
        prepare(engine, config.partitions)
        with psycopg.connect(engine.dsn) as plain:
            runs = Bench(engine, plain)
            facts = bench.server_settings(
                engine.dsn, ("server_version", "fsync", "synchronous_commit", "wal_sync_method")
            )
            batched_variants: list[tuple[Measurement, Runner]] = [
                (Measurement(f"append, {config.batch_size} events/txn"), runs.append),
                (
                    Measurement(f"plain executemany, {config.batch_size} rows/txn"),
                    runs.executemany,
                ),
                (Measurement(f"plain COPY, {config.batch_size} rows/txn"), runs.copy),
            ]
            single_variants: list[tuple[Measurement, Runner]] = [
                (Measurement("append, 1 event/txn"), runs.append),
                (Measurement("plain INSERT, 1 row/txn"), runs.insert),
                (Measurement("plain INSERT, autocommit"), runs.insert_autocommit),
            ]
            for _, runner in batched_variants:
                runner(workload.batched_warmup, None)
            for _, runner in single_variants:
                runner(workload.single_warmup, None)
            for number in range(config.rounds):
                for measurement, runner in bench.rotated(batched_variants, number):
                    measure(measurement, runner, workload.batched_rounds[number])
                for measurement, runner in bench.rotated(single_variants, number):
                    measure(measurement, runner, workload.single_rounds[number])
                print(f"round {number + 1} of {config.rounds} done", file=sys.stderr)
            mismatches = sum(
                differing_rows(plain, engine.schema, table, stream)
                for table, stream in (
                    (PLAIN_TABLE, BATCHED_STREAM),
                    (COPY_TABLE, BATCHED_STREAM),
                    (PLAIN_TABLE, SINGLE_STREAM),
                    (AUTOCOMMIT_TABLE, SINGLE_STREAM),
                )
            )
        print_report(
            config,
            facts,
            engine.embedded,
            [m for m, _ in batched_variants],
            [m for m, _ in single_variants],
            mismatches,
        )
    print(f"run time {time.perf_counter() - started:.0f} s, with setup and data generation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
