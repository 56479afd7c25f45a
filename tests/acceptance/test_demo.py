"""`subengine demo`: two worker processes project order events while a producer appends
them and one worker is killed; it exits 0 only if the projection matches the events. It
writes only into a schema of its own, `subengine_demo`."""

from __future__ import annotations

import subprocess
from typing import Any

import psycopg
import pytest
from helpers import run_subengine
from psycopg.sql import SQL, Identifier, Literal
from subengine.cli import _demo  # type: ignore[import-not-found]

import subengine
from subengine import NewEvent

pytestmark = pytest.mark.slow


def run_demo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_subengine(env, "demo", "--events", "1200", "--rate", "1500", *args, timeout=180)


def test_the_demo_projects_every_event_once_though_a_worker_is_killed(
    cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    result = run_demo(cli_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the demo writes only into schema 'subengine_demo'" in result.stdout.splitlines()[0]
    assert "killed worker pid" in result.stdout
    assert "check passed" in result.stdout
    # the projection, read on its own: one row per order, one applied event per stored event
    events, orders = sql.execute(  # type: ignore[misc]
        "SELECT count(*), count(*) FILTER (WHERE type = 'OrderPlaced')"
        " FROM subengine_demo.events WHERE stream = 'orders'"
    ).fetchone()
    assert events == 1200
    assert sql.execute("SELECT count(*), sum(events) FROM subengine_demo.orders").fetchone() == (
        orders,
        events,
    )
    assert sql.execute(
        "SELECT sum(position), sum(head), max(generation) FROM subengine_demo.subscription_status"
        " WHERE subscription = 'order_projection'"
    ).fetchone() == (events, events, 2)  # created in 1, then reset for the rebuild
    # every worker it started is gone, and holds nothing
    assert sql.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchone() == (0,)
    assert sql.execute(
        "SELECT count(*) FROM subengine_demo.workers_status WHERE connected"
    ).fetchone() == (0,)


def test_running_the_demo_again_rebuilds_the_projection_from_every_event(
    cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    assert run_demo(cli_env).returncode == 0
    again = run_demo(cli_env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "the projection is rebuilt from its first event" in again.stdout
    assert "checked 2,400 events" in again.stdout
    assert sql.execute("SELECT sum(events) FROM subengine_demo.orders").fetchone() == (2400,)
    assert sql.execute(
        "SELECT generation FROM subengine_demo.subscriptions WHERE name = 'order_projection'"
    ).fetchone() == (3,)


TAMPERS = {
    "a total": "UPDATE subengine_demo.orders SET total_cents = total_cents + 1"
    " WHERE order_key = (SELECT min(order_key) FROM subengine_demo.orders)",
    "a missing order": "DELETE FROM subengine_demo.orders"
    " WHERE order_key = (SELECT max(order_key) FROM subengine_demo.orders)",
    "an event applied twice": "UPDATE subengine_demo.orders SET events = events + 1"
    " WHERE order_key = (SELECT min(order_key) FROM subengine_demo.orders)",
}


def test_the_check_fails_when_the_projection_differs_from_the_events(
    cli_env: dict[str, str], dsn: str, sql: psycopg.Connection[Any]
) -> None:
    assert run_demo(cli_env).returncode == 0
    said: list[str] = []
    engine = subengine.Engine(settings=_demo.settings(subengine.Settings(dsn=dsn)))
    assert _demo.verify(engine, said.append)  # as the demo left it
    sql.execute("CREATE TABLE projected AS TABLE subengine_demo.orders")
    for what, tamper in TAMPERS.items():
        sql.execute(tamper)
        said.clear()
        assert not _demo.verify(engine, said.append), what
        assert any(line.startswith("MISMATCH order-") for line in said), (what, said)
        assert any(line.startswith("FAILED") for line in said), (what, said)
        sql.execute("TRUNCATE subengine_demo.orders")
        sql.execute("INSERT INTO subengine_demo.orders TABLE projected")
    engine.close()


def test_the_demo_refuses_an_orders_stream_of_another_shape_and_changes_nothing(
    cli_env: dict[str, str], dsn: str, sql: psycopg.Connection[Any]
) -> None:
    sql.execute("CREATE SCHEMA subengine_demo")
    sql.execute(SQL("COMMENT ON SCHEMA subengine_demo IS {}").format(Literal(_demo.MARKER)))
    with subengine.Engine(dsn, schema="subengine_demo") as engine:
        engine.migrate()
        engine.create_stream("orders", partitions=4)
    before = everything_in(sql, "subengine_demo")
    result = run_demo(cli_env)
    assert result.returncode == 1
    assert "already exists with 4 partitions, not 8" in result.stdout
    assert everything_in(sql, "subengine_demo") == before


def test_the_demo_leaves_the_users_own_orders_stream_and_subscription_alone(
    cli_env: dict[str, str], engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # the README's own example: a stream `orders` and a subscription consuming it, here
    # even with the demo's shape and names, in the default schema
    engine.create_stream("orders", partitions=8)
    engine.append("orders", [NewEvent(f"order-{n}", "OrderPlaced", {"n": n}) for n in range(20)])
    engine.ensure_subscription(subengine.Subscription("order_projection", "orders", "beginning"))
    engine.reset_subscription("order_projection", "end")
    before = everything_in(sql, "subengine")
    result = run_demo(cli_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert everything_in(sql, "subengine") == before
    assert sql.execute("SELECT count(*) FROM subengine_demo.events").fetchone() == (1200,)


def test_a_schema_of_the_demos_name_that_it_did_not_make_is_refused_unchanged(
    cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    sql.execute("CREATE SCHEMA subengine_demo")
    sql.execute("CREATE TABLE subengine_demo.orders (mine text)")
    sql.execute("INSERT INTO subengine_demo.orders VALUES ('keep me')")
    before = everything_in(sql, "subengine_demo")
    result = run_demo(cli_env)
    assert result.returncode == 1
    assert "schema 'subengine_demo' exists, and the demo did not make it" in result.stdout
    assert "the demo changed nothing" in result.stdout
    assert everything_in(sql, "subengine_demo") == before
    assert sql.execute(
        "SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace"
        " WHERE nspname = 'subengine_demo'"
    ).fetchone() == (None,)


def everything_in(sql: psycopg.Connection[Any], schema: str) -> dict[str, list[str]]:
    """Every table and sequence of `schema` with all of its rows (views show the time)."""
    relations = sql.execute(
        "SELECT c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relkind IN ('r', 'S') ORDER BY 1",
        (schema,),
    ).fetchall()
    return {
        name: sorted(
            map(
                repr,
                sql.execute(
                    SQL("SELECT * FROM {}.{}").format(Identifier(schema), Identifier(name))
                ).fetchall(),
            )
        )
        for name, _kind in relations
    }
