"""Worker processes behind a transaction-mode PgBouncer (docs/pooler.md), killed at
random under load: every event's effect exactly once and in key order, with a direct DSN
for the workers' sessions and without one (then they run on row locks and poll)."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import WorkerProcesses, assert_each_effect_once_in_key_order

import subengine
from subengine import NewEvent


@pytest.fixture
def pooled_workers(
    request: pytest.FixtureRequest,
    worker_app_env: dict[str, str],
    bouncer: str,
    dsn: str,
    tmp_path: Path,
) -> Iterator[WorkerProcesses]:
    env = {**worker_app_env, "SUBENGINE_DSN": bouncer}
    if request.param == "direct-dsn":
        env["SUBENGINE_DIRECT_DSN"] = dsn
    workers = WorkerProcesses(env, tmp_path)
    yield workers
    workers.kill_all()


@pytest.mark.parametrize("pooled_workers", ["direct-dsn", "no-direct-dsn"], indirect=True)
def test_exactly_once_while_pooled_workers_are_killed(
    pooled_workers: WorkerProcesses,
    bouncer: str,
    engine: subengine.Engine,
    sql: psycopg.Connection[Any],
) -> None:
    engine.create_stream("orders", partitions=4)
    rng = random.Random(31)
    running = [pooled_workers.start("--concurrency", "2") for _ in range(3)]
    total, appended = 2_000, threading.Event()

    def produce() -> None:
        keys = [f"order-{n}" for n in range(100)]
        with subengine.Engine(bouncer) as producer:  # the application, through the pooler
            for _ in range(total // 20):
                producer.append("orders", [NewEvent(rng.choice(keys), "T", {}) for _ in range(20)])
                time.sleep(0.02)
        appended.set()

    def handled() -> int:
        row = sql.execute(
            "SELECT coalesce(sum(position), 0) FROM subengine.subscription_positions"
            " WHERE subscription = 'effects'"
        ).fetchone()
        return int(row[0]) if row else 0

    producer = threading.Thread(target=produce)
    producer.start()
    kills, deadline = 0, time.monotonic() + 180
    while not (appended.is_set() and handled() == total) or kills < 3:
        assert time.monotonic() < deadline, f"caught up {handled()} of {total}"
        time.sleep(rng.uniform(1.0, 2.0))
        victim = running.pop(rng.randrange(len(running)))
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        kills += 1
        running.append(pooled_workers.start("--concurrency", "2"))
    producer.join()
    assert sum(engine.heads("orders").values()) == total
    assert_each_effect_once_in_key_order(sql, engine)
    logs = pooled_workers.logs()
    assert ("takes no partition locks" in logs) == (
        "SUBENGINE_DIRECT_DSN" not in pooled_workers.env
    )
