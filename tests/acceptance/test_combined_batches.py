"""Transactions that carry several partitions' batches (a sparse backlog: few events per
partition), with real `subengine worker` processes running `tests/apps/combined_app.py`:
every event's effect exactly once and in order per partition, a failing event in one
partition of a combined transaction, a reset of one of its partitions, and a SIGKILL
while one is open. The app records each effect with its transaction's id, and notes each
handler call (partition, positions, events, transaction id) before it runs."""

from __future__ import annotations

import signal
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
import pytest
from helpers import WorkerProcesses, key_in, wait_for

import subengine
from subengine import NewEvent

GATE = 4242


class Call(NamedTuple):
    """A handler call the app noted: its process, partition, positions, events, transaction."""

    pid: int
    partition: int
    first: int
    last: int
    events: int
    txid: int


@pytest.fixture
def env(
    worker_app_env: dict[str, str], sql: psycopg.Connection[Any], tmp_path: Path
) -> dict[str, str]:
    sql.execute("ALTER TABLE effects ADD COLUMN txid bigint")
    return dict(worker_app_env, COMBINED_APP_MARKS=str(tmp_path / "marks"))


@pytest.fixture
def engine(dsn: str) -> Iterator[subengine.Engine]:
    with subengine.Engine(dsn) as engine:
        yield engine


@pytest.fixture
def workers(env: dict[str, str], tmp_path: Path) -> Iterator[WorkerProcesses]:
    started = WorkerProcesses(env, tmp_path, "combined_app:app")
    yield started
    started.kill_all()


def calls(env: dict[str, str]) -> list[Call]:
    path = Path(env["COMBINED_APP_MARKS"])
    lines = path.read_text().splitlines() if path.exists() else []
    return [Call(*map(int, line.split())) for line in lines if len(line.split()) == 6]


def append_spread(
    engine: subengine.Engine, partitions: int, data: dict[int, list[dict[str, Any]]]
) -> None:
    """Append, in one transaction, each partition's events (their data given in order)."""
    engine.append(
        "orders",
        [
            NewEvent(key_in(partition, partitions=partitions), "Step", item)
            for partition, items in data.items()
            for item in items
        ],
    )


def caught_up(engine: subengine.Engine, sql: psycopg.Connection[Any]) -> bool:
    stored = dict(
        sql.execute(
            "SELECT partition, position FROM subengine.subscription_positions"
            " WHERE subscription = 'effects'"
        ).fetchall()
    )
    return bool(stored) and stored == engine.heads("orders")


def assert_once_in_order(sql: psycopg.Connection[Any], twice: frozenset[int] = frozenset()) -> None:
    """Every stored event has one effect (two in the partitions `twice`, one per pass),
    but the poisoned ones none; each partition's effects, in the order they were made, are
    its positions 1, 2, 3 … (after each other in `twice`)."""
    rows = sql.execute(
        "SELECT e.partition, e.position, e.data ? 'poison', count(f.event_id)"
        " FROM subengine.events e LEFT JOIN effects f ON f.event_id = e.id"
        " GROUP BY 1, 2, 3 ORDER BY 1, 2"
    ).fetchall()
    wrong = [
        (partition, position, made)
        for partition, position, poison, made in rows
        if made != (0 if poison else 2 if partition in twice else 1)
    ]
    assert wrong == []
    order: dict[int, list[int]] = defaultdict(list)
    for partition, position in sql.execute("SELECT partition, position FROM effects ORDER BY seq"):
        order[partition].append(position)
    poisoned = {
        (p, n) for p, n in sql.execute(
            "SELECT partition, position FROM subengine.events WHERE data ? 'poison'"
        )
    }  # fmt: skip
    for partition, positions in order.items():
        expected = [n for n in range(1, max(positions) + 1) if (partition, n) not in poisoned]
        assert positions == expected * (2 if partition in twice else 1), partition


def by_transaction(found: list[Call]) -> dict[int, list[Call]]:
    grouped: dict[int, list[Call]] = defaultdict(list)
    for call in found:
        grouped[call.txid].append(call)
    return grouped


def test_sparse_partitions_share_transactions_and_each_effect_is_made_once_in_order(
    env: dict[str, str],
    engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
) -> None:
    # 64 partitions of 1 to 4 events, batch size 5, two processes of two slots: the
    # batches carry other partitions, beyond the batch size in all (never beyond it in
    # one handler call), and every effect is still made once, in order per partition.
    engine.create_stream("orders", partitions=64)
    append_spread(engine, 64, {p: [{"n": n} for n in range(1 + p % 4)] for p in range(64)})
    append_spread(engine, 64, {p: [{"n": 9}] for p in range(0, 64, 3)})
    workers.start("--concurrency", "2")
    workers.start("--concurrency", "2")
    wait_for(lambda: caught_up(engine, sql), what="the workers to catch up")
    assert_once_in_order(sql)
    found = calls(env)
    assert max(call.events for call in found) <= 5
    transactions = by_transaction(found)
    assert max(len({c.partition for c in t}) for t in transactions.values()) > 1
    carried = max(sum(c.events for c in t) for t in transactions.values())
    assert 5 < carried <= 20, "a combined transaction carries up to 4 batch sizes"
    # each partition once per transaction: one handler call each
    assert all(len({c.partition for c in t}) == len(t) for t in transactions.values())


