"""What webhook deliveries cost, next to a plain loop posting the same batches.

Run it from the repository root:

    .venv/bin/python bench/webhooks.py            # about 5 minutes on 2 cores
    .venv/bin/python bench/webhooks.py --quick    # about 2 minutes, a smoke test
    .venv/bin/python bench/webhooks.py --dsn postgresql://...   # or set SUBENGINE_DSN

Without a DSN it uses the embedded PostgreSQL (`subengine.Engine()`), which keeps running
afterwards (stop it with `.venv/bin/subengine db stop`). Every run creates a database of
its own on that server (`bench_webhooks_<pid>`), migrates it, and drops it at the end.
Every server this script starts listens on 127.0.0.1 only.

What each figure means
----------------------
The sink. One process of this script (`--sink`, a raw asyncio HTTP/1.1 server with
keep-alive) receives every POST: it echoes challenges and answers event batches 204,
recording for each its arrival (time.monotonic), subscription, partition, `after`,
`through`, the events' positions and the body's size. The bench takes the records over
a small control endpoint when a run is over.

Variants. "gateway x1": one `subengine serve --workers 1 --delivery-concurrency 4
--callback-allow 127.0.0.0/8` process; "gateway x3": three such processes on their own
ports, whose delivery workers compete through the engine's partition locks. Each gateway
run has a fresh stream of `--partitions` partitions holding `--events` preloaded events
(about 150 bytes of JSON data each) and fresh servers; a webhook (`start` "beginning",
`max_events` `--max-events`) is then subscribed on the first server. "plain xN": N
threads, each with its own keep-alive `httpx.Client`, post batches built beforehand from
a stream of the same events (the same JSON shape as the gateway's, same sizes) to the
same sink, serializing and signing each one (Standard Webhooks) as it goes, with no
database; each thread sends the batches of its own partitions in order. N is the
gateway's delivery slots, at most the partitions (one batch per partition is in flight
at a time, so the gateway never uses more): 4 beside x1, 8 beside x3.

Throughput (deliveries/s). Events received after the first batch of a run, divided by
the time from that batch's arrival to the last one's. A gateway's second and third
processes find a new webhook at their next supervisor round (about a second), which the
x3 figure includes.

Latency (append -> receiver). After the preloaded events arrived, single-event
transactions are appended to random keys at `--rate` per second for `--seconds`; latency
of an event = its arrival at the sink - the moment `Engine.append` returned (its commit;
CLOCK_MONOTONIC is one clock for every process of the machine). p50 and p99 over the
events of a run; the table gives the median (min-max) over the rounds.

Checks, over every batch a run's subscription received, in arrival order per partition:
a batch whose `through` is not beyond the last accepted one is a redelivery (a repeat,
allowed by at-least-once); any other batch whose `after` is not the last accepted
`through` is a reordering; a position of the stream never received is a loss. Goal:
zero reorderings and zero losses, and gateway deliveries/s >= 0.7x the plain loop with
as many senders, measured in the same run. The machine's other load distorts every
figure: the script prints the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

import subengine
from subengine.gateway._delivery import event_body

SCHEMA = "subengine"  # every Engine and server here is given it, whatever the environment
DATABASE_PREFIX = "bench_webhooks_"
PLAIN_STREAM = "plain-source"
SLOTS = 4  # --delivery-concurrency of each gateway process
KEYS = 1000
APPEND_BATCH = 1000
# bounds of every wait
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
CONSENT_TIMEOUT = 30.0
DRAIN_SECONDS_MIN = 60.0
DRAIN_RATE_MIN = 200.0  # events/s below which a drain is given up
POLL = 0.05
HTTP_TIMEOUT = 30.0
# goals
RATIO_GOAL = 0.7
# the sink's status lines
REASONS = {200: b"OK", 204: b"No Content", 404: b"Not Found"}

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Config:
    events: int
    partitions: int
    max_events: int
    rounds: int
    rate: float
    seconds: float
    seed: int


@dataclass(frozen=True, slots=True)
class Database:
    admin_dsn: str
    name: str
    dsn: str


@dataclass(frozen=True, slots=True)
class Spread:
    """Median, min and max of some measurements."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def text(self, scale: float = 1.0, digits: int = 0) -> str:
        return (
            f"{self.median * scale:,.{digits}f} ({self.low * scale:,.{digits}f}"
            f"-{self.high * scale:,.{digits}f})"
        )


