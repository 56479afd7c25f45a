"""The live tail's contract, run over both twins (`Tail` and `AsyncTail`, through the
`twin` fixture): every position once, in order, from any cursor, across lost
notifications; filters; one listening connection per engine; closing.

Every wait is bounded (a timeout per event, a deadline per test); nothing asserts on how
long anything took. Engines here poll rarely (`poll_interval`), so what the tests see
came through notifications and the listener's pull after a reconnect, not the poll.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from helpers import stored_events
from twins import Twin, twin_fixture  # noqa: F401  (the fixture `twin`)

import subengine
from subengine import Cursor, Event, NewEvent

# no test should lean on the poll: it would hide a lost notification
RARE_POLL = 120.0
EVENT_TIMEOUT = 15.0
TEST_DEADLINE = 90.0


@pytest.fixture
def settings(dsn: str) -> subengine.Settings:
    return subengine.Settings(dsn=dsn, poll_interval=RARE_POLL, read_limit=7)


@pytest.fixture
def quiet_engine(twin: Twin, settings: subengine.Settings) -> Iterator[Any]:
    """`Engine` or `AsyncEngine` (behind its sync facade), with a stream 'orders'."""
    with twin.engine(settings=settings) as engine:
        engine.create_stream("orders", 4)
        yield engine


def append_one(engine: Any, key: str, type: str = "Happened") -> None:
    engine.append("orders", [NewEvent(key, type, {"key": key})])


def listener_pids(sql: psycopg.Connection[Any]) -> list[int]:
    return [
        row[0]
        for row in sql.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = 'subengine-tail'"
        ).fetchall()
    ]


def wait_for(condition: Callable[[], object], what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


def drain(tail: Any, count: int) -> list[Event]:
    """`count` events of `tail`; fails on a timeout."""
    got: list[Event] = []
    deadline = time.monotonic() + TEST_DEADLINE
    while len(got) < count and time.monotonic() < deadline:
        event = tail.next_event(timeout=EVENT_TIMEOUT)
        if event is None:
            break
        got.extend(stored_events([event]))
    assert len(got) == count, f"{len(got)} of {count} events"
    return got


def assert_exactly_once_in_order(got: list[Event], start: Cursor, heads: dict[int, int]) -> None:
    for partition, head in heads.items():
        positions = [e.position for e in got if e.partition == partition]
        assert positions == list(range(start.position(partition) + 1, head + 1)), partition


def test_a_cursor_of_another_stream_or_partition_count_is_refused(
    quiet_engine: Any,
) -> None:
    with pytest.raises(subengine.InvalidInput, match="letters"):
        quiet_engine.tail("orders", after=Cursor("letters", (0, 0, 0, 0)))
    with quiet_engine.tail("orders", after="orders:0,0") as tail:
        with pytest.raises(subengine.InvalidInput, match="4 partitions"):
            tail.next_event(timeout=EVENT_TIMEOUT)


def test_a_tail_of_a_missing_stream_raises_stream_not_found(quiet_engine: Any) -> None:
    with quiet_engine.tail("nowhere") as tail, pytest.raises(subengine.StreamNotFound):
        tail.next_event(timeout=EVENT_TIMEOUT)


def test_a_tail_gives_every_event_from_the_beginning_then_new_ones(
    quiet_engine: Any,
) -> None:
    for n in range(30):
        append_one(quiet_engine, f"order-{n % 9}")
    with quiet_engine.tail("orders") as tail:
        got = drain(tail, 30)
        assert tail.cursor == Cursor.at("orders", quiet_engine.heads("orders"))
        assert tail.next_event(timeout=0.05) is None
        append_one(quiet_engine, "order-late")  # only a notification can bring it in time
        [late] = drain(tail, 1)
    assert late.key == "order-late"
    assert_exactly_once_in_order([*got, late], Cursor("orders"), quiet_engine.heads("orders"))


def test_a_tail_resumes_from_a_stored_cursor_without_repeating(
    quiet_engine: Any,
) -> None:
    for n in range(20):
        append_one(quiet_engine, f"order-{n}")
    with quiet_engine.tail("orders") as tail:
        first = drain(tail, 12)
        stored = str(tail.cursor)
    for n in range(20, 25):
        append_one(quiet_engine, f"order-{n}")
    with quiet_engine.tail("orders", after=stored) as tail:
        rest = drain(tail, 13)
        assert tail.next_event(timeout=0.05) is None
    assert {e.id for e in first}.isdisjoint(e.id for e in rest)
    assert_exactly_once_in_order([*first, *rest], Cursor("orders"), quiet_engine.heads("orders"))


def test_filters_keep_some_events_and_the_cursor_passes_the_others(
    quiet_engine: Any,
) -> None:
    for n in range(24):
        append_one(quiet_engine, f"order-{n % 6}", "Paid" if n % 2 else "Placed")
    with quiet_engine.tail("orders", keys=["order-1", "order-2"], types=["Paid"]) as tail:
        got = drain(tail, 4)
        assert tail.next_event(timeout=0.05) is None
        assert tail.cursor == Cursor.at("orders", quiet_engine.heads("orders"))
    assert sorted(e.key for e in got) == ["order-1"] * 4  # order-2's events are Placed
    assert {e.type for e in got} == {"Paid"}


def test_a_single_string_as_a_filter_is_refused(quiet_engine: Any) -> None:
    with pytest.raises(subengine.InvalidInput, match="keys"):
        quiet_engine.tail("orders", keys="order-1")


def test_the_tails_of_one_engine_share_one_listening_connection(
    quiet_engine: Any, sql: psycopg.Connection[Any]
) -> None:
    tails = [quiet_engine.tail("orders") for _ in range(3)]
    try:
        for tail in tails:  # an async tail registers with the listener when first used
            assert tail.next_event(timeout=0.05) is None
        wait_for(lambda: listener_pids(sql), "the listener")
        append_one(quiet_engine, "k")
        for tail in tails:
            assert [e.key for e in drain(tail, 1)] == ["k"]
        assert len(listener_pids(sql)) == 1
    finally:
        for tail in tails:
            tail.close()
    wait_for(lambda: not listener_pids(sql), "the listener to stop with its last tail")


def test_what_commits_while_the_listener_reconnects_is_still_delivered(
    quiet_engine: Any, sql: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a longer pause before reconnecting: the append below surely lands in it, and its
    # notification is lost; only the pull after the reconnection can deliver it
    monkeypatch.setattr("subengine.streams._listener._FIRST_RECONNECT_SECONDS", 1.0)
    with quiet_engine.tail("orders") as tail:
        assert tail.next_event(timeout=0.05) is None
        wait_for(lambda: listener_pids(sql), "the listener")
        [old] = listener_pids(sql)
        sql.execute("SELECT pg_terminate_backend(%s)", (old,))
        wait_for(lambda: old not in listener_pids(sql), "the old listener to end")
        append_one(quiet_engine, "order-in-the-gap")
        assert [e.key for e in drain(tail, 1)] == ["order-in-the-gap"]
        # the pull may come before pg_stat_activity shows the new listener's LISTEN
        # connection on a loaded machine; it must come, and not be the old one
        wait_for(lambda: listener_pids(sql) not in ([], [old]), "a new listener")


def test_closing_a_tail_ends_an_iteration_in_another_thread(quiet_engine: Any) -> None:
    tail = quiet_engine.tail("orders")
    ended = threading.Event()

    def iterate() -> None:
        for _ in tail:
            pass
        ended.set()

    thread = threading.Thread(target=iterate, daemon=True)
    thread.start()
    time.sleep(0.1)
    tail.close()
    assert ended.wait(EVENT_TIMEOUT)


# many writers, a late commit and a lost listener: sync and async tails alike


class Writers:
    """8 threads appending single events to random keys, and one transaction that holds
    a position (and its partition's head lock) for a while before it commits."""

    def __init__(self, engine: Any, dsn: str, per_thread: int) -> None:
        self.engine = engine
        self.dsn = dsn
        self.per_thread = per_thread
        self.threads = [
            threading.Thread(target=self._append, args=(n,), daemon=True) for n in range(8)
        ]
        self.threads.append(threading.Thread(target=self._late_commit, daemon=True))
        self.errors: list[BaseException] = []
        self.late_held = threading.Event()

    def _append(self, n: int) -> None:
        rng = random.Random(n)
        try:
            for _ in range(self.per_thread):
                append_one(self.engine, f"order-{rng.randrange(50)}")
        except BaseException as error:
            self.errors.append(error)

    def _late_commit(self) -> None:
        try:
            with psycopg.connect(self.dsn) as conn:
                subengine.append(conn, "orders", [NewEvent("order-late", "Late", {})])
                self.late_held.set()
                time.sleep(1.0)  # others behind its partition's head lock wait
                conn.commit()
        except BaseException as error:
            self.errors.append(error)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(TEST_DEADLINE)
        assert not any(t.is_alive() for t in self.threads)
        assert not self.errors, self.errors


def terminate_listener(sql: psycopg.Connection[Any]) -> int:
    wait_for(lambda: listener_pids(sql), "the listener")
    [pid] = listener_pids(sql)
    sql.execute("SELECT pg_terminate_backend(%s)", (pid,))
    return pid


def run_against_writers(
    quiet_engine: Any,
    dsn: str,
    sql: psycopg.Connection[Any],
    consume: Callable[[Cursor, int, Callable[[], None]], list[Event]],
) -> None:
    for n in range(60):
        append_one(quiet_engine, f"order-{n % 13}")
    start = Cursor.at("orders", quiet_engine.heads("orders"))
    for n in range(20):  # mid-stream: the tail starts behind
        append_one(quiet_engine, f"order-{n % 11}")
    writers = Writers(quiet_engine, dsn, per_thread=40)
    expected = 20 + 8 * 40 + 1
    terminated: list[int] = []
    writers.start()
    assert writers.late_held.wait(TEST_DEADLINE)
    got = consume(start, expected, lambda: terminated.append(terminate_listener(sql)))
    writers.join()
    assert len(terminated) == 1
    assert "order-late" in {e.key for e in got}
    assert_exactly_once_in_order(got, start, quiet_engine.heads("orders"))


def test_a_tail_gets_every_position_once_in_order_under_concurrent_writers(
    quiet_engine: Any, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    def consume(start: Cursor, expected: int, terminate: Callable[[], None]) -> list[Event]:
        got: list[Event] = []
        with quiet_engine.tail("orders", after=start) as tail:
            deadline = time.monotonic() + TEST_DEADLINE
            while len(got) < expected and time.monotonic() < deadline:
                event = tail.next_event(timeout=EVENT_TIMEOUT)
                if event is None:
                    break
                got.extend(stored_events([event]))
                if len(got) == expected // 3:
                    terminate()
            assert tail.next_event(timeout=0.2) is None  # nothing twice
            assert tail.cursor == Cursor.at("orders", quiet_engine.heads("orders"))
        return got

    run_against_writers(quiet_engine, dsn, sql, consume)


def test_a_tail_resumes_from_a_cursor_and_filters(quiet_engine: Any) -> None:
    for n in range(16):
        append_one(quiet_engine, f"order-{n % 4}", "Paid" if n % 2 else "Placed")
    with quiet_engine.tail("orders", types=["Paid"]) as tail:
        first = [tail.next_event(timeout=EVENT_TIMEOUT) for _ in range(3)]
        stored = tail.cursor
    quiet_engine.append("orders", [NewEvent("order-9", "Paid", {})])
    with quiet_engine.tail("orders", after=stored, types=["Paid"]) as tail:
        rest = []
        for event in tail:
            rest.append(event)
            if len(rest) == 6:
                break
        assert tail.next_event(timeout=0.05) is None
        cursor = tail.cursor
    assert {e.type for e in [*first, *rest]} == {"Paid"}
    assert len({e.id for e in [*first, *rest]}) == 9
    assert cursor == Cursor.at("orders", quiet_engine.heads("orders"))


# closing the engine


def test_closing_the_engine_ends_its_tails_and_their_listening_connection(
    twin: Twin, settings: subengine.Settings, sql: psycopg.Connection[Any]
) -> None:
    engine = twin.engine(settings=settings)
    engine.create_stream("orders", partitions=4)
    tail = engine.tail("orders")
    ended = threading.Event()

    def iterate() -> None:
        for _ in tail:
            pass
        ended.set()  # the iteration ended, as the close must make it

    threading.Thread(target=iterate, daemon=True).start()
    wait_for(lambda: listener_pids(sql), "the listener")
    engine.close()
    wait_for(ended.is_set, "the iteration to end with the engine")
    wait_for(lambda: not listener_pids(sql), "the listener to stop with the engine")


def test_a_tail_of_a_closed_engine_is_refused_and_starts_no_listener(
    twin: Twin, settings: subengine.Settings, sql: psycopg.Connection[Any]
) -> None:
    engine = twin.engine(settings=settings)
    engine.create_stream("orders", partitions=4)
    with engine.tail("orders") as tail:
        assert tail.next_event(timeout=0.05) is None
    engine.close()
    # the sync tail is refused when made, the async one (made outside any event loop)
    # when first used
    with pytest.raises(subengine.DatabaseUnavailable, match="closed"):
        engine.tail("orders").next_event(timeout=0.05)
    # give a listener the refused tail might have started the time to connect, then look
    for _ in range(10):
        time.sleep(0.1)
        assert listener_pids(sql) == [], "a listening connection outlived the close"


def test_a_tail_far_behind_holds_about_one_read_of_events_not_one_per_partition(
    twin: Twin, settings: subengine.Settings
) -> None:
    with twin.engine(settings=settings) as engine:
        engine.create_stream("wide", 16)
        events = [NewEvent(f"k{n}", "Happened", {}) for n in range(320)]
        engine.append("wide", events)
        heads = engine.heads("wide")
        with engine.tail("wide") as tail:
            first = tail.next_event(timeout=10)
            assert first is not None
            # held: what the first pull read, less the event given
            assert len(tail._state._unread) < settings.read_limit
            seen = [first, *drain(tail, 319)]
        assert sorted((e.partition, e.position) for e in seen) == sorted(
            (p, n) for p, head in heads.items() for n in range(1, head + 1)
        )
        assert tail.cursor.positions == tuple(heads[p] for p in range(16))
