"""subengine's gateway beside the Durable Streams reference server (@durable-streams/server
0.3.7, in memory, and file-backed with an fdatasync per append): issue 26's proof. One
httpx client, loopback; every run must deliver every event once and in order, or it exits.

1. catch-up read of N small JSON events, events/s; plain: one SELECT of the same rows.
   Goals: gateway >= 1.0x the reference file-backed, and >= 0.5x the SELECT.
2. append of the same N in batches of 500, events/s; plain: COPY into a table shaped like
   `events`, a transaction per batch. Goals: gateway >= 0.9x COPY, >= 0.5x reference file.
3. append -> one SSE reader, and -> one long-poll reader, at 100 appends/s: p50 and p99.
   Goal: gateway <= the reference file-backed.

subengine runs twice: its own API (/v1, pages of events with their envelope) and its
Durable Streams surface (`--durable-streams`), which the same client code as the
reference's reads and writes with the same requests and bodies; each gets the goals.
Its own API's catch-up is also read with `fields=data` (each event's data and place,
what the Durable Streams reads carry), and gets the catch-up goals too.

    .venv/bin/python bench/door.py            # 50,000 events, 3 rounds: a few minutes
    .venv/bin/python bench/door.py --quick    # a smoke test
    .venv/bin/python bench/door.py --dsn postgresql://...   # or SUBENGINE_DSN; else embedded

Node.js 18+ is needed: the reference is installed with npm into ~/.cache/subengine-bench
on first use. A database of its own (`bench_door_<pid>`) is dropped at the end; every
server listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import _harness as bench
import httpx
import psycopg
from _door import (
    HEADERS,
    HTTP_TIMEOUT,
    PLAIN_SCHEMA,
    VERSION,
    Door,
    Failed,
    GatewayDoor,
    GatewayDsDoor,
    Meter,
    Received,
    ReferenceDoor,
    check,
    copy_batches,
    plain_table,
    profiled,
    reference_package,
    select_rows,
    selected,
    stored,
)
from _harness import SCHEMA, Connection, Spread, progress, verdict

import subengine

DATABASE_PREFIX = "bench_door_"
FIGURES = ("catch-up", "append", "latency")
MODES = ("sse", "long-poll")
SQL = "one SQL read"
COPY = "COPY"
KEYS = 1000
DRAIN_TIMEOUT = 10.0
# goals (issue 26)
CATCH_UP_VS_FILE = 1.0
CATCH_UP_VS_SQL = 0.5
APPEND_VS_COPY = 0.9
APPEND_VS_FILE = 0.5
LATENCY_VS_FILE = 1.0


@dataclass(frozen=True, slots=True)
class Config:
    events: int
    batch: int
    partitions: int
    live_events: int
    warmup: int
    rate: float
    rounds: int
    figures: tuple[str, ...]
    py_spy: Path | None
    seed: int


@dataclass(slots=True)
class Figure:
    """Per variant, a value per round, and per round the CPU seconds by kind (Meter's) and
    the bytes read per event."""

    values: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, variant: str, value: float, cpu: dict[str, float | None] | None = None) -> None:
        self.values.setdefault(variant, []).append(value)
        for kind, seconds in (cpu or {}).items():
            if seconds is not None:
                self.cpu.setdefault((variant, kind), []).append(seconds)

    def spread(self, variant: str) -> Spread:
        return Spread.of(self.values[variant])

    def cpu_text(self, variant: str, kind: str) -> str:
        values = self.cpu.get((variant, kind))
        digits = 0 if kind == "bytes/event" else 2
        return f"{Spread.of(values).median:11.{digits}f}" if values else f"{'-':>11}"


@dataclass(frozen=True, slots=True)
class Workload:
    """The events, as each side takes them: JSON bodies of `batch` events, (key, type,
    data text) rows for COPY, and one-event bodies for the latency runs."""

    batches: list[bytes]
    rows: list[tuple[str, str, str]]
    singles: list[bytes]
    size: float  # bytes of JSON per event, on average


def workload(config: Config) -> Workload:
    rng = random.Random(config.seed)
    keys = bench.order_keys(KEYS)

    def event(n: int) -> dict[str, Any]:
        key = keys[n % KEYS]
        return {"key": key, "type": "OrderUpdated", "data": {**bench.order_data(rng, key), "n": n}}

    events = [event(n) for n in range(config.events)]
    batches = [
        json.dumps(events[first : first + config.batch]).encode()
        for first in range(0, config.events, config.batch)
    ]
    rows = [(e["key"], e["type"], json.dumps(e["data"])) for e in events]
    singles = [json.dumps([event(n)]).encode() for n in range(config.warmup + config.live_events)]
    size = sum(len(json.dumps(e)) for e in events) / len(events)
    return Workload(batches, rows, singles, size)


def fill(door: Door, stream: str, batches: list[bytes]) -> None:
    door.create(stream)
    with httpx.Client(timeout=HTTP_TIMEOUT, headers=HEADERS) as client:
        for body in batches:
            door.append(client, stream, body)


# 1. catch-up


def read_once(door: Door | None, conn: Connection, stream: str, expected: int) -> Meter:
    """One read of `stream` from its beginning, checked."""
    if door is None:
        with Meter(None, conn) as meter:
            rows = select_rows(conn, stream)
        check(selected(rows), expected, f"{SQL} of {stream}")
        return meter
    read = door.bytes_read
    with httpx.Client(timeout=HTTP_TIMEOUT, headers=HEADERS) as client:
        with Meter(door, conn) as meter:
            pages = door.read_all(client, stream, expected)
    check(door.delivered(pages), expected, f"{door.name}: catch-up of {stream}")
    meter.cpu["bytes/event"] = (door.bytes_read - read) / expected
    return meter


def gateway_of(doors: list[Door]) -> Door:
    """The native gateway, the one --py-spy samples."""
    return next(door for door in doors if isinstance(door, GatewayDoor))


def catch_up(config: Config, doors: list[Door], conn: Connection, work: Workload) -> Figure:
    stream = "door-catch-up"
    for each in doors:
        fill(each, stream, work.batches)
    progress(f"catch-up: {config.events:,} events in each server's {stream}")
    by_name: dict[str, Door | None] = {}
    for each in doors:
        by_name[each.name] = each
        if isinstance(each, GatewayDoor):  # and read for the data alone
            by_name[LEAN] = each.reading("data", LEAN)
    by_name[SQL] = None
    for door in by_name.values():  # warm-up: caches, pools, plans, the JIT
        read_once(door, conn, stream, config.events)
    figure = Figure()
    with profiled(gateway_of(doors), config.py_spy, "catch-up"):
        for number, name in bench.rotating(list(by_name), config.rounds):
            meter = read_once(by_name[name], conn, stream, config.events)
            figure.add(name, config.events / meter.seconds, meter.cpu)
            progress(f"catch-up round {number + 1}, {name}: {figure.values[name][-1]:,.0f}/s")
    return figure


# 2. append


def append_once(
    door: Door | None, conn: Connection, config: Config, work: Workload, stream: str
) -> Meter:
    """Append every batch to a new `stream`, then check what it holds."""
    if door is None:
        with Meter(None, conn) as meter:
            copy_batches(conn, stream, work.rows, config.batch, config.partitions)
        check(stored(conn, PLAIN_SCHEMA, stream), len(work.rows), f"{COPY} into {stream}")
        return meter
    door.create(stream)
    with httpx.Client(timeout=HTTP_TIMEOUT, headers=HEADERS) as client:
        with Meter(door, conn) as meter:
            for body in work.batches:
                door.append(client, stream, body)
        if isinstance(door, GatewayDoor):  # from its table: the gateway stays idle
            events = stored(conn, SCHEMA, stream)
        else:
            events = door.delivered(door.read_all(client, stream, config.events))
    check(events, config.events, f"{door.name}: append to {stream}")
    return meter


def append(config: Config, doors: list[Door], conn: Connection, work: Workload) -> Figure:
    plain_table(conn)
    by_name: dict[str, Door | None] = {each.name: each for each in doors}
    by_name[COPY] = None
    warm = Workload(work.batches[:4], work.rows[: 4 * config.batch], [], work.size)
    warm_config = replace(config, events=len(warm.rows))
    for door in by_name.values():
        append_once(door, conn, warm_config, warm, "door-append-warm-up")
    figure = Figure()
    with profiled(gateway_of(doors), config.py_spy, "append"):
        for number, name in bench.rotating(list(by_name), config.rounds):
            meter = append_once(by_name[name], conn, config, work, f"door-append-{number}")
            figure.add(name, config.events / meter.seconds, meter.cpu)
            progress(f"append round {number + 1}, {name}: {figure.values[name][-1]:,.0f}/s")
    return figure


# 3. latency


async def paced(
    door: Door, client: httpx.AsyncClient, stream: str, bodies: list[bytes], rate: float
) -> list[float]:
    """Append each body on a schedule of `rate` a second; when each was sent."""
    sent = []
    start = time.perf_counter()
    for number, body in enumerate(bodies):
        delay = start + number / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent.append(time.perf_counter())
        await door.append_async(client, stream, body)
    return sent


async def arrived(received: Received, reader: asyncio.Task[None], count: int) -> None:
    """Until `count` events arrived, the reader failed, or DRAIN_TIMEOUT passed."""
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while len(received.at) < count and time.monotonic() < deadline:
        if reader.done():
            reader.result()
        await asyncio.sleep(0.005)


async def live_run(
    door: Door, mode: str, stream: str, config: Config, work: Workload
) -> tuple[list[float], float]:
    """Warm-up appends, then the counted ones, one at a time at up to config.rate a
    second: each counted event's latency from its append's request to its arrival at the
    reader (seconds), and the appends a second reached."""
    door.create(stream)
    received = Received()
    total = len(work.singles)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, headers=HEADERS) as client:
        reader = asyncio.create_task(door.follow(client, stream, mode, received))
        try:
            sent = await paced(door, client, stream, work.singles[: config.warmup], config.rate)
            await arrived(received, reader, config.warmup)
            rest = work.singles[config.warmup :]
            sent += await paced(door, client, stream, rest, config.rate)
            await arrived(received, reader, total)
        finally:
            reader.cancel()
            with suppress(asyncio.CancelledError):
                await reader
    check(received.events, total, f"{door.name}: {mode} reader of {stream}")
    counted = sent[config.warmup :]
    rate = (len(counted) - 1) / (counted[-1] - counted[0])
    return [received.at[n] - sent[n] for n in range(config.warmup, total)], rate


def latency(config: Config, doors: list[Door], work: Workload) -> dict[str, Figure]:
    figures = {mode: Figure() for mode in MODES}
    variants = [(mode, door) for mode in MODES for door in doors]
    for number, (mode, door) in bench.rotating(variants, config.rounds):
        stream = f"door-{mode}-{door.child.kind}-{number}"
        latencies, rate = asyncio.run(live_run(door, mode, stream, config, work))
        p50, p99 = bench.percentile(latencies, 0.5) * 1000, bench.percentile(latencies, 0.99) * 1000
        figures[mode].add(f"{door.name} p50", p50)
        figures[mode].add(f"{door.name} p99", p99)
        figures[mode].add(f"{door.name} rate", rate)
        progress(
            f"latency round {number + 1}, {mode}, {door.name}: p50 {p50:.1f} ms,"
            f" p99 {p99:.1f} ms, {rate:.0f} appends/s"
        )
    return figures


# output

MEMORY, FILE, GATEWAY, DS = (
    "reference, memory",
    "reference, file",
    "subengine gateway",
    "subengine, DS",
)
LEAN = "gateway fields=data"  # the native catch-up, reading only the events' data


def throughput(title: str, figure: Figure, config: Config) -> None:
    read = "read" in title
    kinds = ("server", "PostgreSQL", "client", "bytes/event")[: 4 if read else 3]
    bytes_read = "; bytes read per event" if read else ""
    print(f"{title}: events/s, median (min-max); seconds; CPU s per run (medians){bytes_read}")
    print(f"  {'':<20} {'events/s':>30} {'seconds':>9} " + " ".join(f"{k:>11}" for k in kinds))
    for name, values in figure.values.items():
        spread = Spread.of(values)
        cpu = " ".join(figure.cpu_text(name, kind) for kind in kinds)
        print(f"  {name:<20} {spread.span(1, 0):>30} {config.events / spread.median:9.3f} {cpu}")


def short(value: float) -> str:
    return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.1f}k"


def report(config: Config, results: dict[str, Any], work: Workload, facts: str) -> None:
    print()
    print(facts)
    print(
        f"{config.events:,} events of {work.size:.0f} bytes of JSON on average; appends in"
        f" batches of {config.batch}; the gateway's streams have {config.partitions}"
        f" partitions; reference {VERSION}; one httpx client without compression, loopback;"
        f" {config.rounds} rounds in rotating order. The machine is shared: the figures are"
        " indicative."
    )
    table: list[tuple[str, ...]] = [("figure", MEMORY, FILE, "plain PostgreSQL", GATEWAY, DS, LEAN)]
    goals: list[tuple[str, float, float, str, float]] = []  # name, ours, theirs, sense, goal
    for name, plain, title in (
        ("catch-up", SQL, f"catch-up read of {config.events:,} events"),
        ("append", COPY, f"append of {config.events:,} events, batches of {config.batch}"),
    ):
        if name not in results:
            continue
        figure = results[name]
        print()
        throughput(title, figure, config)
        medians = {variant: figure.spread(variant).median for variant in figure.values}
        cells = [
            short(medians[v]) if v in medians else "-"
            for v in (MEMORY, FILE, plain, GATEWAY, DS, LEAN)
        ]
        table.append(
            (f"{title}, events/s", cells[0], cells[1], f"{cells[2]} ({plain})", *cells[3:])
        )
        for door, tag in ((GATEWAY, ""), (DS, " (DS)"), (LEAN, " (fields=data)")):
            if door not in medians:
                continue
            ours = medians[door]
            if name == "catch-up":
                goals.append(
                    (
                        f"catch-up{tag} vs reference, file",
                        ours,
                        medians[FILE],
                        ">=",
                        CATCH_UP_VS_FILE,
                    )
                )
                goals.append(
                    (f"catch-up{tag} vs one SQL read", ours, medians[SQL], ">=", CATCH_UP_VS_SQL)
                )
            else:
                goals.append((f"append{tag} vs COPY", ours, medians[COPY], ">=", APPEND_VS_COPY))
                goals.append(
                    (f"append{tag} vs reference, file", ours, medians[FILE], ">=", APPEND_VS_FILE)
                )
    if "latency" in results:
        print()
        print(
            f"append -> reader latency, ms, one reader, appends one at a time at up to"
            f" {config.rate:g}/s, {config.live_events} counted after {config.warmup} warm-up"
            " ones; median (min-max) over rounds; the appends/s reached"
        )
        for mode, figure in results["latency"].items():
            cells = []
            for door in (MEMORY, FILE, GATEWAY, DS):
                p50, p99 = figure.spread(f"{door} p50"), figure.spread(f"{door} p99")
                rate = figure.spread(f"{door} rate").median
                print(
                    f"  {mode:<9} {door:<18} p50 {p50.span(1, 2):>20}  p99 {p99.span(1, 2):>22}"
                    f"  {rate:5.0f}/s"
                )
                cells.append(f"{p50.median:.1f} / {p99.median:.1f}")
            table.append(
                (f"append -> {mode} reader, p50 / p99 ms", cells[0], cells[1], "-", *cells[2:], "-")
            )
            for door, tag in ((GATEWAY, ""), (DS, " (DS)")):
                for what in ("p50", "p99"):
                    ours, theirs = (figure.spread(f"{d} {what}").median for d in (door, FILE))
                    goals.append(
                        (
                            f"{mode}{tag} {what} vs reference, file",
                            ours,
                            theirs,
                            "<=",
                            LATENCY_VS_FILE,
                        )
                    )
    print()
    for row in table:
        print("| " + " | ".join(row) + " |")
        if row is table[0]:
            print("|---|" + "---:|" * (len(row) - 1))
    print()
    print("goals: gateway, counterpart (medians), their ratio")
    for name, ours, theirs, sense, goal in goals:
        ratio = ours / theirs
        ok = ratio >= goal if sense == ">=" else ratio <= goal
        print(
            f"  {name:<45} {ours:>12,.2f} {theirs:>12,.2f} {ratio:>6.2f}x"
            f"  goal {sense} {goal:g}x  {verdict(ok)}"
        )


# the run


def parse_args(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    parser = bench.arguments(__doc__.splitlines()[0], quick="5,000 events, 100 live appends")
    add = parser.add_argument
    add("--events", type=int, help="events read and appended (50,000; quick 5,000)")
    add("--batch", type=int, default=500, help="events per append request (500)")
    add("--partitions", type=int, default=4, help="partitions of the gateway's streams (4)")
    add("--live-events", type=int, help="counted appends per latency run (500; quick 100)")
    add("--rate", type=float, default=100.0, help="appends per second, latency runs (100)")
    add("--figures", default=",".join(FIGURES), help=f"some of {','.join(FIGURES)}")
    add("--py-spy", type=Path, help="folder: sample the gateway with py-spy (catch-up, append)")
    add("--seed", type=int, default=20261128, help="seed of the events")
    args = bench.parse(parser, argv)
    figures = tuple(name.strip() for name in args.figures.split(","))
    if not figures or set(figures) - set(FIGURES):
        parser.error(f"--figures takes some of {','.join(FIGURES)}, not {args.figures!r}")
    events = bench.sized(args, "events", 5_000, 50_000)
    if events < args.batch or args.batch < 1:
        parser.error("--events must be at least --batch, which must be at least 1")
    config = Config(
        events=events,
        batch=args.batch,
        partitions=args.partitions,
        live_events=bench.sized(args, "live_events", 100, 500),
        warmup=10 if args.quick else 20,
        rate=args.rate,
        rounds=args.rounds,
        figures=figures,
        py_spy=args.py_spy,
        seed=args.seed,
    )
    return config, args


def data_directory(conn: psycopg.Connection[Any]) -> Path | None:
    """The database server's data directory, when it is on this machine and we may read
    the setting (superusers and pg_read_all_settings); else None."""
    try:
        row = conn.execute("SHOW data_directory").fetchone()
    except psycopg.Error:
        return None
    path = Path(row[0]) if row else None
    return path if path is not None and path.exists() else None


def file_system(path: Path) -> str:
    """The type of the file system holding `path` (from /proc/mounts), or "unknown"."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "unknown"
    resolved, best, kind = path.resolve(), -1, "unknown"
    for line in mounts:
        fields = line.split()
        if len(fields) >= 3 and resolved.is_relative_to(fields[1]) and len(fields[1]) > best:
            best, kind = len(fields[1]), fields[2]
    return kind


def main(argv: Sequence[str] | None = None) -> int:
    config, args = parse_args(argv)
    try:
        package = reference_package()
        load_before = os.getloadavg()[0]
        work = workload(config)
        with (
            bench.benchmark_database(bench.dsn_of(args), DATABASE_PREFIX, migrate=True) as db,
            tempfile.TemporaryDirectory() as scratch,
            subengine.Engine(db.dsn, schema=SCHEMA) as engine,
            psycopg.connect(db.dsn, autocommit=True) as conn,
            contextlib.ExitStack() as stack,
        ):
            # the file-backed reference's fdatasync has to reach the disk the WAL's fsync
            # reaches: beside the database's data when it is on this machine, and never
            # under TMPDIR, which may be a memory file system (free to sync)
            data = data_directory(conn)
            place = data.parent if data is not None and os.access(data.parent, os.W_OK) else None
            files = stack.enter_context(
                tempfile.TemporaryDirectory(dir=place or Path.cwd(), prefix=".door-reference-")
            )
            logs = Path(scratch)
            doors: list[Door] = [
                ReferenceDoor(package, "memory", logs / "memory", logs),
                ReferenceDoor(package, "file", Path(files) / "file", logs),
                GatewayDoor(db, engine, config.partitions, logs),
                GatewayDsDoor(db, logs),
            ]
            results: dict[str, Any] = {}
            try:
                for door in doors:
                    door.started()
                if "catch-up" in config.figures:
                    results["catch-up"] = catch_up(config, doors, conn, work)
                if "append" in config.figures:
                    results["append"] = append(config, doors, conn, work)
                if "latency" in config.figures:
                    results["latency"] = latency(config, doors, work)
            finally:
                for door in doors:
                    door.stop()
            facts = bench.machine(bench.server_facts(db.dsn), load_before)
            facts += (
                f"\nreference, file: its data on {file_system(Path(files))}; the database's "
                + (f"on {file_system(data)}" if data is not None else "not on this machine")
            )
    except Failed as error:
        raise SystemExit(f"bench/door.py: {error}") from None
    report(config, results, work, facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
