"""AsyncEngine and append_async: the sync engine's reads, appends and errors, on asyncio.

The contract tests run once on `Engine` and once on `AsyncEngine` (through a facade that
runs each coroutine to its end), so the two engines are held to the same behaviour.
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


class Synced:
    """An AsyncEngine whose coroutine methods run to their end on one event loop."""

    def __init__(self, engine: subengine.AsyncEngine, runner: asyncio.Runner) -> None:
        self._engine = engine
        self._runner = runner

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._engine, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            return self._runner.run(method(*args, **kwargs))

        return run


@pytest.fixture
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as runner:
        yield runner


@pytest.fixture
def async_engine(dsn: str, runner: asyncio.Runner) -> Iterator[subengine.AsyncEngine]:
    engine = subengine.AsyncEngine(dsn)
    runner.run(engine.open())
    yield engine
    runner.run(engine.close())


@pytest.fixture(params=["Engine", "AsyncEngine"])
def either(
    request: pytest.FixtureRequest,
    engine: subengine.Engine,
    async_engine: subengine.AsyncEngine,
    runner: asyncio.Runner,
) -> Any:
    """The sync engine, or the async one behind a sync facade: the same contract."""
    return engine if request.param == "Engine" else Synced(async_engine, runner)


# the contract: both engines


def test_appends_are_dense_and_read_back_in_order(either: Any, orders: str) -> None:
    stored = either.append(orders, events("a", "a", "b"))
    assert [s.key_version for s in stored] == [1, 2, 1]
    for partition in {s.partition for s in stored}:
        read = either.read(orders, partition)
        assert [e.position for e in read] == list(range(1, len(read) + 1))


def test_create_stream_twice_raises_stream_exists(either: Any) -> None:
    either.create_stream("letters", 3)
    with pytest.raises(subengine.StreamExists) as raised:
        either.create_stream("letters", 5)
    assert raised.value.partitions == 3


def test_a_missing_stream_raises_stream_not_found(either: Any) -> None:
    with pytest.raises(subengine.StreamNotFound):
        either.stream("nowhere")
    with pytest.raises(subengine.StreamNotFound):
        either.read("nowhere", 0)
    with pytest.raises(subengine.StreamNotFound):
        either.heads("nowhere")
    with pytest.raises(subengine.StreamNotFound):
        either.append("nowhere", events("k"))


def test_a_partition_outside_the_stream_raises_partition_not_found(
    either: Any, orders: str
) -> None:
    with pytest.raises(subengine.PartitionNotFound):
        either.read(orders, 4)


def test_a_wrong_expected_version_raises_and_writes_nothing(
    either: Any, orders: str, sql: psycopg.Connection[Any]
) -> None:
    either.append(orders, events("k"))
    before = snapshot(sql)
    with pytest.raises(subengine.WrongExpectedVersion) as raised:
        either.append(orders, events("k"), expected_version=0)
    assert (raised.value.expected, raised.value.actual) == (0, 1)
    assert snapshot(sql) == before


def test_a_bad_event_raises_invalid_event_and_writes_nothing(
    either: Any, orders: str, sql: psycopg.Connection[Any]
) -> None:
    before = snapshot(sql)
    with pytest.raises(subengine.InvalidEvent) as raised:
        either.append(orders, [NewEvent("k", "Ok", {}), NewEvent("k", "Bad", {1, 2})])
    assert raised.value.index == 1
    with pytest.raises(subengine.InvalidInput):
        either.read(orders, 0, limit=0)
    assert snapshot(sql) == before


def test_an_id_appended_twice_is_stored_once(either: Any, orders: str) -> None:
    event = NewEvent("k", "Once", {}, id=uuid.uuid4())
    first = either.append(orders, [event])
    again = either.append(orders, [event])
    assert again[0].duplicate and not first[0].duplicate
    assert again[0].position == first[0].position
    assert len(either.read(orders, first[0].partition)) == 1


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


def test_a_lost_pooled_connection_raises_database_unavailable_then_works(
    async_engine: subengine.AsyncEngine,
    runner: asyncio.Runner,
    orders: str,
    sql: psycopg.Connection[Any],
) -> None:
    async def hold_two() -> None:
        async with async_engine.connection(), async_engine.connection():
            pass

    runner.run(hold_two())
    terminated = sql.execute(  # type: ignore[index]
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'subengine'"
        " AND pid <> pg_backend_pid()"
    ).fetchone()[0]
    assert terminated >= 2
    with pytest.raises(subengine.DatabaseUnavailable) as raised:
        runner.run(async_engine.append(orders, events("k")))
    assert isinstance(raised.value.__cause__, psycopg.OperationalError)
    stored = runner.run(async_engine.append(orders, events("k")))
    assert len(runner.run(async_engine.read(orders, stored[0].partition))) == 1


def test_a_malformed_dsn_is_refused_without_quoting_its_password() -> None:
    with pytest.raises(subengine.ConfigurationError) as raised:
        subengine.AsyncEngine("host=localhost password='s3cret port=x")
    assert "s3cret" not in str(raised.value)


def test_an_unknown_database_fails_at_once(dsn: str, runner: asyncio.Runner) -> None:
    from psycopg.conninfo import make_conninfo

    wrong = make_conninfo(dsn, dbname="no_such_database")
    settings = subengine.Settings(dsn=wrong, connect_timeout=20)

    async def attempt() -> None:
        async with subengine.AsyncEngine(settings=settings) as engine:
            await engine.streams()

    with pytest.raises(subengine.ConfigurationError, match="no_such_database"):
        runner.run(asyncio.wait_for(attempt(), 15))


def test_the_async_engine_uses_the_engines_schema_and_limits(
    dsn: str, runner: asyncio.Runner, sql: psycopg.Connection[Any]
) -> None:
    subengine.Engine(dsn, schema="second").migrate()
    settings = subengine.Settings(dsn=dsn, schema="second", max_event_bytes=100)

    async def use() -> list[subengine.Stream]:
        async with subengine.AsyncEngine(settings=settings) as engine:
            await engine.create_stream("letters", 2)
            with pytest.raises(subengine.InvalidEvent, match="SUBENGINE_MAX_EVENT_BYTES"):
                await engine.append("letters", [NewEvent("k", "Big", "x" * 200)])
            return await engine.streams()

    assert [s.name for s in runner.run(use())] == ["letters"]
    assert sql.execute("SELECT count(*) FROM subengine.streams").fetchone()[0] == 0  # type: ignore[index]


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


def test_an_append_is_its_own_transaction_and_leaves_pooled_connections_in_transactions(
    dsn: str, runner: asyncio.Runner, orders: str
) -> None:
    # One connection in each pool, so the append's is the one looked at afterwards.
    settings = subengine.Settings(dsn=dsn, pool_min_size=1, pool_max_size=1)
    engine = subengine.Engine(settings=settings)
    async_engine = subengine.AsyncEngine(settings=settings)
    runner.run(async_engine.open())

    async def async_state() -> tuple[bool, psycopg.pq.TransactionStatus]:
        async with async_engine.connection() as conn:
            await conn.execute("SELECT 1")
            return conn.autocommit, conn.info.transaction_status

    def state() -> tuple[bool, psycopg.pq.TransactionStatus]:
        with engine.connection() as conn:
            conn.execute("SELECT 1")
            return conn.autocommit, conn.info.transaction_status

    try:
        for either, look in ((engine, state), (Synced(async_engine, runner), None)):
            stored = either.append(orders, events("k"))
            with pytest.raises(subengine.WrongExpectedVersion):
                either.append(orders, events("k"), expected_version=0)
            with pytest.raises(subengine.StreamNotFound):
                either.append("no-such-stream", events("k"))
            in_transaction = (False, psycopg.pq.TransactionStatus.INTRANS)
            assert (look() if look else runner.run(async_state())) == in_transaction
            assert stored[0].key_version == (1 if either is engine else 2)
    finally:
        engine.close()
        runner.run(async_engine.close())
