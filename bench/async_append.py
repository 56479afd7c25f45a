"""How fast `AsyncEngine.append` is, next to `Engine.append` in the same run.

Run it from the repository root:

    .venv/bin/python bench/async_append.py            # about a minute on 2 cores
    .venv/bin/python bench/async_append.py --quick    # a few seconds, for a smoke test
    .venv/bin/python bench/async_append.py --dsn postgresql://...   # or set SUBENGINE_DSN

Without a DSN it uses the embedded PostgreSQL, which keeps running afterwards.

Method
------
One process, one append at a time (no concurrency: this measures the cost of the asyncio
path, not what concurrency buys), in a scratch schema (`--schema`, default
`bench_async_append`) that is dropped and migrated again on every run. The event data is
generated up front from a fixed seed. Two sizes: one event per transaction and
`--batch-size` events per transaction; for each, the sync variant
(`engine.append`) and the async one (`await async_engine.append`, the loop running only
that) append the same kind of events to streams of their own. Every variant warms up
first, then runs `--rounds` rounds in an order that rotates from round to round; the
rates printed are the median, the minimum and the maximum of the rounds. The goal is an
async rate of at least 0.9 times the sync rate of the same size.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from _scratch import reset_scratch_schema

import subengine
from subengine import NewEvent

SCHEMA_MARKER = "subengine benchmark scratch schema (bench/async_append.py); dropped on every run"
GOAL = 0.9


@dataclass
class Variant:
    name: str
    stream: str
    run: Callable[[str, list[list[NewEvent]]], None]
    rates: list[float] = field(default_factory=list)


def transactions(rng: random.Random, count: int, size: int, keys: int) -> list[list[NewEvent]]:
    return [
        [
            NewEvent(
                f"order-{rng.randrange(keys)}",
                rng.choice(("OrderPlaced", "ItemAdded", "OrderPaid")),
                {"total": rng.randrange(10_000), "sku": f"SKU-{rng.randrange(50_000):05d}"},
                metadata={"channel": rng.choice(("web", "app"))},
            )
            for _ in range(size)
        ]
        for _ in range(count)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="AsyncEngine.append beside Engine.append.")
    parser.add_argument("--dsn", help="PostgreSQL URL or conninfo (default: SUBENGINE_DSN)")
    parser.add_argument("--schema", default="bench_async_append", help="scratch schema")
    parser.add_argument("--quick", action="store_true", help="a small run, for a smoke test")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (3)")
    parser.add_argument("--singles", type=int, help="1-event transactions per round (1500)")
    parser.add_argument("--batches", type=int, help="batched transactions per round (40)")
    parser.add_argument("--batch-size", type=int, default=200, help="events per batch (200)")
    args = parser.parse_args(argv)
    singles = args.singles or (200 if args.quick else 1500)
    batches = args.batches or (5 if args.quick else 40)
    rounds = 2 if args.quick else max(3, args.rounds)
    dsn = args.dsn or os.environ.get("SUBENGINE_DSN") or None
    rng = random.Random(20261121)
    started = time.perf_counter()

    with subengine.Engine(dsn, schema=args.schema) as engine:
        reset_scratch_schema(engine, SCHEMA_MARKER, "bench/async_append.py")
        streams = ("sync-1", "async-1", f"sync-{args.batch_size}", f"async-{args.batch_size}")
        for stream in streams:
            engine.create_stream(stream, 8)
        loop = asyncio.new_event_loop()
        async_engine = subengine.AsyncEngine(settings=engine.settings)
        loop.run_until_complete(async_engine.open())

        def sync_run(stream: str, work: list[list[NewEvent]]) -> None:
            for events in work:
                engine.append(stream, events)

        async def appends(stream: str, work: list[list[NewEvent]]) -> None:
            for events in work:
                await async_engine.append(stream, events)

        def async_run(stream: str, work: list[list[NewEvent]]) -> None:
            loop.run_until_complete(appends(stream, work))

        sizes = [(1, singles), (args.batch_size, batches)]
        pairs = {
            size: [
                Variant(f"Engine.append, {size} event(s)/txn", f"sync-{size}", sync_run),
                Variant(f"AsyncEngine.append, {size} event(s)/txn", f"async-{size}", async_run),
            ]
            for size, _ in sizes
        }
        for size, count in sizes:  # warm-up: pools, prepared plans, the loop
            for variant in pairs[size]:
                variant.run(variant.stream, transactions(rng, max(1, count // 10), size, 1000))
        for number in range(rounds):
            for size, count in sizes:
                work = transactions(rng, count, size, 1000)
                variants = pairs[size][number % 2 :] + pairs[size][: number % 2]
                for variant in variants:
                    gc.collect()
                    began = time.perf_counter()
                    variant.run(variant.stream, work)
                    variant.rates.append(count * size / (time.perf_counter() - began))
            print(f"round {number + 1} of {rounds} done", file=sys.stderr)
        loop.run_until_complete(async_engine.close())
        loop.close()

    print(f"{rounds} rounds in rotating order; events/s: median (min, max)")
    print()
    for size, _ in sizes:
        for variant in pairs[size]:
            rates = variant.rates
            print(
                f"{variant.name:<40} {statistics.median(rates):>9,.0f}"
                f"   ({min(rates):,.0f}, {max(rates):,.0f})"
            )
    print()
    for size, _ in sizes:
        sync, asynchronous = pairs[size]
        ratio = statistics.median(asynchronous.rates) / statistics.median(sync.rates)
        verdict = "PASS" if ratio >= GOAL else "MISS"
        print(f"async / sync, {size} event(s)/txn: {ratio:5.2f}  (goal >= {GOAL})  {verdict}")
    print(f"run time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
