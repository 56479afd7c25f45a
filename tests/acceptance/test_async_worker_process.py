"""`subengine worker` running an app whose handler is `async def` and writes through a
SQLAlchemy AsyncSession (tests/apps/async_worker_app.py), as real processes killed with
SIGKILL in the middle of their batches."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import APPS, run_subengine, start_subengine

import subengine
from subengine import NewEvent


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def positions(sql: psycopg.Connection[Any]) -> dict[int, int]:
    return dict(
        sql.execute(
            "SELECT partition, position FROM subengine.subscription_positions"
            " WHERE subscription = 'effects'"
        ).fetchall()
    )


def batches_started(marks: Path, pid: int) -> list[tuple[int, int]]:
    """(partition, last position) of each batch process `pid` started."""
    if not marks.exists():
        return []
    lines = [tuple(map(int, line.split())) for line in marks.read_text().splitlines() if line]
    return [(partition, last) for p, partition, _, last in lines if p == pid]


@pytest.mark.xdist_group("worker-processes")
def test_exactly_once_in_key_order_while_async_workers_are_killed_mid_batch(
    worker_app_env: dict[str, str],
    sql: psycopg.Connection[Any],
    processes: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    marks = tmp_path / "marks"
    env = dict(worker_app_env, WORKER_APP_MARKS=str(marks), WORKER_APP_SLEEP="0.002")
    log = open(tmp_path / "workers.log", "ab")

    def start() -> subprocess.Popen[bytes]:
        process = start_subengine(
            "worker", "--app", "async_worker_app:app", "--concurrency", "2",
            cwd=APPS, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        processes.append(process)
        return process

    rng = random.Random(11)
    total, appended = 6_000, threading.Event()
    with subengine.Engine(env["SUBENGINE_DSN"]) as engine:
        engine.create_stream("orders", partitions=8)

        def produce() -> None:
            keys = [f"order-{n}" for n in range(200)]
            for _ in range(total // 20):
                engine.append("orders", [NewEvent(rng.choice(keys), "T", {}) for _ in range(20)])
                time.sleep(0.01)
            appended.set()

        running = [start() for _ in range(3)]
        producer = threading.Thread(target=produce)
        producer.start()
        kills = mid_batch = 0
        while not (appended.is_set() and sum(positions(sql).values()) == total) or kills < 4:
            time.sleep(rng.uniform(0.5, 1.5))
            victim = running.pop(rng.randrange(len(running)))
            committed = positions(sql)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            # a batch it started that had not committed when it died: killed mid-batch
            mid_batch += any(last > committed.get(partition, 0)
                             for partition, last in batches_started(marks, victim.pid))  # fmt: skip
            kills += 1
            running.append(start())
            if kills > 200:
                raise AssertionError("the workers never caught up")
        producer.join()
        assert sum(engine.heads("orders").values()) == total
    log.close()
    assert mid_batch >= 1
    duplicated = sql.execute(
        "SELECT event_id, count(*) FROM effects GROUP BY 1 HAVING count(*) > 1"
    ).fetchall()
    assert duplicated == []
    missing = sql.execute(
        "SELECT count(*) FROM subengine.events e"
        " WHERE NOT EXISTS (SELECT FROM effects f WHERE f.event_id = e.id)"
    ).fetchone()
    assert missing == (0,)
    versions = defaultdict(list)
    for key, version in sql.execute("SELECT key, key_version FROM effects ORDER BY seq"):
        versions[key].append(version)
    assert all(v == list(range(1, len(v) + 1)) for v in versions.values())


def test_a_subscription_mixing_plain_and_async_handlers_exits_with_one_clear_line(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "mixed_app.py").write_text(
        "import subengine\n"
        "app = subengine.App()\n"
        "sub = app.subscription('billing', stream='orders')\n"
        "sub.handler('A')(lambda event, conn: None)\n"
        "async def paid(event, conn): pass\n"
        "sub.handler('B')(paid)\n"
    )
    result = run_subengine(cli_env, "worker", "--app", "mixed_app:app", cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert (
        "subscription 'billing' has plain def handlers; an async def handler cannot share "
        "their batches' transaction" in line
    )
