"""Revenue per hour and per day from the `orders` stream, with Spark Structured Streaming.

Two streaming queries read the `OrderPlaced` events of `orders` through subengine's
PySpark data source, with a one-hour watermark on `occurred_at`:

* revenue per hour goes to Parquet files (`--output`);
* revenue per day goes back into subengine, as `DailyRevenueComputed` events of the
  stream `daily-revenue` (key `revenue-YYYY-MM-DD`), through the data source's writer.

A window is written once the watermark has passed its end, so the last hour and day stay
open until later orders arrive. Each query keeps its progress in its own checkpoint
(`--checkpoints`); run it again and it goes on where it stopped, without duplicates.

Locally, against the embedded PostgreSQL, with 500 made-up orders of the last three days:

    export SUBENGINE_DSN=$(.venv/bin/subengine db url)
    .venv/bin/subengine migrate
    .venv/bin/python examples/spark_revenue.py --demo-orders 500 --once

`--once` processes what is there and stops (Trigger.AvailableNow); without it the queries
keep running and pick up new orders every `--interval`. docs/spark.md says what changes on
a cluster.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

import subengine
import subengine.spark

REVENUE_EVENT = "DailyRevenueComputed"


def placed_orders(spark: SparkSession, source: str, dsn_env: str) -> DataFrame:
    """The time and total of every OrderPlaced event, with a one-hour watermark."""
    return (
        spark.readStream.format("subengine")
        .option("stream", source)
        .option("dsnEnv", dsn_env)
        .load()
        .where(F.col("type") == "OrderPlaced")
        .select(
            "occurred_at",
            F.get_json_object("data", "$.total").cast("decimal(18,2)").alias("total"),
        )
        .withWatermark("occurred_at", "1 hour")
    )


def revenue(orders: DataFrame, every: str) -> DataFrame:
    return orders.groupBy(F.window("occurred_at", every)).agg(
        F.sum("total").alias("revenue"), F.count("*").alias("orders")
    )


def start_queries(
    spark: SparkSession,
    *,
    output: Path,
    checkpoints: Path,
    source: str = "orders",
    target: str = "daily-revenue",
    dsn_env: str = subengine.spark.DEFAULT_DSN_ENV,
    once: bool = False,
    interval: str = "10 seconds",
) -> list[StreamingQuery]:
    """Start the hourly (Parquet) and daily (subengine) revenue queries."""
    trigger = {"availableNow": True} if once else {"processingTime": interval}
    hourly = revenue(placed_orders(spark, source, dsn_env), "1 hour").select(
        F.col("window.start").alias("hour"), "revenue", "orders"
    )
    hourly_query = (
        hourly.writeStream.format("parquet")
        .option("path", str(output))
        .option("checkpointLocation", str(checkpoints / "hourly"))
        .outputMode("append")
        .trigger(**trigger)
        .start()
    )
    day = F.date_format("window.start", "yyyy-MM-dd")
    daily = revenue(placed_orders(spark, source, dsn_env), "1 day").select(
        F.concat(F.lit("revenue-"), day).alias("key"),
        F.lit(REVENUE_EVENT).alias("type"),
        F.to_json(F.struct(day.alias("day"), "revenue", "orders")).alias("data"),
        F.col("window.end").alias("occurred_at"),
    )
    daily_query = (
        daily.writeStream.format("subengine")
        .option("stream", target)
        .option("dsnEnv", dsn_env)
        .option("checkpointLocation", str(checkpoints / "daily"))
        .outputMode("append")
        .trigger(**trigger)
        .start()
    )
    return [hourly_query, daily_query]


def add_demo_orders(engine: subengine.Engine, source: str, count: int) -> None:
    """Create `source` if needed and append `count` OrderPlaced events of the last 3 days."""
    if source not in {s.name for s in engine.streams()}:
        engine.create_stream(source, partitions=4)
    rng = random.Random(20260101)
    now = datetime.now(UTC)
    events = [
        subengine.NewEvent(
            f"order-{rng.getrandbits(40):010x}",
            "OrderPlaced",
            {"total": rng.randint(500, 20_000) / 100},
            occurred_at=now - timedelta(minutes=rng.randrange(3 * 24 * 60)),
        )
        for _ in range(count)
    ]
    engine.append(source, sorted(events, key=lambda e: e.occurred_at or now))


def ensure_stream(engine: subengine.Engine, name: str) -> None:
    if name not in {s.name for s in engine.streams()}:
        engine.create_stream(name, partitions=1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="orders", help="stream of orders (orders)")
    parser.add_argument("--target", default="daily-revenue", help="stream of daily revenue")
    parser.add_argument("--output", type=Path, default=Path("revenue/hourly"), help="Parquet")
    parser.add_argument("--checkpoints", type=Path, default=Path("revenue/checkpoints"))
    parser.add_argument("--once", action="store_true", help="process what is there, then stop")
    parser.add_argument("--interval", default="10 seconds", help="trigger interval when running")
    parser.add_argument("--demo-orders", type=int, default=0, help="append N made-up orders first")
    parser.add_argument("--master", default=os.environ.get("SPARK_MASTER", "local[2]"))
    args = parser.parse_args(argv)
    if not os.environ.get(subengine.spark.DEFAULT_DSN_ENV):
        parser.error(f"set {subengine.spark.DEFAULT_DSN_ENV} to the database's DSN")

    with subengine.Engine() as engine:
        if args.demo_orders:
            add_demo_orders(engine, args.source, args.demo_orders)
        ensure_stream(engine, args.target)

    # Python workers run this interpreter, which has subengine installed, unless told
    # otherwise (on a cluster: the Python environment shipped to the nodes).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master(args.master)
        .appName("subengine-revenue")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    subengine.spark.register(spark)
    queries = start_queries(
        spark,
        output=args.output,
        checkpoints=args.checkpoints,
        source=args.source,
        target=args.target,
        once=args.once,
        interval=args.interval,
    )
    for query in queries:
        query.awaitTermination()
    hours = (
        spark.read.parquet(str(args.output)).count() if any(args.output.glob("*.parquet")) else 0
    )
    print(f"{hours} hours of revenue in {args.output}")
    with subengine.Engine() as engine:
        heads = engine.heads(args.target)
    print(f"{sum(heads.values())} {REVENUE_EVENT} events in stream {args.target!r}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
