"""Gaps: every reader that falls below a partition's floor gets a tombstone for exactly
the positions retention removed, before any later event (DESIGN.md, "Retention and
gaps", invariant 6). The gaps here come from real pruning runs."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from helpers import Running, count, record, server_now, wait_for

import subengine
from subengine import NewEvent, Retention, Tombstone


def single(engine: subengine.Engine, events: int = 10, keep: int = 4) -> None:
    """Stream 'single' (one partition) with `events` events, of which retention keeps
    the last `keep` once pruned; one append each, so each has a time of its own."""
    engine.create_stream("single", partitions=1, retention=Retention(max_events=keep))
    for n in range(events):
        engine.append("single", [NewEvent(f"k{n}", "T", {"n": n})])


def prune(engine: subengine.Engine) -> None:
    run = engine.run_retention()
    assert not run.locked
    assert run.removed > 0


def effects(sql: psycopg.Connection[Any]) -> list[int]:
    rows = sql.execute("SELECT position FROM effects ORDER BY position").fetchall()
    return [position for (position,) in rows]


def gaps(sql: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return sql.execute(
        "SELECT subscription, partition, gap_from, gap_to, floor, reason, action"
        " FROM subengine.gaps ORDER BY id"
    ).fetchall()


# reads


def test_a_read_below_the_floor_yields_the_gap_before_the_events(
    engine: subengine.Engine,
) -> None:
    single(engine)
    prune(engine)
    items = engine.read("single", 0)
    assert items[0] == Tombstone("single", 0, 1, 6, 7, "cap", 10)
    assert [item.position for item in items[1:]] == [7, 8, 9, 10]
    assert all(isinstance(item, subengine.Event) for item in items[1:])
    # from inside the gap, the tombstone names only what is left of it
    assert engine.read("single", 0, after=4)[0] == Tombstone("single", 0, 5, 6, 7, "cap", 10)
    # from the floor's eve on, nothing is missing
    assert [item.position for item in engine.read("single", 0, after=6)] == [7, 8, 9, 10]


def test_a_tombstone_says_whether_age_count_or_both_removed_its_range(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("aging", partitions=1, retention=Retention(max_age="1h"))
    for n in range(6):
        engine.append("aging", [NewEvent(f"k{n}", "T", {"n": n})])
    sql.execute(
        "UPDATE subengine.events SET recorded_at = recorded_at - interval '2 hours'"
        " WHERE stream = 'aging' AND position <= 3"
    )
    prune(engine)  # 1 to 3: too old
    assert engine.read("aging", 0)[0] == Tombstone("aging", 0, 1, 3, 4, "ttl", 6)
    engine.set_retention("aging", Retention(max_age="1h", max_events=2))
    prune(engine)  # 4: one too many
    # each reader is told exactly what removed the range it missed
    assert engine.read("aging", 0)[0] == Tombstone("aging", 0, 1, 4, 5, "mixed", 6)
    assert engine.read("aging", 0, after=3)[0] == Tombstone("aging", 0, 4, 4, 5, "cap", 6)
    assert str(engine.read("aging", 0, after=3)[0]).endswith("'aging' by its size limit")


def test_a_read_by_time_names_the_partitions_that_lost_events_since(
    engine: subengine.Engine,
) -> None:
    before = server_now(engine) - timedelta(seconds=1)
    single(engine)
    prune(engine)
    items = engine.read_since("single", before)
    assert items[0] == Tombstone("single", 0, 1, 6, 7, "cap", 10)
    assert [item.position for item in items[1:]] == [7, 8, 9, 10]
    # after the last removed event's time, no gap
    last_removed = engine.read("single", 0, after=6)[0]
    assert isinstance(last_removed, subengine.Event)
    later = engine.read_since("single", last_removed.recorded_at)
    assert not any(isinstance(item, Tombstone) for item in later)


def test_the_async_engine_reads_the_gap_too(dsn: str, engine: subengine.Engine) -> None:
    single(engine)
    prune(engine)

    async def read() -> list[subengine.Event | Tombstone]:
        async with subengine.AsyncEngine(dsn) as async_engine:
            return await async_engine.read("single", 0)

    items = asyncio.run(read())
    assert items[0] == Tombstone("single", 0, 1, 6, 7, "cap", 10)
    assert [item.position for item in items[1:]] == [7, 8, 9, 10]


def test_a_tail_yields_the_gap_before_later_events_and_moves_its_cursor_past_it(
    engine: subengine.Engine,
) -> None:
    single(engine)
    prune(engine)
    with engine.tail("single", types=["Other"]) as tail:
        first = tail.next_event(timeout=5)
        # the filter does not hide the gap: it may have held wanted events
        assert first == Tombstone("single", 0, 1, 6, 7, "cap", 10)
        assert str(tail.cursor) == "single:6"
    with engine.tail("single", after="single:2") as tail:
        items = [tail.next_event(timeout=5) for _ in range(5)]
    assert items[0] == Tombstone("single", 0, 3, 6, 7, "cap", 10)
    assert [item.position for item in items[1:] if item is not None] == [7, 8, 9, 10]


# subscriptions


def test_policy_stop_halts_the_partition_in_state_gap_until_an_operator_skips_it(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    single(fast_engine)
    app = subengine.App()
    app.subscription("billing", stream="single").handler()(record)
    fast_engine.ensure_subscription(app.subscriptions["billing"])
    prune(fast_engine)
    with Running(app, fast_engine):
        wait_for(lambda: fast_engine.subscription_positions("billing")[0].stopped)
        [status] = fast_engine.subscription_status("billing")
        assert (status.state, status.position) == ("gap", 0)
        assert (status.floor, status.gap_from, status.gap_to) == (7, 1, 6)
        assert effects(sql) == []
        assert "subengine subscription skip-gap billing --partition 0" in str(status.last_error)
        gap = fast_engine.skip_gap("billing", 0)
        assert gap == Tombstone("single", 0, 1, 6, 7, "cap", 10)
        wait_for(lambda: count(sql) == 4)
    assert effects(sql) == [7, 8, 9, 10]
    assert gaps(sql) == [("billing", 0, 1, 6, 7, "cap", "accepted")]
    [status] = fast_engine.subscription_status("billing")
    assert status.state == "idle"
    with pytest.raises(subengine.InvalidInput, match="has no gap"):
        fast_engine.skip_gap("billing", 0)


def test_policy_skip_records_the_exact_gap_and_handles_every_retained_event_once(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    single(fast_engine, events=30, keep=10)
    app = subengine.App()
    app.subscription("billing", stream="single", on_gap="skip", batch_size=3).handler()(record)
    fast_engine.ensure_subscription(app.subscriptions["billing"])
    prune(fast_engine)
    with Running(app, fast_engine):
        wait_for(lambda: count(sql) == 10)
    assert effects(sql) == list(range(21, 31))
    assert gaps(sql) == [("billing", 0, 1, 20, 21, "cap", "skipped")]


def test_a_gap_handler_writes_with_the_position_that_passes_the_gap(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    sql.execute("CREATE TABLE incomplete (gap_from bigint, gap_to bigint)")
    single(fast_engine)
    app = subengine.App()
    billing = app.subscription("billing", stream="single", max_attempts=10)
    billing.handler()(record)
    calls: list[Tombstone] = []

    @billing.gap_handler()
    def mark_incomplete(gap: Tombstone, conn: Any) -> None:
        calls.append(gap)
        conn.execute("INSERT INTO incomplete VALUES (%s, %s)", (gap.gap_from, gap.gap_to))
        if len(calls) == 1:
            raise RuntimeError("not yet")  # rolls its own write back with the position

    fast_engine.ensure_subscription(billing)
    prune(fast_engine)
    with Running(app, fast_engine):
        wait_for(lambda: count(sql) == 4)
    assert calls == [Tombstone("single", 0, 1, 6, 7, "cap", 10)] * 2
    assert sql.execute("SELECT * FROM incomplete").fetchall() == [(1, 6)]
    assert gaps(sql) == [("billing", 0, 1, 6, 7, "cap", "handled")]
    assert effects(sql) == [7, 8, 9, 10]


def test_an_at_least_once_subscription_passes_a_gap_with_its_record(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    single(fast_engine)
    seen: list[int] = []
    app = subengine.App()
    sub = app.subscription("mailer", stream="single", ack="at_least_once", on_gap="skip")
    sub.handler()(lambda event, conn: seen.append(event.position))
    fast_engine.ensure_subscription(sub)
    prune(fast_engine)
    with Running(app, fast_engine):
        wait_for(lambda: len(seen) == 4)
    assert seen == [7, 8, 9, 10]
    assert gaps(sql) == [("mailer", 0, 1, 6, 7, "cap", "skipped")]


def test_a_gap_handler_cannot_go_with_policy_skip() -> None:
    app = subengine.App()
    sub = app.subscription("billing", stream="single", on_gap="skip")
    with pytest.raises(subengine.InvalidInput, match="skips gaps"):
        sub.gap_handler()(lambda gap, conn: None)
    with pytest.raises(subengine.InvalidInput, match="on_gap must be"):
        app.subscription("other", stream="single", on_gap="ignore")  # type: ignore[arg-type]


def test_starting_from_the_beginning_of_a_pruned_stream_is_no_gap(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    single(fast_engine)
    prune(fast_engine)
    app = subengine.App()
    app.subscription("late", stream="single").handler()(record)
    fast_engine.ensure_subscription(app.subscriptions["late"])
    assert fast_engine.subscription_positions("late")[0].position == 6
    assert fast_engine.reset_subscription("late", "beginning") == {0: 6}
    with Running(app, fast_engine):
        wait_for(lambda: count(sql) == 4)
    assert effects(sql) == [7, 8, 9, 10]
    assert gaps(sql) == []


@pytest.mark.parametrize("on_error", ["stop", "dead_letter"])
def test_a_gap_handler_that_keeps_failing_stops_the_partition_with_its_error(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], on_error: Any
) -> None:
    single(fast_engine)
    app = subengine.App()
    sub = app.subscription("billing", stream="single", max_attempts=2, on_error=on_error)
    sub.handler()(record)

    @sub.gap_handler()
    def failing(gap: Tombstone, conn: Any) -> None:
        raise RuntimeError("the projection cannot be marked")

    fast_engine.ensure_subscription(sub)
    prune(fast_engine)
    with Running(app, fast_engine):
        wait_for(lambda: fast_engine.subscription_positions("billing")[0].stopped)
    [status] = fast_engine.subscription_status("billing")
    assert (status.state, status.position, status.attempts) == ("gap", 0, 2)
    assert status.last_error == "RuntimeError: the projection cannot be marked"
    assert count(sql, "subengine.dead_letters") == 0  # a gap has no event to dead-letter
    assert gaps(sql) == [] and effects(sql) == []


def test_a_gap_handler_that_swallows_its_sql_error_is_charged_with_it(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # its transaction is aborted: recording the gap fails, and that is the handler's doing
    single(fast_engine)
    app = subengine.App()
    sub = app.subscription("billing", stream="single", max_attempts=2)
    sub.handler()(record)

    @sub.gap_handler()
    def swallowing(gap: Tombstone, conn: Any) -> None:
        try:
            conn.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            pass

    fast_engine.ensure_subscription(sub)
    prune(fast_engine)
    with Running(app, fast_engine):
        wait_for(lambda: fast_engine.subscription_positions("billing")[0].stopped, timeout=20)
    [status] = fast_engine.subscription_status("billing")
    assert (status.state, status.attempts) == ("gap", 2)
    assert str(status.last_error).startswith("InFailedSqlTransaction")
