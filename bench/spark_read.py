"""How fast Spark reads a stream through subengine's data source, next to a plain COPY of
the same rows: every event and column of a stream, read by `spark.read.format("subengine")`
into Spark's `noop` sink and by one psycopg `COPY ... TO STDOUT`, rounds in rotating order.
The README's performance section and docs/spark.md explain the figures.

    .venv/bin/python bench/spark_read.py            # 1,000,000 events, a few minutes
    .venv/bin/python bench/spark_read.py --quick    # 50,000 events, for a smoke test
    .venv/bin/python bench/spark_read.py --dsn postgresql://...   # or set SUBENGINE_DSN

It works in a scratch schema (`--schema`, default `bench_spark`), dropped and migrated on
every run (never one it did not make).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import _harness as bench
import psycopg
from psycopg import sql

import subengine

STREAM = "bench-orders"
DSN_ENV = "SUBENGINE_BENCH_DSN"
GOAL = 0.8  # the data source's rate over the plain COPY's
COLUMNS = (
    "stream, partition, position, id, key, key_version, type, data, metadata, "
    "occurred_at, recorded_at"
)


def fill(engine: subengine.Engine, events: int, batch: int) -> None:
    """Append `events` order events through append_events, `batch` per call."""
    statement = engine.sql.text("append_events")
    with psycopg.connect(engine.dsn) as conn:
        for start in range(0, events, batch):
            numbers = range(start, min(start + batch, events))
            conn.execute(
                statement,
                {
                    "stream": STREAM,
                    "ids": None,
                    "keys": [f"order-{n % 50_000:05d}" for n in numbers],
                    "types": ["OrderPlaced" if n < 50_000 else "OrderUpdated" for n in numbers],
                    "data": [
                        f'{{"order": "order-{n % 50_000:05d}",'
                        f' "customer": "customer-{n % 977:05d}", "sku": "SKU-{n % 4099:05d}",'
                        f' "quantity": {1 + n % 5},'
                        f' "unit_price": "{(n % 9000) / 100 + 1:.2f}", "currency": "EUR",'
                        f' "channel": "web"}}'
                        for n in numbers
                    ],
                    "metadata": [f'{{"source": "bench", "n": {n}}}' for n in numbers],
                    "occurred_at": None,
                    "expected_keys": None,
                    "expected_versions": None,
                },
            ).fetchall()
            conn.commit()
    with psycopg.connect(engine.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM ANALYZE {}.events").format(sql.Identifier(engine.schema)))


def plain_copy(dsn: str, schema: str) -> Callable[[], int]:
    statement = sql.SQL("COPY (SELECT {} FROM {}.events WHERE stream = {}) TO STDOUT").format(
        sql.SQL(COLUMNS), sql.Identifier(schema), sql.Literal(STREAM)
    )

    def run() -> int:
        rows = 0
        with psycopg.connect(dsn) as conn, conn.cursor().copy(statement) as copy:
            for chunk in copy:
                rows += bytes(chunk).count(b"\n")
        return rows

    return run


def data_source(spark: Any, schema: str, rows_per_split: int) -> Callable[[], int]:
    def run() -> int:
        frame = (
            spark.read.format("subengine")
            .option("stream", STREAM)
            .option("dsnEnv", DSN_ENV)
            .option("dbSchema", schema)
            .option("rowsPerSplit", str(rows_per_split))
            .load()
        )
        frame.write.format("noop").mode("overwrite").save()
        return -1  # the noop sink counts nothing; the row count is checked after the rounds

    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench.arguments(
        "Benchmark Spark reads through subengine's data source against plain COPY.",
        quick="50,000 events, for a smoke test",
        schema="bench_spark",
    )
    add = parser.add_argument
    add("--events", type=int, help="events in the stream (1,000,000)")
    add("--partitions", type=int, default=8, help="partitions of the stream (8)")
    add("--fill-batch", type=int, default=20_000, help="events per append call")
    add("--rows-per-split", type=int, default=250_000, help="rowsPerSplit option")
    add("--master", default="local[2]", help="Spark master (local[2])")
    args = bench.parse(parser, argv)
    events = bench.sized(args, "events", 50_000, 1_000_000)
    rounds = args.rounds
    started = time.perf_counter()

    with bench.scratch_engine(args, "bench/spark_read.py") as engine:
        engine.create_stream(STREAM, args.partitions)
        fill_started = time.perf_counter()
        fill(engine, events, args.fill_batch)
        fill_seconds = time.perf_counter() - fill_started
        print(
            f"filled {events:,} events in {fill_seconds:.1f} s ({events / fill_seconds:,.0f}/s)",
            file=sys.stderr,
        )
        with psycopg.connect(engine.dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            size = conn.execute(
                sql.SQL("SELECT pg_size_pretty(sum(pg_column_size(e.*))) FROM {}.events e").format(
                    sql.Identifier(engine.schema)
                )
            ).fetchone()

        spark = bench.spark_session(args.master, "subengine-bench", DSN_ENV, engine.dsn)
        variants: list[tuple[str, Callable[[], int]]] = [
            ("plain COPY, 1 connection", plain_copy(engine.dsn, engine.schema)),
            (
                f"subengine data source, {args.master}",
                data_source(spark, engine.schema, args.rows_per_split),
            ),
        ]
        seconds: dict[str, list[float]] = {name: [] for name, _ in variants}
        copied = variants[0][1]()  # warm-up, and the row count to check against
        if copied != events:
            raise SystemExit(f"plain COPY read {copied:,} rows, not {events:,}")
        variants[1][1]()
        for number, (name, run) in bench.rotating(variants, rounds):
            began = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - began)
            if name == variants[number % len(variants) - 1][0]:
                print(f"round {number + 1} of {rounds} done", file=sys.stderr)
        counted = (
            spark.read.format("subengine")
            .option("stream", STREAM)
            .option("dsnEnv", DSN_ENV)
            .option("dbSchema", engine.schema)
            .load()
            .count()
        )
        spark.stop()

    print(
        f"PostgreSQL {version[0] if version else '?'} ({'embedded' if engine.embedded else 'DSN'});"
        f" {events:,} events in {args.partitions} partitions, {size[0] if size else '?'} of rows;"
        f" {rounds} rounds, rotating order"
    )
    print()
    header = (
        f"{'variant':<36} {'median s':>8} {'min s':>6} {'max s':>6}"
        f" {'rows/s (median)':>16} {'min-max rows/s':>18}"
    )
    print(header)
    print("-" * len(header))
    rates = {}
    for name, _ in variants:
        median, fastest, slowest = (
            statistics.median(seconds[name]),
            min(seconds[name]),
            max(seconds[name]),
        )
        rates[name] = events / median
        spread = f"{events / slowest:,.0f}-{events / fastest:,.0f}"
        print(
            f"{name:<36} {median:>8.2f} {fastest:>6.2f} {slowest:>6.2f}"
            f" {rates[name]:>16,.0f} {spread:>18}"
        )
    print()
    plain, ours = (name for name, _ in variants)
    ratio = rates[ours] / rates[plain]
    each = " ".join(
        f"{copied / read:.2f}" for copied, read in zip(seconds[plain], seconds[ours], strict=True)
    )
    verdict = bench.verdict(ratio >= GOAL)
    print(
        f"data source / plain COPY {ratio:5.2f} (ratio of medians; rounds: {each})"
        f"  goal >= {GOAL}  {verdict}"
    )
    same = "yes" if counted == events else f"NO, {counted:,}"
    print(f"the data source read every event: {same}")
    print(f"run time {time.perf_counter() - started:.0f} s, with setup and the fill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
