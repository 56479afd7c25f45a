"""`subengine.reset_subscription(conn, …)`: a reset in the caller's own transaction,
committed or rolled back together with the caller's other writes (a projection rebuild)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
import sqlalchemy
from sqlalchemy.orm import Session

import subengine
from subengine import NewEvent


@pytest.fixture
def billing(engine: subengine.Engine, sql: psycopg.Connection[Any]) -> str:
    """Subscription 'billing' of a 2-partition stream 'orders', its positions at the heads
    (5 events), and a table `projection` holding one row."""
    engine.create_stream("orders", partitions=2)
    engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(5)])
    engine.ensure_subscription(subengine.Subscription("billing", "orders", "beginning"))
    engine.reset_subscription("billing", "end")
    sql.execute("CREATE TABLE projection (n int)")
    sql.execute("INSERT INTO projection VALUES (1)")
    return "billing"


def state(sql: psycopg.Connection[Any]) -> tuple[Any, ...]:
    """(generation, sum of positions, rows in the projection)"""
    generation, positions = sql.execute(  # type: ignore[misc]
        "SELECT max(generation), sum(position) FROM subengine.subscription_positions"
        " WHERE subscription = 'billing'"
    ).fetchone()
    rows = sql.execute("SELECT count(*) FROM projection").fetchone()[0]  # type: ignore[index]
    return generation, positions, rows


def test_a_reset_commits_together_with_the_callers_writes(
    dsn: str, engine: subengine.Engine, billing: str, sql: psycopg.Connection[Any]
) -> None:
    assert state(sql) == (2, 5, 1)
    with psycopg.connect(dsn) as conn:
        conn.execute("TRUNCATE projection")
        moved = subengine.reset_subscription(conn, billing, "beginning")
        assert moved == {0: 0, 1: 0}
        # not before the caller commits (the truncation locks the projection meanwhile)
        assert sql.execute(
            "SELECT max(generation), sum(position) FROM subengine.subscription_positions"
        ).fetchone() == (2, 5)
    assert state(sql) == (3, 0, 0)


def test_a_reset_rolls_back_with_the_callers_transaction(
    dsn: str, engine: subengine.Engine, billing: str, sql: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("TRUNCATE projection")
        subengine.reset_subscription(conn, billing, "beginning", settings=engine.settings)
        conn.rollback()
    assert state(sql) == (2, 5, 1)


def test_a_reset_joins_a_sqlalchemy_session(
    dsn: str, engine: subengine.Engine, billing: str, sql: psycopg.Connection[Any]
) -> None:
    sa_engine = sqlalchemy.create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(dsn)
    )
    try:
        with Session(sa_engine) as session:
            session.execute(sqlalchemy.text("TRUNCATE projection"))
            subengine.reset_subscription(session, billing, {0: 1, 1: 0})
            session.commit()
    finally:
        sa_engine.dispose()
    assert state(sql) == (3, 1, 0)


def test_a_failed_reset_changes_nothing_and_leaves_the_transaction_usable(
    dsn: str, engine: subengine.Engine, billing: str, sql: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("TRUNCATE projection")
        with pytest.raises(subengine.SubscriptionNotFound):
            subengine.reset_subscription(conn, "no_such_subscription", "beginning")
        with pytest.raises(subengine.SubengineError):
            subengine.reset_subscription(conn, billing, {0: 99})  # past the head
        conn.execute("INSERT INTO projection VALUES (2)")
    assert state(sql) == (2, 5, 1)


def test_an_autocommit_connection_without_a_transaction_is_refused(
    dsn: str, engine: subengine.Engine, billing: str, sql: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(subengine.InvalidInput, match="the reset would commit on its own"):
            subengine.reset_subscription(conn, billing, "beginning")
        with conn.transaction():
            subengine.reset_subscription(conn, billing, "beginning")
    assert state(sql) == (3, 0, 1)


def test_a_reset_in_another_schema(dsn: str, sql: psycopg.Connection[Any]) -> None:
    with subengine.Engine(dsn, schema="elsewhere") as other:
        other.migrate()
        other.create_stream("orders", partitions=1)
        other.append("orders", [NewEvent("k", "T", {})])
        other.ensure_subscription(subengine.Subscription("billing", "orders", "end"))
        with psycopg.connect(dsn) as conn:
            assert subengine.reset_subscription(
                conn, "billing", "beginning", schema="elsewhere"
            ) == {0: 0}
        assert [p.position for p in other.subscription_positions("billing")] == [0]
