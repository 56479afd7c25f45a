"""The Python client's contract, run over both twins (`Reader` and `AsyncReader`, through
the `twin` fixture of twins.py) against a real gateway: every event exactly once across
catch-up and live, through a crash of the gateway, a connection that goes silent and
event streams that a network keeps cutting; gaps and re-created streams as items; a
refusal as an error naming the gateway's code; watches of several streams.

Every wait is bounded; no test asserts on how long anything took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import web
from helpers import PASSWORD, GatewayProcess, GatewayProxy, free_port, wait_for
from twins import Twin, twin_fixture  # noqa: F401  (the fixture `twin`)

import subengine
from subengine import AsyncEngine
from subengine.client import (
    Event,
    GatewayError,
    Item,
    Reconnect,
    Reset,
    StreamOptions,
    Tombstone,
)
from subengine.gateway import GatewayConfig, close_all_streams, create_app

# one bound for every wait in these tests
TIMEOUT = 60.0
# reconnect at once, so that a test waits on what it tests and not on backoff
QUICK = Reconnect(delay=0.05, max_delay=0.5)


def append(engine: subengine.Engine, stream: str, count: int, start: int = 0) -> None:
    engine.append(
        stream,
        [subengine.NewEvent(f"k{n % 7}", "created", {"n": n}) for n in range(start, start + count)],
    )


def numbers(items: Sequence[Item]) -> list[int]:
    return [item.data["n"] for item in items if isinstance(item, Event)]


def assert_exactly_once(items: list[Item], count: int) -> None:
    """`items` are the events 0 … count-1, each once, each partition in order."""
    events = [item for item in items if isinstance(item, Event)]
    assert sorted(numbers(events)) == list(range(count))
    for partition in {event.partition for event in events}:
        positions = [event.position for event in events if event.partition == partition]
        assert positions == list(range(1, len(positions) + 1))


class Collector:
    """A reader iterated in a thread: `items` and the cursor after each (`cursors`)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.items: list[Item] = []
        self.cursors: list[str | None] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            for item in self.reader:
                self.items.append(item)
                self.cursors.append(self.reader.cursor)
        except BaseException as error:
            self.error = error

    def events(self) -> list[Event]:
        return [item for item in self.items if isinstance(item, Event)]

    def wait(self, condition: Callable[[], object], what: str) -> None:
        def done() -> object:
            if self.error is not None:
                raise AssertionError(f"the reader failed: {self.error!r}")
            return condition()

        wait_for(done, what, timeout=TIMEOUT)


@contextmanager
def collecting(reader: Any) -> Iterator[Collector]:
    collector = Collector(reader)
    collector.thread.start()
    try:
        yield collector
    finally:
        reader.stop()
        collector.thread.join(TIMEOUT)
        reader.close()
    assert not collector.thread.is_alive(), "the reader did not stop"
    assert collector.error is None, collector.error


def read_to_end(twin: Twin, url: str, stream: str, **options: Any) -> tuple[list[Item], str | None]:
    """Everything a reader that does not follow reads, and its cursor at the end."""
    with twin.reader(url, stream, follow=False, **options) as reader:
        items = list(reader)
        return items, reader.cursor


