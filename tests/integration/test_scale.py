"""Workers at scale (1,024 partitions by 100 subscriptions) and the look for work that makes
it possible: every effect once, the intended plan without statistics, and suspects that a
batch held looked at again. Nothing here is timed: bench/scale.py measures the speed."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from helpers import Running, count, key_in, plan_nodes, record, scans, wait_for
from psycopg import sql as pgsql

import subengine
from subengine import NewEvent
from subengine.db._sql import SQL
from subengine.subscriptions._work import look_for_work

PARTITIONS = 1024
SUBSCRIPTIONS = 100


def fan_out_app(names: list[str]) -> subengine.App:
    """One batch handler per subscription, recording (subscription, event) in `effects`."""
    app = subengine.App()
    for name in names:
        app.subscription(name, stream="wide", batch_size=50).batch_handler()(recorder(name))
    return app


def recorder(name: str) -> Callable[[Sequence[subengine.Event], Any], None]:
    def handle(events: Sequence[subengine.Event], conn: Any) -> None:
        # one statement for the batch: 200,000 effects in all
        conn.execute(
            "INSERT INTO effects (subscription, event_id) SELECT %s, unnest(%s::uuid[])",
            (name, [event.id for event in events]),
        )

    return handle


def test_every_subscription_reaches_the_head_once_per_event_at_1024_partitions(
    dsn: str, sql: psycopg.Connection[Any]
) -> None:
    sql.execute("CREATE TABLE effects (subscription text, event_id uuid)")
    names = [f"s{n:03d}" for n in range(SUBSCRIPTIONS)]
    app = fan_out_app(names)
    settings = subengine.Settings(dsn=dsn, poll_interval=0.5, heartbeat_interval=1)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("wide", partitions=PARTITIONS)
        backlog = engine.append("wide", [NewEvent(f"k{n}", "T", {}) for n in range(1500)])
        with Running(app, engine, concurrency=2), Running(app, engine, concurrency=2):
            # live events too, while the backlog is being handled
            live = engine.append("wide", [NewEvent(f"live{n}", "T", {}) for n in range(500)])
            total = len(backlog) + len(live)
            # each look counts up to 200,000 rows: twice a second is often enough
            wait_for(lambda: count(sql) == total * SUBSCRIPTIONS, timeout=600, every=0.5)
        heads = engine.heads("wide")
        for name in names:
            positions = {p.partition: p.position for p in engine.subscription_positions(name)}
            assert positions == heads, name
    per_subscription = sql.execute(
        "SELECT count(*), count(DISTINCT event_id) FROM effects GROUP BY subscription"
    ).fetchall()
    assert per_subscription == [(total, total)] * SUBSCRIPTIONS


def look_plan(conn: psycopg.Connection[Any], sql: SQL, **params: Any) -> str:
    """EXPLAIN of the look for work with these parameters, as JSON text."""
    query = look_for_work(**params)
    explained = b"EXPLAIN (FORMAT JSON) " + sql.text(query.name)
    with conn.transaction(force_rollback=True):
        row = conn.execute(explained, query.params).fetchone()
    assert row is not None
    return json.dumps(row[0])


def generic_plan(conn: psycopg.Connection[Any], sql: SQL, **params: Any) -> str:
    """EXPLAIN of the look for work as a prepared statement's generic plan (the one a
    worker's lock connection keeps, see worker_connection_settings), as JSON text."""
    query = look_for_work(**params)
    order: list[str] = []

    def placeholder(match: re.Match[bytes]) -> bytes:
        name = match.group(1).decode()
        if name not in order:
            order.append(name)
        return f"${order.index(name) + 1}".encode()

    text = re.sub(rb"%\((\w+)\)s", placeholder, sql.text(query.name))
    values = pgsql.SQL(", ").join(pgsql.Literal(query.params[name]) for name in order)
    with conn.transaction(force_rollback=True):
        conn.execute(b"PREPARE look AS " + text)
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        explain = pgsql.SQL("EXPLAIN (FORMAT JSON) EXECUTE look ({})").format(values)
        row = conn.execute(explain).fetchone()
        conn.execute("DEALLOCATE look")
    assert row is not None
    return json.dumps(row[0])


