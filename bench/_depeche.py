"""depeche-db's side of bench/consume.py: its exactly-once consumers, timed on the same
backlog shape. It runs in an interpreter of its own (depeche-db conflicts with subengine's
dependencies), reads its parameters as JSON on stdin and prints its rows as JSON.
"""

from __future__ import annotations

import dataclasses
import getpass
import hashlib
import json
import multiprocessing
import random
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
from _harness import Database, order_data, order_keys, settled_xacts
from _workers import Processes, check_effects, truncate_effects, wait_for_go, wait_for_total
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

APPEND_BATCH = 1000
KEYS = 1000
MISSING = "depeche-db not installed (pip install 'depeche-db==0.13.*')"


def run_child(
    python: str, database: Database, backlog: int, partitions: int, batch_size: int,
    processes: list[int], seed: int,
) -> dict[str, Any] | str:  # fmt: skip
    """This module's report, run by `python` (depeche-db's interpreter); or why not."""
    params = {
        "database": {"admin_dsn": database.admin_dsn, "name": database.name, "dsn": database.dsn},
        "backlog": backlog,
        "partitions": partitions,
        "batch_size": batch_size,
        "processes": processes,
        "seed": seed,
    }
    try:
        completed = subprocess.run(
            [python, str(Path(__file__))],
            input=json.dumps(params),
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as error:
        return f"{MISSING}: cannot run --depeche-python {python}: {error.strerror}"
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        return f"depeche-db run failed (exit status {completed.returncode})"
    report: dict[str, Any] = json.loads(lines[-1])
    return MISSING if "missing" in report else report


def psycopg_url(dsn: str) -> str:
    """`dsn` as a `postgresql+psycopg://` URL, the form depeche-db's listener parses.

    Every parameter goes in the query string but the user, which keeps the authority part
    non-empty (depeche-db re-assembles the URL with urlunparse, which drops an empty one);
    libpq's default user is the operating system's, as here.
    """
    params = conninfo_to_dict(dsn)
    user = str(params.pop("user", None) or getpass.getuser())
    return f"postgresql+psycopg://{quote(user, safe='')}@/?{urlencode(params)}"


def key_partition(key: str, partitions: int) -> int:
    """subengine's partition of a key (README), without importing subengine."""
    digest = hashlib.md5(key.encode()).digest()
    return (int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF) % partitions


@dataclass(frozen=True, slots=True)
class DepecheJob:
    dsn: str
    name: str
    partitions: int
    batch_size: int


@dataclass(frozen=True, slots=True)
class DepecheEvent:
    """A depeche-db message: the same order payload as subengine's events."""

    message_id: uuid.UUID
    occurred_at: datetime
    data: dict[str, Any]

    def get_message_id(self) -> uuid.UUID:
        return self.message_id

    def get_message_time(self) -> datetime:
        return self.occurred_at


class DepecheSerializer:
    def serialize(self, message: DepecheEvent) -> dict[str, Any]:
        return {
            "id": str(message.message_id),
            "at": message.occurred_at.isoformat(),
            "data": message.data,
        }

    def deserialize(self, stored: dict[str, Any]) -> DepecheEvent:
        return DepecheEvent(
            uuid.UUID(stored["id"]), datetime.fromisoformat(stored["at"]), stored["data"]
        )


class DepechePartitioner:
    def __init__(self, partitions: int) -> None:
        self.partitions = partitions

    def get_partition(self, message: Any) -> int:
        return key_partition(message.stream, self.partitions)


@dataclass(frozen=True, slots=True)
class DepecheObjects:
    engine: Any
    store: Any
    stream: Any
    subscription: Any


def depeche_objects(job: DepecheJob) -> DepecheObjects:
    """depeche-db's store, aggregated stream and exactly-once subscription."""
    import sqlalchemy
    from depeche_db import MessageHandlerRegister, MessageStore, SubscriptionMessage

    dsn = job.dsn
    engine = sqlalchemy.create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
    store = MessageStore[DepecheEvent](name="bench", engine=engine, serializer=DepecheSerializer())
    stream = store.aggregated_stream(
        name="bench_agg",
        partitioner=DepechePartitioner(job.partitions),
        stream_wildcards=["order-%"],
        update_batch_size=APPEND_BATCH,
    )
    insert = sqlalchemy.text(
        "INSERT INTO bench_effects (event_id, partition, position)"
        " VALUES (:id, :partition, :position)"
    )

    def handle(message: Any) -> None:
        # exactly once, as depeche-db's documentation shows: the effect and the ack
        # commit in one transaction of the handler's own
        with engine.connect() as conn:
            conn.execute(
                insert,
                {
                    "id": message.stored_message.message_id,
                    "partition": message.partition,
                    "position": message.position,
                },
            )
            message.ack.execute(conn=conn)
            conn.commit()

    handlers = MessageHandlerRegister[DepecheEvent]()
    handlers.register_manual(handle, SubscriptionMessage[DepecheEvent])
    subscription = stream.subscription(name=job.name, handlers=handlers, batch_size=job.batch_size)
    return DepecheObjects(engine, store, stream, subscription)


def depeche_executor(job: DepecheJob, ready: Any, go: Any) -> None:
    """One process running depeche-db's Executor; SIGTERM stops it."""
    from depeche_db import Executor

    objects = depeche_objects(job)
    executor = Executor(db_dsn=psycopg_url(job.dsn))
    executor.register(objects.stream.projector)
    executor.register(objects.subscription.runner)
    ready.set()
    wait_for_go(go)
    executor.run()


def write_backlog(job: DepecheJob, events: int, seed: int) -> float:
    """Write `events` messages, one stream per key, and project them; the seconds."""
    rng = random.Random(seed)
    keys = order_keys(KEYS)
    objects = depeche_objects(job)
    started = time.perf_counter()
    with objects.engine.connect() as conn:
        for n in range(events):
            key = rng.choice(keys)
            message = DepecheEvent(uuid.uuid4(), datetime.now(UTC), order_data(rng, key))
            objects.store.write(stream=key, message=message, conn=conn)
            if n % APPEND_BATCH == APPEND_BATCH - 1:
                conn.commit()
        conn.commit()
    objects.stream.projector.update_full()
    objects.engine.dispose()
    return time.perf_counter() - started


def done_query(name: str) -> sql.Composable:
    # depeche-db numbers positions from 0 and stores the last one handled
    return sql.SQL("SELECT sum(position + 1) FROM {} WHERE partition >= 0").format(
        sql.Identifier(f"depeche_subscriptions_{name}")
    )


def timed(
    context: SpawnContext, database: Database, backlog: int, job: DepecheJob, processes: int
) -> dict[str, Any]:
    """One timed run of `processes` executors over the backlog: a consume.py row."""
    truncate_effects(database.dsn)
    group = Processes.new(context)
    before = settled_xacts(database)
    try:
        for _ in range(processes):
            group.start(depeche_executor, job)
        with psycopg.connect(database.dsn, autocommit=True) as monitor:
            started = group.begin()
            finished, polls = wait_for_total(
                monitor, done_query(job.name), (), backlog, group.started
            )
    finally:
        group.finish()  # SIGTERM: the Executor's own way to stop, too
    return {
        "runner": "depeche-db executor",
        "handler": "one INSERT",
        "processes": processes,
        "events": backlog,
        "seconds": finished - started,
        "xacts": settled_xacts(database) - before - polls,
        "note": check_effects(database.dsn, backlog),
    }


def main(params: dict[str, Any]) -> dict[str, Any]:
    try:
        import depeche_db  # noqa: F401
    except ImportError as error:
        return {"missing": f"{error}"}
    database = Database(**params["database"])
    context = multiprocessing.get_context("spawn")
    base = DepecheJob(database.dsn, "sub", params["partitions"], params["batch_size"])
    write_seconds = write_backlog(base, params["backlog"], params["seed"])
    rows = []
    for processes in params["processes"]:
        job = dataclasses.replace(base, name=f"sub{processes}")
        depeche_objects(job).engine.dispose()  # creates the subscription's state table
        rows.append(timed(context, database, params["backlog"], job, processes))
    return {"write_seconds": write_seconds, "rows": rows}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.stdin.read()))))
