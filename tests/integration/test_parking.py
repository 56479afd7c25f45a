"""Key-scoped parking (on_error="park"): a poison event parks its key, the key's later
events are set aside while the other keys go on, and a retry replays the key's events
once each, in order. Workers run in threads against a real PostgreSQL."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest
from helpers import Running, count, wait_for

import subengine
from subengine import NewEvent
from subengine.subscriptions import _parking


@pytest.fixture
def effects(sql: psycopg.Connection[Any]) -> None:
    """The table `key_effects`: one row per effect, in the order they committed (seq)."""
    sql.execute(
        "CREATE TABLE key_effects (seq bigserial, event_id uuid, key text, key_version bigint,"
        " position bigint)"
    )


@pytest.fixture
def single(fast_engine: subengine.Engine) -> str:
    fast_engine.create_stream("single", partitions=1)
    return "single"


class Poison:
    """Events whose data says poison fail until `fixed` is set."""

    def __init__(self) -> None:
        self.fixed = threading.Event()
        self.calls: list[list[int]] = []

    def check(self, event: subengine.Event) -> None:
        if event.data.get("poison") and not self.fixed.is_set():
            raise ValueError(f"cannot handle {event.key} {event.key_version}")


def write(event: subengine.Event, conn: Any) -> None:
    conn.execute(
        "INSERT INTO key_effects (event_id, key, key_version, position) VALUES (%s, %s, %s, %s)",
        (event.id, event.key, event.key_version, event.position),
    )


def parking_app(
    stream: str, poison: Poison, batch: bool = False, **options: Any
) -> tuple[subengine.App, subengine.Subscription]:
    app = subengine.App()
    options = {"max_attempts": 2, "on_error": "park", "batch_size": 3, **options}
    sub = app.subscription("billing", stream=stream, **options)
    if batch:

        @sub.batch_handler()
        def handle_all(events: Sequence[subengine.Event], conn: Any) -> None:
            poison.calls.append([e.position for e in events])
            for event in events:
                poison.check(event)
                write(event, conn)

    else:

        @sub.handler()
        def handle(event: subengine.Event, conn: Any) -> None:
            poison.check(event)
            write(event, conn)

    return app, sub


def interleaved(engine: subengine.Engine, stream: str) -> list[subengine.Appended]:
    """Keys a, b, c interleaved, four events each; a's second is poison."""
    events = [
        NewEvent(key, "T", {"poison": (key, n) == ("a", 1)})
        for n in range(4)
        for key in ("a", "b", "c")
    ]
    return engine.append(stream, events)


def effects_by_key(sql: psycopg.Connection[Any]) -> dict[str, list[int]]:
    """Each key's effects: its versions, in the order they were made."""
    by_key: dict[str, list[int]] = defaultdict(list)
    for key, version in sql.execute("SELECT key, key_version FROM key_effects ORDER BY seq"):
        by_key[key].append(version)
    return dict(by_key)


def caught_up(engine: subengine.Engine, stream: str = "single") -> bool:
    heads = engine.heads(stream)
    positions = engine.subscription_positions("billing")
    return bool(positions) and all(p.position == heads[p.partition] for p in positions)


