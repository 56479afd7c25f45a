"""The inspection views, queried as an operator would (DESIGN.md: visible in plain SQL)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from helpers import Running, wait_for

import subengine
from subengine import NewEvent
from subengine.db._locks import lock_key


def status(
    sql: psycopg.Connection[Any], subscription: str = "billing"
) -> dict[int, tuple[Any, ...]]:
    rows = sql.execute(
        "SELECT partition, position, head, lag, state, attempts, worker_id"
        " FROM subengine.subscription_status WHERE subscription = %s ORDER BY partition",
        (subscription,),
    ).fetchall()
    return {row[0]: row[1:] for row in rows}


@pytest.mark.parametrize("name", ["billing", "a", "x.y-z_9"])
def test_the_lock_key_is_the_same_in_python_and_sql(
    sql: psycopg.Connection[Any], name: str
) -> None:
    [(cls,)] = sql.execute("SELECT subengine.lock_class(%s)", (name,)).fetchall()
    assert lock_key("subengine", name, 5) == cls << 32 | 5


def test_subscription_status_shows_positions_lag_states_and_holders(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    fast_engine.create_stream("single", partitions=3)
    keys = {
        p: next(f"k{i}" for i in range(99) if subengine.partition_for(f"k{i}", 3) == p)
        for p in range(3)
    }
    fast_engine.append("single", [NewEvent(keys[0], "T", {}) for _ in range(4)])
    fast_engine.append("single", [NewEvent(keys[1], "Poison", {})])
    app = subengine.App()
    sub = app.subscription("billing", stream="single", max_attempts=1000)
    inside, release = threading.Event(), threading.Event()

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        if event.type == "Poison":
            raise ValueError("poison")
        if event.type == "Slow":
            inside.set()
            release.wait(30)

    fast_engine.ensure_subscription(sub)
    assert status(sql) == {
        0: (0, 4, 4, "ok", 0, None),
        1: (0, 1, 1, "ok", 0, None),
        2: (0, 0, 0, "idle", 0, None),
    }
    with Running(app, fast_engine):
        wait_for(lambda: status(sql)[0][3] == "idle" and status(sql)[1][3] == "retrying")
        fast_engine.append("single", [NewEvent(keys[2], "Slow", {})])
        assert inside.wait(30)
        [(worker_id,)] = sql.execute("SELECT id FROM subengine.workers").fetchall()
        rows = status(sql)
        assert rows[2] == (0, 1, 1, "ok", 0, worker_id)
        assert rows[1][3:5] == ("retrying", rows[1][4]) and rows[1][4] >= 1
        last_error = sql.execute(  # type: ignore[index]
            "SELECT last_error FROM subengine.subscription_status WHERE partition = 1"
        ).fetchone()[0]
        assert last_error == "ValueError: poison"
        [(connected, held)] = sql.execute(
            "SELECT connected, partitions_held FROM subengine.workers_status"
        ).fetchall()
        assert (connected, held) == (True, 1)
        release.set()
        wait_for(lambda: status(sql)[2][3] == "idle")
        sql.execute("UPDATE subengine.subscriptions SET paused = true")
        assert {row[3] for row in status(sql).values()} == {"paused"}
    lag = sql.execute(
        "SELECT lag, lag_seconds > 0, next_event_at IS NOT NULL"
        " FROM subengine.subscription_status WHERE partition = 1"
    ).fetchone()
    assert lag == (1, True, True)


def test_stream_status_counts_events(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    stored = engine.append(orders, [NewEvent(f"k{n}", "T", {}) for n in range(30)])
    rows = sql.execute(
        "SELECT partition, head, floor, events FROM subengine.stream_status"
        " WHERE stream = 'orders' ORDER BY 1"
    ).fetchall()
    per_partition = {p: sum(1 for a in stored if a.partition == p) for p in range(4)}
    assert rows == [(p, per_partition[p], 1, per_partition[p]) for p in range(4)]


def test_an_operator_role_with_select_only_reads_the_views(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any], dsn: str
) -> None:
    engine.append(orders, [NewEvent("k", "T", {})])
    engine.ensure_subscription(subengine.App().subscription("billing", stream=orders))
    role = f"operator_{sql.info.dbname}"
    sql.execute(f'CREATE ROLE "{role}"')
    try:
        sql.execute(
            f'GRANT USAGE ON SCHEMA subengine TO "{role}";'
            f" GRANT SELECT ON subengine.subscription_status, subengine.stream_status,"
            f' subengine.workers_status, subengine.dead_letters TO "{role}";'
            f' GRANT pg_read_all_stats TO "{role}"'
        )
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'SET ROLE "{role}"')
            for view in ("subscription_status", "stream_status", "workers_status", "dead_letters"):
                conn.execute(f"SELECT * FROM subengine.{view}").fetchall()  # noqa: S608
            assert conn.execute(
                "SELECT lag FROM subengine.subscription_status WHERE subscription = 'billing'"
                " AND lag > 0"
            ).fetchall() == [(1,)]
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("DELETE FROM subengine.dead_letters")
    finally:
        sql.execute(f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')