def gated(engine: subengine.Engine, extra: dict[int, list[dict[str, Any]]] | None = None) -> None:
    """8 partitions of 2 events (0 to 6 first; then 7, whose second event waits for the
    gate): one batch of batch size 5 takes them all, partition 7 last."""
    engine.create_stream("orders", partitions=8)
    append_spread(engine, 8, {p: [{"n": 0}, {"n": 1}] for p in range(7)} | (extra or {}))
    append_spread(engine, 8, {7: [{"n": 0}, {"n": 1, "gate": GATE}]})


def held_open(env: dict[str, str]) -> list[Call]:
    """Wait until a batch has reached partition 7 (where it waits for the gate): the
    handler calls of its transaction so far."""
    wait_for(lambda: any(c.partition == 7 for c in calls(env)), what="the batch to reach the gate")
    [txid] = {c.txid for c in calls(env) if c.partition == 7}
    return [c for c in calls(env) if c.txid == txid]


@pytest.fixture
def gate(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection holding the gate's lock (released by closing it)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (GATE,))
        yield conn


def test_a_worker_killed_inside_a_combined_transaction_commits_none_of_it(
    env: dict[str, str], engine: subengine.Engine, sql: psycopg.Connection[Any],
    workers: WorkerProcesses, gate: psycopg.Connection[Any],
) -> None:  # fmt: skip
    gated(engine)
    first = workers.start()
    open_calls = held_open(env)
    assert len({c.partition for c in open_calls}) == 8, "one transaction for all of them"
    assert sql.execute("SELECT count(*) FROM effects").fetchone() == (0,)
    first.send_signal(signal.SIGKILL)
    first.wait()
    gate.close()
    workers.start()
    wait_for(lambda: caught_up(engine, sql), what="the next worker to catch up")
    assert_once_in_order(sql)
    killed = open_calls[0].txid
    assert sql.execute("SELECT count(*) FROM effects WHERE txid = %s", (killed,)).fetchone() == (0,)


def test_a_failing_event_in_one_partition_of_a_combined_transaction_fails_alone(
    env: dict[str, str],
    engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    workers: WorkerProcesses,
) -> None:
    # Partition 3's first event raises, in a transaction that carries all 8 partitions:
    # it rolls back, and every other event is then handled once (none twice: its first
    # pass never committed), partition 3's second one included; the poison alone is
    # dead-lettered.
    engine.create_stream("orders", partitions=8)
    append_spread(engine, 8, {p: [{"n": 0}, {"n": 1}] for p in range(8) if p != 3})
    append_spread(engine, 8, {3: [{"poison": True}, {"n": 1}]})
    workers.start(COMBINED_APP_ON_ERROR="dead_letter")
    wait_for(lambda: caught_up(engine, sql), what="the worker to catch up")
    assert_once_in_order(sql)
    dead = sql.execute("SELECT partition, position FROM subengine.dead_letters").fetchall()
    assert dead == [(3, 1)]
    transactions = by_transaction(calls(env))
    failed = [t for t in transactions.values() if any(c.partition == 3 for c in t) and len(t) > 1]
    assert failed, "partition 3 was carried with others"
    committed = {txid for (txid,) in sql.execute("SELECT DISTINCT txid FROM effects")}
    assert failed[0][0].txid not in committed


def test_a_reset_of_one_partition_of_a_combined_transaction_waits_for_it(
    env: dict[str, str], engine: subengine.Engine, sql: psycopg.Connection[Any],
    workers: WorkerProcesses, gate: psycopg.Connection[Any], dsn: str,
) -> None:  # fmt: skip
    # A transaction carries all 8 partitions and waits at partition 7 when partition 3 is
    # reset to 0. The reset waits for the batch (it holds the position rows), which then
    # commits whole with its generation; partition 3 alone is handled again, in the new
    # generation; no other partition sees an event twice.
    gated(engine)
    workers.start()
    open_calls = held_open(env)
    assert len({c.partition for c in open_calls}) == 8
    done: list[dict[int, int]] = []
    reset = threading.Thread(
        target=lambda: done.append(engine.reset_subscription("effects", {3: 0}))
    )
    reset.start()
    try:
        wait_for(lambda: waiting_reset(sql), what="the reset to wait for the batch's rows")
        assert done == []
    finally:
        gate.close()
        reset.join(timeout=60)
    assert done and done[0][3] == 0
    wait_for(
        lambda: (
            caught_up(engine, sql)
            and sql.execute("SELECT count(*) FROM effects").fetchone() == (18,)
        ),
        what="partition 3 handled again",
    )
    assert_once_in_order(sql, twice=frozenset({3}))
    generations = dict(
        sql.execute(
            "SELECT partition, generation FROM subengine.subscription_positions"
            " WHERE subscription = 'effects'"
        ).fetchall()
    )
    assert generations[3] > generations[0]
    batch = open_calls[0].txid
    assert sql.execute("SELECT count(*) FROM effects WHERE txid = %s", (batch,)).fetchone() == (16,)


def waiting_reset(sql: psycopg.Connection[Any]) -> bool:
    row = sql.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND datname = current_database() AND query ILIKE '%subscription_positions%'"
    ).fetchone()
    return bool(row and row[0])
