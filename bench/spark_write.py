"""How fast Spark appends a DataFrame to a stream through subengine's data source: rows
generated from `spark.range` written with `df.write.format("subengine")` to a new stream
per round, each round checked to hold exactly its rows. docs/spark.md explains the
figures. It uses nothing but the public API, so it runs unchanged against another
installed version of subengine: run it with each environment's Python to compare them.

    .venv/bin/python bench/spark_write.py            # 1,000,000 rows, a few minutes
    .venv/bin/python bench/spark_write.py --quick    # 50,000 rows, for a smoke test
    .venv/bin/python bench/spark_write.py --dsn postgresql://...   # or set SUBENGINE_DSN

It works in a scratch schema (`--schema`, default `bench_spark_write`), dropped and
migrated on every run (never one it did not make).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence

import _harness as bench
import psycopg
from psycopg import sql

import subengine

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
    parser = bench.arguments(
        "Benchmark Spark writes through subengine's data source.",
        quick="50,000 rows, for a smoke test",
        schema="bench_spark_write",
    )
    add = parser.add_argument
    add("--rows", type=int, help="rows per write (1,000,000)")
    add("--partitions", type=int, default=8, help="partitions of the stream (8)")
    add("--tasks", type=int, default=8, help="Spark partitions of a write (8)")
    add("--master", default="local[2]", help="Spark master (local[2])")
    args = bench.parse(parser, argv)
    rows = bench.sized(args, "rows", 50_000, 1_000_000)
    rounds = args.rounds
    started = time.perf_counter()

    with bench.scratch_engine(args, "bench/spark_write.py") as engine:
        version = bench.server_settings(engine.dsn, ("server_version",))["server_version"]

        spark = bench.spark_session(args.master, "subengine-bench-write", DSN_ENV, engine.dsn)
        from pyspark.sql import functions as F

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
        f"PostgreSQL {version} ({'embedded' if engine.embedded else 'DSN'});"
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
