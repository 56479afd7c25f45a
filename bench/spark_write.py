"""How fast Spark appends a DataFrame to a stream through subengine's data source.

Run it from the repository root:

    .venv/bin/python bench/spark_write.py            # 1,000,000 rows, a few minutes
    .venv/bin/python bench/spark_write.py --quick    # 50,000 rows, for a smoke test
    .venv/bin/python bench/spark_write.py --dsn postgresql://...   # or set SUBENGINE_DSN

Without a DSN it uses the embedded PostgreSQL (`subengine.Engine()`), which keeps running
afterwards (stop it with `.venv/bin/subengine db stop`).

Method
------
The script works in a scratch schema (`--schema`, default `bench_spark_write`), dropped
and migrated again at the start of every run; it refuses to drop a schema it did not
create. Every round appends `--rows` small distinct order rows (key, type and a JSON
payload of about 130 bytes), which Spark generates from `spark.range` in `--tasks`
partitions, with `df.write.format("subengine")` to a new stream of `--partitions`
partitions, in a local SparkSession with one task slot per core (`--master`, default
local[2]). A round's time is the `save()` call's, from planning to the driver's commit,
as a user's job pays it; each round then checks that its stream holds exactly `--rows`
events. One small write first warms up the JVM, the Python workers and the server.

The script uses nothing but the public API, so it runs unchanged against another version
of subengine installed in another environment: to compare two versions, run it with each
environment's Python in turn, several times, and compare the medians. The `appending`
column is the span of the events' `recorded_at` times in a round: how long the appends
held the partitions' append locks, from the first append to the last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
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


SCHEMA_MARKER = "subengine benchmark scratch schema (bench/spark_write.py); dropped on every run"
DSN_ENV = "SUBENGINE_BENCH_DSN"


def stored(dsn: str, schema: str, stream: str) -> tuple[int, float]:
    """The events of `stream`, and the seconds between its first and last recorded_at."""
    statement = sql.SQL(
        "SELECT count(*), coalesce(extract(epoch FROM max(recorded_at) - min(recorded_at)), 0)"
        " FROM {}.events WHERE stream = %s"
    ).format(sql.Identifier(schema))
    with psycopg.connect(dsn) as conn:
        row = conn.execute(statement, (stream,)).fetchone()
    return (int(row[0]), float(row[1])) if row else (0, 0.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Benchmark Spark writes through subengine's data source."
    )
    parser.add_argument("--dsn", help="PostgreSQL URL or conninfo (default: SUBENGINE_DSN)")
    parser.add_argument("--schema", default="bench_spark_write", help="scratch schema")
    parser.add_argument("--quick", action="store_true", help="50,000 rows, for a smoke test")
    parser.add_argument("--rows", type=int, help="rows per write (1,000,000)")
    parser.add_argument("--partitions", type=int, default=8, help="partitions of the stream (8)")
    parser.add_argument("--tasks", type=int, default=8, help="Spark partitions of a write (8)")
    parser.add_argument("--rounds", type=int, default=3, help="measured writes (3)")
    parser.add_argument("--master", default="local[2]", help="Spark master (local[2])")
    args = parser.parse_args(argv)
    rows = args.rows or (50_000 if args.quick else 1_000_000)
    rounds = 1 if args.quick else args.rounds
    dsn = args.dsn or os.environ.get("SUBENGINE_DSN") or None
    started = time.perf_counter()

    with subengine.Engine(dsn, schema=args.schema) as engine:
        reset_scratch_schema(engine, SCHEMA_MARKER, "bench/spark_write.py")
        with psycopg.connect(engine.dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()

        # Python workers inherit the JVM's environment, fixed when the session starts.
        os.environ[DSN_ENV] = engine.dsn
        os.environ["PYSPARK_PYTHON"] = sys.executable
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        spark = (
            SparkSession.builder.master(args.master)
            .appName("subengine-bench-write")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)

        def write(stream: str, count: int) -> float:
            engine.create_stream(stream, args.partitions)
            n = F.col("id")
            order = F.format_string("order-%05d", n % 50_000)
            frame = spark.range(0, count, numPartitions=args.tasks).select(
                order.alias("key"),
                F.lit("OrderPlaced").alias("type"),
                F.to_json(
                    F.struct(
                        n.alias("n"),
                        order.alias("order"),
                        F.format_string("customer-%05d", n % 977).alias("customer"),
                        F.format_string("SKU-%05d", n % 4099).alias("sku"),
                        (1 + n % 5).alias("quantity"),
                        F.lit("EUR").alias("currency"),
                    )
                ).alias("data"),
            )
            began = time.perf_counter()
            frame.write.format("subengine").option("stream", stream).option(
                "dsnEnv", DSN_ENV
            ).option("dbSchema", engine.schema).mode("append").save()
            return time.perf_counter() - began

        write("bench-warm-up", min(rows, 20_000))
        seconds, spans = [], []
        for number in range(rounds):
            stream = f"bench-write-{number}"
            seconds.append(write(stream, rows))
            count, span = stored(engine.dsn, engine.schema, stream)
            if count != rows:
                raise SystemExit(f"round {number + 1}: {count:,} events stored, not {rows:,}")
            spans.append(span)
            print(f"round {number + 1} of {rounds}: {seconds[-1]:.1f} s", file=sys.stderr)
        spark.stop()

    print(
        f"subengine from {os.path.dirname(subengine.__file__)}\n"
        f"PostgreSQL {version[0] if version else '?'} ({'embedded' if engine.embedded else 'DSN'});"
        f" {rows:,} rows from {args.tasks} Spark partitions into {args.partitions} stream"
        f" partitions, {args.master}; {rounds} rounds, medians"
    )
    median = statistics.median(seconds)
    each = " ".join(f"{s:.1f}" for s in seconds)
    print(f"write: {median:.1f} s, {rows / median:,.0f} rows/s   (each round: {each})")
    each = " ".join(f"{s:.1f}" for s in spans)
    print(f"appending: {statistics.median(spans):.1f} s   (each round: {each})")
    print(f"run time {time.perf_counter() - started:.0f} s, with setup")
    return 0


if __name__ == "__main__":
    sys.exit(main())
