"""What every benchmark here shares: its arguments, its database, rounds in rotating order,
the median, min and max of a figure, goals, and the facts of the server and the machine.

Nothing here imports subengine at the top: bench/_depeche.py runs in an interpreter
that cannot install it.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

if TYPE_CHECKING:
    import subengine

# every Engine and server of a benchmark database is given it, whatever SUBENGINE_SCHEMA
# says: plain loops and polls name it
SCHEMA = "subengine"
STOP_TIMEOUT = 15.0

T = TypeVar("T")
Connection = psycopg.Connection[Any]


# arguments


def arguments(
    description: str,
    *,
    quick: str = "a small run, for a smoke test",
    rounds: int | None = 3,
    schema: str | None = None,
) -> argparse.ArgumentParser:
    """A parser with what every benchmark takes: --dsn, --quick, --rounds (at least 3) and,
    for one that works in a scratch schema, --schema."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dsn", help="PostgreSQL URL or conninfo (default: SUBENGINE_DSN)")
    if schema is not None:
        parser.add_argument("--schema", default=schema, help="scratch schema, dropped first")
    parser.add_argument("--quick", action="store_true", help=quick)
    if rounds is not None:
        parser.add_argument(
            "--rounds",
            type=int,
            default=rounds,
            help=f"rounds of every variant, at least 3 ({rounds})",
        )
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if getattr(args, "rounds", 3) < 3:
        parser.error("--rounds must be at least 3: the report gives a median, min and max")
    return args


def sized(args: argparse.Namespace, name: str, quick: Any, default: Any) -> Any:
    """The option `name` as given, or its default for a --quick run or a full one."""
    given = getattr(args, name)
    return given if given is not None else quick if args.quick else default


def dsn_of(args: argparse.Namespace) -> str | None:
    """--dsn, else SUBENGINE_DSN, else None: the embedded PostgreSQL."""
    return args.dsn or os.environ.get("SUBENGINE_DSN") or None


# rounds and figures


def rotated(items: Sequence[T], by: int) -> list[T]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def rotating(variants: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, variant): every variant once a round, each round's order rotated by one
    from the round before, so that the machine's drift falls on every variant alike."""
    for number in range(rounds):
        for variant in rotated(variants, number):
            yield number, variant


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


@dataclass(frozen=True, slots=True)
class Spread:
    """Median, min and max of some measurements."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, digits: int = 0, unit: str = "", count: bool = False) -> str:
        """'median (min low, max high)', with the count when asked."""
        n = f", n={self.count}" if count else ""
        return (
            f"{self.median:,.{digits}f}{unit} (min {self.low:,.{digits}f}, "
            f"max {self.high:,.{digits}f}{n})"
        )

    def span(self, scale: float = 1.0, digits: int = 0) -> str:
        """'median (low-high)', each times `scale`."""
        return (
            f"{self.median * scale:,.{digits}f} ({self.low * scale:,.{digits}f}"
            f"-{self.high * scale:,.{digits}f})"
        )


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# the server and the machine


def server_settings(
    dsn: str, names: Sequence[str] = ("server_version", "fsync", "synchronous_commit")
) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        values = {}
        for name in names:
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            values[name] = str(row[0]) if row else "?"
    return values


def server_facts(dsn: str) -> str:
    facts = server_settings(dsn)
    return (
        f"PostgreSQL {facts['server_version']}, fsync={facts['fsync']}, "
        f"synchronous_commit={facts['synchronous_commit']}"
    )


def machine(facts: str, load_before: float) -> str:
    """The server's facts, the cores and the load average before and now."""
    return (
        f"{facts}; {os.cpu_count()} CPUs; load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )


# the database


@dataclass(frozen=True, slots=True)
class Database:
    """A benchmark's own database, and the server's maintenance database for stats."""

    admin_dsn: str
    name: str
    dsn: str


def create_database(admin_dsn: str, name: str) -> Database:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8'").format(
                sql.Identifier(name)
            )
        )
    return Database(admin_dsn, name, make_conninfo(admin_dsn, dbname=name))


def drop_database(database: Database) -> None:
    with psycopg.connect(database.admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database.name))
        )


@contextmanager
def benchmark_database(dsn: str | None, prefix: str, migrate: bool = False) -> Iterator[Database]:
    """A database of this run (`<prefix><pid>`) on the server of `dsn` (None: the embedded
    one), dropped at the end; with `migrate`, subengine's schema in it."""
    import subengine

    with subengine.Engine(dsn) as engine:
        admin_dsn = engine.dsn
    database = create_database(admin_dsn, f"{prefix}{os.getpid()}")
    try:
        if migrate:
            with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
                engine.migrate()
        yield database
    finally:
        drop_database(database)


@contextmanager
def scratch_engine(args: argparse.Namespace, script: str) -> Iterator[subengine.Engine]:
    """An Engine on `args.schema`, a scratch schema dropped and migrated afresh.

    The schema carries a marker comment once a benchmark made it; one without that marker
    is never dropped, so a benchmark pointed at a real database cannot destroy its data.
    """
    import subengine

    marker = f"subengine benchmark scratch schema ({script}); dropped on every run"
    with subengine.Engine(dsn_of(args), schema=args.schema) as engine:
        schema = sql.Identifier(engine.schema)
        with psycopg.connect(engine.dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT coalesce(obj_description(oid, 'pg_namespace'), '')"
                " FROM pg_namespace WHERE nspname = %s",
                (engine.schema,),
            ).fetchone()
            if row is not None and row[0] != marker:
                raise SystemExit(
                    f"{script}: schema {engine.schema!r} exists and was not made by this "
                    "benchmark; refusing to drop it. Pick another one with --schema."
                )
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(schema))
        engine.migrate()
        with psycopg.connect(engine.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("COMMENT ON SCHEMA {} IS {}").format(schema, marker))
        yield engine


