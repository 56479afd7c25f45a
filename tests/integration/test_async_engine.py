"""AsyncEngine and append_async: the async engine reads what the sync one reads, and
append_async joins the caller's transaction as append does.

What both engines must do is in test_engine_contract.py, run over `Engine` and
`AsyncEngine` alike.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Coroutine, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy
from helpers import snapshot
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import subengine
from subengine import NewEvent


def events(*keys: str, type: str = "Happened") -> list[NewEvent]:
    return [NewEvent(key, type, {"n": n}) for n, key in enumerate(keys)]


# the async engine reads what the sync one reads


def test_async_reads_equal_sync_reads(
    engine: subengine.Engine,
    async_engine: subengine.AsyncEngine,
    runner: asyncio.Runner,
    orders: str,
) -> None:
    engine.create_stream("other", 2)
    started = datetime.now(UTC) - timedelta(seconds=1)
    engine.append(orders, events(*(f"order-{n % 7}" for n in range(40))))
    runner.run(async_engine.append(orders, events(*(f"order-{n % 5}" for n in range(30)))))
    assert sum(engine.heads(orders).values()) == 70

    assert runner.run(async_engine.streams()) == engine.streams()
    assert runner.run(async_engine.stream(orders)) == engine.stream(orders)
    assert runner.run(async_engine.heads(orders)) == engine.heads(orders)
    assert runner.run(async_engine.partitions(orders)) == engine.partitions(orders)
    for partition in range(4):
        for after, limit in ((0, None), (3, 2), (100, 5)):
            assert runner.run(async_engine.read(orders, partition, after, limit)) == engine.read(
                orders, partition, after, limit
            )
    assert runner.run(async_engine.read_since(orders, started, 25)) == engine.read_since(
        orders, started, 25
    )


# append_async in the caller's transaction


def test_append_async_in_a_transaction_that_rolls_back_leaves_nothing(
    orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    before = snapshot(sql)

    async def append_then_roll_back() -> list[subengine.Appended]:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            stored = await subengine.append_async(conn, orders, events("k", "j"))
            await conn.execute("CREATE TABLE app_state (n int)")
            await conn.rollback()
            return stored

    stored = asyncio.run(append_then_roll_back())
    assert [s.position for s in stored] != []
    assert snapshot(sql) == before
    assert sql.execute("SELECT to_regclass('app_state')").fetchone()[0] is None  # type: ignore[index]


def test_append_async_commits_with_the_callers_transaction(
    engine: subengine.Engine, orders: str, dsn: str
) -> None:
    async def append_and_commit() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            async with conn.transaction():
                await subengine.append_async(conn, orders, events("k"), expected_version=0)

    asyncio.run(append_and_commit())
    assert sum(engine.heads(orders).values()) == 1


@pytest.fixture
def sa_async_engine(dsn: str) -> Iterator[Any]:
    async def creator() -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(dsn)

    sa_engine = create_async_engine("postgresql+psycopg://", async_creator=creator)
    yield sa_engine
    asyncio.run(sa_engine.dispose())


def test_append_async_through_an_async_session_commits_and_rolls_back_with_it(
    engine: subengine.Engine, orders: str, sa_async_engine: Any, sql: psycopg.Connection[Any]
) -> None:
    sql.execute("CREATE TABLE app_state (n int)")

    async def in_session(commit: bool, n: int) -> None:
        async with AsyncSession(sa_async_engine) as session:
            await session.execute(sqlalchemy.text("INSERT INTO app_state VALUES (:n)"), {"n": n})
            await subengine.append_async(session, orders, events("k"))
            await (session.commit() if commit else session.rollback())

    async def both() -> None:
        await in_session(False, 1)
        await in_session(True, 2)

    asyncio.run(both())
    assert sql.execute("SELECT n FROM app_state").fetchall() == [(2,)]
    assert sum(engine.heads(orders).values()) == 1


def test_append_async_on_a_fresh_sqlalchemy_async_connection_commits_with_it(
    engine: subengine.Engine, orders: str, sa_async_engine: Any
) -> None:
    async def append(commit: bool) -> None:
        async with sa_async_engine.connect() as conn:
            assert not conn.in_transaction()  # no statement ran before the append
            await subengine.append_async(conn, orders, events("k"))
            await (conn.commit() if commit else conn.rollback())

    asyncio.run(append(False))
    assert sum(engine.heads(orders).values()) == 0
    asyncio.run(append(True))
    assert sum(engine.heads(orders).values()) == 1


def test_append_async_raises_what_append_raises(
    engine: subengine.Engine, orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    engine.append(orders, events("k"))
    before = snapshot(sql)

    async def attempt(
        call: Callable[[psycopg.AsyncConnection[Any]], Coroutine[Any, Any, object]],
    ) -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            await call(conn)

    with pytest.raises(subengine.WrongExpectedVersion):
        asyncio.run(
            attempt(lambda c: subengine.append_async(c, orders, events("k"), expected_version=3))
        )
    with pytest.raises(subengine.InvalidEvent):
        asyncio.run(attempt(lambda c: subengine.append_async(c, orders, [NewEvent("", "T", 1)])))
    with pytest.raises(subengine.StreamNotFound):
        asyncio.run(attempt(lambda c: subengine.append_async(c, "nowhere", events("k"))))
    assert snapshot(sql) == before


def test_append_async_is_idempotent_by_event_id(
    engine: subengine.Engine, orders: str, dsn: str
) -> None:
    event = NewEvent("k", "Once", {}, id=uuid.uuid4())

    async def append() -> list[subengine.Appended]:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            return await subengine.append_async(conn, orders, [event])

    first, again = asyncio.run(append()), asyncio.run(append())
    assert (first[0].duplicate, again[0].duplicate) == (False, True)
    assert again[0].position == first[0].position
    assert sum(engine.heads(orders).values()) == 1


def test_append_async_refuses_what_would_commit_on_its_own_or_is_not_async(
    orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    before = snapshot(sql)

    async def autocommit() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await subengine.append_async(conn, orders, events("k"))

    with pytest.raises(subengine.InvalidInput, match="autocommit"):
        asyncio.run(autocommit())
    with psycopg.connect(dsn) as conn, pytest.raises(subengine.InvalidInput, match="sync"):
        asyncio.run(subengine.append_async(conn, orders, events("k")))
    with pytest.raises(subengine.InvalidInput, match="AsyncSession"):
        asyncio.run(subengine.append_async(object(), orders, events("k")))
    assert snapshot(sql) == before


def test_append_async_appends_to_the_schema_it_is_given(
    dsn: str, sql: psycopg.Connection[Any]
) -> None:
    subengine.Engine(dsn, schema="second").migrate()
    with subengine.Engine(dsn, schema="second") as second:
        second.create_stream("letters", 1)

    async def append() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            await subengine.append_async(conn, "letters", events("k"), schema="second")
            await conn.commit()

    asyncio.run(append())
    assert sql.execute("SELECT count(*) FROM second.events").fetchone()[0] == 1  # type: ignore[index]
