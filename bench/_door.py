"""The servers and clients of bench/door.py: the Durable Streams reference server (installed
with npm into a cache folder, run by bench/_reference_server.mjs) and subengine's gateway
behind one interface (create a stream, append a batch, read it all, follow it by SSE or
long-poll), the plain PostgreSQL counterparts (one SELECT, one COPY per batch), the check
that a run delivered every event in order, and py-spy around the gateway.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import _harness as bench
import httpx
from _harness import SCHEMA, Child, Connection, Database
from psycopg import sql
from psycopg.types.string import TextLoader

import subengine

PACKAGE = "@durable-streams/server"
VERSION = "0.3.7"
LAUNCHER = Path(__file__).with_name("_reference_server.mjs")
# no compression: the gateway has none, and on loopback it only costs the server CPU
HEADERS = {"Accept-Encoding": "identity"}
JSON = {"Content-Type": "application/json"}
HTTP_TIMEOUT = 60.0
WAIT = 30  # seconds a long-poll waits
PAGE = 10_000  # the gateway's largest page
START_TIMEOUT = 30.0
PLAIN_SCHEMA = "door_plain"
COLUMNS = "stream partition position id key key_version type data metadata occurred_at recorded_at"


class Failed(Exception):
    """A run that went wrong: bench/door.py exits with its message."""


def fail(message: str) -> Failed:
    return Failed(message)


# the reference server's package


def reference_package() -> Path:
    """The folder holding @durable-streams/server at VERSION, installed with npm on first
    use into the user's cache folder (never into the repository)."""
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        raise fail(
            "node and npm are needed to run the Durable Streams reference server; "
            "install Node.js 18 or later"
        )
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = cache / "subengine-bench" / f"durable-streams-server-{VERSION}"
    if installed_version(folder) == VERSION:
        return folder
    bench.progress(f"installing {PACKAGE}@{VERSION} with npm into {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / "package.json"
    if not manifest.exists():
        manifest.write_text('{"name": "subengine-bench-reference", "private": true}\n')
    done = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--save-exact", f"{PACKAGE}@{VERSION}"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0 or installed_version(folder) != VERSION:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise fail(f"npm install {PACKAGE}@{VERSION} failed: {last}")
    return folder


def installed_version(folder: Path) -> str | None:
    manifest = folder / "node_modules" / "@durable-streams" / "server" / "package.json"
    try:
        version = json.loads(manifest.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None
    return str(version)


# what a reader received


@dataclass(slots=True)
class Received:
    """(partition, n) per event in the order received, and when each n arrived."""

    events: list[tuple[int, int]] = field(default_factory=list)
    at: dict[int, float] = field(default_factory=dict)

    def add(self, pairs: Sequence[tuple[int, int]], at: float) -> None:
        self.events.extend(pairs)
        for _, n in pairs:
            self.at.setdefault(n, at)


def check(delivered: Sequence[tuple[int, int]], expected: int, what: str) -> None:
    """Exit unless `delivered` holds the events 0 to expected - 1, each once, in order
    within each partition (the reference has one)."""
    last: dict[int, int] = {}
    for partition, n in delivered:
        if n <= last.get(partition, -1):
            raise fail(
                f"{what}: event {n} came after event {last[partition]} in partition "
                f"{partition}: out of order or repeated"
            )
        last[partition] = n
    numbers = sorted(n for _, n in delivered)
    if numbers != list(range(expected)):
        raise fail(
            f"{what}: delivered {len(delivered):,} events ({len(set(numbers)):,} distinct),"
            f" expected 0 to {expected - 1:,}"
        )


async def sse_frames(response: httpx.Response) -> AsyncIterator[tuple[str, str, float]]:
    """(event, data, when the frame ended) per frame of a server-sent event stream."""
    event, data = "message", list[str]()
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event, "\n".join(data), time.perf_counter()
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)


# CPU


def process_cpu(pid: int) -> float:
    """User and system CPU seconds of a process of this machine so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backends_cpu(conn: Connection) -> float | None:
    """CPU seconds so far of the PostgreSQL backends of this connection's database; None
    when they do not run on this machine."""
    pids = conn.execute(
        "SELECT pid FROM pg_stat_activity"
        " WHERE datname = current_database() AND backend_type = 'client backend'"
    ).fetchall()
    try:
        if not all(b"postgres" in Path(f"/proc/{pid}/cmdline").read_bytes() for (pid,) in pids):
            return None
        return sum(process_cpu(pid) for (pid,) in pids)
    except OSError:
        return None


class Meter:
    """The seconds of a `with` block, and the CPU seconds spent meanwhile by the server's
    process (if any), the database's PostgreSQL backends and this process."""

    def __init__(self, door: Door | None, conn: Connection) -> None:
        self.door, self.conn = door, conn
        self.seconds = 0.0
        self.cpu: dict[str, float | None] = {}

    def now(self) -> dict[str, float | None]:
        server = process_cpu(self.door.child.pid) if self.door else None
        return {
            "server": server,
            "PostgreSQL": backends_cpu(self.conn),
            "client": time.process_time(),
        }

    def __enter__(self) -> Meter:
        self.cpu = self.now()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started
        after = self.now()
        for kind, before in self.cpu.items():
            later = after[kind]
            self.cpu[kind] = None if before is None or later is None else later - before


# the servers


class Door:
    """A server that takes appends and reads over HTTP: what bench/door.py measures."""

    name = ""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.bytes_read = 0  # bodies of the answers read_all got

    def started(self) -> Door:
        self.child.started()
        return self

    def stop(self) -> None:
        self.child.stop()

    def url(self, stream: str) -> str:
        raise NotImplementedError

    def create(self, stream: str) -> None:
        raise NotImplementedError

    def appended(self, response: httpx.Response) -> None:
        raise NotImplementedError

    def append(self, client: httpx.Client, stream: str, body: bytes) -> None:
        """Append one batch (a JSON array of events) in one request."""
        self.appended(client.post(self.url(stream), content=body, headers=JSON))

    async def append_async(self, client: httpx.AsyncClient, stream: str, body: bytes) -> None:
        self.appended(await client.post(self.url(stream), content=body, headers=JSON))

    def read_all(self, client: httpx.Client, stream: str, expected: int) -> list[Any]:
        """Every page from the beginning until up to date, decoded."""
        raise NotImplementedError

    def delivered(self, pages: list[Any]) -> list[tuple[int, int]]:
        """(partition, n) of every event of the pages, in order."""
        raise NotImplementedError

    async def follow(
        self, client: httpx.AsyncClient, stream: str, mode: str, received: Received
    ) -> None:
        """Read `stream` from its beginning by SSE or long-poll until cancelled."""
        raise NotImplementedError


class DurableStreamsDoor(Door):
    """A server of the Durable Streams protocol, JSON mode: a PUT creates a stream, a POST
    of an array appends each element as a message, a GET answers an array."""

    def create(self, stream: str) -> None:
        answer = httpx.put(self.url(stream), headers=JSON, timeout=HTTP_TIMEOUT)
        if answer.status_code != 201:
            raise fail(f"{self.name}: PUT of {stream} answered {answer.status_code}")

    def appended(self, response: httpx.Response) -> None:
        if response.status_code not in (200, 204):
            raise fail(f"{self.name}: an append answered {response.status_code}: {response.text}")

    def read_all(self, client: httpx.Client, stream: str, expected: int) -> list[Any]:
        pages: list[Any] = []
        offset = "-1"
        for _ in range(expected // PAGE + 10):
            answer = client.get(self.url(stream), params={"offset": offset})
            answer.raise_for_status()
            self.bytes_read += len(answer.content)
            pages.append(answer.json())
            offset = answer.headers["Stream-Next-Offset"]
            if answer.headers.get("Stream-Up-To-Date") == "true":
                return pages
        raise fail(f"{self.name}: {stream} was not up to date after {len(pages)} reads")

    def delivered(self, pages: list[Any]) -> list[tuple[int, int]]:
        return [(0, message["data"]["n"]) for page in pages for message in page]

    async def follow(
        self, client: httpx.AsyncClient, stream: str, mode: str, received: Received
    ) -> None:
        if mode == "sse":
            params = {"offset": "-1", "live": "sse"}
            async with client.stream("GET", self.url(stream), params=params) as response:
                response.raise_for_status()
                async for event, data, at in sse_frames(response):
                    if event == "data":
                        received.add([(0, m["data"]["n"]) for m in json.loads(data)], at)
            raise fail(f"{self.name}: the SSE stream of {stream} ended")
        offset, cursor = "-1", ""
        while True:
            params = {"offset": offset, "live": "long-poll"}
            if cursor:
                params["cursor"] = cursor
            answer = await client.get(self.url(stream), params=params)
            at = time.perf_counter()
            if answer.status_code == 200:
                received.add([(0, m["data"]["n"]) for m in answer.json()], at)
            elif answer.status_code != 204:
                raise fail(f"{self.name}: a long-poll answered {answer.status_code}")
            offset = answer.headers["Stream-Next-Offset"]
            cursor = answer.headers.get("Stream-Cursor", "")


class ReferenceDoor(DurableStreamsDoor):
    """The Durable Streams reference server: one stream per URL under /door/."""

    def __init__(self, package: Path, mode: str, data: Path, logs: Path) -> None:
        node = shutil.which("node") or "node"
        command = [node, str(LAUNCHER), str(package), mode, str(data)]
        super().__init__(Child(f"reference-{mode}", command, dict(os.environ), logs))
        self.name = f"reference, {mode}"

    def started(self) -> Door:
        """Once it printed "ready" (it has no health endpoint: every path is a stream)."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.child.process.poll() is not None:
                raise fail(f"the {self.name} server exited:\n{self.child.output()}")
            if "ready http" in self.child.output():
                return self
            time.sleep(0.05)
        raise fail(f"the {self.name} server did not start:\n{self.child.output()}")

    def url(self, stream: str) -> str:
        return f"{self.child.url}/door/{stream}"


class GatewayDsDoor(DurableStreamsDoor):
    """`subengine serve --durable-streams` on the benchmark's database: the reference's
    protocol, with the same client code, requests and bodies."""

    name = "subengine, DS"

    def __init__(self, database: Database, logs: Path) -> None:
        env = {**os.environ, "SUBENGINE_DSN": database.dsn, "SUBENGINE_SCHEMA": SCHEMA}
        command = bench.subengine_serve("--durable-streams")
        super().__init__(Child("gateway-ds", command, env, logs))

    def url(self, stream: str) -> str:
        return f"{self.child.url}/ds/door/{stream}"


class GatewayDoor(Door):
    """`subengine serve` on the benchmark's database; streams created by an Engine."""

    name = "subengine gateway"

    def __init__(
        self, database: Database, engine: subengine.Engine, partitions: int, logs: Path
    ) -> None:
        env = {**os.environ, "SUBENGINE_DSN": database.dsn, "SUBENGINE_SCHEMA": SCHEMA}
        super().__init__(Child("gateway", bench.subengine_serve(), env, logs))
        self.engine = engine
        self.partitions = partitions
        self.fields: str | None = None  # the `fields` parameter of its reads (None: all)

    def reading(self, fields: str, name: str) -> GatewayDoor:
        """This gateway, read with `fields=` (a view named `name`: it starts nothing)."""
        view = copy.copy(self)
        view.fields, view.name = fields, name
        return view

    def url(self, stream: str) -> str:
        return f"{self.child.url}/v1/streams/{stream}/events"

    def create(self, stream: str) -> None:
        self.engine.create_stream(stream, self.partitions)

    def appended(self, response: httpx.Response) -> None:
        if response.status_code != 201:
            raise fail(f"gateway: an append answered {response.status_code}: {response.text}")

    def read_all(self, client: httpx.Client, stream: str, expected: int) -> list[Any]:
        pages: list[Any] = []
        cursor = "beginning"
        for _ in range(expected + 10):  # a page holds one event at least
            params: dict[str, Any] = {"after": cursor, "limit": PAGE}
            if self.fields is not None:
                params["fields"] = self.fields
            answer = client.get(self.url(stream), params=params)
            answer.raise_for_status()
            self.bytes_read += len(answer.content)
            page = answer.json()
            pages.append(page)
            cursor = page["cursor"]
            if page["up_to_date"]:
                return pages
        raise fail(f"gateway: {stream} was not up to date after {len(pages)} pages")

    def delivered(self, pages: list[Any]) -> list[tuple[int, int]]:
        for page in pages:
            if page["tombstones"] or page["resets"]:
                raise fail(f"gateway: a page with a tombstone or a reset: {str(page)[:300]}")
        return [(e["partition"], e["data"]["n"]) for page in pages for e in page["events"]]

    async def follow(
        self, client: httpx.AsyncClient, stream: str, mode: str, received: Received
    ) -> None:
        if mode == "sse":
            params = {"after": "beginning", "live": "sse"}
            async with client.stream("GET", self.url(stream), params=params) as response:
                response.raise_for_status()
                async for event, data, at in sse_frames(response):
                    if event == "events":
                        frame = json.loads(data)
                        pairs = [(frame["partition"], e["data"]["n"]) for e in frame["events"]]
                        received.add(pairs, at)
                    elif event != "caught-up":
                        raise fail(f"gateway: an unexpected {event} frame: {data[:300]}")
            raise fail(f"gateway: the SSE stream of {stream} ended")
        cursor = "beginning"
        params = {"live": "long-poll", "wait": str(WAIT), "limit": str(PAGE)}
        while True:
            answer = await client.get(self.url(stream), params={**params, "after": cursor})
            at = time.perf_counter()
            if answer.status_code == 204:
                cursor = answer.headers["Subengine-Cursor"]
                continue
            answer.raise_for_status()
            page = answer.json()
            received.add(self.delivered([page]), at)
            cursor = page["cursor"]


# the plain PostgreSQL counterparts


def select_rows(conn: Connection, stream: str) -> list[tuple[Any, ...]]:
    """The stream's events in one SELECT: the columns the gateway's page query reads, ids
    and times as the text PostgreSQL writes (what a relay puts in JSON), not as objects."""
    cursor = conn.cursor()
    for name in ("uuid", "timestamptz"):
        cursor.adapters.register_loader(name, TextLoader)
    query = sql.SQL(
        "SELECT id, stream, partition, position, key, key_version, type, data::text,"
        " metadata::text, occurred_at, recorded_at FROM {} WHERE stream = %s"
        " ORDER BY recorded_at, partition, position"
    ).format(sql.Identifier(SCHEMA, "events"))
    return cursor.execute(query, (stream,)).fetchall()


def selected(rows: list[tuple[Any, ...]]) -> list[tuple[int, int]]:
    return [(row[2], json.loads(row[7])["n"]) for row in rows]


def plain_table(conn: Connection) -> None:
    """A table shaped like subengine's events (columns, keys, index, checks)."""
    conn.execute(
        sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE; CREATE SCHEMA {}").format(
            sql.Identifier(PLAIN_SCHEMA), sql.Identifier(PLAIN_SCHEMA)
        )
    )
    conn.execute(
        sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(
            sql.Identifier(PLAIN_SCHEMA, "events"), sql.Identifier(SCHEMA, "events")
        )
    )


def copy_batches(
    conn: Connection,
    stream: str,
    events: Sequence[tuple[str, str, str]],
    batch: int,
    partitions: int,
) -> None:
    """COPY (key, type, data text) events into the plain table, one transaction per batch,
    with their partition, position, key version, id and times as an append would give."""
    heads = [0] * partitions
    versions: dict[str, int] = {}
    statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(PLAIN_SCHEMA, "events"),
        sql.SQL(", ").join(map(sql.Identifier, COLUMNS.split())),
    )
    for first in range(0, len(events), batch):
        now = datetime.now(UTC)
        with conn.transaction(), conn.cursor().copy(statement) as copy:
            for key, kind, data in events[first : first + batch]:
                partition = zlib.crc32(key.encode()) % partitions
                heads[partition] += 1
                version = versions[key] = versions.get(key, 0) + 1
                row = (stream, partition, heads[partition], uuid.uuid4(), key, version)
                copy.write_row((*row, kind, data, "{}", now, now))


def stored(conn: Connection, schema: str, stream: str) -> list[tuple[int, int]]:
    """(partition, n) of the stream's rows in `schema`.events, in position order."""
    query = sql.SQL(
        "SELECT partition, (data->>'n')::int FROM {} WHERE stream = %s ORDER BY partition, position"
    ).format(sql.Identifier(schema, "events"))
    return [(row[0], row[1]) for row in conn.execute(query, (stream,))]


# py-spy around the gateway


@contextmanager
def profiled(door: Door, folder: Path | None, name: str) -> Iterator[None]:
    """With a folder, py-spy samples `door`'s process meanwhile (collapsed stacks, idle
    time left out) into folder/<name>.txt."""
    if folder is None:
        yield
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        raise fail("--py-spy needs py-spy (pip install py-spy)")
    folder.mkdir(parents=True, exist_ok=True)
    output = folder / f"{name}.txt"
    options = "record --format raw --nonblocking --rate 200".split()
    process = subprocess.Popen(
        [spy, *options, "--pid", str(door.child.pid), "--output", str(output)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
        bench.progress(f"py-spy: {output}")
