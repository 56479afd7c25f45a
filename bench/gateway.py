"""What the HTTP gateway costs an outside subscriber, next to what teams write by hand: the
latency from an append to an SSE watcher (10, 100 and 1,000 watchers) of `subengine serve`
and of a plain LISTEN-to-SSE relay, the database reads per notification, the memory per
idle connection, and catch-up over HTTP against an `Engine.read` loop. The README's
performance section explains each figure.

    .venv/bin/python bench/gateway.py            # about 7 minutes on 2 cores
    .venv/bin/python bench/gateway.py --quick    # about 4 minutes, a smoke test
    .venv/bin/python bench/gateway.py --dsn postgresql://...   # or set SUBENGINE_DSN

Every run creates a database of its own (`bench_gateway_<pid>`) and drops it at the end;
every server it starts listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as bench
import psycopg
from _gateway import (
    GATEWAY,
    LIVE_STREAM,
    PLAIN,
    Appender,
    Server,
    TransactionCount,
    drained,
    latencies_of,
    open_watchers,
    raise_file_limit,
    running,
    warm_up,
)
from _harness import SCHEMA, Database, Spread, progress, verdict

import subengine

PULL_STREAM = "bench-pull"
DATABASE_PREFIX = "bench_gateway_"
KEYS = 1000
PAGE_LIMIT = 1000
# the gateway's head poll, its safety net (GatewayConfig.poll_interval)
POLL_INTERVAL = 1.0
# goals
P50_GOAL_100 = 0.003
P99_GOAL_100 = 0.015
P99_GOAL_1000 = 0.050
CATCH_UP_GOAL = 0.5
READS_GOAL = 1.2
# issue 26: the gateway's reads of events (its metrics), per notification: one at most
HUB_READS_GOAL = 1.0
# issue 26: beside the relay, as a ratio of its figure in the same run
RELAY_GOALS = {("p50", 100): 1.1, ("p99", 1000): 1.0}
MEMORY_GOAL = 20 * 1024


@dataclass(frozen=True, slots=True)
class Config:
    watchers: tuple[int, ...]
    rounds: int
    seconds: float  # of counted appends per run
    warmup: int
    rate: float
    max_deliveries: float  # per second: rate x watchers, at most
    overload: bool  # also run the capped watcher counts at the full rate
    partitions: int
    pull_events: int
    seed: int


@dataclass(slots=True)
class LatencyRun:
    """One run of one server with one watcher count."""

    latencies: list[float]
    missing: int  # (event, watcher) pairs never received
    server_cpu: float  # CPU seconds per second while the appends were delivered
    client_cpu: float
    seconds: float  # from the first counted append to the last delivery
    rss_per_connection: float | None = None  # bytes
    xacts: int | None = None  # the database's transactions, when counted
    xact_seconds: float = 0.0  # the time they were counted over
    reads_per_notification: float | None = None
    # the gateway's reads of events (hub and pages, by its metrics) per counted append
    hub_reads_per_notification: float | None = None
    frames: int = 0  # events frames (or notifications) the watchers received

    def percentile(self, fraction: float) -> float:
        return bench.percentile(self.latencies, fraction)


@dataclass(slots=True)
class Variant:
    server: str
    watchers: int
    rate: float
    appends: int
    runs: list[LatencyRun] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.server}, {self.watchers:,} watchers, {self.rate:g}/s"

    def spread(self, what: str) -> Spread | None:
        """Over the runs: "p50", "p99", or a field of LatencyRun (None: not measured)."""
        values: list[float] = []
        for run in self.runs:
            if what in ("p50", "p99"):
                value: float | None = run.percentile(0.5 if what == "p50" else 0.99)
            else:
                value = getattr(run, what)
            if value is not None:
                values.append(value)
        return Spread.of(values) if values else None


def prepare(database: Database, config: Config) -> float:
    """Schema, streams and the pull stream's events; autovacuum off for the scratch
    tables, whose transactions would count in the database's. The fill's seconds."""
    rng = random.Random(config.seed)
    keys = bench.order_keys(KEYS)
    with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
        engine.create_stream(LIVE_STREAM, config.partitions)
        engine.create_stream(PULL_STREAM, config.partitions)
        seconds = bench.append_orders(
            engine, PULL_STREAM, config.pull_events, rng, lambda _: rng.choice(keys)
        )
    with psycopg.connect(database.dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        bench.autovacuum_off(conn)
    return seconds


# the latency runs


async def latency_run(
    variant: Variant,
    config: Config,
    database: Database,
    appender: Appender,
    xacts: TransactionCount | None,
    logs: Path,
) -> LatencyRun:
    """One run; with `xacts`, the database's transactions from just before the counted
    appends until the server has stopped."""
    server = Server(variant.server, database, logs).started()
    try:
        await warm_up(server)
        rss_before = server.rss()
        watchers = await open_watchers(server, variant.watchers)
        await asyncio.sleep(1.0)
        rss_after = server.rss()
        # the warm-up appends are not counted, and get the watchers going
        await appender.append(config.warmup, variant.rate)
        before = 0 if xacts is None else await xacts.after_idle()
        before_at = time.monotonic()
        reads_before = server.hub_reads() if variant.server == GATEWAY else 0
        cpu_server, cpu_client, started = server.cpu(), time.process_time(), time.monotonic()
        done = await appender.append(variant.appends, variant.rate)
        heads: dict[int, int] = {}
        for partition, position, _ in done:
            heads[partition] = max(heads.get(partition, 0), position)
        await drained(watchers, heads)
        elapsed = time.monotonic() - started
        cpu_server = (server.cpu() - cpu_server) / elapsed
        cpu_client = (time.process_time() - cpu_client) / elapsed
        reads = server.hub_reads() - reads_before if variant.server == GATEWAY else None
        for watcher in watchers:
            watcher.close()
        await asyncio.sleep(0.2)  # let the server see the disconnections
    finally:
        server.stop()
    committed = {(partition, position): at for partition, position, at in done}
    latencies, missing = latencies_of(watchers, committed)
    run = LatencyRun(latencies, missing, cpu_server, cpu_client, elapsed)
    run.frames = sum(len(watcher.frames) for watcher in watchers)
    if reads is not None:
        run.hub_reads_per_notification = reads / variant.appends
    if variant.watchers == max(config.watchers):
        run.rss_per_connection = (rss_after - rss_before) / variant.watchers
    if xacts is not None:
        run.xacts = await xacts.settled() - before
        run.xact_seconds = time.monotonic() - before_at
    return run


def variants_of(config: Config) -> list[Variant]:
    """Per server and watcher count, appends at `rate`, or fewer where rate x watchers
    would pass `max_deliveries` (and then, with `overload`, at `rate` as well)."""
    plans: list[tuple[int, float]] = []
    for watchers in config.watchers:
        capped = min(config.rate, config.max_deliveries / watchers)
        plans.append((watchers, capped))
        if capped < config.rate and config.overload:
            plans.append((watchers, config.rate))
    return [
        Variant(server, watchers, rate, max(50, round(rate * config.seconds)))
        for server in (GATEWAY, PLAIN)
        for watchers, rate in plans
    ]


async def measure_latency(
    config: Config, database: Database, logs: Path
) -> tuple[list[Variant], dict[tuple[float, int], int]]:
    """Every variant's runs, and the baselines of the transaction counts: the same run
    of the plain server with one watcher (the appender's transactions, and those its
    LISTEN backend commits to read the notifications), per rate and append count."""
    variants = variants_of(config)
    appender = Appender(database)
    xacts = TransactionCount(database)
    baselines: dict[tuple[float, int], int] = {}
    try:
        for variant in variants:
            key = (variant.rate, variant.appends)
            if variant.server != GATEWAY or key in baselines:
                continue
            calibration = Variant(PLAIN, 1, variant.rate, variant.appends)
            run = await latency_run(calibration, config, database, appender, xacts, logs)
            assert run.xacts is not None
            baselines[key] = run.xacts
            progress(
                f"baseline: {run.xacts} transactions for {variant.appends} appends"
                f" at {variant.rate:g}/s"
            )
        for number in range(config.rounds):
            for variant in bench.rotated(variants, number):
                counting = xacts if variant.server == GATEWAY else None
                run = await latency_run(variant, config, database, appender, counting, logs)
                if run.xacts is not None:
                    polls = run.xact_seconds / POLL_INTERVAL
                    baseline = baselines[(variant.rate, variant.appends)]
                    run.reads_per_notification = (run.xacts - baseline - polls) / variant.appends
                variant.runs.append(run)
                reads = run.reads_per_notification
                progress(
                    f"round {number + 1}, {variant.name}: p50 {run.percentile(0.5) * 1000:.1f}"
                    f" ms, p99 {run.percentile(0.99) * 1000:.1f} ms, missing {run.missing}"
                    + ("" if reads is None else f", reads/notification {reads:.2f}")
                )
    finally:
        appender.close()
        xacts.close()
    return variants, baselines


# catch-up


def pull_http(url: str, expected: int) -> float:
    """Read the pull stream from its beginning over HTTP; rows/s."""
    import httpx

    pages = expected // PAGE_LIMIT * 2 + 10  # bound: pages are full but for the last ones
    events = 0
    cursor = "beginning"
    with httpx.Client(timeout=60.0) as client:
        started = time.perf_counter()
        for _ in range(pages):
            response = client.get(url, params={"after": cursor, "limit": PAGE_LIMIT})
            response.raise_for_status()
            body = response.json()
            events += len(body["events"])
            cursor = body["cursor"]
            if body["up_to_date"]:
                break
        seconds = time.perf_counter() - started
    if events != expected:
        raise SystemExit(f"bench/gateway.py: HTTP catch-up read {events:,} of {expected:,}")
    return events / seconds


def pull_engine(engine: subengine.Engine, partitions: int, expected: int) -> float:
    """Read the pull stream from its beginning with Engine.read loops; rows/s."""
    events = 0
    started = time.perf_counter()
    for partition in range(partitions):
        after = 0
        for _ in range(expected // PAGE_LIMIT + 10):
            got = engine.read(PULL_STREAM, partition, after, PAGE_LIMIT)
            if not got:
                break
            for item in got:
                if isinstance(item, subengine.Event):
                    events += 1
            after = got[-1].position if isinstance(got[-1], subengine.Event) else got[-1].gap_to
    seconds = time.perf_counter() - started
    if events != expected:
        raise SystemExit(f"bench/gateway.py: Engine.read catch-up read {events:,} of {expected:,}")
    return events / seconds


async def measure_catch_up(
    config: Config, database: Database, logs: Path
) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {"HTTP by cursor": [], "Engine.read loop": []}
    loop = asyncio.get_running_loop()
    async with running(GATEWAY, database, logs) as server:
        url = f"{server.url}/v1/streams/{PULL_STREAM}/events"
        with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
            # warm up: the server's cache, the pools, the plans
            pull_engine(engine, config.partitions, config.pull_events)
            for number in range(config.rounds):
                for name in bench.rotated(list(rates), number):
                    if name == "HTTP by cursor":
                        rate = await loop.run_in_executor(None, pull_http, url, config.pull_events)
                    else:
                        rate = pull_engine(engine, config.partitions, config.pull_events)
                    rates[name].append(rate)
                    progress(f"catch-up round {number + 1}, {name}: {rate:,.0f} rows/s")
    return rates


# output


@dataclass(slots=True)
class Row:
    figure: str
    value: str
    plain: str
    ratio: str
    goal: str
    ok: bool | None  # None: no goal (reference)


def report(
    config: Config,
    facts: str,
    fill_seconds: float,
    load_before: float,
    variants: list[Variant],
    baselines: dict[tuple[float, int], int],
    catch_up: dict[str, list[float]],
) -> None:
    print()
    print(bench.machine(facts, load_before))
    print(
        f"stream {LIVE_STREAM!r}: {config.partitions} partitions; single-event appends for"
        f" {config.seconds:g} s (at least 50) per run after {config.warmup} warm-up ones, at"
        f" {config.rate:g}/s or, where that passes {config.max_deliveries:,.0f} deliveries/s,"
        f" at {config.max_deliveries:,.0f}/watchers; {config.rounds} rounds in rotating"
        " order; a fresh server per run"
    )
    print(
        "the client (raw asyncio sockets, this process) and the server share the machine's"
        " cores with PostgreSQL and the appender: CPU columns are CPU seconds per second;"
        " us/frame = server CPU per events frame (plain: per notification) received"
    )
    print()
    print("append -> SSE client latency, ms: median (min-max) over rounds")
    print(
        f"  {'server':<8} {'watchers':>8} {'rate':>5} {'p50':>24} {'p99':>26} {'missing':>7}"
        f" {'server CPU':>10} {'client CPU':>10} {'us/frame':>8} {'reads/notif.':>18}"
    )
    for variant in variants:
        p50, p99 = variant.spread("p50"), variant.spread("p99")
        assert p50 is not None and p99 is not None
        server_cpu = statistics.median(r.server_cpu for r in variant.runs)
        client_cpu = statistics.median(r.client_cpu for r in variant.runs)
        per_frame = statistics.median(
            r.server_cpu * r.seconds / max(r.frames, 1) for r in variant.runs
        )
        reads = variant.spread("reads_per_notification")
        print(
            f"  {variant.server:<8} {variant.watchers:>8,} {variant.rate:>5g}"
            f" {p50.span(1000, 2):>24} {p99.span(1000, 1):>26}"
            f" {sum(r.missing for r in variant.runs):>7}"
            f" {server_cpu:>10.2f} {client_cpu:>10.2f} {per_frame * 1e6:>8.0f}"
            f" {reads.span(1, 2) if reads else '-':>18}"
        )
    print(
        "  (reads/notif.: the database's transactions (xact_commit) per notification in a"
        " gateway run, less those of the same run of the plain server with one watcher"
        f" ({', '.join(f'{n} for {a} at {r:g}/s' for (r, a), n in baselines.items())}: the"
        f" appender's and its LISTEN backend's) and one head poll per {POLL_INTERVAL:g} s)"
    )
    print()
    rows = goal_rows(config, variants, catch_up)
    print("gateway against the plain counterpart, median (min-max) over rounds:")
    print(f"  {'figure':<44} {'gateway':<30} {'plain':>12} {'ratio':>12} {'goal':>16}")
    for row in rows:
        mark = "" if row.ok is None else verdict(row.ok)
        print(
            f"  {row.figure:<44} {row.value:<30} {row.plain:>12} {row.ratio:>12}"
            f" {row.goal:>16} {mark}"
        )
    rates = "; ".join(
        f"{name}: " + ", ".join(f"{rate:,.0f}" for rate in values)
        for name, values in catch_up.items()
    )
    print(f"  (catch-up rows/s per round: {rates})")


def goal_rows(
    config: Config, variants: list[Variant], catch_up: dict[str, list[float]]
) -> list[Row]:
    rows: list[Row] = []
    gateways = [v for v in variants if v.server == GATEWAY]
    plains = {(v.watchers, v.rate): v for v in variants if v.server == PLAIN}
    goals = {
        ("p50", 100): P50_GOAL_100,
        ("p99", 100): P99_GOAL_100,
        ("p99", 1000): P99_GOAL_1000,
    }
    # the rate each watcher count runs at for its goals (a higher one is the overload)
    capped = {w: min(v.rate for v in gateways if v.watchers == w) for w in config.watchers}
    for gateway in gateways:
        plain = plains[(gateway.watchers, gateway.rate)]
        overload = gateway.rate != capped[gateway.watchers]
        for what in ("p50", "p99"):
            ours, theirs = gateway.spread(what), plain.spread(what)
            assert ours is not None and theirs is not None
            goal = None if overload else goals.get((what, gateway.watchers))
            relay = None if overload else RELAY_GOALS.get((what, gateway.watchers))
            ratio = ours.median / theirs.median
            texts, passes = [], []
            if goal is not None:
                texts.append(f"<= {goal * 1000:g} ms")
                passes.append(ours.median <= goal)
            if relay is not None:
                texts.append(f"<= {relay:g}x")
                passes.append(ratio <= relay)
            rows.append(
                Row(
                    f"{what} latency, {gateway.watchers:,} watchers, {gateway.rate:g}/s",
                    ours.span(1000, 2) + " ms",
                    f"{theirs.median * 1000:,.2f} ms",
                    f"{ratio:.1f}x",
                    ", ".join(texts) or "-",
                    all(passes) if passes else None,
                )
            )
    http = Spread.of(catch_up["HTTP by cursor"])
    plain_rate = Spread.of(catch_up["Engine.read loop"])
    ratio = http.median / plain_rate.median
    rows.append(
        Row(
            f"catch-up, {config.pull_events:,} events, rows/s",
            http.span(1, 0),
            f"{plain_rate.median:,.0f}",
            f"{ratio:.2f}x",
            f">= {CATCH_UP_GOAL}x",
            ratio >= CATCH_UP_GOAL,
        )
    )
    reference = gateways[0]
    base = reference.spread("reads_per_notification")
    assert base is not None
    # per gateway run: the database's transactions, then the gateway's own event reads
    transactions: list[Row] = []
    event_reads: list[Row] = []
    for gateway in gateways:
        reads = gateway.spread("reads_per_notification")
        hub = gateway.spread("hub_reads_per_notification")
        assert reads is not None and hub is not None
        ratio = reads.median / base.median if base.median > 0 else float("inf")
        overload = gateway.rate != capped[gateway.watchers]
        which = f"{gateway.watchers:,} watchers, {gateway.rate:g}/s"
        transactions.append(
            Row(
                f"reads/notification, {which}",
                reads.span(1, 2),
                "0 (none)",
                f"{ratio:.2f}x" + (" (ref.)" if gateway is reference else ""),
                "-" if overload else f"<= {READS_GOAL}x ref.",
                None if overload else ratio <= READS_GOAL,
            )
        )
        event_reads.append(
            Row(
                f"event reads/notif., {which}",
                hub.span(1, 2),
                "0 (none)",
                "-",
                "-" if overload else f"<= {HUB_READS_GOAL:g}",
                None if overload else hub.median <= HUB_READS_GOAL,
            )
        )
    rows += transactions + event_reads
    most = max(config.watchers)
    memory = {
        server: Spread.of(
            [
                r.rss_per_connection
                for v in variants
                if v.server == server and v.watchers == most
                for r in v.runs
                if r.rss_per_connection is not None
            ]
        )
        for server in (GATEWAY, PLAIN)
    }
    rows.append(
        Row(
            f"memory per idle SSE connection ({most:,})",
            memory[GATEWAY].span(1 / 1024, 1) + " KB",
            f"{memory[PLAIN].median / 1024:.1f} KB",
            f"{memory[GATEWAY].median / memory[PLAIN].median:.2f}x",
            f"<= {MEMORY_GOAL // 1024} KB",
            memory[GATEWAY].median <= MEMORY_GOAL,
        )
    )
    return rows


# the run


def parse_args(argv: Sequence[str] | None) -> tuple[Any, Config]:
    parser = bench.arguments(
        "Benchmark the HTTP gateway against a hand-written SSE relay.",
        quick="fewer events: a smoke test",
    )
    add = parser.add_argument
    add("--watchers", default="10,100,1000", help="SSE connections (10,100,1000)")
    add("--seconds", type=float, help="seconds of counted appends per run (3; quick 1)")
    add("--rate", type=float, default=100.0, help="appends per second (100)")
    add("--max-deliveries", type=float, default=10_000, help="rate x watchers at most (10,000)")
    add("--no-overload", action="store_true", help="skip the runs above --max-deliveries")
    add("--partitions", type=int, default=4, help="partitions per stream (4)")
    add("--pull-events", type=int, help="events of the catch-up stream (200,000; quick 20,000)")
    add("--seed", type=int, default=20261201, help="seed of the events")
    args = bench.parse(parser, argv)
    config = Config(
        watchers=tuple(sorted(int(n) for n in args.watchers.split(","))),
        rounds=args.rounds,
        seconds=args.seconds or (1.0 if args.quick else 3.0),
        warmup=10 if args.quick else 20,
        rate=args.rate,
        max_deliveries=args.max_deliveries,
        overload=not (args.no_overload or args.quick),
        partitions=args.partitions,
        pull_events=args.pull_events or (20_000 if args.quick else 200_000),
        seed=args.seed,
    )
    return args, config


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse_args(argv)
    raise_file_limit(max(config.watchers))
    load_before = os.getloadavg()[0]
    run_started = time.perf_counter()
    with (
        bench.benchmark_database(bench.dsn_of(args), DATABASE_PREFIX, migrate=True) as database,
        tempfile.TemporaryDirectory() as logs,
    ):
        fill_seconds = prepare(database, config)
        progress(f"appended {config.pull_events:,} events in {fill_seconds:.1f} s")
        facts = bench.server_facts(database.dsn)

        async def measure() -> tuple[
            list[Variant], dict[tuple[float, int], int], dict[str, list[float]]
        ]:
            variants, baselines = await measure_latency(config, database, Path(logs))
            catch_up = await measure_catch_up(config, database, Path(logs))
            return variants, baselines, catch_up

        variants, baselines, catch_up = asyncio.run(measure())
    report(config, facts, fill_seconds, load_before, variants, baselines, catch_up)
    print(f"run time {time.perf_counter() - run_started:.0f} s, with setup")
    return 0


if __name__ == "__main__":
    sys.exit(main())
