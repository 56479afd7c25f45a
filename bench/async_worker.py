"""What async handlers cost: the worker's throughput over a backlog with a handler that
INSERTs one row per event, as a plain def on the batch's Connection and as an async def
on its AsyncConnection, each directly and through an SQLAlchemy Session or AsyncSession
(docs/async-workers.md). The async batches run their statements on an event loop the slot
waits for, so the figure to read is each async rate against its plain counterpart,
measured in the same run.

    .venv/bin/python bench/async_worker.py            # a few minutes on 2 cores
    .venv/bin/python bench/async_worker.py --quick    # a smoke test
    .venv/bin/python bench/async_worker.py --dsn postgresql://...   # or SUBENGINE_DSN

Every run creates a database of its own (`bench_async_<pid>`) and drops it at the end.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import _harness as bench
import psycopg
from _harness import SCHEMA, Spread, progress
from sqlalchemy import text

import subengine

STREAM = "bench"
VARIANTS = ("plain def", "async def", "plain def + Session", "async def + AsyncSession")
INSERT = "INSERT INTO bench_effects (event_id, position) VALUES (%s, %s)"
STATEMENT = text("INSERT INTO bench_effects (event_id, position) VALUES (:id, :p)")
# no goal in issue 28 for this figure: it says what async handlers cost, for reading
TIMEOUT_SECONDS = 600.0


def app_for(variant: str, name: str) -> subengine.App:
    app = subengine.App()
    sub = app.subscription(name, stream=STREAM, batch_size=100)
    if variant == "plain def":

        @sub.handler()
        def plain(event: subengine.Event, conn: Any) -> None:
            conn.execute(INSERT, (event.id, event.position))

    elif variant == "async def":

        @sub.handler()
        async def awaited(event: subengine.Event, conn: Any) -> None:
            await conn.execute(INSERT, (event.id, event.position))

    elif variant == "plain def + Session":

        @sub.handler()
        def session_plain(event: subengine.Event, conn: Any) -> None:
            with subengine.sqlalchemy_session(conn) as orm:
                orm.execute(STATEMENT, {"id": event.id, "p": event.position})

    else:

        @sub.handler()
        async def session(event: subengine.Event, conn: Any) -> None:
            async with subengine.async_sqlalchemy_session(conn) as orm:
                await orm.execute(STATEMENT, {"id": event.id, "p": event.position})

    return app


def consume(engine: subengine.Engine, variant: str, name: str, total: int, slots: int) -> float:
    """Events per second for one worker with `slots` slots to handle the backlog."""
    app = app_for(variant, name)
    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            app.run_worker(engine, concurrency=slots, stop=stop)
        except BaseException as error:
            failed.append(error)

    worker = threading.Thread(target=run)
    started = time.perf_counter()
    worker.start()
    try:
        bench.wait_drained(engine.dsn, name, total, failed, TIMEOUT_SECONDS)
    except SystemExit:
        stop.set()
        raise
    seconds = time.perf_counter() - started
    stop.set()
    worker.join()
    return total / seconds


def main(argv: Sequence[str] | None = None) -> None:
    parser = bench.arguments(__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--events", type=int, help="backlog (20,000; --quick 2,000)")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2, help="slots of the worker")
    args = bench.parse(parser, argv)
    total = bench.sized(args, "events", 2_000, 20_000)
    load_before = os.getloadavg()[0]
    rates: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    with bench.benchmark_database(bench.dsn_of(args), "bench_async_", migrate=True) as database:
        settings = subengine.Settings(dsn=database.dsn, schema=SCHEMA, poll_interval=0.2)
        with subengine.Engine(settings=settings) as engine:
            with psycopg.connect(database.dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE bench_effects (event_id uuid, position bigint)")
            engine.create_stream(STREAM, partitions=args.partitions)
            keys = bench.order_keys(1000)
            bench.append_orders(
                engine, STREAM, total, random.Random(1), lambda n: keys[n % len(keys)]
            )
            for number, variant in bench.rotating(VARIANTS, args.rounds):
                name = f"v{VARIANTS.index(variant)}r{number}"
                rate = consume(engine, variant, name, total, args.concurrency)
                rates[variant].append(rate)
                progress(f"round {number + 1}: {variant}: {rate:,.0f} events/s")
            facts = bench.server_facts(database.dsn)
    plain = Spread.of(rates["plain def"]).median
    print(
        f"{total:,} events, {args.partitions} partitions, one worker of "
        f"{args.concurrency} slots, one INSERT per event, {args.rounds} rounds "
        "(events/s, median (min, max)); no goal in issue 28: for reading"
    )
    session = Spread.of(rates["plain def + Session"]).median
    for variant in VARIANTS:
        spread = Spread.of(rates[variant])
        against = session if "Session" in variant else plain
        counterpart = "plain def + Session" if "Session" in variant else "plain def"
        print(f"  {variant:<26} {spread.text()}  {spread.median / against:.2f}x {counterpart}")
    print(bench.machine(facts, load_before))


if __name__ == "__main__":
    main()