def test_the_workers_queries_take_their_intended_plans_in_a_database_without_statistics(
    dsn: str,
) -> None:
    # A fresh database at scale before any ANALYZE: the plans must not depend on
    # statistics. The look walks the index of rows with work, and reaches a suspect's
    # rows by their keys (an index or bitmap scan): never a scan of every position,
    # partition or event.
    names = [f"s{n:03d}" for n in range(SUBSCRIPTIONS)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        # autovacuum would analyse the tables while this loads them on a busy machine
        tables = conn.execute(
            "SELECT relname FROM pg_stat_user_tables WHERE schemaname = 'subengine'"
        ).fetchall()
        for (table,) in tables:
            conn.execute(
                pgsql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(
                    pgsql.Identifier("subengine", table)
                )
            )
    settings = subengine.Settings(dsn=dsn)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("wide", partitions=PARTITIONS)
        engine.append("wide", [NewEvent(f"k{n}", "T", {}) for n in range(3000)])
        for name in names:
            engine.ensure_subscription(subengine.App().subscription(name, stream="wide"))
        with psycopg.connect(dsn) as conn:
            analysed = conn.execute(
                "SELECT count(*) FROM pg_stat_user_tables WHERE schemaname = 'subengine'"
                " AND (last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL)"
            ).fetchone()
            assert analysed == (0,), "the test needs a database without statistics"
            # the worker's lag query (progress lines, gauges) asks which worker reports
            # each subscription once a subscription, not once a partition row
            with conn.transaction(force_rollback=True):
                conn.execute(
                    "INSERT INTO subengine.workers (id, host, pid, subscriptions,"
                    " serves_metrics) VALUES (gen_random_uuid(), 'h', 1, %s, true)",
                    (names,),
                )
                explained = b"EXPLAIN (ANALYZE, FORMAT JSON) " + engine.sql.text("subscription_lag")
                row = conn.execute(explained, {"names": names, "worker": "w"}).fetchone()
                assert row is not None
                lag = json.dumps(row[0])
            suspects = [(name, n * 100) for n, name in enumerate(names[:5])]
            # a look after notifications, and a worker's first look (every partition)
            looks = [
                {"serving": names, "suspects": suspects, "whole": [], "limit": 8},
                {"serving": names, "suspects": [], "whole": names, "limit": 8},
            ]
            # the plan for these values, and the one plan a worker's lock connection keeps
            plans = [
                plan(conn, engine.sql, **params)
                for params in looks
                for plan in (look_plan, generic_plan)
            ]
    for plan in plans:
        found = scans(plan)
        assert ("Index Scan", "subscription_positions", "subscription_positions_work") in found
        # the subscriptions table has a row per subscription: scanning it costs as a key
        scanned = {relation for node, relation, _ in found if node == "Seq Scan"}
        assert scanned <= {"subscriptions"}, found
        # a suspect's partition row is reached by its whole key, not among every
        # partition of its stream (that cost 6 s a look at 1,024 partitions)
        conditions = partition_lookups(plan)
        assert conditions, plan
        for condition in conditions:
            assert "stream =" in condition and "partition =" in condition, condition
    reporters = [n for n in plan_nodes(lag) if n.get("Relation Name") == "workers"]
    assert reporters, lag
    for node in reporters:
        assert node["Actual Loops"] <= SUBSCRIPTIONS, node


def partition_lookups(plan: str) -> list[str]:
    """The index conditions of every scan of `partitions` in a JSON plan (a bitmap
    heap scan's are its recheck's)."""
    return [
        node.get("Index Cond", node.get("Recheck Cond", ""))
        for node in plan_nodes(plan)
        if node.get("Relation Name") == "partitions"
    ]


def test_a_suspect_whose_row_a_batch_holds_is_looked_at_again(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # The notification of an append reaches the worker while a transaction holds the
    # subscription's position row in that partition (as a batch of another worker
    # would): the look cannot mark it then, and must come back to it, though nothing
    # else is appended.
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    partition = 2
    key = key_in(partition)
    with Running(app, fast_engine):
        wait_for(lambda: count(sql, "subengine.workers") == 1)
        with psycopg.connect(fast_engine.dsn) as holder:
            holder.execute(
                "SELECT 1 FROM subengine.subscription_positions"
                " WHERE subscription = 'billing' AND partition = %s FOR UPDATE",
                (partition,),
            )
            fast_engine.append("orders", [NewEvent(key, "T", {})])
            time.sleep(1)  # the notification, its look and several polls
            assert count(sql) == 0
        wait_for(lambda: count(sql) == 1)
