"""The demo the README's first command runs: the engine working end to end.

On the configured database (the embedded PostgreSQL when no DSN is given) it works in a
schema of its own, `subengine_demo`, and nowhere else: it creates the schema and marks it
with a comment, and refuses a schema of that name it did not make. There it migrates,
creates the stream `orders` (8 partitions) and starts two `subengine worker` processes
running the projection of `subengine.cli.demo_app`. A producer appends a few thousand
order events (placed, items added, paid, shipped, cancelled, over many order keys) while
the live status table shows the lag draining; half-way, one worker is killed with SIGKILL
and another one started. At the end the projection is checked against the events: every
order's state, items, totals, event count and version must be what the events say.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from psycopg import sql
from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from subengine.cli import _status
from subengine.cli.demo_app import PROJECTION_DDL, SCHEMA, STREAM, SUBSCRIPTION, projection

import subengine

PARTITIONS = 8
WORKERS = 2
WORKER_CONCURRENCY = 2
APPEND_BATCH = 20  # events per producer transaction
DRAIN_TIMEOUT_SECONDS = 60.0  # after the producer is done
REGISTER_TIMEOUT_SECONDS = 30.0  # for a worker process to start
REFRESH_SECONDS = 0.25
WORKER_APP = "subengine.cli.demo_app:app"
# The comment on a schema the demo made; a schema of its name without it is not the demo's.
MARKER = "made by `subengine demo`, which writes only into this schema"

Say = Callable[[str], None]
Row = dict[str, Any]
COLUMNS: _status.Columns = tuple(  # one subscription's: narrow enough for 80 columns
    column
    for column in _status.PARTITION_COLUMNS
    if column[0] not in ("subscription", "attempts", "worker_host")
)

CATALOGUE = (
    ("kettle", 3499),
    ("teapot", 2450),
    ("mug", 899),
    ("grinder", 5900),
    ("filter-papers", 399),
    ("scale", 2999),
    ("beans-1kg", 2350),
    ("tea-loose-250g", 1290),
    ("french-press", 3150),
    ("milk-frother", 4475),
)
PAYMENT_METHODS = ("card", "paypal", "invoice")
CARRIERS = ("dhl", "ups", "postnl", "dpd")
CANCEL_REASONS = ("customer request", "payment declined", "out of stock")


@dataclass
class _Order:
    state: str
    version: int
    total_cents: int


class Producer(threading.Thread):
    """Appends `count` order events at about `rate` per second, APPEND_BATCH events per
    transaction, with each key's current version as its expected version."""

    def __init__(self, engine: subengine.Engine, count: int, rate: float) -> None:
        super().__init__(name="demo producer", daemon=True)
        self.engine = engine
        self.count = count
        self.rate = rate
        self.appended = 0
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self._rng = random.Random()
        self._run = f"{self._rng.getrandbits(24):06x}"  # keys of earlier runs stay distinct
        self._orders: dict[str, _Order] = {}
        self._open: list[str] = []

    def run(self) -> None:
        started = time.monotonic()
        try:
            while self.appended < self.count and not self.stopping.is_set():
                events, expected = self._batch(min(APPEND_BATCH, self.count - self.appended))
                self.engine.append(STREAM, events, expected_version=expected)
                self.appended += len(events)
                self.stopping.wait(started + self.appended / self.rate - time.monotonic())
        except BaseException as error:  # reported by the demo, which then fails
            self.error = error

    def _batch(self, size: int) -> tuple[list[subengine.NewEvent], dict[str, int]]:
        events: list[subengine.NewEvent] = []
        expected: dict[str, int] = {}
        for _ in range(size):
            key, event_type, data = self._next()
            order = self._orders[key]
            expected.setdefault(key, order.version)
            order.version += 1
            events.append(subengine.NewEvent(key, event_type, data))
        return events, expected

    def _next(self) -> tuple[str, str, dict[str, Any]]:
        rng = self._rng
        if not self._open or rng.random() < 0.3:
            key = f"order-{self._run}-{len(self._orders) + 1:05d}"
            lines = [
                {"sku": sku, "quantity": rng.randint(1, 3), "price_cents": price}
                for sku, price in rng.sample(CATALOGUE, rng.randint(1, 4))
            ]
            total = sum(line["quantity"] * line["price_cents"] for line in lines)
            self._orders[key] = _Order("placed", 0, total)
            self._open.append(key)
            customer = f"customer-{rng.randrange(500):03d}"
            data = {"customer": customer, "items": lines, "currency": "EUR", "total": total / 100}
            return key, "OrderPlaced", data
        key = rng.choice(self._open)
        order = self._orders[key]
        roll = rng.random()
        if order.state == "placed" and roll < 0.3:
            sku, price = rng.choice(CATALOGUE)
            quantity = rng.randint(1, 2)
            order.total_cents += quantity * price
            return key, "ItemAdded", {"sku": sku, "quantity": quantity, "price_cents": price}
        if order.state == "placed" and roll < 0.85:
            order.state = "paid"
            method = rng.choice(PAYMENT_METHODS)
            return key, "OrderPaid", {"amount_cents": order.total_cents, "method": method}
        self._open.remove(key)
        if order.state == "paid" and roll < 0.85:
            order.state = "shipped"
            carrier = rng.choice(CARRIERS)
            tracking = f"{carrier.upper()}{rng.randrange(10**9):09d}"
            return key, "OrderShipped", {"carrier": carrier, "tracking": tracking}
        order.state = "cancelled"
        return key, "OrderCancelled", {"reason": rng.choice(CANCEL_REASONS)}


