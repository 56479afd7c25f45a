"""What the HTTP gateway costs an outside subscriber, next to what teams write by hand.

Run it from the repository root:

    .venv/bin/python bench/gateway.py            # about 7 minutes on 2 cores
    .venv/bin/python bench/gateway.py --quick    # about 4 minutes, a smoke test
    .venv/bin/python bench/gateway.py --dsn postgresql://...   # or set SUBENGINE_DSN

Without a DSN it uses the embedded PostgreSQL (`subengine.Engine()`), which keeps running
afterwards (stop it with `.venv/bin/subengine db stop`). Every run creates a database of
its own on that server (`bench_gateway_<pid>`), migrates it, and drops it at the end.
Every server this script starts listens on 127.0.0.1 only.

What each figure means
----------------------
Servers. "gateway" is a real `subengine serve` process (one uvicorn worker, default
settings) on the benchmark database. "plain" is what teams write by hand, defined in this
file (`plain_app`) and run the same way (uvicorn, its default loop and HTTP parser): one
psycopg connection LISTENs on the channel `append_events` notifies (the schema's name,
payload `{"stream", "partition", "head"}`) and each notification is written as an SSE
`data:` line to every connected client. It reads no event: it is a lower bound, where the
gateway reads each partition after the client's cursor and sends the events with cursors.

Latency (append -> SSE client). For each watcher count (`--watchers`, 10, 100 and 1,000
connections on one stream of `--partitions` partitions) and each server, a fresh server
process is started, the watchers connect (`live=sse&after=now` on the gateway) and
wait until they are caught up, then an appender process appends single-event
transactions to random keys for `--seconds` (at least 50 of them; `--warmup` more
before, not counted) at `--rate` per second, or at fewer where rate x watchers would
pass `--max-deliveries` per second (10,000: 1,000 watchers get 10 appends/s). At 100/s
a 1,000-watcher fan-out asks one Python process for 100,000 SSE frames a second, which
neither server delivers on 2 cores; that overload is also run (without a goal) unless
`--no-overload` or `--quick`. Latency of an event at a watcher = the moment the client's
socket handed over the frame that carries it (time.monotonic in this process) - the
moment the appender's `Engine.append` returned, i.e. its commit (time.monotonic in the
appender; CLOCK_MONOTONIC is one clock for every process of the machine; a frame can
arrive a little before `append` returns, hence latencies just below 0). An events
frame that covers several positions (the gateway coalesces when a watcher falls behind)
counts each of them. p50 and p99 are over every (event, watcher) pair of a run; the
table gives the median (min-max) over the rounds. The client is one asyncio process of
raw sockets (`asyncio.Protocol`, no HTTP library) that only finds the partition and
positions of each frame with a regular expression: it still competes with the server
for the cores, so the table prints the CPU seconds per second of the server and of the
client, and the server's CPU time per frame received.

Database reads per notification. This PostgreSQL has no pg_stat_statements loaded and the
gateway has no /metrics yet, so the figure comes from `pg_stat_database.xact_commit` of
the benchmark's own database (autovacuum off for its tables), counted from just before
the counted appends (after 11 s idle, by when PostgreSQL 15 backends have reported)
until the server has stopped (its backends report as they exit). From a gateway run's
count are taken the same run's count with the plain server and one watcher (measured
first, per rate: the appender's transactions, and the one its LISTEN backend commits to
read each batch of notifications) and one head poll per `poll_interval` (1 s); the rest,
divided by the notifications (one per append: each appends to one partition), is the
hub's reads (`Hub.read`: `read_after`, one transaction each). Noise: a few transactions
per run. Goal: independent of the watcher count (at most 1.2x the figure at 10).

Memory per idle SSE connection. In each round's run with the most watchers, VmRSS of the
server process (/proc/<pid>/status) once the connections are caught up and idle, minus
VmRSS before they connected (a fresh server after one SSE connection and a page pull),
divided by the connection count.

Catch-up over HTTP. A stream of `--pull-events` events (`--partitions` partitions, about
150 bytes of JSON data each) is read from its beginning: over HTTP by cursor, `GET
/v1/streams/{s}/events?after=<cursor>&limit=1000` with one keep-alive httpx client that
parses each page's JSON, until `up_to_date`; and by the plain counterpart, an
`Engine.read(stream, partition, after, 1000)` loop per partition (`read_after`). rows/s
= events / seconds. Both run `--rounds` times in rotating order; ratio = HTTP / plain.

Goals (the gateway's issue): p50 <= 3 ms and p99 <= 15 ms at 100 watchers, p99 <= 50 ms
at 1,000 (at the lowered rate); catch-up >= 0.5x the plain loop; reads per notification
independent of the watchers; <= 20 KB per idle connection. The machine's other load
distorts every figure: the script prints the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

import subengine

LIVE_STREAM = "bench-live"
PULL_STREAM = "bench-pull"
SCHEMA = "subengine"  # every Engine and server here is given it, whatever the environment
DATABASE_PREFIX = "bench_gateway_"
GATEWAY = "gateway"
PLAIN = "plain"
KEYS = 1000
APPEND_BATCH = 1000
PAGE_LIMIT = 1000
# the gateway's head poll, its safety net (GatewayConfig.poll_interval)
POLL_INTERVAL = 1.0
# connections opened at once; the rest wait their turn
CONNECT_CONCURRENCY = 50
# bounds of every wait
START_TIMEOUT = 30.0
CONNECT_TIMEOUT = 120.0
DRAIN_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
# a backend reports its statistics after 10 s idle at the latest (PostgreSQL 15)
STATS_IDLE = 11.0
# goals
P50_GOAL_100 = 0.003
P99_GOAL_100 = 0.015
P99_GOAL_1000 = 0.050
CATCH_UP_GOAL = 0.5
READS_GOAL = 1.2
MEMORY_GOAL = 20 * 1024
# the frames' partition and positions: an events frame of the gateway, a notification
GATEWAY_FRAME = re.compile(rb'"partition":(\d+),"first":(\d+),"last":(\d+)')
PLAIN_FRAME = re.compile(rb'"partition" : (\d+), "head" : (\d+)')
READY = {GATEWAY: b"event: caught-up", PLAIN: b": ready"}

T = TypeVar("T")


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


@dataclass(frozen=True, slots=True)
class Database:
    """The benchmark's own database, and the server's maintenance database for stats."""

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

    def text(self, scale: float = 1.0, digits: int = 1) -> str:
        return (
            f"{self.median * scale:,.{digits}f} ({self.low * scale:,.{digits}f}"
            f"-{self.high * scale:,.{digits}f})"
        )


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

    frames: int = 0  # events frames (or notifications) the watchers received

    def percentile(self, fraction: float) -> float:
        return percentile(self.latencies, fraction)


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


def rotated(items: Sequence[T], by: int) -> list[T]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# the benchmark database


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
        yield database
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


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


def prepare(database: Database, config: Config) -> float:
    """Schema, streams and the pull stream's events; autovacuum off for the scratch
    tables, whose transactions would count in the database's. The fill's seconds."""
    rng = random.Random(config.seed)
    keys = [f"order-{n:05d}" for n in range(KEYS)]
    with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
        engine.migrate()
        engine.create_stream(LIVE_STREAM, config.partitions)
        engine.create_stream(PULL_STREAM, config.partitions)
        started = time.perf_counter()
        for first in range(0, config.pull_events, APPEND_BATCH):
            batch = []
            for _ in range(min(APPEND_BATCH, config.pull_events - first)):
                key = rng.choice(keys)
                batch.append(subengine.NewEvent(key, "OrderUpdated", order_data(rng, key)))
            engine.append(PULL_STREAM, batch)
        seconds = time.perf_counter() - started
    with psycopg.connect(database.dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        tables = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (SCHEMA,)
        ).fetchall()
        for (table,) in tables:
            conn.execute(
                sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(
                    sql.Identifier(SCHEMA, table)
                )
            )
    return seconds


class TransactionCount:
    """The benchmark database's committed transactions, read from the maintenance
    database (so that reading them adds none).

    A PostgreSQL 15 backend reports its counts when it exits, at the end of a
    transaction at least a second after its last report, or after ten seconds idle."""

    def __init__(self, database: Database) -> None:
        self.database = database
        self.conn = psycopg.connect(database.admin_dsn, autocommit=True)

    def now(self) -> int:
        row = self.conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
            (self.database.name,),
        ).fetchone()
        return int(row[0]) if row else 0

    async def after_idle(self) -> int:
        """The count once every backend reported what it did until STATS_IDLE ago."""
        await asyncio.sleep(STATS_IDLE)
        return self.now()

    async def settled(self) -> int:
        """The count once no client is connected to the database: complete."""
        deadline = time.monotonic() + STOP_TIMEOUT
        while time.monotonic() < deadline:
            row = self.conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = %s AND backend_type = 'client backend'",
                (self.database.name,),
            ).fetchone()
            if row is not None and row[0] == 0:
                break
            await asyncio.sleep(0.05)
        else:
            progress(f"warning: clients still connected to {self.database.name}")
        await asyncio.sleep(0.1)
        return self.now()

    def close(self) -> None:
        self.conn.close()


def server_facts(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        values = []
        for setting in ("server_version", "fsync", "synchronous_commit"):
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(setting))).fetchone()
            values.append(str(row[0]) if row else "?")
    return f"PostgreSQL {values[0]}, fsync={values[1]}, synchronous_commit={values[2]}"


# servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """A server process on a free loopback port: `subengine serve` or the plain one."""

    def __init__(self, kind: str, database: Database, logs: Path) -> None:
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logs / f"{kind}-{self.port}.log"
        env = {**os.environ, "SUBENGINE_DSN": database.dsn, "SUBENGINE_SCHEMA": SCHEMA}
        bin_dir = Path(sys.executable).parent
        if kind == GATEWAY:
            command = [
                str(bin_dir / "subengine"),
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--no-access-log",
                # every watcher of the bench is the same anonymous principal
                "--max-connections-per-key",
                "100000",
            ]
            self.path = f"/v1/streams/{LIVE_STREAM}/events?live=sse&after=now"
        else:
            command = [sys.executable, __file__, "--plain-server", str(self.port)]
            self.path = "/events"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.pid = self.process.pid

    async def started(self) -> Server:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(
                    f"bench/gateway.py: the {self.kind} server exited:\n{self.output()}"
                )
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await reader.read(64)
            writer.close()
            if answer.startswith(b"HTTP/1.1 200"):
                return self
            await asyncio.sleep(0.1)
        raise SystemExit(f"bench/gateway.py: the {self.kind} server did not start")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def rss(self) -> int:
        """VmRSS in bytes."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise SystemExit("bench/gateway.py: no VmRSS in /proc/<pid>/status")

    def cpu(self) -> float:
        """User and system CPU seconds so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                progress(f"the {self.kind} server did not stop on SIGTERM; killed")
                self.process.kill()
                self.process.wait(STOP_TIMEOUT)


@asynccontextmanager
async def running(kind: str, database: Database, logs: Path) -> AsyncIterator[Server]:
    server = Server(kind, database, logs)
    try:
        yield await server.started()
    finally:
        server.stop()


# the plain counterpart: what teams write by hand


def plain_app(dsn: str, channel: str) -> Any:
    """A Starlette app that LISTENs on `channel` and writes every notification's payload
    to every connected SSE client (GET /events)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    clients: set[asyncio.Queue[str]] = set()

    async def listen() -> None:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        async with conn:
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            async for notify in conn.notifies():
                for queue in clients:
                    queue.put_nowait(notify.payload)

    async def events(request: Request) -> StreamingResponse:
        queue: asyncio.Queue[str] = asyncio.Queue()

        async def stream() -> AsyncIterator[str]:
            clients.add(queue)
            try:
                yield ": ready\n\n"
                while True:
                    yield f"data: {await queue.get()}\n\n"
            finally:
                clients.discard(queue)

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def healthz(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(listen())
        yield
        task.cancel()

    return Starlette(
        routes=[Route("/events", events), Route("/healthz", healthz)], lifespan=lifespan
    )


def run_plain_server(port: int) -> None:
    import uvicorn

    dsn = os.environ["SUBENGINE_DSN"]
    app = plain_app(dsn, os.environ["SUBENGINE_SCHEMA"])
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
    )