def client_count(conn: Connection, database: Database) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = %s AND backend_type = 'client backend'",
        (database.name,),
    ).fetchone()
    return int(row[0]) if row else 0


def wait_drained(
    dsn: str, subscription: str, total: int, failed: Sequence[BaseException], timeout: float
) -> None:
    """Wait until the positions of `subscription` add up to `total` (every event of its
    partitions handled); SystemExit when a worker failed (`failed` filled) or after
    `timeout` seconds."""
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT coalesce(sum(position), 0) FROM subengine.subscription_positions"
                " WHERE subscription = %s",
                (subscription,),
            ).fetchone()
            if row is not None and row[0] == total:
                return
            if failed or time.perf_counter() - started > timeout:
                raise SystemExit(f"{subscription}: the workers did not finish: {list(failed)}")
            time.sleep(0.02)


def settled_xacts(
    database: Database, timeout: float = 30.0, column: str = "", pause: float = 0.0
) -> int:
    """The database's transactions (xact_commit + xact_rollback, or `column` alone) once
    no client is connected to it (and `pause` seconds more): a backend reports its
    statistics when it exits, so the count is then complete. Autovacuum is not a client
    and may still add to it."""
    counted = sql.SQL(column or "xact_commit + xact_rollback")
    deadline = time.monotonic() + timeout
    with psycopg.connect(database.admin_dsn, autocommit=True) as conn:
        while client_count(conn, database) and time.monotonic() < deadline:
            time.sleep(0.05)
        if client_count(conn, database):
            progress(f"warning: clients still connected to {database.name}; counts may be short")
        time.sleep(pause)
        row = conn.execute(
            sql.SQL("SELECT {} FROM pg_stat_database WHERE datname = %s").format(counted),
            (database.name,),
        ).fetchone()
    return int(row[0]) if row else 0


def autovacuum_off(conn: Connection, schema: str | None = SCHEMA) -> None:
    """Keep autovacuum out of `schema`'s tables (None: every table outside the catalogs),
    whose transactions would count in the database's and whose ANALYZE would change
    plans under a measurement."""
    tables = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r'"
        " AND n.nspname NOT IN ('pg_catalog', 'information_schema')"
        " AND (n.nspname = %(schema)s::text OR %(schema)s::text IS NULL)",
        {"schema": schema},
    ).fetchall()
    for namespace, table in tables:
        conn.execute(
            sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(
                sql.Identifier(namespace, table)
            )
        )


# the events


SKUS = tuple(f"SKU-{n:05d}" for n in range(0, 50_000, 97))
CHANNELS = ("web", "app", "store", "phone")


def order_data(rng: random.Random, key: str) -> dict[str, Any]:
    """A small order event's payload: about 150 bytes of JSON."""
    return {
        "order": key,
        "customer": f"customer-{rng.randrange(100_000):05d}",
        "sku": rng.choice(SKUS),
        "quantity": rng.randint(1, 5),
        "unit_price": f"{rng.randint(99, 99_999) / 100:.2f}",
        "currency": "EUR",
        "channel": rng.choice(CHANNELS),
    }


def order_keys(count: int) -> list[str]:
    return [f"order-{n:05d}" for n in range(count)]


def append_orders(
    engine: subengine.Engine,
    stream: str,
    count: int,
    rng: random.Random,
    key_of: Callable[[int], str],
    batch: int = 1000,
) -> float:
    """Append `count` order events, `batch` per transaction, the n-th to the key
    `key_of(n)`; the seconds it took."""
    import subengine

    started = time.perf_counter()
    for first in range(0, count, batch):
        events = []
        for n in range(first, min(count, first + batch)):
            key = key_of(n)
            events.append(subengine.NewEvent(key, "OrderUpdated", order_data(rng, key)))
        engine.append(stream, events)
    return time.perf_counter() - started


# child processes on a port of their own


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Child:
    """A server process (`subengine serve`, a plain server, a sink) on a free loopback
    port, its output in a log file; `command` gets the port appended."""

    def __init__(self, kind: str, command: list[str], env: dict[str, str], logs: Path) -> None:
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logs / f"{kind}-{self.port}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [*command, str(self.port)], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.pid = self.process.pid

    def started(self, timeout: float = 30.0) -> Child:
        """Once GET /healthz answers 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the {self.kind} exited:\n{self.output()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if s.recv(64).startswith(b"HTTP/1.1 200"):
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"the {self.kind} did not start")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                progress(f"the {self.kind} did not stop on SIGTERM; killed")
                self.process.kill()
                self.process.wait(STOP_TIMEOUT)


def subengine_serve(*options: str) -> list[str]:
    """The command of a `subengine serve` on 127.0.0.1, without access log; the port last."""
    command = str(Path(sys.executable).parent / "subengine")
    return [command, "serve", "--host", "127.0.0.1", "--no-access-log", *options, "--port"]


# Spark


def spark_session(master: str, name: str, dsn_env: str, dsn: str) -> Any:
    """A local SparkSession with subengine's data source registered; its Python workers
    find the database in the environment variable `dsn_env`."""
    # Python workers inherit the JVM's environment, fixed when the session starts.
    os.environ[dsn_env] = dsn
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import subengine.spark  # needs pyspark; imported only once the session is wanted

    spark = (
        SparkSession.builder.master(master)
        .appName(name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    subengine.spark.register(spark)
    return spark