def test_every_event_once_across_catch_up_and_live(
    twin: Twin, engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    append(engine, orders, 30)
    reader = twin.reader(gateway.url, orders, page_limit=7, heartbeat=1, reconnect=QUICK)
    with collecting(reader) as collector:
        collector.wait(lambda: len(collector.events()) == 30, "the catch-up")
        collector.wait(lambda: reader.mode == "sse", "the reader to go live")
        for start in range(30, 50, 5):
            append(engine, orders, 5, start=start)
        collector.wait(lambda: len(collector.events()) >= 50, "the live events")
    assert_exactly_once(collector.items, 50)
    # its last cursor resumes after everything it delivered
    rest, _ = read_to_end(twin, gateway.url, orders, after=collector.cursors[-1])
    assert rest == []


def test_the_cursor_after_each_item_resumes_right_after_it(
    twin: Twin, engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    append(engine, orders, 40)
    options: dict[str, Any] = {"keys": ["k1", "k2", "k5"], "page_limit": 4}
    items, _ = read_to_end(twin, gateway.url, orders, **options)
    assert sorted(numbers(items)) == [n for n in range(40) if n % 7 in (1, 2, 5)]
    with twin.reader(gateway.url, orders, follow=False, **options) as reader:
        cursors = [reader.cursor for _ in reader]
    for index, cursor in enumerate(cursors):
        rest, _ = read_to_end(twin, gateway.url, orders, after=cursor, **options)
        assert numbers(rest) == numbers(items[index + 1 :])


def test_a_crashed_gateway_restarted_on_its_port_loses_and_repeats_nothing(
    twin: Twin, engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    port = free_port()
    first = GatewayProcess(cli_env, "--heartbeat", "1", tmp=tmp_path, port=port).start()
    second: GatewayProcess | None = None
    appended = threading.Event()

    def appender() -> None:
        for start in range(0, 200, 2):
            append(engine, orders, 2, start=start)
            time.sleep(0.02)
        appended.set()

    reader = twin.reader(first.url, orders, heartbeat=1, reconnect=QUICK)
    try:
        with collecting(reader) as collector:
            writing = threading.Thread(target=appender, daemon=True)
            writing.start()
            collector.wait(lambda: len(collector.events()) >= 40, "events before the crash")
            first.kill()
            wait_for(appended.is_set, "the appends", timeout=TIMEOUT)
            second = GatewayProcess(cli_env, "--heartbeat", "1", tmp=tmp_path, port=port).start()
            collector.wait(lambda: len(collector.events()) >= 200, "every event")
            writing.join(TIMEOUT)
        assert_exactly_once(collector.items, 200)
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_gaps_surface_as_tombstones_before_later_events(
    twin: Twin, engine: subengine.Engine, gateway: GatewayProcess
) -> None:
    engine.create_stream("feed", 1, retention=subengine.Retention(max_events=5))
    engine.append("feed", [subengine.NewEvent("k", "t", {"n": n}) for n in range(12)])
    start, cursor = read_to_end(twin, gateway.url, "feed", page_limit=2)
    assert numbers(start) == list(range(12))
    engine.append("feed", [subengine.NewEvent("k", "t", {"n": n}) for n in range(12, 20)])
    engine.run_retention()
    items, _ = read_to_end(twin, gateway.url, "feed", after=cursor)
    assert items[0] == Tombstone("feed", 0, 13, 15, 16, "cap", 20, cursor_below_floor=True)
    assert numbers(items[1:]) == list(range(15, 20))


def test_a_re_created_stream_surfaces_as_a_reset(
    twin: Twin, engine: subengine.Engine, gateway: GatewayProcess
) -> None:
    engine.create_stream("temp", 2)
    engine.append("temp", [subengine.NewEvent("a", "t", {"n": 0})])
    before, cursor = read_to_end(twin, gateway.url, "temp")
    assert numbers(before) == [0]
    old_epoch = engine.stream("temp").epoch
    engine.delete_stream("temp")
    engine.create_stream("temp", 2)
    engine.append("temp", [subengine.NewEvent("b", "t", {"n": 1})])
    items, _ = read_to_end(twin, gateway.url, "temp", after=cursor)
    assert items[0] == Reset(
        "temp", old_epoch, engine.stream("temp").epoch, "the stream was deleted and created again"
    )
    assert numbers(items[1:]) == [1]


def test_a_silent_connection_is_left_after_twice_the_heartbeat(
    twin: Twin, engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    with GatewayProxy(gateway.url) as proxy:
        reader = twin.reader(proxy.url, orders, heartbeat=1, reconnect=QUICK)
        with collecting(reader) as collector:
            collector.wait(lambda: reader.mode == "sse" and proxy.connections, "going live")
            append(engine, orders, 1)
            collector.wait(lambda: len(collector.events()) == 1, "the first live event")
            connections = proxy.connections
            proxy.freeze()  # the open connection now carries nothing, heartbeats neither
            append(engine, orders, 1, start=1)
            collector.wait(lambda: len(collector.events()) == 2, "the event after the silence")
        assert proxy.connections > connections
    assert_exactly_once(collector.items, 2)


def test_event_streams_cut_young_fall_back_to_long_poll(
    twin: Twin, engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    append(engine, orders, 3)
    with GatewayProxy(gateway.url, cut_sse_after=0.2) as proxy:
        fallback = Reconnect(delay=0.05, max_delay=0.2, short_connection=5, short_connections=3)
        reader = twin.reader(proxy.url, orders, heartbeat=1, long_poll_wait=2, reconnect=fallback)
        with collecting(reader) as collector:
            collector.wait(lambda: reader.mode == "long-poll", "the fallback to long-poll")
            append(engine, orders, 4, start=3)
            collector.wait(lambda: len(collector.events()) == 7, "events by long-poll")
            assert reader.mode == "long-poll"
    assert_exactly_once(collector.items, 7)


def test_a_refusal_raises_the_gateways_code_and_never_the_api_key(
    twin: Twin, orders: str, gateway: GatewayProcess
) -> None:
    with (
        twin.reader(gateway.url, orders, api_key=PASSWORD) as reader,
        pytest.raises(GatewayError) as refused,
    ):
        next(iter(reader))
    assert (refused.value.status, refused.value.code) == (401, "unauthorized")
    assert PASSWORD not in str(refused.value) and PASSWORD not in repr(refused.value)
    with twin.reader(gateway.url, "nope") as reader, pytest.raises(GatewayError) as refused:
        next(iter(reader))
    assert (refused.value.status, refused.value.code) == (404, "stream_not_found")
    assert "nope" in refused.value.message
    with (
        twin.reader(gateway.url, orders, after="c1.!!") as reader,
        pytest.raises(GatewayError, match="bad_cursor"),
    ):
        next(iter(reader))


def test_a_reader_catches_up_then_follows(
    twin: Twin, engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    append(engine, orders, 12)
    items: list[Item] = []
    with twin.reader(gateway.url, orders, page_limit=5, heartbeat=1, reconnect=QUICK) as reader:
        for item in reader:
            items.append(item)
            if len(items) == 12:
                assert reader.up_to_date or reader.mode == "pages"
                append(engine, orders, 6, 12)
            if len(items) == 18:
                break
        cursor = reader.cursor
    assert_exactly_once(items, 18)
    rest, _ = read_to_end(twin, gateway.url, orders, after=cursor)
    assert rest == []


def test_a_reader_of_some_fields_reads_every_event_once_with_those(
    twin: Twin, engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    """Pages, then live frames: each event has its stream, its place and the fields
    asked for, and None for the others."""
    append(engine, orders, 20)
    reader = twin.reader(
        gateway.url, orders, fields=["data"], page_limit=7, heartbeat=1, reconnect=QUICK
    )
    with collecting(reader) as collector:
        collector.wait(lambda: len(collector.events()) == 20, "the catch-up")
        collector.wait(lambda: reader.mode == "sse", "the reader to go live")
        append(engine, orders, 10, start=20)
        collector.wait(lambda: len(collector.events()) >= 30, "the live events")
    assert_exactly_once(collector.items, 30)
    for event in collector.events():
        assert event.stream == orders and event.data is not None
        assert (event.id, event.key, event.type, event.metadata, event.recorded_at) == ((None,) * 5)
    keys, _ = read_to_end(twin, gateway.url, orders, fields=["key"])
    assert [item.key for item in keys if isinstance(item, Event)] == [
        event.key for event in read_to_end(twin, gateway.url, orders)[0] if isinstance(event, Event)
    ]
    assert all(item.data is None for item in keys if isinstance(item, Event))


def test_a_reader_catches_up_in_pages_of_a_thousand_events(
    twin: Twin, engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """Not of the gateway's default 100: a catch-up of small events took twice as long."""
    append(engine, orders, 1500)
    with GatewayProcess(cli_env, "--access-log", tmp=tmp_path) as gateway:
        items, _ = read_to_end(twin, gateway.url, orders)
        assert_exactly_once(items, 1500)
        wait_for(lambda: "/events?" in gateway.output(), "the access log lines")
        pulls = [line for line in gateway.output().splitlines() if "/events?" in line]
    assert len(pulls) == 2 and all("limit=1000" in line for line in pulls), pulls


@contextmanager
def watching_gateway(dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The gateway application under uvicorn in a thread of this process, whose engine
    has a watch-signing secret (serve's engine has none yet), so that watches work."""

    async def signing_secret(self: AsyncEngine, purpose: str) -> bytes:
        return b"a test secret for " + purpose.encode()

    monkeypatch.setattr(AsyncEngine, "signing_secret", signing_secret, raising=False)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            lambda: create_app(GatewayConfig(heartbeat=1), dsn=dsn),
            factory=True,
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, "the gateway in a thread", timeout=TIMEOUT)
        yield f"http://127.0.0.1:{port}"
    finally:
        close_all_streams()
        server.should_exit = True
        thread.join(TIMEOUT)


def test_a_watch_reads_several_streams_once_and_resumes_by_its_cursor(
    twin: Twin, engine: subengine.Engine, orders: str, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.create_stream("payments", 2)

    def pay(start: int, count: int) -> None:
        engine.append(
            "payments",
            [
                subengine.NewEvent(f"p{n}", "paid" if n % 2 else "refunded", {"n": n})
                for n in range(start, start + count)
            ],
        )

    append(engine, orders, 10)
    pay(0, 10)
    streams = {
        "orders": StreamOptions(after="beginning"),
        "payments": StreamOptions(after="beginning", types=["paid"], fields=["data"]),
    }
    with watching_gateway(dsn, monkeypatch) as url:
        reader = twin.watch(url, streams, heartbeat=1, reconnect=QUICK)
        with collecting(reader) as collector:
            collector.wait(lambda: len(collector.events()) == 15, "the catch-up")
            append(engine, orders, 5, start=10)
            pay(10, 4)
            collector.wait(lambda: len(collector.events()) == 22, "the live events")
        by_stream = {
            name: [event for event in collector.events() if event.stream == name]
            for name in ("orders", "payments")
        }
        assert_exactly_once(list(by_stream["orders"]), 15)
        assert sorted(numbers(by_stream["payments"])) == [1, 3, 5, 7, 9, 11, 13]
        assert all(event.id is None for event in by_stream["payments"])  # its fields
        assert all(event.id is not None for event in by_stream["orders"])
        cursor = collector.cursors[-1]
        assert cursor is not None
        pay(14, 2)
        resumed = twin.watch(url, streams, after=cursor, heartbeat=1, reconnect=QUICK)
        with collecting(resumed) as again:
            again.wait(lambda: len(again.events()) == 1, "the event after the cursor")
        assert numbers(again.items) == [15]


def test_a_reader_since_a_time_reads_what_came_after_it_not_at_it(
    twin: Twin, engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    append(engine, orders, 6)
    # a reader passes the time of the last event it has
    had = engine.read_since(orders, datetime(2000, 1, 1, tzinfo=UTC))[-1]
    assert isinstance(had, subengine.Event)
    append(engine, orders, 4, start=6)
    items, _ = read_to_end(twin, gateway.url, orders, since=had.recorded_at)
    assert sorted(numbers(items)) == [6, 7, 8, 9]
    page = web.get(
        f"{gateway.url}/v1/streams/{orders}/events",
        params={"since": had.recorded_at.isoformat()},
        timeout=TIMEOUT,
    ).json()
    assert sorted(e["data"]["n"] for e in page["events"]) == [6, 7, 8, 9]
