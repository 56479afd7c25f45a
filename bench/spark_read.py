"""How fast Spark reads a stream through subengine's data source, next to a plain COPY.

Run it from the repository root:

    .venv/bin/python bench/spark_read.py            # 1,000,000 events, a few minutes
    .venv/bin/python bench/spark_read.py --quick    # 50,000 events, for a smoke test
    .venv/bin/python bench/spark_read.py --dsn postgresql://...   # or set SUBENGINE_DSN

Without a DSN it uses the embedded PostgreSQL (`subengine.Engine()`), which keeps running
afterwards (stop it with `.venv/bin/subengine db stop`).

Method
------
The script works in a scratch schema (`--schema`, default `bench_spark`), dropped and
migrated again at the start of every run; it refuses to drop a schema it did not create.
It fills one stream of `--partitions` partitions with `--events` small order events (a
JSON payload of about 150 bytes and a little metadata) through the `append_events`
function, `--fill-batch` events per call, with ids and times left to the database.

Two variants read every event of the stream, every column:

* `plain COPY`: one psycopg connection runs `COPY (SELECT <the 11 columns> FROM events
  WHERE stream = ...) TO STDOUT` and receives every chunk: the floor of what any client
  pays to get the rows out of PostgreSQL, with no parsing at all;
* `subengine data source`: `spark.read.format("subengine")...load()` written to Spark's
  `noop` sink, which makes Spark produce every row and column and discard them, in a
  local SparkSession with one task slot per core (`--master`, default local[2]). The
  data source makes one task per partition, cut every `--rows-per-split` events.

Each variant runs once to warm up (the JVM, Python workers, the server's cache), then
`--rounds` measured rounds (at least 3), the variants' order rotating from round to
round. For each variant the script prints the median, the fastest and the slowest round;
the data source's rate is compared with the plain COPY's as the ratio of their medians
(each round's own ratio is printed beside it). Spark's time includes planning the query
(a query for the partition heads) and starting its tasks, as a user's job pays them. The
goal is a data source at least 0.8 times as fast as the plain COPY on the same machine.
Rates on a shared machine are noisy: compare the variants of one run, not runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import psycopg
from _scratch import reset_scratch_schema
from psycopg import sql

import subengine

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def register(spark: SparkSession) -> None:
    import subengine.spark  # needs pyspark; imported only once the session exists

    subengine.spark.register(spark)


SCHEMA_MARKER = "subengine benchmark scratch schema (bench/spark_read.py); dropped on every run"
STREAM = "bench-orders"
DSN_ENV = "SUBENGINE_BENCH_DSN"
GOAL = 0.8  # the data source's rate over the plain COPY's
COLUMNS = (
    "stream, partition, position, id, key, key_version, type, data, metadata, "
    "occurred_at, recorded_at"
)


def reset_schema(engine: subengine.Engine, partitions: int) -> None:
    """Drop the scratch schema (only one this script made), build it again, add the stream."""
    reset_scratch_schema(engine, SCHEMA_MARKER, "bench/spark_read.py")
    engine.create_stream(STREAM, partitions)


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


def data_source(spark: SparkSession, schema: str, rows_per_split: int) -> Callable[[], int]:
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
    parser = argparse.ArgumentParser(
        description="Benchmark Spark reads through subengine's data source against plain COPY."
    )
    parser.add_argument("--dsn", help="PostgreSQL URL or conninfo (default: SUBENGINE_DSN)")
    parser.add_argument("--schema", default="bench_spark", help="scratch schema, dropped first")
    parser.add_argument("--quick", action="store_true", help="50,000 events, for a smoke test")
    parser.add_argument("--events", type=int, help="events in the stream (1,000,000)")
    parser.add_argument("--partitions", type=int, default=8, help="partitions of the stream (8)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="measured rounds per variant (3, at least 3)"
    )
    parser.add_argument("--fill-batch", type=int, default=20_000, help="events per append call")
    parser.add_argument("--rows-per-split", type=int, default=250_000, help="rowsPerSplit option")
    parser.add_argument("--master", default="local[2]", help="Spark master (local[2])")
    args = parser.parse_args(argv)
    events = args.events or (50_000 if args.quick else 1_000_000)
    if args.rounds < 3:
        parser.error("--rounds must be at least 3: the script reports a median, min and max")
    rounds = args.rounds
    dsn = args.dsn or os.environ.get("SUBENGINE_DSN") or None
    started = time.perf_counter()

    with subengine.Engine(dsn, schema=args.schema) as engine:
        reset_schema(engine, args.partitions)
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

        # Python workers inherit the JVM's environment, fixed when the session starts.
        os.environ[DSN_ENV] = engine.dsn
        os.environ["PYSPARK_PYTHON"] = sys.executable
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master(args.master)
            .appName("subengine-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
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
        for number in range(rounds):
            turn = number % len(variants)
            for name, run in variants[turn:] + variants[:turn]:
                began = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - began)
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
    verdict = "PASS" if ratio >= GOAL else "MISS"
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
