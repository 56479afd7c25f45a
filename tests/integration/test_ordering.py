"""Invariant 1: within a partition, position p+1 never becomes visible before p.

These tests run appends on several connections at once against a real PostgreSQL.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
from helpers import key_in, stored_events

import subengine
from subengine import NewEvent

PARTITIONS = 4


def wait_until_blocked(sql: psycopg.Connection, application_name: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = sql.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE application_name = %s"
            " AND datname = current_database()",
            (application_name,),
        ).fetchone()
        if row and row[0] == "Lock":
            return
        time.sleep(0.02)
    raise AssertionError(f"{application_name} never waited for a lock")


def test_open_append_holds_back_later_appends_to_its_partition_only(
    engine: subengine.Engine, orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    first_key = key_in(1)
    second_key = key_in(1, avoid={first_key})
    other_key = key_in(2)
    holder = psycopg.connect(dsn)
    try:
        subengine.append(holder, orders, [NewEvent(first_key, "First", {})])

        def later_append() -> list[subengine.Appended]:
            with psycopg.connect(dsn, application_name="later-append") as conn:
                return subengine.append(conn, orders, [NewEvent(second_key, "Second", {})])

        with ThreadPoolExecutor(1) as pool:
            later = pool.submit(later_append)
            wait_until_blocked(sql, "later-append")
            assert (
                stored_events(engine.read(orders, 1)) == []
            )  # the later append is not visible first
            assert not later.done()

            # another partition appends and commits while partition 1 is held
            [other] = engine.append(orders, [NewEvent(other_key, "Other", {})])
            assert (other.partition, other.position) == (2, 1)

            holder.commit()
            [second] = later.result(timeout=10)
    finally:
        holder.close()
    assert second.position == 2
    assert [(e.position, e.type) for e in stored_events(engine.read(orders, 1))] == [
        (1, "First"),
        (2, "Second"),
    ]


def test_rolled_back_append_leaves_no_hole(
    engine: subengine.Engine, orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    key = key_in(3)
    with psycopg.connect(dsn) as conn:
        subengine.append(conn, orders, [NewEvent(key, "Lost", {})])
        conn.rollback()
    engine.append(orders, [NewEvent(key, "Kept", {})])
    assert [(e.position, e.key_version, e.type) for e in stored_events(engine.read(orders, 3))] == [
        (1, 1, "Kept")
    ]


def test_append_waiting_on_a_rolled_back_one_takes_its_position(
    engine: subengine.Engine, orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    key = key_in(0)
    holder = psycopg.connect(dsn)
    try:
        subengine.append(holder, orders, [NewEvent(key, "Lost", {})])

        def waiting_append() -> list[subengine.Appended]:
            with psycopg.connect(dsn, application_name="waiting-append") as conn:
                return subengine.append(conn, orders, [NewEvent(key, "Kept", {})])

        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(waiting_append)
            wait_until_blocked(sql, "waiting-append")
            holder.rollback()
            [kept] = waiting.result(timeout=10)
    finally:
        holder.close()
    assert (kept.position, kept.key_version) == (1, 1)
    assert sql.execute("SELECT max(position) FROM subengine.events").fetchone()[0] == 1  # type: ignore[index]


def test_concurrent_appends_are_dense_ordered_and_never_skipped_by_a_tailing_reader(
    dsn: str,
) -> None:
    threads, appends_per_thread = 8, 1000
    keys = [f"order-{n}" for n in range(40)]
    with subengine.Engine(dsn, settings=subengine.Settings(dsn=dsn, pool_max_size=12)) as engine:
        engine.create_stream("orders", partitions=PARTITIONS)
        done = threading.Event()
        seen: dict[int, list[int]] = defaultdict(list)

        def tail() -> None:
            # Keeps only a position per partition, as a subscriber does: a skipped event
            # would never be read again.
            last = dict.fromkeys(range(PARTITIONS), 0)
            while True:
                finished = done.is_set()
                for partition in range(PARTITIONS):
                    for event in stored_events(
                        engine.read("orders", partition, after=last[partition])
                    ):
                        seen[partition].append(event.position)
                        last[partition] = event.position
                if finished:
                    return

        def produce(thread: int) -> None:
            for n in range(appends_per_thread):
                key = keys[(thread * 7 + n) % len(keys)]
                engine.append("orders", [NewEvent(key, "Step", {"thread": thread, "n": n})])

        reader = threading.Thread(target=tail)
        reader.start()
        with ThreadPoolExecutor(threads) as pool:
            for future in [pool.submit(produce, t) for t in range(threads)]:
                future.result()
        done.set()
        reader.join(timeout=60)

        heads = engine.heads("orders")
        assert sum(heads.values()) == threads * appends_per_thread
        versions: dict[str, list[int]] = defaultdict(list)
        per_writer: dict[tuple[int, str], list[int]] = defaultdict(list)
        for partition, head in heads.items():
            assert seen[partition] == list(range(1, head + 1)), "the tail skipped an event"
            stored = stored_events(engine.read("orders", partition, limit=head))
            assert [e.position for e in stored] == list(range(1, head + 1))
            recorded = [e.recorded_at for e in stored]
            assert recorded == sorted(recorded), "recorded_at went back along a partition"
            for event in stored:
                versions[event.key].append(event.key_version)
                per_writer[event.data["thread"], event.key].append(event.data["n"])
        for key, key_versions in versions.items():
            assert key_versions == list(range(1, len(key_versions) + 1)), key
        # what one writer appended to a key, one commit after another, keeps its order
        assert all(ns == sorted(ns) for ns in per_writer.values())


def test_multi_partition_appends_in_opposite_orders_do_not_deadlock(
    engine: subengine.Engine, orders: str
) -> None:
    keys = [key_in(p) for p in range(PARTITIONS)]

    def produce(order: list[str]) -> None:
        for n in range(100):
            engine.append(orders, [NewEvent(k, "Step", {"n": n}) for k in order])

    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(produce, keys),
            pool.submit(produce, keys[::-1]),
            pool.submit(produce, keys[1:] + keys[:1]),
            pool.submit(produce, keys[2:] + keys[:2]),
        ]
        for future in futures:
            future.result(timeout=120)
    assert engine.heads(orders) == dict.fromkeys(range(PARTITIONS), 400)


def _append_while_held(
    dsn: str,
    sql: psycopg.Connection[Any],
    holder_events: list[NewEvent],
    waiter_events: list[NewEvent],
    waiter_expected: Any = None,
) -> tuple[BaseException | None, Any]:
    """Append `holder_events` in an open transaction, start `waiter_events` in another
    (which must wait for the first), commit the first and return the waiter's outcome."""
    holder = psycopg.connect(dsn)
    try:
        subengine.append(holder, "orders", holder_events)

        def waiter() -> list[subengine.Appended]:
            with psycopg.connect(dsn, application_name="waiter") as conn:
                return subengine.append(conn, "orders", waiter_events, waiter_expected)

        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(waiter)
            wait_until_blocked(sql, "waiter")
            holder.commit()
            error = waiting.exception(timeout=10)
            return error, None if error else waiting.result()
    finally:
        holder.close()


