"""Remote workers (docs/remote-workers.md): events a second acknowledged by remote workers
over HTTP against a local worker on the same backlog, and the latency from an append to
the answer of a claim that waits for it, against a long-poll read that waits for it.

Throughput: a backlog of events on 8 partitions; each round a fresh subscription from the
beginning is drained either by a local worker of 2 slots (`run_worker`, a handler that
does nothing, transactional) or by 2 `RemoteWorker` threads (a handler that does nothing,
100 events a lease) through one real `subengine serve`; the rate is the backlog over the
time until every position reached its head. Latency: a claim (or a long-poll read of the
stream) is waiting when one event is appended; the time from the append's call to the
answer. Variants run in rotating order; the report gives median, min and max over rounds
and each remote figure against its local or plain counterpart. Issue 30 states no number
to reach: the figures are for reading.

    .venv/bin/python bench/remote_workers.py            # a few minutes on 2 cores
    .venv/bin/python bench/remote_workers.py --quick    # a smoke test
    .venv/bin/python bench/remote_workers.py --dsn postgresql://...   # or SUBENGINE_DSN

Every run creates a database of its own (`bench_remote_<pid>`) and drops it at the end.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _harness as bench
import httpx
from _harness import SCHEMA, Spread, progress

import subengine
from subengine.client import RemoteWorker

STREAM = "bench"
LATENCY_STREAM = "latency"
THROUGHPUT = ("local worker", "remote workers")
LATENCY = ("long-poll read", "waiting claim")
TIMEOUT_SECONDS = 600.0
WAIT_SECONDS = 10.0
SETTLE_SECONDS = 0.3  # for the waiting request to be waiting before the append


def local(engine: subengine.Engine, gateway: str, name: str, total: int, slots: int) -> float:
    app = subengine.App()
    subscription = app.subscription(name, stream=STREAM, batch_size=100)

    @subscription.handler()
    def nothing(event: subengine.Event, conn: Any) -> None:
        pass

    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            app.run_worker(engine, concurrency=slots, stop=stop)
        except BaseException as error:
            failed.append(error)

    return _timed(engine, name, total, failed, [run], stop.set)


def remote(engine: subengine.Engine, gateway: str, name: str, total: int, slots: int) -> float:
    engine.ensure_subscription(subengine.Subscription(name, STREAM))
    engine.set_remote_policy(name, batch_size=100)
    failed: list[BaseException] = []
    workers = [
        RemoteWorker(gateway, name, lambda event: None, worker=f"bench-{n}", wait=1)
        for n in range(slots)
    ]

    def runner(worker: RemoteWorker) -> Callable[[], None]:
        def run() -> None:
            try:
                worker.run()
            except BaseException as error:
                failed.append(error)

        return run

    def stop() -> None:
        for worker in workers:
            worker.stop()

    try:
        return _timed(engine, name, total, failed, [runner(w) for w in workers], stop)
    finally:
        for worker in workers:
            worker.close()


def _timed(
    engine: subengine.Engine,
    name: str,
    total: int,
    failed: list[BaseException],
    runs: list[Callable[[], None]],
    stop: Callable[[], None],
) -> float:
    threads = [threading.Thread(target=run) for run in runs]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    try:
        bench.wait_drained(engine.dsn, name, total, failed, TIMEOUT_SECONDS)
        return total / (time.perf_counter() - started)
    finally:
        stop()
        for thread in threads:
            thread.join()


def latency(engine: subengine.Engine, gateway: str, variant: str, samples: int) -> list[float]:
    """Seconds from an append's call to the answer of the request waiting for it."""
    found: list[float] = []
    with httpx.Client(timeout=WAIT_SECONDS + 30) as client:
        cursor = client.get(f"{gateway}/v1/streams/{LATENCY_STREAM}").json()["cursor"]
        for n in range(samples):
            seconds, body = _sample(engine, client, gateway, variant, cursor, n)
            found.append(seconds)
            if variant == "waiting claim":
                client.post(f"{gateway}/v1/subscriptions/latency/leases/{body['lease']}/ack")
            else:
                cursor = body["cursor"]
    if variant == "long-poll read":
        # the claims' subscription skips what the reads saw: each claim waits for its event
        engine.reset_subscription("latency", "end")
    return found