class Workers:
    """The demo's `subengine worker` processes, each logging to a file of its own."""

    def __init__(self, engine: subengine.Engine, directory: Path) -> None:
        self.directory = directory
        self.env = dict(os.environ, SUBENGINE_DSN=engine.dsn, SUBENGINE_SCHEMA=engine.schema)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.killed: set[int] = set()
        self._logs: list[IO[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        log = (self.directory / f"worker-{len(self.processes) + 1}.log").open("wb")
        self._logs.append(log)
        command = [sys.executable, "-m", "subengine.cli", "worker", "--app", WORKER_APP]
        process = subprocess.Popen(
            [*command, "--concurrency", str(WORKER_CONCURRENCY)],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the demo, which stops them in order
        )
        self.processes.append(process)
        return process

    def wait_registered(self, engine: subengine.Engine, timeout: float) -> list[str]:
        """Wait until every running worker has registered (it then handles SIGTERM)."""
        deadline = time.monotonic() + timeout
        while True:
            registered = {row.pid for row in engine.workers() if row.connected}
            waiting = [p for p in self.running() if p.pid not in registered]
            if not waiting:
                return self.failed()
            if time.monotonic() > deadline:
                pids = ", ".join(str(p.pid) for p in waiting)
                return [f"worker pids {pids} did not register within {timeout:g} s"]
            time.sleep(0.1)

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        self.killed.add(process.pid)
        process.send_signal(signal.SIGKILL)
        process.wait()

    def running(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.processes if p.poll() is None]

    def failed(self) -> list[str]:
        """What every worker that exited without being asked to said last."""
        return [
            f"worker pid {p.pid} exited with status {p.returncode}: {self.last_line(p)}"
            for p in self.processes
            if p.poll() is not None and p.pid not in self.killed
        ]

    def stop(self) -> list[str]:
        """SIGTERM every running worker; what went wrong if one did not exit 0."""
        stopping = self.running()
        for process in stopping:
            self.killed.add(process.pid)
            process.send_signal(signal.SIGTERM)
        problems = []
        for process in stopping:
            try:
                status = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                status = process.wait()
            if status != 0:
                problems.append(
                    f"worker pid {process.pid} exited with status {status} on SIGTERM: "
                    f"{self.last_line(process)}"
                )
        for log in self._logs:
            log.close()
        return problems

    def last_line(self, process: subprocess.Popen[bytes]) -> str:
        log = self.directory / f"worker-{self.processes.index(process) + 1}.log"
        lines = log.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(it printed nothing)"


def settings(base: subengine.Settings) -> subengine.Settings:
    """The demo's settings: `base` (the database), with the demo's own schema."""
    return base.with_changes(schema=SCHEMA)


def run(engine: subengine.Engine, count: int, rate: float, say: Say) -> bool:
    """The whole demo, on an engine made with `settings`; True only if the projection
    matched the events exactly."""
    if engine.schema != SCHEMA:
        raise subengine.ConfigurationError(
            f"the demo runs only in its own schema {SCHEMA!r}, not {engine.schema!r}"
        )
    say(
        f"the demo writes only into schema {SCHEMA!r} on {_where(engine)}, which it creates "
        "and marks; nothing outside it changes"
    )
    if not _claim_schema(engine, say):
        return False
    engine.migrate()
    if not _prepare(engine, say):
        return False
    with tempfile.TemporaryDirectory(prefix="subengine-demo-") as directory:
        workers = Workers(engine, Path(directory))
        producer = Producer(engine, count, rate)
        try:
            problems = _produce_and_project(engine, producer, workers, say)
        finally:
            producer.stopping.set()
            stopping = workers.stop()
    for problem in problems + stopping:
        say(f"FAILED: {problem}")
    return not (problems or stopping) and verify(engine, say)


def _produce_and_project(
    engine: subengine.Engine, producer: Producer, workers: Workers, say: Say
) -> list[str]:
    for _ in range(WORKERS):
        workers.start()
    problems = workers.wait_registered(engine, REGISTER_TIMEOUT_SECONDS)
    if problems:
        return problems
    say(
        f"started {WORKERS} worker processes (subengine worker --app {WORKER_APP} "
        f"--concurrency {WORKER_CONCURRENCY}), pids "
        + ", ".join(str(p.pid) for p in workers.processes)
    )
    say(f"appending {producer.count:,} order events at about {producer.rate:,.0f} per second")
    started = time.monotonic()
    producer.start()
    problems = _watch(engine, producer, workers, say)
    if not problems:
        elapsed = time.monotonic() - started
        say(f"producer done and lag drained {elapsed:.1f} s after the first append")
    # the replacement worker must have started too, or have said why it did not
    return problems + workers.wait_registered(engine, REGISTER_TIMEOUT_SECONDS)


def _claim_schema(engine: subengine.Engine, say: Say) -> bool:
    """Create and mark the demo's schema, or make sure the one there is the demo's."""
    with engine.connection() as conn:
        row = conn.execute(
            "SELECT coalesce(obj_description(oid, 'pg_namespace'), '')"
            " FROM pg_namespace WHERE nspname = %s",
            (SCHEMA,),
        ).fetchone()
        if row is None:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
            conn.execute(
                sql.SQL("COMMENT ON SCHEMA {} IS {}").format(
                    sql.Identifier(SCHEMA), sql.Literal(MARKER)
                )
            )
            say(f"created schema {SCHEMA!r}")
            return True
    if row[0] == MARKER:
        return True
    say(
        f"FAILED: schema {SCHEMA!r} exists, and the demo did not make it (it lacks the "
        "demo's comment), so the demo changed nothing. If an older `subengine demo` made "
        f"it (with only a table {STREAM}), drop it and run the demo again: "
        f"psql \"$({_command_name()} db url)\" -c 'DROP SCHEMA {SCHEMA} CASCADE'"
    )
    return False


def _prepare(engine: subengine.Engine, say: Say) -> bool:
    """Stream, projection table and subscription, the subscription rebuilding from the
    beginning: its reset and the projection's truncation commit together."""
    existing = {s.name: s for s in engine.streams()}
    if STREAM not in existing:
        engine.create_stream(STREAM, PARTITIONS)
        say(f"created stream {STREAM!r} with {PARTITIONS} partitions")
    elif existing[STREAM].partitions != PARTITIONS:
        say(
            f"FAILED: stream {STREAM!r} of schema {SCHEMA!r} already exists with "
            f"{existing[STREAM].partitions} partitions, not {PARTITIONS}, so the demo changed "
            f"nothing; drop the schema and run the demo again: psql "
            f"\"$({_command_name()} db url)\" -c 'DROP SCHEMA {SCHEMA} CASCADE'"
        )
        return False
    else:
        say(f"stream {STREAM!r} exists: the projection is rebuilt from its first event")
    engine.ensure_subscription(projection)
    engine.resume_subscription(SUBSCRIPTION)
    with engine.connection() as conn:
        conn.execute(PROJECTION_DDL)
        subengine.reset_subscription(conn, SUBSCRIPTION, "beginning", settings=engine.settings)
        conn.execute("TRUNCATE subengine_demo.orders")
    say(f"subscription {SUBSCRIPTION!r} projects orders into table subengine_demo.orders")
    return True


def _where(engine: subengine.Engine) -> str:
    return "the embedded PostgreSQL" if engine.embedded else "the PostgreSQL of SUBENGINE_DSN"


def _watch(engine: subengine.Engine, producer: Producer, workers: Workers, say: Say) -> list[str]:
    """Show the status until the producer is done and the lag is gone; the problems met.

    Half-way through the appends, one worker is killed with SIGKILL and another started.
    """
    killed = False
    drain_deadline: float | None = None
    with _Display(say) as show:
        while True:
            rows = engine.subscription_status(SUBSCRIPTION)
            show([asdict(r) for r in rows], producer, workers)
            problems = workers.failed() + [
                f"partition {r.partition} stopped: {r.last_error}"
                for r in rows
                if r.state == "stopped"
            ]
            if producer.error is not None:
                problems.append(f"the producer failed: {producer.error}")
            if problems:
                return problems
            if not killed and producer.appended >= producer.count // 2:
                victim = workers.running()[0]
                workers.kill(victim)
                replacement = workers.start()
                killed = True
                say(
                    f"killed worker pid {victim.pid} with SIGKILL while it worked, and started "
                    f"pid {replacement.pid}: its open transaction rolled back, its locks "
                    "went with its connection"
                )
            if not producer.is_alive():
                if sum(r.lag for r in rows) == 0:
                    return []
                drain_deadline = drain_deadline or time.monotonic() + DRAIN_TIMEOUT_SECONDS
                if time.monotonic() > drain_deadline:
                    return [f"the lag did not drain within {DRAIN_TIMEOUT_SECONDS:g} s"]
            time.sleep(REFRESH_SECONDS)


Show = Callable[[list[Row], Producer, Workers], None]


class _Display:
    """A live table and progress bar on a terminal; elsewhere a line a second."""

    def __init__(self, say: Say) -> None:
        self.say = say
        self.console = _status.console()
        self.live: Live | None = None
        self.progress = Progress(
            TextColumn("projected"), BarColumn(), MofNCompleteColumn(), TextColumn("events")
        )
        self.task = self.progress.add_task("projected", total=None)
        self.last_line = 0.0
        self.rows: list[Row] = []
        self.started = time.monotonic()

    def __enter__(self) -> Show:
        if self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=8)
            self.live.__enter__()
        return self.show

    def __exit__(self, *exc_info: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)
        elif self.rows:
            self.console.print(_status.table(self.rows, COLUMNS, SUBSCRIPTION))

    def show(self, rows: list[Row], producer: Producer, workers: Workers) -> None:
        self.rows = rows
        projected = sum(int(r["position"]) for r in rows)
        heads = sum(int(r["head"]) for r in rows)
        lag = heads - projected
        pids = ", ".join(str(p.pid) for p in workers.running())
        if self.live is not None:
            self.progress.update(self.task, total=heads or None, completed=projected)
            caption = f"appended {producer.appended:,} of {producer.count:,}; workers {pids}"
            table = _status.table(rows, COLUMNS, f"{SUBSCRIPTION} ({caption})")
            self.live.update(Group(table, self.progress))
            return
        now = time.monotonic()
        if now - self.last_line >= 1.0:
            self.last_line = now
            self.say(
                f"{now - self.started:5.1f} s  appended {producer.appended:>6,}  "
                f"projected {projected:>6,}  lag {lag:>5,}  workers {pids}"
            )


def _events(engine: subengine.Engine) -> Iterator[subengine.Event]:
    for partition in range(engine.stream(STREAM).partitions):
        after = 0
        while batch := engine.read(STREAM, partition, after=after, limit=5000):
            yield from batch
            after = batch[-1].position


def expected_orders(events: Iterator[subengine.Event]) -> tuple[dict[str, tuple[Any, ...]], int]:
    """What the projection must hold, folded from the events in Python, independently of
    the handlers' SQL: (customer, state, items, total, paid, events, version) per order,
    and the number of events folded."""
    orders: dict[str, list[Any]] = {}
    folded = 0
    for event in events:
        data = event.data
        if event.type == "OrderPlaced":
            lines = data["items"]
            items = sum(line["quantity"] for line in lines)
            total = sum(line["quantity"] * line["price_cents"] for line in lines)
            orders[event.key] = [data["customer"], "placed", items, total, 0, 0, 0]
        elif event.type == "ItemAdded":
            orders[event.key][2] += data["quantity"]
            orders[event.key][3] += data["quantity"] * data["price_cents"]
        elif event.type == "OrderPaid":
            orders[event.key][1] = "paid"
            orders[event.key][4] += data["amount_cents"]
        elif event.type in ("OrderShipped", "OrderCancelled"):
            orders[event.key][1] = "shipped" if event.type == "OrderShipped" else "cancelled"
        else:
            continue
        orders[event.key][5] += 1
        orders[event.key][6] = event.key_version
        folded += 1
    return {key: tuple(values) for key, values in orders.items()}, folded


def verify(engine: subengine.Engine, say: Say) -> bool:
    expected, folded = expected_orders(_events(engine))
    with engine.connection() as conn:
        projected = {
            key: tuple(values)
            for key, *values in conn.execute(
                "SELECT order_key, customer, state, items, total_cents, paid_cents, events,"
                " version FROM subengine_demo.orders"
            )
        }
    wrong = sorted(
        k for k in expected.keys() | projected.keys() if expected.get(k) != projected.get(k)
    )
    for key in wrong[:5]:
        say(
            f"MISMATCH {key}: the events say {expected.get(key)}, "
            f"the projection holds {projected.get(key)}"
        )
    applied = sum(row[5] for row in projected.values())
    states = Counter(values[1] for values in projected.values())
    say("")
    say(f"checked {folded:,} events against {len(projected):,} projected orders:")
    for state in ("placed", "paid", "shipped", "cancelled"):
        cents = sum(v[3] for v in projected.values() if v[1] == state)
        say(f"  {state:<10} {states[state]:>6,} orders  {cents / 100:>12,.2f} EUR")
    if wrong or applied != folded:
        say(
            f"FAILED: {len(wrong)} orders differ; the projection applied {applied:,} events, "
            f"the stream holds {folded:,}"
        )
        return False
    say(
        "check passed: every order's state, items, totals, event count and version equal "
        "what its events say (each event applied exactly once, in order)"
    )
    _next_steps(engine, say)
    return True


def _command_name() -> str:
    """How the reader can call `subengine` again: by name if it is on PATH."""
    program = sys.argv[0]
    on_path = shutil.which("subengine")
    if os.sep not in program or (on_path and os.path.samefile(on_path, program)):
        return "subengine"
    relative = os.path.relpath(program)
    return program if relative.startswith("..") else relative


def _next_steps(engine: subengine.Engine, say: Say) -> None:
    command = _command_name()
    demo = f"{command} --schema {SCHEMA}"  # the demo's schema, not SUBENGINE_SCHEMA's
    say("")
    say("Try next (the server keeps running; stop it with `" + command + " db stop`):")
    for line in (
        f"{demo} status --partitions   # positions, lag and state per partition",
        f"{demo} subscription show {SUBSCRIPTION}",
        # a line printed for the reader to run, not SQL this program runs
        f'psql "$({command} db url)" -c "SELECT * FROM {SCHEMA}.subscription_status"',  # noqa: S608
        f"{demo} worker --app {WORKER_APP}   # in two terminals;",
        f"    then append more, kill one with kill -9, and watch `{demo} status --watch`",
        f"{demo} append {STREAM} --key order-x --type OrderPlaced \\",
        '    --data \'{"customer": "you", "items": [{"sku": "mug", "quantity": 1, '
        '"price_cents": 899}]}\'',
    ):
        say(f"  {line}")
