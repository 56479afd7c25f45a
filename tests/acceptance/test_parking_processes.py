"""Key-scoped parking with real processes: two `subengine worker` processes park poisoned
keys while the other keys go on, and `subengine parked retry` replays them in order while
the workers run and events keep coming; the `subengine parked` commands, and their bad
input. The workers run `tests/apps/parking_app.py`."""

from __future__ import annotations

import json
import random
import subprocess
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import APPS, WorkerProcesses, run_subengine, start_subengine, wait_for

import subengine
from subengine import NewEvent


@pytest.fixture
def workers(worker_app_env: dict[str, str], tmp_path: Path) -> Iterator[WorkerProcesses]:
    started = WorkerProcesses(worker_app_env, tmp_path, "parking_app:app")
    yield started
    started.kill_all()


@pytest.fixture
def engine_of(dsn: str) -> Iterator[subengine.Engine]:
    with subengine.Engine(dsn) as engine:
        yield engine


def parked(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_subengine(env, "parked", *args, cwd=APPS)


def parked_list(env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    result = parked(env, "list", "--json", *args)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def caught_up(engine: subengine.Engine) -> bool:
    heads = engine.heads("orders")
    positions = engine.subscription_positions("parking")
    return bool(positions) and all(p.position == heads[p.partition] for p in positions)


def effects_by_key(sql: psycopg.Connection[Any]) -> dict[str, list[int]]:
    by_key: dict[str, list[int]] = defaultdict(list)
    for key, version in sql.execute("SELECT key, key_version FROM effects ORDER BY seq"):
        by_key[key].append(version)
    return dict(by_key)


def test_two_workers_park_poisoned_keys_and_a_retry_replays_them_in_order_as_they_run(
    worker_app_env: dict[str, str],
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
) -> None:
    engine_of.create_stream("orders", partitions=4)
    keys = [f"order-{n}" for n in range(40)]
    poisoned = ["order-3", "order-17", "order-30"]
    rng = random.Random(28)

    def produce(rounds: range) -> None:
        with subengine.Engine(worker_app_env["SUBENGINE_DSN"]) as producer:
            for round_ in rounds:
                shuffled = rng.sample(keys, len(keys))
                producer.append(
                    "orders",
                    [
                        NewEvent(key, "T", {"poison": round_ == 1 and key in poisoned})
                        for key in shuffled
                    ],
                )

    for _ in range(2):
        workers.start("--concurrency", "2")
    produce(range(10))
    wait_for(lambda: len(parked_list(worker_app_env)) == 3, what="the poisoned keys to park")
    wait_for(lambda: caught_up(engine_of), what="the workers to pass every event")
    so_far = effects_by_key(sql)
    # every other key's effects once each and in order; a poisoned key's only before it
    assert {key: so_far[key] for key in keys if key not in poisoned} == {
        key: list(range(1, 11)) for key in keys if key not in poisoned
    }
    assert {key: so_far[key] for key in poisoned} == {key: [1] for key in poisoned}
    listed = {row["key"]: row for row in parked_list(worker_app_env)}
    assert sorted(listed) == sorted(poisoned)
    assert all(row["waiting"] == 9 and row["attempts"] == 2 for row in listed.values())
    # Fixed: retry each key while the workers run and more events of every key come
    producer = threading.Thread(target=produce, args=(range(10, 30),))
    producer.start()
    fixed = dict(worker_app_env, PARKING_FIXED="1")
    for key in poisoned:
        result = parked(fixed, "retry", "parking", key, "--app", "parking_app:app")
        assert result.returncode == 0, result.stderr
        assert f"of key {key!r} of 'parking' handled in order; the key is clear" in result.stdout
    producer.join(timeout=120)
    wait_for(lambda: caught_up(engine_of), timeout=120, what="the workers to catch up")
    assert parked_list(worker_app_env) == []
    # every event's effect exactly once, each key's in version order
    duplicated = sql.execute(
        "SELECT event_id FROM effects GROUP BY 1 HAVING count(*) > 1"
    ).fetchall()
    assert duplicated == []
    assert effects_by_key(sql) == {key: list(range(1, 31)) for key in keys}
    resolved = parked_list(worker_app_env, "--all")
    assert sorted((row["key"], row["resolution"]) for row in resolved) == [
        (key, "retried") for key in sorted(poisoned)
    ]
    assert all(row["events"] >= 9 and row["waiting"] == 0 for row in resolved)
    for process in workers.processes:
        assert process.poll() is None


@pytest.fixture
def parked_key(
    worker_app_env: dict[str, str], engine_of: subengine.Engine, workers: WorkerProcesses
) -> str:
    """Key 'p' of subscription parking parked at its first event, with two more events set
    aside after it; key 'q' handled."""
    engine_of.create_stream("orders", partitions=2)
    engine_of.append(
        "orders",
        [NewEvent(k, "T", {"poison": n == 0 and k == "p"}) for n in range(3) for k in "pq"],
    )
    worker = workers.start()
    wait_for(lambda: caught_up(engine_of), what="the worker to pass every event")
    worker.terminate()
    assert worker.wait(timeout=60) == 0
    return "p"


def parking_state(sql: psycopg.Connection[Any]) -> tuple[Any, ...]:
    return (
        sql.execute("SELECT * FROM subengine.parked_keys ORDER BY id").fetchall(),
        sql.execute(
            "SELECT * FROM subengine.parked_events ORDER BY parked_key, position"
        ).fetchall(),
        sql.execute("SELECT * FROM effects ORDER BY seq").fetchall(),
        sql.execute("SELECT * FROM subengine.subscription_positions ORDER BY 2").fetchall(),
    )


def test_parked_list_show_retry_and_discard(
    worker_app_env: dict[str, str],
    parked_key: str,
    engine_of: subengine.Engine,
    sql: psycopg.Connection[Any],
) -> None:
    [row] = parked_list(worker_app_env)
    assert (row["subscription"], row["key"], row["waiting"], row["events"]) == (
        "parking", "p", 3, 3,
    )  # fmt: skip
    assert row["error"] == "ValueError: cannot handle p version 1"
    table = parked(worker_app_env, "list")
    assert table.returncode == 0 and "parked keys" in table.stdout and "p" in table.stdout
    shown = json.loads(parked(worker_app_env, "show", "parking", "p").stdout)
    assert shown["event"]["key"] == "p" and shown["event"]["data"] == {"poison": True}
    assert [e["resolution"] for e in shown["parked_events"]] == [None, None, None]
    status = json.loads(run_subengine(worker_app_env, "status", "--json").stdout.splitlines()[0])
    assert (status["parked_keys"], status["parked_events"]) == (1, 3)
    partitions = run_subengine(worker_app_env, "status", "--partitions")
    assert "parked keys" in partitions.stdout
    assert "parked keys" in run_subengine(worker_app_env, "subscription", "show", "parking").stdout
    # still broken: recorded, exit 1, nothing handled
    failed = parked(worker_app_env, "retry", "parking", "p", "--app", "parking_app:app")
    assert failed.returncode == 1
    assert failed.stderr.startswith("error: the handlers failed again (recorded; key 'p'")
    assert failed.stderr.count("\n") == 1
    assert parked_list(worker_app_env)[0]["retries"] == 1
    assert "p" not in effects_by_key(sql)
    fixed = dict(worker_app_env, PARKING_FIXED="1")
    done = parked(fixed, "retry", "parking", "p", "--app", "parking_app:app")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("retried: 3 event(s) of key 'p' of 'parking'")
    assert effects_by_key(sql) == {"p": [1, 2, 3], "q": [1, 2, 3]}
    # discard: a key parked again (a new poison) is released without its events
    engine_of.append("orders", [NewEvent("p", "T", {"poison": True})])
    engine_of.append("orders", [NewEvent("p", "T", {})])
    subprocess_env = dict(worker_app_env)
    worker = start_subengine(
        "worker",
        "--app",
        "parking_app:app",
        cwd=APPS,
        env=subprocess_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: len(parked_list(worker_app_env)) == 1, what="p to park again")
        wait_for(lambda: caught_up(engine_of), what="the worker to pass p's events")
        discarded = parked(worker_app_env, "discard", "parking", "p")
        assert discarded.returncode == 0, discarded.stderr
        assert discarded.stdout.startswith("discarded: 2 event(s) of key 'p'")
        engine_of.append("orders", [NewEvent("p", "T", {})])
        wait_for(lambda: effects_by_key(sql)["p"] == [1, 2, 3, 6], what="p's next event")
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    resolutions = [r["resolution"] for r in parked_list(worker_app_env, "--all")]
    assert resolutions == ["retried", "discarded"]


def test_bad_input_to_the_parked_commands_is_one_line_and_changes_nothing(
    worker_app_env: dict[str, str], parked_key: str, sql: psycopg.Connection[Any]
) -> None:
    before = parking_state(sql)
    app = ("--app", "parking_app:app")
    cases = [
        (["show", "parking", "nokey"], "never parked key 'nokey'"),
        (["show", "nope", "p"], "no subscription named 'nope'"),
        (["retry", "parking", "nokey", *app], "has no parked key 'nokey'"),
        (["retry", "nope", "p", *app], "the app declares no subscription 'nope'"),
        (["retry", "parking", "p"], "Missing option '--app'"),
        (["retry", "parking", "", *app], "invalid event key"),
        (["retry", "parking", "p", "--app", "no_such_module:app"], "cannot import"),
        (["discard", "parking", "nokey"], "has no parked key 'nokey'"),
        (["discard", "bad name!", "p"], "invalid stream name"),
        (["discard", "parking"], "Missing argument 'KEY'"),
        (["list", "--subscription", "bad name!"], "invalid stream name"),
    ]
    for args, message in cases:
        result = parked(worker_app_env, *args)
        assert result.returncode != 0, args
        assert result.stderr.startswith("error: "), (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert result.stderr.count("\n") == 1, (args, result.stderr)
    assert parking_state(sql) == before
