"""The processes and the client of bench/gateway.py: the servers it measures (`subengine
serve`, and the plain relay teams write by hand), the appender process, the database's
transaction count, and the SSE watchers (raw asyncio sockets, no HTTP library).

Run as a script, it is one of the child processes: `plain-server PORT` or `appender`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import resource
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import _harness as bench
import psycopg
from _harness import SCHEMA, Database
from psycopg import sql

import subengine

LIVE_STREAM = "bench-live"
GATEWAY = "gateway"
PLAIN = "plain"
KEYS = 1000
# connections opened at once; the rest wait their turn
CONNECT_CONCURRENCY = 50
CONNECT_TIMEOUT = 120.0
DRAIN_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
# a backend reports its statistics after 10 s idle at the latest (PostgreSQL 15)
STATS_IDLE = 11.0
# the frames' partition and positions: an events frame of the gateway, a notification
GATEWAY_FRAME = re.compile(rb'"partition":(\d+),"first":(\d+),"last":(\d+)')
PLAIN_FRAME = re.compile(rb'"partition" : (\d+), "head" : (\d+)')
READY = {GATEWAY: b"event: caught-up", PLAIN: b": ready"}


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
        return bench.settled_xacts(self.database, STOP_TIMEOUT, "xact_commit", pause=0.1)

    def close(self) -> None:
        self.conn.close()


# servers


class Server(bench.Child):
    """A server process on a free loopback port: `subengine serve` or the plain one."""

    def __init__(self, kind: str, database: Database, logs: Path) -> None:
        env = {**os.environ, "SUBENGINE_DSN": database.dsn, "SUBENGINE_SCHEMA": SCHEMA}
        if kind == GATEWAY:
            # every watcher of the bench is the same anonymous principal
            command = bench.subengine_serve("--max-connections-per-key", "100000")
            self.path = f"/v1/streams/{LIVE_STREAM}/events?live=sse&after=now"
        else:
            command = [sys.executable, __file__, "plain-server"]
            self.path = "/events"
        super().__init__(f"{kind} server", command, env, logs)
        self.kind = kind

    def rss(self) -> int:
        """VmRSS in bytes."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise SystemExit("bench/gateway.py: no VmRSS in /proc/<pid>/status")

    def hub_reads(self) -> int:
        """The events the gateway read for its watchers so far: its hub's shared reads and
        its pages read by cursor (its own metrics)."""
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=STOP_TIMEOUT) as answer:
            text = answer.read().decode()
        found = re.findall(
            r"^subengine_gateway_(?:hub|page)_reads_total ([0-9.e+]+)$", text, re.MULTILINE
        )
        if len(found) != 2:
            raise SystemExit("bench/gateway.py: the gateway's /metrics has no read counts")
        return round(sum(float(value) for value in found))

    def cpu(self) -> float:
        """User and system CPU seconds so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@asynccontextmanager
async def running(kind: str, database: Database, logs: Path) -> AsyncIterator[Server]:
    server = Server(kind, database, logs)
    try:
        server.started()
        yield server
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
            [sys.executable, __file__, "appender"],
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


def raise_file_limit(connections: int) -> None:
    """Each SSE connection is a descriptor here (and one in the server, which inherits
    the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = connections + 256
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(f"bench/gateway.py: the file limit {hard} is below {needed}")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536) if hard > 0 else needed, hard))


if __name__ == "__main__":
    if sys.argv[1] == "plain-server":
        run_plain_server(int(sys.argv[2]))
    else:
        run_appender()
