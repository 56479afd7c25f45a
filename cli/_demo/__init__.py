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

The parts: producer (the order events), processes (the worker processes), schema (the
demo's own schema, stream and subscription), display (what it shows while it runs) and
check (the projection compared with the events). Everything here uses subengine's public
API only; the projection's SQL is the demo app's own (demo_app).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import subengine

from ..demo_app import SCHEMA, SUBSCRIPTION
from .check import Say, verify
from .display import Display
from .processes import WORKER_APP, WORKER_CONCURRENCY, Workers
from .producer import Producer
from .schema import MARKER, claim_schema, prepare

__all__ = ["MARKER", "run", "settings", "verify"]

WORKERS = 2
DRAIN_TIMEOUT_SECONDS = 60.0  # after the producer is done
REGISTER_TIMEOUT_SECONDS = 30.0  # for a worker process to start
REFRESH_SECONDS = 0.25


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
    if not claim_schema(engine, say):
        return False
    engine.migrate()
    if not prepare(engine, say):
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


def _where(engine: subengine.Engine) -> str:
    return "the embedded PostgreSQL" if engine.embedded else "the PostgreSQL of SUBENGINE_DSN"


def _watch(engine: subengine.Engine, producer: Producer, workers: Workers, say: Say) -> list[str]:
    """Show the status until the producer is done and the lag is gone; the problems met.

    Half-way through the appends, one worker is killed with SIGKILL and another started.
    """
    killed = False
    drain_deadline: float | None = None
    with Display(say) as show:
        while True:
            rows = engine.subscription_status(SUBSCRIPTION)
            show(rows, producer, workers)
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