# the appender process


def run_appender() -> None:
    """Append on command, one event per transaction at a fixed rate: reads `count rate`
    lines on stdin, answers a JSON line of [partition, position, returned] per append.
    Each command has an Engine of its own, closed before the answer, so that its
    backend has exited (and reported its statistics) by then."""
    rng = random.Random(os.getpid())
    keys = [f"live-{n:04d}" for n in range(KEYS)]
    print("ready", flush=True)
    for line in sys.stdin:
        count, rate = int(line.split()[0]), float(line.split()[1])
        done = []
        with subengine.Engine(os.environ["SUBENGINE_DSN"], schema=SCHEMA) as engine:
            engine.streams()
            started = time.monotonic()
            for n in range(count):
                wait = started + n / rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                key = rng.choice(keys)
                (appended,) = engine.append(
                    LIVE_STREAM, [subengine.NewEvent(key, "Ticked", {"n": n, "key": key})]
                )
                done.append((appended.partition, appended.position, time.monotonic()))
        print(json.dumps(done), flush=True)


class Appender:
    def __init__(self, database: Database) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--appender"],
            env={**os.environ, "SUBENGINE_DSN": database.dsn, "SUBENGINE_SCHEMA": SCHEMA},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            raise SystemExit("bench/gateway.py: the appender did not start")

    async def append(self, count: int, rate: float) -> list[tuple[int, int, float]]:
        """`count` appends at `rate` per second: (partition, position, commit returned)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{count} {rate}\n")
        self.process.stdin.flush()
        line = await asyncio.get_running_loop().run_in_executor(None, self.process.stdout.readline)
        return [(p, position, at) for p, position, at in json.loads(line)]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(STOP_TIMEOUT)


# the SSE client: raw sockets, one Protocol per connection


class Watcher(asyncio.Protocol):
    """One SSE connection. Records (received, partition, first, last) per frame that
    carries events, and the last position received per partition."""

    def __init__(self, kind: str, request: bytes) -> None:
        self.kind = kind
        self.request = request
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.buffer = b""
        self.answered = False  # the status line was read
        self.frames: list[tuple[float, int, int, int]] = []
        self.last: dict[int, int] = {}
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        buffer = self.buffer + data
        end = buffer.rfind(b"\n\n")
        if end < 0:
            self.buffer = buffer
            return
        chunk, self.buffer = buffer[:end], buffer[end + 2 :]
        if not self.ready.done():
            if not self.answered:
                if not chunk.startswith(b"HTTP/1.1 200"):
                    self.ready.set_exception(RuntimeError(chunk[:300].decode(errors="replace")))
                    return
                self.answered = True
            if READY[self.kind] in chunk:
                self.ready.set_result(None)
        if self.kind == GATEWAY:
            for match in GATEWAY_FRAME.finditer(chunk):
                partition, last = int(match[1]), int(match[3])
                self.frames.append((now, partition, int(match[2]), last))
                self.last[partition] = last
        else:
            for match in PLAIN_FRAME.finditer(chunk):
                partition, head = int(match[1]), int(match[2])
                self.frames.append((now, partition, head, head))
                self.last[partition] = head

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_exception(RuntimeError(f"connection lost: {exc}"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def open_watchers(server: Server, count: int) -> list[Watcher]:
    loop = asyncio.get_running_loop()
    request = (
        f"GET {server.path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        "Accept: text/event-stream\r\n\r\n"
    ).encode()
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

    async def one() -> Watcher:
        async with gate:
            _, watcher = await loop.create_connection(
                lambda: Watcher(server.kind, request), "127.0.0.1", server.port
            )
            await watcher.ready
            return watcher

    return list(
        await asyncio.wait_for(asyncio.gather(*(one() for _ in range(count))), CONNECT_TIMEOUT)
    )


async def warm_up(server: Server) -> None:
    """One SSE connection until it is ready, and (on the gateway) a page pull: what every
    server has loaded before it holds connections."""
    (watcher,) = await open_watchers(server, 1)
    watcher.close()
    if server.kind == GATEWAY:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            f"GET /v1/streams/{LIVE_STREAM}/events?limit=10 HTTP/1.1\r\nHost: x\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        await reader.read()
        writer.close()
    await asyncio.sleep(0.5)


async def drained(watchers: list[Watcher], heads: dict[int, int]) -> None:
    """Wait until every watcher received every head, or DRAIN_TIMEOUT passes."""
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while time.monotonic() < deadline:
        if all(
            watcher.last.get(partition, 0) >= head
            for watcher in watchers
            for partition, head in heads.items()
        ):
            return
        await asyncio.sleep(0.02)


def latencies_of(
    watchers: list[Watcher], committed: dict[tuple[int, int], float]
) -> tuple[list[float], int]:
    """Every counted (event, watcher) latency, and how many pairs never arrived."""
    latencies = []
    for watcher in watchers:
        for received, partition, first, last in watcher.frames:
            for position in range(first, last + 1):
                at = committed.get((partition, position))
                if at is not None:
                    latencies.append(received - at)
    return latencies, len(watchers) * len(committed) - len(latencies)


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
    server = await Server(variant.server, database, logs).started()
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
        cpu_server, cpu_client, started = server.cpu(), time.process_time(), time.monotonic()
        done = await appender.append(variant.appends, variant.rate)
        heads: dict[int, int] = {}
        for partition, position, _ in done:
            heads[partition] = max(heads.get(partition, 0), position)
        await drained(watchers, heads)
        elapsed = time.monotonic() - started
        cpu_server = (server.cpu() - cpu_server) / elapsed
        cpu_client = (time.process_time() - cpu_client) / elapsed
        for watcher in watchers:
            watcher.close()
        await asyncio.sleep(0.2)  # let the server see the disconnections
    finally:
        server.stop()
    committed = {(partition, position): at for partition, position, at in done}
    latencies, missing = latencies_of(watchers, committed)
    run = LatencyRun(latencies, missing, cpu_server, cpu_client, elapsed)
    run.frames = sum(len(watcher.frames) for watcher in watchers)
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
            for variant in rotated(variants, number):
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
                for name in rotated(list(rates), number):
                    if name == "HTTP by cursor":
                        rate = await loop.run_in_executor(None, pull_http, url, config.pull_events)
                    else:
                        rate = pull_engine(engine, config.partitions, config.pull_events)
                    rates[name].append(rate)
                    progress(f"catch-up round {number + 1}, {name}: {rate:,.0f} rows/s")
    return rates


# output


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


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
    print(
        f"{facts}; {os.cpu_count()} CPUs; load average {load_before:.2f} before,"
        f" {os.getloadavg()[0]:.2f} after"
    )
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
            f" {p50.text(1000, 2):>24} {p99.text(1000, 1):>26}"
            f" {sum(r.missing for r in variant.runs):>7}"
            f" {server_cpu:>10.2f} {client_cpu:>10.2f} {per_frame * 1e6:>8.0f}"
            f" {reads.text(1, 2) if reads else '-':>18}"
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
            rows.append(
                Row(
                    f"{what} latency, {gateway.watchers:,} watchers, {gateway.rate:g}/s",
                    ours.text(1000, 2) + " ms",
                    f"{theirs.median * 1000:,.2f} ms",
                    f"{ours.median / theirs.median:.1f}x",
                    "-" if goal is None else f"<= {goal * 1000:g} ms",
                    None if goal is None else ours.median <= goal,
                )
            )
    http = Spread.of(catch_up["HTTP by cursor"])
    plain_rate = Spread.of(catch_up["Engine.read loop"])
    ratio = http.median / plain_rate.median
    rows.append(
        Row(
            f"catch-up, {config.pull_events:,} events, rows/s",
            http.text(1, 0),
            f"{plain_rate.median:,.0f}",
            f"{ratio:.2f}x",
            f">= {CATCH_UP_GOAL}x",
            ratio >= CATCH_UP_GOAL,
        )
    )
    reference = gateways[0]
    base = reference.spread("reads_per_notification")
    assert base is not None
    for gateway in gateways:
        reads = gateway.spread("reads_per_notification")
        assert reads is not None
        ratio = reads.median / base.median if base.median > 0 else float("inf")
        overload = gateway.rate != capped[gateway.watchers]
        rows.append(
            Row(
                f"reads/notification, {gateway.watchers:,} watchers, {gateway.rate:g}/s",
                reads.text(1, 2),
                "0 (none)",
                f"{ratio:.2f}x" + (" (ref.)" if gateway is reference else ""),
                "-" if overload else f"<= {READS_GOAL}x ref.",
                None if overload else ratio <= READS_GOAL,
            )
        )
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
            memory[GATEWAY].text(1 / 1024, 1) + " KB",
            f"{memory[PLAIN].median / 1024:.1f} KB",
            f"{memory[GATEWAY].median / memory[PLAIN].median:.2f}x",
            f"<= {MEMORY_GOAL // 1024} KB",
            memory[GATEWAY].median <= MEMORY_GOAL,
        )
    )
    return rows


# the run


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        description="Benchmark the HTTP gateway against a hand-written SSE relay."
    )
    parser.add_argument("--dsn", help="PostgreSQL URL or conninfo (default: SUBENGINE_DSN)")
    parser.add_argument("--quick", action="store_true", help="fewer events: a smoke test")
    parser.add_argument("--watchers", default="10,100,1000", help="SSE connections (10,100,1000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, at least 3 (3)")
    parser.add_argument(
        "--seconds", type=float, help="seconds of counted appends per run (3; quick 1)"
    )
    parser.add_argument("--rate", type=float, default=100.0, help="appends per second (100)")
    parser.add_argument(
        "--max-deliveries",
        type=float,
        default=10_000,
        help="rate x watchers at most; above it the rate is lowered (10,000)",
    )
    parser.add_argument(
        "--no-overload",
        action="store_true",
        help="skip the runs at the full rate where it was lowered (skipped with --quick)",
    )
    parser.add_argument("--partitions", type=int, default=4, help="partitions per stream (4)")
    parser.add_argument(
        "--pull-events", type=int, help="events of the catch-up stream (200,000; quick 20,000)"
    )
    parser.add_argument("--seed", type=int, default=20261201, help="seed of the events")
    parser.add_argument("--plain-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--appender", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
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
    if config.rounds < 3:
        parser.error("--rounds must be at least 3")
    return args, config


def raise_file_limit(connections: int) -> None:
    """Each SSE connection is a descriptor here (and one in the server, which inherits
    the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = connections + 256
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(f"bench/gateway.py: the file limit {hard} is below {needed}")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536) if hard > 0 else needed, hard))


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.plain_server:
        run_plain_server(args.plain_server)
        return 0
    if args.appender:
        run_appender()
        return 0
    raise_file_limit(max(config.watchers))
    dsn = args.dsn or os.environ.get("SUBENGINE_DSN") or None
    load_before = os.getloadavg()[0]
    run_started = time.perf_counter()
    with benchmark_database(dsn) as database, tempfile.TemporaryDirectory() as logs:
        fill_seconds = prepare(database, config)
        progress(f"appended {config.pull_events:,} events in {fill_seconds:.1f} s")
        facts = server_facts(database.dsn)

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