@dataclass(frozen=True, slots=True)
class Batch:
    """One POST the sink received: (arrival, partition, after, through, positions, bytes)."""

    at: float
    partition: int
    after: int
    through: int
    positions: tuple[int, ...]
    size: int


@dataclass(frozen=True, slots=True)
class Checked:
    reorderings: int
    redeliveries: int
    losses: int


@dataclass(slots=True)
class Run:
    rate: float  # events/s
    batches: int
    mean_bytes: float
    checked: Checked
    latencies: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Variant:
    name: str
    kind: str  # "gateway" or "plain"
    senders: int  # gateway: processes; plain: threads
    runs: list[Run] = field(default_factory=list)


def rotated(items: Sequence[T], by: int) -> list[T]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# the sink


class Sink:
    """What the sink process received, per subscription."""

    def __init__(self) -> None:
        self.records: dict[str, list[list[Any]]] = {}
        self.counts: dict[str, int] = {}

    def handle(self, method: bytes, path: bytes, body: bytes, at: float) -> tuple[int, bytes]:
        if method == b"POST" and path == b"/hook":
            message = json.loads(body)
            if message.get("type") == "challenge":
                return 200, json.dumps({"challenge": message["challenge"]}).encode()
            subscription = message["subscription"]
            positions = [event["position"] for event in message["events"]]
            self.records.setdefault(subscription, []).append(
                [
                    at,
                    message["partition"],
                    message["after"],
                    message["through"],
                    positions,
                    len(body),
                ]
            )
            self.counts[subscription] = self.counts.get(subscription, 0) + len(positions)
            return 204, b""
        subscription = path.rpartition(b"/")[2].decode()
        if method == b"GET" and path.startswith(b"/count/"):
            return 200, str(self.counts.get(subscription, 0)).encode()
        if method == b"POST" and path.startswith(b"/take/"):
            self.counts.pop(subscription, None)
            return 200, json.dumps(self.records.pop(subscription, [])).encode()
        if path == b"/healthz":
            return 200, b"ok"
        return 404, b""


class SinkConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to the sink (Content-Length bodies only)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buffer[:end]).split(b"\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            method, path = lines[0].split(b" ")[:2]
            status, answer = self.sink.handle(method, path, body, time.monotonic())
            assert self.transport is not None
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\ncontent-type: application/json\r\n\r\n"
                % (status, REASONS[status], len(answer))
                + answer
            )


def run_sink(port: int) -> None:
    async def serve() -> None:
        sink = Sink()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: SinkConnection(sink), "127.0.0.1", port)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        async with server:
            await stop.wait()

    asyncio.run(serve())


# processes


class Process:
    """A child process (the sink or `subengine serve`) on a free loopback port."""

    def __init__(self, kind: str, command: list[str], env: dict[str, str], logs: Path) -> None:
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logs / f"{kind}-{self.port}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [*command, str(self.port)], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def started(self) -> Process:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"bench/webhooks.py: the {self.kind} exited:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"bench/webhooks.py: the {self.kind} did not start")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                progress(f"the {self.kind} did not stop on SIGTERM; killed")
                self.process.kill()
                self.process.wait(STOP_TIMEOUT)


def start_sink(logs: Path) -> Process:
    return Process("sink", [sys.executable, __file__, "--sink"], dict(os.environ), logs).started()


@contextmanager
def gateways(count: int, database: Database, logs: Path) -> Iterator[list[Process]]:
    env = {**os.environ, "SUBENGINE_DSN": database.dsn, "SUBENGINE_SCHEMA": SCHEMA}
    command = [
        str(Path(sys.executable).parent / "subengine"),
        "serve",
        "--host",
        "127.0.0.1",
        "--workers",
        "1",
        "--delivery-concurrency",
        str(SLOTS),
        "--callback-allow",
        "127.0.0.0/8",
        "--no-access-log",
        "--port",
    ]
    processes = [Process("gateway", command, env, logs) for _ in range(count)]
    try:
        yield [process.started() for process in processes]
    finally:
        for process in processes:
            process.stop()


