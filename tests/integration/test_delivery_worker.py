"""The delivery worker of a gateway process (gateway/_delivery_turns.py), run in a thread
against a real PostgreSQL with a send that records what it is given: how it takes and
switches its partitions."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from helpers import wait_for

import subengine
from subengine import NewEvent
from subengine.db import _locks
from subengine.gateway._delivery_turns import DeliveryWorker, Route
from subengine.model._declarations import Subscription
from subengine.outside import _webhooks
from subengine.outside._webhook_batches import ClaimedBatch
from subengine.outside._webhooks import Deliverable, WebhookDefinition, WebhookStream
from subengine.worker import _held


@contextmanager
def _running(worker: DeliveryWorker) -> Iterator[None]:
    """`worker` run in a thread, stopped and joined on exit; what it raised fails."""
    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(stop)
        except BaseException as error:
            failed.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
        assert not failed, failed  # what the worker raised, though the test failed first
    assert not thread.is_alive(), "the delivery worker did not stop"


def _active_webhook(
    engine: subengine.Engine, sql: psycopg.Connection[Any], name: str, max_events: int
) -> tuple[Deliverable, WebhookStream, Subscription]:
    """An active webhook of the whole stream `name` from its beginning: as its delivery
    worker sees it, its stream, and its engine subscription."""
    stream = WebhookStream(name)
    callback = "https://receiver.example/hook"
    definition = WebhookDefinition(callback, (stream,), max_events=max_events)
    engine.put_webhook("hook", definition, {name: "beginning"})
    sql.execute("UPDATE subengine.webhooks SET state = 'active'")
    with engine.db() as db:
        (hook,) = db.run(_webhooks.deliverable())
    declared = _webhooks.engine_subscription(hook.serial, 0, stream, max_events, hook.starts[0])
    return hook, stream, declared


def _key_in(partition: int) -> str:
    """A key of `partition` of a stream of 2."""
    return next(f"k{i}" for i in range(100) if subengine.partition_for(f"k{i}", 2) == partition)


@contextmanager
def _slow_polls(dsn: str) -> Iterator[tuple[subengine.Engine, psycopg.Connection[Any]]]:
    """An engine whose polls (and heartbeats) are a minute apart, with a stream "s" of 2
    partitions, and a connection of its own to hold partition locks as another holder."""
    settings = subengine.Settings(dsn=dsn, poll_interval=60.0, heartbeat_interval=60.0)
    with (
        subengine.Engine(settings=settings) as engine,
        psycopg.connect(dsn, autocommit=True) as holder,
    ):
        engine.create_stream("s", partitions=2)
        yield engine, holder


@pytest.fixture
def pals_engine(dsn: str) -> Iterator[subengine.Engine]:
    settings = subengine.Settings(dsn=dsn, lock_provider="pals", poll_interval=0.2)
    with subengine.Engine(settings=settings) as engine:
        yield engine


def test_delivery_slots_lock_partitions_by_one_statement_where_the_setting_says_pals(
    pals_engine: subengine.Engine, sql: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = pals_engine
    engine.create_stream("s", partitions=4)
    engine.append("s", [NewEvent(f"k{n}", "T", {"n": n}) for n in range(40)])
    hook, stream, declared = _active_webhook(engine, sql, "s", 5)

    def engine_batch(*args: Any) -> None:
        raise AssertionError("every batch here is plain")

    declared = replace(declared, batch=engine_batch, gap=engine_batch, on_gap="handler")
    providers: list[str] = []

    def recording(provider: str, db: Any) -> _locks.PartitionLocks:
        providers.append(provider)
        return _locks.partition_locks(provider, db)

    monkeypatch.setattr(_held, "partition_locks", recording)
    sent: list[tuple[int, int, int]] = []

    def send(route: Route, partition: int, batch: ClaimedBatch) -> None:
        sent.append((partition, batch.position, batch.through))

    # one slot, four partitions with events, batches of 5: it switches partitions
    worker = DeliveryWorker(engine, [declared], {declared.name: (hook, stream)}, send, 1)
    with _running(worker):
        wait_for(lambda: sum(through - after for _, after, through in sent) == 40, "the batches")
    assert len({partition for partition, _, _ in sent}) == 4
    assert providers and set(providers) == {"builtin"}


@pytest.mark.parametrize("moves_on", [True, False])
def test_a_slot_tries_a_partition_it_passed_over_again_once_its_own_drains(
    moves_on: bool, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    # Invariant 7: a partition that another holder had when the slot looked may be free
    # once the slot drains its own, its work known to no other slot. The slot tries it
    # again rather than wait for news (the next poll, and heartbeat, is a minute away
    # here); when it is still held, the slot waits holding its own partition's lock, so
    # that the next event there needs no lock statement.
    mine, held = _key_in(0), _key_in(1)
    with _slow_polls(dsn) as (engine, holder):
        older = datetime.now(UTC) - timedelta(hours=1)
        engine.append("s", [NewEvent(held, "T", {}, occurred_at=older)])
        engine.append("s", [NewEvent(mine, "T", {"n": n}) for n in range(5)])
        hook, stream, declared = _active_webhook(engine, sql, "s", 1)
        keys = [_locks.lock_key("subengine", declared.name, p) for p in (0, 1)]
        holder.execute("SELECT pg_advisory_lock(%s)", [keys[1]])
        sent: list[tuple[int, int]] = []

        def send(route: Route, partition: int, batch: ClaimedBatch) -> None:
            sent.append((partition, batch.through))
            if moves_on and (partition, batch.through) == (0, 5):  # the other holder moves on
                holder.execute("SELECT pg_advisory_unlock_all()")

        def own_lock_held() -> bool:
            holders = sql.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND (classid::bigint << 32 | objid::bigint) = %s AND pid <> %s",
                [keys[0], holder.info.backend_pid],
            ).fetchone()
            return holders is not None and holders[0] == 1

        worker = DeliveryWorker(engine, [declared], {declared.name: (hook, stream)}, send, 1)
        with _running(worker):
            if moves_on:
                wait_for(lambda: len(sent) == 6, "the held partition's batch", timeout=10)
            else:
                wait_for(lambda: len(sent) == 5, "the slot's own batches", timeout=10)
                time.sleep(0.5)  # the slot tries the held partition, then waits
                assert own_lock_held()
    mine_sent = [(0, n) for n in range(1, 6)]
    assert sent == ([*mine_sent, (1, 1)] if moves_on else mine_sent)


def test_a_slot_looks_after_a_notified_batch_for_work_no_append_announced(
    dsn: str, sql: psycopg.Connection[Any]
) -> None:
    # Invariant 7: a partition another holder had when the slot took its notification
    # is passed over; the holder lets go, which no notification says. The next append
    # elsewhere wakes the slot, which delivers it and then looks: it finds the older
    # event then, not at the next poll (a minute away here).
    free, held = _key_in(0), _key_in(1)
    with _slow_polls(dsn) as (engine, holder):
        hook, stream, declared = _active_webhook(engine, sql, "s", 1)
        key = _locks.lock_key("subengine", declared.name, 1)
        holder.execute("SELECT pg_advisory_lock(%s)", [key])
        sent: list[int] = []
        worker = DeliveryWorker(
            engine,
            [declared],
            {declared.name: (hook, stream)},
            lambda route, partition, batch: sent.append(partition),
            1,
        )
        marked = (
            "SELECT next_time IS NOT NULL FROM subengine.subscription_positions"
            " WHERE subscription = %s AND partition = 1"
        )
        with _running(worker):
            time.sleep(0.5)  # the slot's first look finds nothing: it waits
            engine.append("s", [NewEvent(held, "T", {})])
            # the slot could not lock that partition, and its look marked the row
            wait_for(lambda: sql.execute(marked, [declared.name]).fetchone() == (True,))
            holder.execute("SELECT pg_advisory_unlock(%s)", [key])
            engine.append("s", [NewEvent(free, "T", {})])
            wait_for(lambda: sorted(sent) == [0, 1], "both batches", timeout=20)