def _sample(
    engine: subengine.Engine,
    client: httpx.Client,
    gateway: str,
    variant: str,
    cursor: str,
    n: int,
) -> tuple[float, Any]:
    """One append while a claim (or a long-poll read from `cursor`) waits: the seconds
    from the append's call to the answer, and the answer."""
    answered: list[tuple[float, httpx.Response]] = []

    def wait() -> None:
        if variant == "waiting claim":
            response = client.post(
                f"{gateway}/v1/subscriptions/latency/claim", json={"wait": WAIT_SECONDS}
            )
        else:
            params = {"live": "long-poll", "wait": f"{WAIT_SECONDS:g}", "after": cursor}
            response = client.get(f"{gateway}/v1/streams/{LATENCY_STREAM}/events", params=params)
        answered.append((time.perf_counter(), response))

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(SETTLE_SECONDS)
    appended_at = time.perf_counter()
    engine.append(LATENCY_STREAM, [subengine.NewEvent(f"k{n}", "Tick", {"n": n})])
    waiting.join()
    [(at, response)] = answered
    if response.status_code != 200:
        raise SystemExit(f"{variant}: answered {response.status_code}: {response.text}")
    return at - appended_at, response.json()


def main(argv: Sequence[str] | None = None) -> None:
    parser = bench.arguments(__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--events", type=int, help="backlog (20,000; --quick 2,000)")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2, help="local slots = remote workers")
    parser.add_argument("--samples", type=int, help="latency samples a round (20; --quick 5)")
    args = bench.parse(parser, argv)
    total = bench.sized(args, "events", 2_000, 20_000)
    samples = bench.sized(args, "samples", 5, 20)
    load_before = os.getloadavg()[0]
    rates: dict[str, list[float]] = {variant: [] for variant in THROUGHPUT}
    delays: dict[str, list[float]] = {variant: [] for variant in LATENCY}
    medians: dict[str, list[float]] = {variant: [] for variant in LATENCY}
    consumers = {"local worker": local, "remote workers": remote}
    with (
        bench.benchmark_database(bench.dsn_of(args), "bench_remote_", migrate=True) as database,
        tempfile.TemporaryDirectory() as logs,
    ):
        settings = subengine.Settings(dsn=database.dsn, schema=SCHEMA, poll_interval=0.2)
        env = {**os.environ, "SUBENGINE_DSN": database.dsn, "SUBENGINE_SCHEMA": SCHEMA}
        server = bench.Child("gateway", bench.subengine_serve(), env, Path(logs)).started()
        try:
            with subengine.Engine(settings=settings) as engine:
                engine.create_stream(STREAM, partitions=args.partitions)
                engine.create_stream(LATENCY_STREAM, partitions=4)
                engine.ensure_subscription(subengine.Subscription("latency", LATENCY_STREAM))
                keys = bench.order_keys(1000)
                bench.append_orders(
                    engine, STREAM, total, random.Random(1), lambda n: keys[n % len(keys)]
                )
                for number, variant in bench.rotating(THROUGHPUT, args.rounds):
                    name = f"v{THROUGHPUT.index(variant)}r{number}"
                    rate = consumers[variant](engine, server.url, name, total, args.slots)
                    rates[variant].append(rate)
                    progress(f"round {number + 1}: {variant}: {rate:,.0f} events/s")
                for number, variant in bench.rotating(LATENCY, args.rounds):
                    found = latency(engine, server.url, variant, samples)
                    delays[variant] += found
                    medians[variant].append(statistics.median(found))
                    progress(
                        f"round {number + 1}: {variant}: median "
                        f"{statistics.median(found) * 1000:.1f} ms"
                    )
        finally:
            server.stop()
        facts = bench.server_facts(database.dsn)
    print(
        f"{total:,} events, {args.partitions} partitions, a handler that does nothing, "
        f"{args.rounds} rounds (events/s acknowledged, median (min, max)); "
        "no goal in issue 30: for reading"
    )
    local_rate = Spread.of(rates["local worker"])
    remote_rate = Spread.of(rates["remote workers"])
    print(f"  {f'local worker, {args.slots} slots':<24} {local_rate.text()}")
    print(
        f"  {f'{args.slots} remote workers (HTTP)':<24} {remote_rate.text()}  "
        f"{remote_rate.median / local_rate.median:.2f}x local"
    )
    print(
        f"append -> answer of a waiting request, ms, median of each round's {samples} "
        "(median (min, max)), and p95 of all samples:"
    )
    plain = Spread.of(medians["long-poll read"])
    for variant in LATENCY:
        spread = Spread.of([m * 1000 for m in medians[variant]])
        p95 = bench.percentile(delays[variant], 0.95) * 1000
        ratio = Spread.of(medians[variant]).median / plain.median
        print(f"  {variant:<15} {spread.text(1)}  p95 {p95:.1f}  {ratio:.2f}x long-poll read")
    print(bench.machine(facts, load_before))


if __name__ == "__main__":
    main()