# the database


@contextmanager
def benchmark_database(dsn: str | None) -> Iterator[Database]:
    with subengine.Engine(dsn) as engine:  # the embedded server when no DSN is given
        admin_dsn = engine.dsn
    name = f"{DATABASE_PREFIX}{os.getpid()}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8'").format(
                sql.Identifier(name)
            )
        )
    database = Database(admin_dsn, name, make_conninfo(admin_dsn, dbname=name))
    try:
        with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
            engine.migrate()
        yield database
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def server_facts(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        values = []
        for setting in ("server_version", "fsync", "synchronous_commit"):
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(setting))).fetchone()
            values.append(str(row[0]) if row else "?")
    return f"PostgreSQL {values[0]}, fsync={values[1]}, synchronous_commit={values[2]}"


def order_data(rng: random.Random, key: str) -> dict[str, Any]:
    """About 150 bytes of JSON, like the other benchmarks' events."""
    return {
        "order": key,
        "customer": f"customer-{rng.randrange(100_000):05d}",
        "sku": f"SKU-{rng.randrange(50_000):05d}",
        "quantity": rng.randint(1, 5),
        "unit_price": f"{rng.randint(99, 99_999) / 100:.2f}",
        "currency": "EUR",
        "channel": "web",
    }


def preload(engine: subengine.Engine, stream: str, config: Config) -> None:
    rng = random.Random(config.seed)
    keys = [f"order-{n:05d}" for n in range(KEYS)]
    engine.create_stream(stream, config.partitions)
    for first in range(0, config.events, APPEND_BATCH):
        batch = []
        for _ in range(min(APPEND_BATCH, config.events - first)):
            key = rng.choice(keys)
            batch.append(subengine.NewEvent(key, "OrderUpdated", order_data(rng, key)))
        engine.append(stream, batch)


# checks and figures


def take(sink: Process, subscription: str) -> list[Batch]:
    records = httpx.post(f"{sink.url}/take/{subscription}", timeout=HTTP_TIMEOUT).json()
    return [Batch(r[0], r[1], r[2], r[3], tuple(r[4]), r[5]) for r in records]


def wait_for_events(
    sink: Process, subscription: str, wanted: int, what: str, diagnose: Callable[[], str]
) -> None:
    """Until the sink counted `wanted` events of `subscription`, bounded in time: past the
    bound, what `diagnose` tells is printed and the missing events count as losses."""
    deadline = time.monotonic() + max(DRAIN_SECONDS_MIN, wanted / DRAIN_RATE_MIN)
    got = 0
    while time.monotonic() < deadline:
        got = int(httpx.get(f"{sink.url}/count/{subscription}", timeout=HTTP_TIMEOUT).text)
        if got >= wanted:
            return
        time.sleep(POLL)
    progress(f"{what}: the sink got {got:,} of {wanted:,} events in time\n{diagnose()}")


def check(batches: Sequence[Batch], heads: dict[int, int]) -> Checked:
    """Reorderings, redeliveries and losses of `batches` (in arrival order) against a
    stream whose partitions end at `heads`."""
    last: dict[int, int] = {}
    received: dict[int, set[int]] = {}
    reorderings = redeliveries = 0
    for batch in sorted(batches, key=lambda b: b.at):
        previous = last.get(batch.partition, 0)
        if batch.through <= previous:
            redeliveries += 1
            continue
        if batch.after != previous:
            reorderings += 1
        last[batch.partition] = batch.through
        received.setdefault(batch.partition, set()).update(batch.positions)
    losses = sum(
        1
        for partition, head in heads.items()
        for position in range(1, head + 1)
        if position not in received.get(partition, ())
    )
    return Checked(reorderings, redeliveries, losses)


def rate_of(batches: Sequence[Batch]) -> float:
    """Events/s from the first batch's arrival to the last's (the first batch's events
    arrived before the clock started, so they are not counted)."""
    ordered = sorted(batches, key=lambda b: b.at)
    seconds = ordered[-1].at - ordered[0].at
    events = sum(len(b.positions) for b in ordered[1:])
    return events / seconds if seconds > 0 else float("nan")


