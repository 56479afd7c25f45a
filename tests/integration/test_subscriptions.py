"""Subscriptions: declaring them, storing them, start points, and the batch transaction."""

from __future__ import annotations

import gc
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import sqlalchemy
from helpers import async_handler, count_json_decodes, generator_handler, record
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import subengine
from subengine import NewEvent


@pytest.fixture
def projections(sql: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    return sql


def effects(sql: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return sql.execute("SELECT partition, position FROM effects ORDER BY 1, 2").fetchall()


def one_partition_stream(engine: subengine.Engine, name: str = "orders", events: int = 10) -> None:
    engine.create_stream(name, partitions=1)
    engine.append(name, [NewEvent(f"k{n % 3}", "Step", {"n": n}) for n in range(events)])


# declaring


@dataclass
class Placed:
    total: int
    currency: str = "EUR"


def test_a_handler_can_take_a_typed_payload(
    engine: subengine.Engine, projections: psycopg.Connection[Any]
) -> None:
    engine.create_stream("orders", partitions=1)
    engine.append(
        "orders",
        [NewEvent("a", "Placed", {"total": 5}), NewEvent("b", "Placed", {"totl": 7})],
    )
    sub = subengine.App().subscription("billing", stream="orders", batch_size=1)
    seen = []

    @sub.handler("Placed", payload=Placed)
    def placed(event: subengine.Event, conn: Any) -> None:
        seen.append(event.payload)

    engine.ensure_subscription(sub)
    engine.process_batch(sub, 0)
    assert seen == [Placed(total=5)]
    # data that does not fit the class fails the batch like a raising handler
    with pytest.raises(TypeError, match="totl"):
        engine.process_batch(sub, 0)
    assert engine.subscription_positions("billing")[0].position == 1


def test_a_batch_decodes_the_json_of_the_events_its_handlers_read_and_no_other(
    engine: subengine.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.create_stream("orders", partitions=1)
    types = ["Placed", "Viewed"] * 3
    engine.append(
        "orders",
        [NewEvent(f"k{n}", kind, {"n": n}, metadata={"m": n}) for n, kind in enumerate(types)],
    )
    sub = subengine.App().subscription("billing", stream="orders")
    seen = []
    sub.handler("Placed")(lambda event, conn: seen.append(event.data["n"]))
    sub.handler("Viewed")(lambda event, conn: None)
    engine.ensure_subscription(sub)
    decoded = count_json_decodes(monkeypatch)
    engine.process_batch(sub, 0)
    assert seen == [0, 2, 4]
    assert decoded == ['{"n": 0}', '{"n": 2}', '{"n": 4}']


def test_a_handler_that_returns_a_generator_fails_its_batch(
    engine: subengine.Engine, projections: psycopg.Connection[Any]
) -> None:
    one_partition_stream(engine, events=3)
    sub = subengine.App().subscription("billing", stream="orders")
    sub.handler()(lambda event, conn: generator_handler(event, conn))
    engine.ensure_subscription(sub)
    with pytest.raises(subengine.InvalidInput, match="returned generator instead of doing its"):
        engine.process_batch(sub, 0)
    assert engine.subscription_positions("billing")[0].position == 0
    assert effects(projections) == []


def test_a_handler_that_returns_an_awaitable_fails_its_batch(
    engine: subengine.Engine, projections: psycopg.Connection[Any]
) -> None:
    one_partition_stream(engine, events=3)
    sub = subengine.App().subscription("billing", stream="orders")
    sub.handler()(lambda event, conn: async_handler(event, conn))  # a coroutine, unawaited
    engine.ensure_subscription(sub)
    with pytest.raises(subengine.InvalidInput, match="returned coroutine instead of doing its"):
        engine.process_batch(sub, 0)
    assert engine.subscription_positions("billing")[0].position == 0


# storing and start points


def test_a_subscription_is_stored_once_and_must_agree_later(engine: subengine.Engine) -> None:
    one_partition_stream(engine)
    engine.create_stream("audit", partitions=1)
    sub = subengine.App().subscription("billing", stream="orders")
    engine.ensure_subscription(sub)
    engine.ensure_subscription(subengine.App().subscription("billing", stream="orders"))
    for other in (
        subengine.App().subscription("billing", stream="audit"),
        subengine.App().subscription("billing", stream="orders", start="end"),
    ):
        with pytest.raises(subengine.SubscriptionMismatch, match="stored with stream 'orders'"):
            engine.ensure_subscription(other)
    with pytest.raises(subengine.StreamNotFound):
        engine.ensure_subscription(subengine.App().subscription("x", stream="missing"))


def test_start_points_set_the_first_positions(engine: subengine.Engine, orders: str) -> None:
    engine.append(orders, [NewEvent(f"k{n}", "T", {}) for n in range(20)])
    heads = engine.heads(orders)
    with engine.connection() as conn:
        middle = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    later = engine.append(orders, [NewEvent(f"k{n}", "T", {}) for n in range(8)])
    app = subengine.App()
    cases = {
        "from-beginning": ("beginning", dict.fromkeys(range(4), 0)),
        "from-end": ("end", engine.heads(orders)),
        "from-time": (middle, heads),
        "from-positions": ({1: 2, 3: 1}, {0: 0, 1: 2, 2: 0, 3: 1}),
    }
    for name, (start, expected) in cases.items():
        engine.ensure_subscription(app.subscription(name, stream=orders, start=start))
        stored = {p.partition: p.position for p in engine.subscription_positions(name)}
        assert stored == expected, name
    # from a time: exactly the events appended after it are ahead of the positions
    ahead = engine.heads(orders)
    stored = {p.partition: p.position for p in engine.subscription_positions("from-time")}
    assert sum(ahead[p] - stored[p] for p in ahead) == len(later)


@pytest.mark.parametrize(
    ("start", "message"), [({9: 0}, "partitions 0..3"), ({0: 99}, "past its head")]
)
def test_start_positions_must_exist(
    engine: subengine.Engine, orders: str, start: Any, message: str
) -> None:
    sub = subengine.App().subscription("billing", stream=orders, start=start)
    with pytest.raises(subengine.InvalidInput, match=message):
        engine.ensure_subscription(sub)
    with pytest.raises(subengine.SubscriptionNotFound, match="not stored"):
        engine.process_batch(sub, 0)


# the batch transaction


def test_batches_commit_handler_effects_and_position_together(
    engine: subengine.Engine, projections: psycopg.Connection[Any]
) -> None:
    one_partition_stream(engine, events=10)
    sub = subengine.App().subscription("billing", stream="orders", batch_size=4)
    sub.handler()(record)
    engine.ensure_subscription(sub)
    outcomes = [engine.process_batch(sub, 0) for _ in range(4)]
    assert [(o.handled, o.position) for o in outcomes] == [(4, 4), (4, 8), (2, 10), (0, 10)]  # type: ignore[union-attr]
    events = engine.read("orders", 0)
    assert outcomes[0].next_time == events[4].occurred_at  # type: ignore[union-attr]
    assert outcomes[2].next_time is None  # type: ignore[union-attr]
    assert effects(projections) == [(0, p) for p in range(1, 11)]


def test_a_failing_handler_rolls_back_the_whole_batch(
    engine: subengine.Engine, projections: psycopg.Connection[Any]
) -> None:
    one_partition_stream(engine, events=5)
    sub = subengine.App().subscription("billing", stream="orders", batch_size=5)

    @sub.handler()
    def fail_on_third(event: subengine.Event, conn: Any) -> None:
        record(event, conn)
        if event.position == 3:
            raise RuntimeError("boom")

    engine.ensure_subscription(sub)
    with pytest.raises(RuntimeError, match="boom"):
        engine.process_batch(sub, 0)
    assert effects(projections) == []
    assert engine.subscription_positions("billing")[0].position == 0


def test_a_position_moved_under_the_batch_fails_the_compare_and_set(
    engine: subengine.Engine, projections: psycopg.Connection[Any]
) -> None:
    one_partition_stream(engine, events=3)
    sub = subengine.App().subscription("billing", stream="orders")

    @sub.handler()
    def reset_meanwhile(event: subengine.Event, conn: Any) -> None:
        record(event, conn)
        # what a reset does to the row: a new generation (same transaction, so no wait)
        conn.execute("UPDATE subengine.subscription_positions SET generation = generation + 1")

    engine.ensure_subscription(sub)
    with pytest.raises(subengine.Fenced, match="nothing of it was committed"):
        engine.process_batch(sub, 0)
    assert effects(projections) == []
    [position] = engine.subscription_positions("billing")
    assert (position.position, position.generation) == (0, 1)


def test_two_workers_on_one_partition_never_handle_an_event_twice(
    engine: subengine.Engine, projections: psycopg.Connection[Any], dsn: str
) -> None:
    one_partition_stream(engine, events=40)
    sub = subengine.App().subscription("billing", stream="orders", batch_size=5)

    @sub.handler()
    def slow(event: subengine.Event, conn: Any) -> None:
        record(event, conn)
        time.sleep(0.005)  # keep batches overlapping in time

    engine.ensure_subscription(sub)

    def work() -> None:
        with psycopg.connect(dsn) as conn:
            db = subengine.db._sql.Db(conn, subengine.db._sql.SQL("subengine"))
            while (
                outcome := subengine.subscriptions._batches.process_batch(db, sub, 0)
            ) is not None and outcome.handled:
                pass

    threads = [threading.Thread(target=work) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert effects(projections) == [(0, p) for p in range(1, 41)]


# SQLAlchemy


class Base(DeclarativeBase):
    pass


class Effect(Base):
    __tablename__ = "effects"
    event_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    partition: Mapped[int]
    position: Mapped[int]


def test_a_sqlalchemy_session_writes_in_the_batch_transaction(
    engine: subengine.Engine, projections: psycopg.Connection[Any]
) -> None:
    one_partition_stream(engine, events=6)
    sub = subengine.App().subscription("billing", stream="orders", batch_size=3)
    fail_at = {5}

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        with subengine.sqlalchemy_session(conn) as session:
            session.add(Effect(event_id=event.id, partition=0, position=event.position))
            session.commit()  # commits nothing yet: the batch's transaction is the worker's
            if event.position in fail_at:
                raise ValueError("after the session's commit")

    engine.ensure_subscription(sub)
    assert engine.process_batch(sub, 0).position == 3  # type: ignore[union-attr]
    assert effects(projections) == [(0, 1), (0, 2), (0, 3)]
    with pytest.raises(ValueError, match="after the session's commit"):
        engine.process_batch(sub, 0)
    # the whole second batch rolled back, the session's "committed" rows with it
    assert effects(projections) == [(0, 1), (0, 2), (0, 3)]
    assert engine.subscription_positions("billing")[0].position == 3
    fail_at.clear()
    assert engine.process_batch(sub, 0).position == 6  # type: ignore[union-attr]
    assert effects(projections) == [(0, p) for p in range(1, 7)]


def test_sqlalchemy_sessions_keep_nothing_alive_after_their_connections_close(dsn: str) -> None:
    def live_engines() -> int:
        return sum(isinstance(o, sqlalchemy.Engine) for o in gc.get_objects())

    gc.collect()
    engines_before = live_engines()
    closed = []
    for _ in range(30):
        with psycopg.connect(dsn) as conn:
            with subengine.sqlalchemy_session(conn) as session:
                assert session.execute(sqlalchemy.text("SELECT 1")).scalar() == 1
            closed.append(weakref.ref(conn))
        del conn, session
    gc.collect()
    assert [ref for ref in closed if ref() is not None] == []
    assert live_engines() <= engines_before  # one per connection would leave 30 more