def test_two_writers_expecting_the_same_version_one_wins(
    engine: subengine.Engine, orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    error, _ = _append_while_held(
        dsn,
        sql,
        [NewEvent("order-1", "Placed", {})],
        [NewEvent("order-1", "Placed", {})],
        waiter_expected=0,
    )
    assert isinstance(error, subengine.WrongExpectedVersion)
    assert (error.expected, error.actual) == (0, 1)
    assert engine.heads(orders)[subengine.partition_for("order-1", PARTITIONS)] == 1


def test_concurrent_retries_of_one_append_store_it_once(
    engine: subengine.Engine, orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    event = NewEvent("order-1", "Placed", {}, id=uuid.uuid4())
    error, result = _append_while_held(dsn, sql, [event], [event])
    assert error is None
    assert result[0].duplicate and result[0].position == 1
    assert engine.heads(orders)[subengine.partition_for("order-1", PARTITIONS)] == 1


def test_one_id_appended_at_once_under_two_keys_fails_clearly(
    engine: subengine.Engine, orders: str, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    event_id = uuid.uuid4()
    first_key, other_key = key_in(0), key_in(1)
    holder = psycopg.connect(dsn)
    try:
        subengine.append(holder, orders, [NewEvent(first_key, "Placed", {}, id=event_id)])

        def other() -> None:
            with psycopg.connect(dsn, application_name="other-key") as conn:
                subengine.append(conn, orders, [NewEvent(other_key, "Placed", {}, id=event_id)])

        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(other)
            wait_until_blocked(sql, "other-key")  # on the unique index, not on a head
            holder.commit()
            error = waiting.exception(timeout=10)
    finally:
        holder.close()
    assert isinstance(error, subengine.InvalidInput)
    assert "an id names one event" in str(error)
    assert engine.heads(orders) == {0: 1, 1: 0, 2: 0, 3: 0}