# the gateway runs


def gateway_run(
    variant: Variant, number: int, config: Config, database: Database, sink: Process, logs: Path
) -> Run:
    stream = f"bench-{number}-{variant.senders}"
    subscription = f"bench-{number}-{variant.senders}-{secrets.token_hex(4)}"
    rng = random.Random(config.seed + number)
    with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
        preload(engine, stream, config)
        preloaded = engine.heads(stream)
        with gateways(variant.senders, database, logs) as servers:
            body = {
                "callback": f"{sink.url}/hook",
                "streams": [stream],
                "start": "beginning",
                "max_events": config.max_events,
            }
            answer = httpx.put(
                f"{servers[0].url}/v1/webhooks/{subscription}", json=body, timeout=HTTP_TIMEOUT
            )
            if answer.status_code != 202:
                raise SystemExit(f"bench/webhooks.py: subscribing: {answer.text}")
            deadline = time.monotonic() + CONSENT_TIMEOUT
            hook = f"{servers[0].url}/v1/webhooks/{subscription}"
            while httpx.get(hook, timeout=HTTP_TIMEOUT).json()["state"] != "active":
                if time.monotonic() > deadline:
                    raise SystemExit("bench/webhooks.py: the challenge was not answered")
                time.sleep(POLL)

            def diagnose() -> str:
                shown = httpx.get(hook, timeout=HTTP_TIMEOUT).text
                logs = "\n".join(
                    line
                    for server in servers
                    for line in server.output().splitlines()
                    if "WARNING" in line or "ERROR" in line or "webhook" in line.lower()
                )
                return f"the webhook: {shown}\nthe gateways' warnings:\n{logs[-3000:]}"

            wait_for_events(
                sink, subscription, config.events, f"{variant.name}, preloaded", diagnose
            )
            loaded = take(sink, subscription)
            # latency: single-event appends at a steady rate
            keys = [f"live-{n:04d}" for n in range(KEYS)]
            appends = max(1, round(config.rate * config.seconds))
            committed: dict[tuple[int, int], float] = {}
            started = time.monotonic()
            for n in range(appends):
                wait = started + n / config.rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                key = rng.choice(keys)
                (event,) = engine.append(
                    stream, [subengine.NewEvent(key, "Ticked", {"n": n, "key": key})]
                )
                committed[(event.partition, event.position)] = time.monotonic()
            wait_for_events(sink, subscription, appends, f"{variant.name}, appended", diagnose)
            live = take(sink, subscription)
            heads = engine.heads(stream)
            httpx.delete(hook, timeout=HTTP_TIMEOUT)
    if sum(preloaded.values()) != config.events:
        raise SystemExit("bench/webhooks.py: the preload did not append every event")
    latencies = [
        batch.at - committed[(batch.partition, position)]
        for batch in live
        for position in batch.positions
        if (batch.partition, position) in committed
    ]
    return Run(
        rate_of(loaded),
        len(loaded),
        statistics.fmean(b.size for b in loaded),
        check([*loaded, *live], heads),
        latencies,
    )


# the plain loop: the same batches posted by hand


