"""How fast `AsyncEngine.append` is, next to `Engine.append` in the same run: one append at
a time (the cost of the asyncio path, not what concurrency buys), with one event and with
`--batch-size` events per transaction, rounds in rotating order. Goal: the async rate at
least 0.9 times the sync rate of the same size.

    .venv/bin/python bench/async_append.py            # about a minute on 2 cores
    .venv/bin/python bench/async_append.py --quick    # a few seconds, for a smoke test
    .venv/bin/python bench/async_append.py --dsn postgresql://...   # or set SUBENGINE_DSN

It works in a scratch schema (`--schema`, default `bench_async_append`), dropped and
migrated on every run (never one it did not make).
"""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import _harness as bench
from _harness import Spread

import subengine
from subengine import NewEvent

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
    parser = bench.arguments(
        "AsyncEngine.append beside Engine.append.", schema="bench_async_append"
    )
    parser.add_argument("--singles", type=int, help="1-event transactions per round (1500)")
    parser.add_argument("--batches", type=int, help="batched transactions per round (40)")
    parser.add_argument("--batch-size", type=int, default=200, help="events per batch (200)")
    args = bench.parse(parser, argv)
    singles = bench.sized(args, "singles", 200, 1500)
    batches = bench.sized(args, "batches", 5, 40)
    rounds = args.rounds
    rng = random.Random(20261121)
    started = time.perf_counter()

    with bench.scratch_engine(args, "bench/async_append.py") as engine:
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
                for variant in bench.rotated(pairs[size], number):
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
            rates = Spread.of(variant.rates)
            spread = f"({rates.low:,.0f}, {rates.high:,.0f})"
            print(f"{variant.name:<40} {rates.median:>9,.0f}   {spread}")
    print()
    for size, _ in sizes:
        sync, asynchronous = pairs[size]
        ratio = statistics.median(asynchronous.rates) / statistics.median(sync.rates)
        verdict = bench.verdict(ratio >= GOAL)
        print(f"async / sync, {size} event(s)/txn: {ratio:5.2f}  (goal >= {GOAL})  {verdict}")
    print(f"run time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