def parked_rows(sql: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return sql.execute(
        "SELECT k.key, k.generation, k.resolution, pe.position, pe.resolution"
        " FROM subengine.parked_keys k JOIN subengine.parked_events pe ON pe.parked_key = k.id"
        " ORDER BY k.id, pe.position"
    ).fetchall()


@pytest.fixture
def parked_a(
    fast_engine: subengine.Engine, single: str, effects: None, sql: psycopg.Connection[Any]
) -> Iterator[tuple[Poison, subengine.Subscription, list[subengine.Appended]]]:
    """Subscription billing of `single` after a worker went through the interleaved
    events: key a parked at its second event."""
    poison = Poison()
    app, sub = parking_app(single, poison)
    stored = interleaved(fast_engine, single)
    with Running(app, fast_engine):
        wait_for(lambda: caught_up(fast_engine), what="the worker to pass every event")
    yield poison, sub, stored


# the worker


def test_a_poison_event_parks_its_key_and_the_other_keys_go_on_in_order(
    parked_a: tuple[Poison, subengine.Subscription, list[subengine.Appended]],
    fast_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
) -> None:
    _, _, stored = parked_a
    # b and c: every effect once, in order; a: only what came before its poison
    assert effects_by_key(sql) == {"a": [1], "b": [1, 2, 3, 4], "c": [1, 2, 3, 4]}
    a_positions = [stored[n].position for n in (3, 6, 9)]
    assert a_positions == [4, 7, 10]
    assert parked_rows(sql) == [("a", 1, None, p, None) for p in a_positions]
    [key] = fast_engine.parked_keys("billing")
    assert (key.key, key.position, key.attempts, key.events, key.waiting) == (
        "a", a_positions[0], 2, 3, 3,
    )  # fmt: skip
    assert (key.next_position, key.last_position, key.type) == (
        a_positions[0],
        a_positions[-1],
        "T",
    )
    assert key.error == "ValueError: cannot handle a 2"
    [row] = fast_engine.subscription_positions("billing")
    assert (row.position, row.attempts, row.stopped) == (12, 0, False)


def test_new_events_of_a_parked_key_keep_parking_while_others_are_handled(
    parked_a: tuple[Poison, subengine.Subscription, list[subengine.Appended]],
    fast_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
) -> None:
    _, sub, _ = parked_a
    app = subengine.App()
    app.subscriptions["billing"] = sub
    with Running(app, fast_engine):
        fast_engine.append("single", [NewEvent(k, "T", {}) for k in ("a", "b", "a", "d")])
        wait_for(lambda: caught_up(fast_engine), what="the new events")
    assert effects_by_key(sql) == {"a": [1], "b": [1, 2, 3, 4, 5], "c": [1, 2, 3, 4], "d": [1]}
    [key] = fast_engine.parked_keys("billing")
    assert (key.events, key.waiting, key.last_position) == (5, 5, 15)


def test_retry_after_the_fix_replays_the_key_once_each_in_order_and_clears_it(
    parked_a: tuple[Poison, subengine.Subscription, list[subengine.Appended]],
    fast_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
) -> None:
    poison, sub, _ = parked_a
    # still broken: recorded, nothing replayed, the key stays parked
    failed = fast_engine.retry_parked_key(sub, "a")
    assert (failed.replayed, failed.error, failed.superseded) == (
        0, "ValueError: cannot handle a 2", False,
    )  # fmt: skip
    [key] = fast_engine.parked_keys("billing")
    assert (key.retries, key.waiting, key.resolution) == (1, 3, None)
    assert effects_by_key(sql)["a"] == [1]
    poison.fixed.set()
    retried = fast_engine.retry_parked_key(sub, "a")  # batch_size 3: one step
    assert (retried.replayed, retried.error, retried.superseded) == (3, None, False)
    assert effects_by_key(sql)["a"] == [1, 2, 3, 4]
    assert fast_engine.parked_keys("billing") == []
    [key] = fast_engine.parked_keys("billing", everything=True)
    assert (key.retries, key.waiting, key.resolution) == (2, 0, "retried")
    assert {r[4] for r in parked_rows(sql)} == {"retried"}
    # the key is clear: its next event is handled by the worker
    app = subengine.App()
    app.subscriptions["billing"] = sub
    with Running(app, fast_engine):
        fast_engine.append("single", [NewEvent("a", "T", {})])
        wait_for(lambda: caught_up(fast_engine), what="the new event")
    assert effects_by_key(sql)["a"] == [1, 2, 3, 4, 5]
    with pytest.raises(subengine.InvalidInput, match="has no parked key 'a'"):
        fast_engine.retry_parked_key(sub, "a")


def test_a_retry_in_steps_keeps_what_it_replayed_when_a_later_event_fails(
    fast_engine: subengine.Engine, single: str, effects: None, sql: psycopg.Connection[Any]
) -> None:
    poison = Poison()
    app, sub = parking_app(single, poison, batch_size=1, max_attempts=1)
    fast_engine.append(single, [NewEvent("a", "T", {"poison": n in (0, 3)}) for n in range(5)])
    with Running(app, fast_engine):
        wait_for(lambda: caught_up(fast_engine))
    assert effects_by_key(sql) == {}
    calls = 0
    original = sub.catch_all
    assert original is not None

    def fixed_once(event: subengine.Event, conn: Any) -> None:
        nonlocal calls
        calls += 1
        if event.key_version == 4:
            raise ValueError("the fourth is still wrong")
        write(event, conn)

    sub.catch_all = fixed_once
    result = fast_engine.retry_parked_key(sub, "a")
    # one step per event: the first three committed, the fourth failed and stays parked
    assert (result.replayed, result.error) == (3, "ValueError: the fourth is still wrong")
    assert effects_by_key(sql) == {"a": [1, 2, 3]}
    [key] = fast_engine.parked_keys("billing")
    assert (key.waiting, key.next_position, key.retries) == (2, 4, 1)
    sub.catch_all = original
    poison.fixed.set()
    assert fast_engine.retry_parked_key(sub, "a").replayed == 2
    assert effects_by_key(sql) == {"a": [1, 2, 3, 4, 5]}


def test_a_batch_handler_parks_the_key_of_the_event_it_fails_on_alone(
    fast_engine: subengine.Engine, single: str, effects: None, sql: psycopg.Connection[Any]
) -> None:
    poison = Poison()
    app, sub = parking_app(single, poison, batch=True, batch_size=6)
    interleaved(fast_engine, single)
    with Running(app, fast_engine):
        wait_for(lambda: caught_up(fast_engine))
    assert effects_by_key(sql) == {"a": [1], "b": [1, 2, 3, 4], "c": [1, 2, 3, 4]}
    # the batch holding the poison failed, was split, and the poison failed alone twice
    assert [4] in poison.calls and poison.calls.count([4]) == 2
    # no call after the parking carried an event of a
    after = poison.calls[len(poison.calls) - poison.calls[::-1].index([4]) :]
    assert all(p not in (7, 10) for call in after for p in call)
    assert fast_engine.parked_keys("billing")[0].key == "a"
    poison.fixed.set()
    assert fast_engine.retry_parked_key(sub, "a").replayed == 3
    assert effects_by_key(sql)["a"] == [1, 2, 3, 4]


def test_discard_releases_the_key_and_its_later_events_are_handled(
    parked_a: tuple[Poison, subengine.Subscription, list[subengine.Appended]],
    fast_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
) -> None:
    _, sub, _ = parked_a
    assert fast_engine.discard_parked_key("billing", "a") == 3
    assert fast_engine.parked_keys("billing") == []
    assert {r[4] for r in parked_rows(sql)} == {"discarded"}
    events = fast_engine.parked_events("billing", "a")
    assert [(e.position, e.resolution) for e in events] == [
        (4, "discarded"),
        (7, "discarded"),
        (10, "discarded"),
    ]
    app = subengine.App()
    app.subscriptions["billing"] = sub
    with Running(app, fast_engine):
        fast_engine.append("single", [NewEvent("a", "T", {})])
        wait_for(lambda: caught_up(fast_engine))
    assert effects_by_key(sql)["a"] == [1, 5]
    with pytest.raises(subengine.InvalidInput, match="has no parked key 'a'"):
        fast_engine.discard_parked_key("billing", "a")


# resets


def test_a_reset_releases_parked_keys_and_replays_their_events_in_order(
    parked_a: tuple[Poison, subengine.Subscription, list[subengine.Appended]],
    fast_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
) -> None:
    poison, sub, _ = parked_a
    fast_engine.reset_subscription("billing", "beginning")
    assert fast_engine.parked_keys("billing") == []
    assert {(r[2], r[4]) for r in parked_rows(sql)} == {("superseded", "superseded")}
    assert fast_engine.subscription_status("billing")[0].parked_keys == 0
    poison.fixed.set()
    sql.execute("TRUNCATE key_effects")
    app = subengine.App()
    app.subscriptions["billing"] = sub
    with Running(app, fast_engine):
        wait_for(lambda: caught_up(fast_engine) and count(sql, "key_effects") == 12)
    assert effects_by_key(sql) == {key: [1, 2, 3, 4] for key in "abc"}
    with pytest.raises(subengine.InvalidInput, match="has no parked key 'a'"):
        fast_engine.retry_parked_key(sub, "a")


def test_a_reset_of_other_partitions_leaves_a_parked_key_parked(
    fast_engine: subengine.Engine, effects: None, sql: psycopg.Connection[Any]
) -> None:
    poison = Poison()
    app, _ = parking_app("orders", poison)
    stored = fast_engine.append("orders", [NewEvent("a", "T", {"poison": True})])
    with Running(app, fast_engine):
        wait_for(lambda: len(fast_engine.parked_keys("billing")) == 1)
    other = next(p for p in range(4) if p != stored[0].partition)
    fast_engine.reset_subscription("billing", {other: 0})
    [key] = fast_engine.parked_keys("billing")
    assert (key.key, key.generation) == ("a", 1)


def test_a_reset_during_a_retry_ends_the_retry_and_the_rest_is_the_resets_replay(
    fast_engine: subengine.Engine,
    single: str,
    effects: None,
    sql: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    poison = Poison()
    app, sub = parking_app(single, poison, batch_size=1, max_attempts=1)
    fast_engine.append(single, [NewEvent("a", "T", {"poison": n == 0}) for n in range(3)])
    with Running(app, fast_engine):
        wait_for(lambda: caught_up(fast_engine))
    assert [k.waiting for k in fast_engine.parked_keys("billing")] == [3]
    # The retry's first step waits in its handler until a reset waits for its row; its
    # second step begins once the reset committed (when the first step's commit wakes the
    # reset, the retry's next lock could otherwise come first).
    in_handler, go_on = threading.Event(), threading.Event()
    original = sub.catch_all
    assert original is not None

    def held(event: subengine.Event, conn: Any) -> None:
        if event.key_version == 1:
            in_handler.set()
            assert go_on.wait(30)
        write(event, conn)

    sub.catch_all = held
    reset = threading.Thread(target=lambda: fast_engine.reset_subscription("billing", "beginning"))
    steps = 0
    lock = _parking._lock

    def after_the_reset(db: Any, where: dict[str, Any]) -> tuple[int, int]:
        nonlocal steps
        steps += 1
        if steps == 2:
            reset.join(30)
        return lock(db, where)

    monkeypatch.setattr(_parking, "_lock", after_the_reset)
    results: list[subengine.ParkedKeyRetry] = []
    retry = threading.Thread(target=lambda: results.append(fast_engine.retry_parked_key(sub, "a")))
    retry.start()
    assert in_handler.wait(30)
    reset.start()
    waiting = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND datname = current_database()"
    )
    wait_for(
        lambda: sql.execute(waiting).fetchone() == (1,),
        what="the reset to wait for the retry's row",
    )
    go_on.set()
    retry.join(30)
    reset.join(30)
    [result] = results
    assert (result.replayed, result.error, result.superseded) == (1, None, True)
    # the first step committed before the reset; the reset released the rest
    assert effects_by_key(sql) == {"a": [1]}
    assert parked_rows(sql) == [
        ("a", 1, "superseded", 1, "retried"),
        ("a", 1, "superseded", 2, "superseded"),
        ("a", 1, "superseded", 3, "superseded"),
    ]
    # the new generation handles the key from the beginning, in order
    sub.catch_all = original
    poison.fixed.set()
    with Running(app, fast_engine):
        wait_for(lambda: count(sql, "key_effects") == 4)
    assert effects_by_key(sql) == {"a": [1, 1, 2, 3]}
    [row] = fast_engine.subscription_positions("billing")
    assert (row.position, row.generation) == (3, 2)


def test_a_retry_after_a_reset_finds_nothing_to_retry(
    parked_a: tuple[Poison, subengine.Subscription, list[subengine.Appended]],
    fast_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
) -> None:
    poison, sub, _ = parked_a
    fast_engine.reset_subscription("billing", "end")
    poison.fixed.set()
    before = (effects_by_key(sql), parked_rows(sql))
    with pytest.raises(subengine.InvalidInput, match="has no parked key 'a'"):
        fast_engine.retry_parked_key(sub, "a")
    assert (effects_by_key(sql), parked_rows(sql)) == before


# at_least_once


def test_an_at_least_once_batch_whose_key_is_released_while_it_runs_is_handled_again(
    fast_engine: subengine.Engine, single: str, effects: None, sql: psycopg.Connection[Any]
) -> None:
    # a is parked; a batch holding an event of a and one of b runs its handler (outside
    # the transaction) while an operator discards a: the batch must not commit past a's
    # event without handling it
    app = subengine.App()
    sub = app.subscription(
        "billing", stream=single, ack="at_least_once", on_error="park", max_attempts=1,
        batch_size=10,
    )  # fmt: skip
    handled: list[tuple[str, int]] = []
    in_handler, go_on = threading.Event(), threading.Event()

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        if event.data.get("poison"):
            raise ValueError("poison")
        if event.data.get("wait") and not go_on.is_set():
            in_handler.set()
            assert go_on.wait(30)
        handled.append((event.key, event.key_version))

    fast_engine.append(single, [NewEvent("a", "T", {"poison": True})])
    with Running(app, fast_engine):
        wait_for(lambda: len(fast_engine.parked_keys("billing")) == 1)
        fast_engine.append(single, [NewEvent("a", "T", {}), NewEvent("b", "T", {"wait": True})])
        assert in_handler.wait(30)
        assert fast_engine.discard_parked_key("billing", "a") == 1
        go_on.set()
        wait_for(lambda: caught_up(fast_engine))
    assert ("a", 2) in handled
    assert fast_engine.parked_keys("billing") == []
    assert [(e.position, e.resolution) for e in fast_engine.parked_events("billing", "a")] == [
        (1, "discarded")
    ]


def test_an_at_least_once_subscription_parks_and_retries_without_a_connection(
    fast_engine: subengine.Engine, single: str
) -> None:
    app = subengine.App()
    sub = app.subscription(
        "billing", stream=single, ack="at_least_once", on_error="park", max_attempts=1
    )
    seen: list[tuple[str, int, bool]] = []
    fixed = threading.Event()

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        if event.data.get("poison") and not fixed.is_set():
            raise ValueError("poison")
        seen.append((event.key, event.key_version, conn is None))

    fast_engine.append(
        single, [NewEvent(k, "T", {"poison": (k, n) == ("a", 0)}) for n in range(2) for k in "ab"]
    )
    with Running(app, fast_engine):
        wait_for(lambda: caught_up(fast_engine))
    assert seen == [("b", 1, True), ("b", 2, True)]
    fixed.set()
    assert fast_engine.retry_parked_key(sub, "a").replayed == 2
    assert seen[2:] == [("a", 1, True), ("a", 2, True)]


# bad input


def test_bad_arguments_to_the_parked_key_methods_change_nothing(
    parked_a: tuple[Poison, subengine.Subscription, list[subengine.Appended]],
    fast_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
) -> None:
    poison, sub, _ = parked_a
    poison.fixed.set()
    before = (effects_by_key(sql), parked_rows(sql))
    elsewhere = subengine.App().subscription("billing", stream="orders", on_error="park")
    elsewhere.handler()(write)
    cases: list[tuple[Any, str]] = [
        (lambda: fast_engine.retry_parked_key(sub, ""), "invalid event key"),
        (lambda: fast_engine.retry_parked_key(sub, "zz"), "has no parked key 'zz'"),
        (lambda: fast_engine.retry_parked_key(elsewhere, "a"), "stored on stream 'single'"),
        (lambda: fast_engine.discard_parked_key("nope", "a"), "no subscription named 'nope'"),
        (lambda: fast_engine.discard_parked_key("bad name!", "a"), "invalid stream name"),
        (lambda: fast_engine.parked_events("billing", "zz"), "never parked key 'zz'"),
        (lambda: fast_engine.parked_keys("billing", key="x\n"), "invalid event key"),
    ]
    for call, message in cases:
        with pytest.raises(subengine.SubengineError, match=message):
            call()
    assert (effects_by_key(sql), parked_rows(sql)) == before


def test_a_retry_of_a_key_whose_parked_events_retention_removed_is_refused(
    parked_a: tuple[Poison, subengine.Subscription, list[subengine.Appended]],
    fast_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
) -> None:
    poison, sub, _ = parked_a
    poison.fixed.set()
    fast_engine.set_retention("single", subengine.Retention(max_events=4))
    fast_engine.run_retention()
    before = (effects_by_key(sql), parked_rows(sql))
    with pytest.raises(subengine.InvalidInput, match=r"positions 4, 7 of partition 0"):
        fast_engine.retry_parked_key(sub, "a")
    assert (effects_by_key(sql), parked_rows(sql)) == before
    assert fast_engine.discard_parked_key("billing", "a") == 3