def plain_batches(engine: subengine.Engine, config: Config) -> list[list[dict[str, Any]]]:
    """Per partition, the batch bodies of the plain source stream (`max_events` each)."""
    partitions: list[list[dict[str, Any]]] = []
    cursor = "c1" + base64.urlsafe_b64encode(os.urandom(30)).decode()
    for partition in range(config.partitions):
        bodies: list[dict[str, Any]] = []
        after = 0
        for _ in range(config.events // config.max_events + 2):
            got = engine.read(PLAIN_STREAM, partition, after, config.max_events)
            events = [e for e in got if isinstance(e, subengine.Event)]
            if not events:
                break
            bodies.append(
                {
                    "type": "events",
                    "subscription": "",
                    "generation": 1,
                    "stream": PLAIN_STREAM,
                    "partition": partition,
                    "after": after,
                    "through": events[-1].position,
                    "events": [event_body(e, include_data=True) for e in events],
                    "tombstones": [],
                    "cursor": cursor,
                }
            )
            after = events[-1].position
        partitions.append(bodies)
    return partitions


def plain_run(
    variant: Variant,
    number: int,
    bodies: list[list[dict[str, Any]]],
    heads: dict[int, int],
    sink: Process,
) -> Run:
    from standardwebhooks import Webhook as Signer

    subscription = f"plain-{number}-{variant.senders}-{secrets.token_hex(4)}"
    signer = Signer("whsec_" + base64.b64encode(os.urandom(24)).decode())
    failures: list[str] = []

    def send(mine: list[int]) -> None:
        queues = [list(bodies[p]) for p in mine]
        with httpx.Client(timeout=HTTP_TIMEOUT) as client:
            for index in range(max(len(q) for q in queues)):
                for queue in queues:
                    if index >= len(queue):
                        continue
                    text = json.dumps(
                        {**queue[index], "subscription": subscription}, separators=(",", ":")
                    )
                    message = "msg_" + secrets.token_hex(16)
                    now = datetime.now(UTC)
                    headers = {
                        "content-type": "application/json",
                        "webhook-id": message,
                        "webhook-timestamp": str(int(now.timestamp())),
                        "webhook-signature": signer.sign(message, now, text),
                    }
                    answer = client.post(f"{sink.url}/hook", content=text, headers=headers)
                    if answer.status_code // 100 != 2:
                        failures.append(f"the sink answered {answer.status_code}")
                        return

    threads = [
        threading.Thread(target=send, args=([p for p in heads if p % variant.senders == n],))
        for n in range(variant.senders)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise SystemExit(f"bench/webhooks.py: plain loop: {failures[0]}")
    wait_for_events(sink, subscription, sum(heads.values()), variant.name, lambda: "")
    batches = take(sink, subscription)
    return Run(
        rate_of(batches),
        len(batches),
        statistics.fmean(b.size for b in batches),
        check(batches, heads),
    )


# output


def report(config: Config, facts: str, load_before: float, variants: list[Variant]) -> None:
    print()
    print(
        f"{facts}; {os.cpu_count()} CPUs; load average {load_before:.2f} before,"
        f" {os.getloadavg()[0]:.2f} after"
    )
    print(
        f"{config.events:,} preloaded events on {config.partitions} partitions, max_events"
        f" {config.max_events}; latency: {config.rate:g} single-event appends/s for"
        f" {config.seconds:g} s; {config.rounds} rounds in rotating order; gateway processes"
        f" with --delivery-concurrency {SLOTS}, fresh per run"
    )
    print()
    print("median (min-max) over rounds")
    print(
        f"  {'variant':<22} {'deliveries, events/s':>26} {'batches/s':>9} {'bytes/batch':>11}"
        f" {'p50 ms':>20} {'p99 ms':>22} {'reorder.':>8} {'redeliv.':>8} {'losses':>6}"
    )
    for variant in variants:
        rates = Spread.of([r.rate for r in variant.runs])
        batch_rate = statistics.median(
            r.rate * r.batches / max(1, config.events) for r in variant.runs
        )
        size = statistics.median(r.mean_bytes for r in variant.runs)
        if variant.kind == "gateway":
            p50 = Spread.of([percentile(r.latencies, 0.5) for r in variant.runs]).text(1000, 1)
            p99 = Spread.of([percentile(r.latencies, 0.99) for r in variant.runs]).text(1000, 1)
        else:
            p50 = p99 = "-"
        print(
            f"  {variant.name:<22} {rates.text():>26} {batch_rate:>9,.0f} {size:>11,.0f}"
            f" {p50:>20} {p99:>22} {sum(r.checked.reorderings for r in variant.runs):>8}"
            f" {sum(r.checked.redeliveries for r in variant.runs):>8}"
            f" {sum(r.checked.losses for r in variant.runs):>6}"
        )
    print()
    print("gateway against the plain loop with as many senders, same run:")
    ok_all = True
    for gateway in (v for v in variants if v.kind == "gateway"):
        plain = next(
            v
            for v in variants
            if v.kind == "plain" and v.senders == min(SLOTS * gateway.senders, config.partitions)
        )
        ours = statistics.median(r.rate for r in gateway.runs)
        theirs = statistics.median(r.rate for r in plain.runs)
        ratio = ours / theirs
        ratios = [g.rate / p.rate for g, p in zip(gateway.runs, plain.runs, strict=True)]
        ok = ratio >= RATIO_GOAL
        ok_all = ok_all and ok
        print(
            f"  {gateway.name} / {plain.name}: {ratio:.2f}x (per round"
            f" {', '.join(f'{r:.2f}' for r in ratios)}); goal >= {RATIO_GOAL}x"
            f" {'PASS' if ok else 'MISS'}"
        )
    reorderings = sum(r.checked.reorderings for v in variants for r in v.runs)
    losses = sum(r.checked.losses for v in variants for r in v.runs)
    print(
        f"  reorderings {reorderings}, losses {losses}; goal 0 and 0"
        f" {'PASS' if reorderings == losses == 0 else 'MISS'}"
    )


# the run


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        description="Benchmark webhook deliveries against a plain httpx loop."
    )
    parser.add_argument("--dsn", help="PostgreSQL URL or conninfo (default: SUBENGINE_DSN)")
    parser.add_argument("--quick", action="store_true", help="fewer events: a smoke test")
    parser.add_argument("--events", type=int, help="preloaded events per run (20,000; quick 5,000)")
    parser.add_argument("--partitions", type=int, default=8, help="partitions (8)")
    parser.add_argument("--max-events", type=int, default=100, help="events per batch (100)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, at least 3 (3)")
    parser.add_argument("--rate", type=float, default=200.0, help="appends/s for latency (200)")
    parser.add_argument("--seconds", type=float, help="seconds of appends (10; quick 3)")
    parser.add_argument("--seed", type=int, default=20261215, help="seed of the events")
    parser.add_argument("--sink", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = Config(
        events=args.events or (5_000 if args.quick else 20_000),
        partitions=args.partitions,
        max_events=args.max_events,
        rounds=args.rounds,
        rate=args.rate,
        seconds=args.seconds or (3.0 if args.quick else 10.0),
        seed=args.seed,
    )
    if config.rounds < 3:
        parser.error("--rounds must be at least 3")
    if not 1 <= config.max_events <= 1000:
        parser.error("--max-events must be 1 to 1000")
    return args, config


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.sink:
        run_sink(args.sink)
        return 0
    dsn = args.dsn or os.environ.get("SUBENGINE_DSN") or None
    load_before = os.getloadavg()[0]
    run_started = time.perf_counter()
    variants = [
        Variant("gateway x1", "gateway", 1),
        Variant(f"plain x{min(SLOTS, config.partitions)}", "plain", min(SLOTS, config.partitions)),
        Variant("gateway x3", "gateway", 3),
        Variant(
            f"plain x{min(3 * SLOTS, config.partitions)}",
            "plain",
            min(3 * SLOTS, config.partitions),
        ),
    ]
    with benchmark_database(dsn) as database, tempfile.TemporaryDirectory() as logs:
        facts = server_facts(database.dsn)
        with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
            preload(engine, PLAIN_STREAM, config)
            bodies = plain_batches(engine, config)
            plain_heads = engine.heads(PLAIN_STREAM)
        sink = start_sink(Path(logs))
        try:
            for number in range(config.rounds):
                for variant in rotated(variants, number):
                    if variant.kind == "gateway":
                        run = gateway_run(variant, number, config, database, sink, Path(logs))
                    else:
                        run = plain_run(variant, number, bodies, plain_heads, sink)
                    variant.runs.append(run)
                    latency = (
                        f", p50 {percentile(run.latencies, 0.5) * 1000:.1f} ms, p99"
                        f" {percentile(run.latencies, 0.99) * 1000:.1f} ms"
                        if run.latencies
                        else ""
                    )
                    progress(
                        f"round {number + 1}, {variant.name}: {run.rate:,.0f} events/s{latency},"
                        f" reorderings {run.checked.reorderings}, redeliveries"
                        f" {run.checked.redeliveries}, losses {run.checked.losses}"
                    )
        finally:
            sink.stop()
    report(config, facts, load_before, variants)
    print(f"run time {time.perf_counter() - run_started:.0f} s, with setup")
    return 0


if __name__ == "__main__":
    sys.exit(main())
