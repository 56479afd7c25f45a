"""The gateway's `/metrics`, scraped from a real `subengine serve` process after real traffic.

Connections by kind, frames and bytes sent, long-polls waiting, the hub's shared reads (one
per notification however many clients watch), watcher lag and LISTEN reconnects.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import psycopg
import web
from helpers import GatewayProcess, SseFrame, scrape, sse_frames, value, wait_for

import subengine

TIMEOUT = httpx.Timeout(30.0)


def metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    found = value(scrape(gateway.port), name, **labels)
    assert found is not None, f"no sample {name} {labels}"
    return found


class Follower:
    """An SSE client of the stream 'orders' from now, in a thread, until `close()`."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self.url = f"{gateway.url}/v1/streams/orders/events"
        self.frames: list[SseFrame] = []
        self.received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        params = {"live": "sse", "after": "now"}
        with web.stream("GET", self.url, params=params, timeout=TIMEOUT) as response:
            assert response.status_code == 200

            def lines() -> Any:
                for line in response.iter_lines():
                    self.received += len(line.encode()) + 1
                    yield line

            for frame in sse_frames(lines()):
                self.frames.append(frame)
                if self._stop.is_set():
                    return

    def kinds(self) -> list[str]:
        return [frame.kind for frame in self.frames]

    def events(self) -> list[Any]:
        return [e for f in self.frames if f.kind == "events" for e in f.data["events"]]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_metrics_are_prometheus_text_not_cached(gateway: GatewayProcess) -> None:
    answer = web.get(f"{gateway.url}/metrics", timeout=TIMEOUT)
    assert answer.status_code == 200
    assert answer.headers["Cache-Control"] == "no-store"
    assert answer.headers["content-type"].startswith("text/plain")
    samples = scrape(gateway.port)
    for kind in ("pull", "long_poll", "sse", "watch"):
        assert value(samples, "subengine_gateway_connections", kind=kind) == 0
        assert value(samples, "subengine_gateway_bytes_sent_total", kind=kind) == 0
    for frame_type in ("events", "tombstone", "reset", "caught-up", "close", "heartbeat"):
        assert value(samples, "subengine_gateway_frames_sent_total", type=frame_type) == 0
    for name in (
        "subengine_gateway_long_polls_waiting",
        "subengine_gateway_hub_reads_total",
        "subengine_gateway_watchers",
        "subengine_gateway_watcher_lag_events_count",
    ):
        assert value(samples, name) == 0, name
    # the LISTEN connection opens as the gateway starts: API key changes arrive on it
    assert (value(samples, "subengine_gateway_listen_connects_total") or 0) <= 1


def test_open_connections_are_counted_by_kind_until_they_close(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    follower = Follower(gateway)
    polls: list[httpx.Response] = []
    poll = threading.Thread(
        target=lambda: polls.append(
            web.get(
                f"{gateway.url}/v1/streams/orders/events",
                params={"after": "now", "live": "long-poll", "wait": "30"},
                timeout=TIMEOUT,
            )
        )
    )
    poll.start()
    wait_for(
        lambda: (
            metric(gateway, "subengine_gateway_long_polls_waiting") == 1
            and metric(gateway, "subengine_gateway_watchers") == 2
        ),
        "both to wait",
        timeout=10,
    )
    samples = scrape(gateway.port)
    assert value(samples, "subengine_gateway_connections", kind="sse") == 1
    assert value(samples, "subengine_gateway_connections", kind="long_poll") == 1
    assert value(samples, "subengine_gateway_watchers") == 2
    engine.append("orders", [subengine.NewEvent("k", "T", {"n": 1})])
    poll.join(30)
    assert polls[0].status_code == 200
    wait_for(lambda: len(follower.events()) == 1, "the event on the stream", timeout=10)
    follower.close()
    wait_for(
        lambda: metric(gateway, "subengine_gateway_connections", kind="sse") == 0,
        "the stream's connection to end",
        timeout=10,
    )
    samples = scrape(gateway.port)
    assert value(samples, "subengine_gateway_connections", kind="long_poll") == 0
    assert value(samples, "subengine_gateway_long_polls_waiting") == 0
    assert value(samples, "subengine_gateway_watchers") == 0


def test_frames_and_bytes_sent_are_counted(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    page = web.get(f"{gateway.url}/v1/streams/orders/events", timeout=TIMEOUT)
    assert metric(gateway, "subengine_gateway_bytes_sent_total", kind="pull") == len(page.content)
    follower = Follower(gateway)
    wait_for(lambda: "caught-up" in follower.kinds(), "caught-up", timeout=10)
    engine.append("orders", [subengine.NewEvent("k", "T", {"n": n}) for n in range(3)])
    wait_for(lambda: len(follower.events()) == 3, "the events", timeout=10)
    wait_for(lambda: ":" in follower.kinds()[-1:], "a heartbeat", timeout=10)  # --heartbeat 1
    received = follower.received
    samples = scrape(gateway.port)
    follower.close()
    frames = follower.kinds()
    assert value(samples, "subengine_gateway_frames_sent_total", type="caught-up") == 1
    assert value(samples, "subengine_gateway_frames_sent_total", type="events") == frames.count(
        "events"
    )
    heartbeats = value(samples, "subengine_gateway_frames_sent_total", type="heartbeat")
    assert heartbeats is not None and heartbeats >= 1
    sent = value(samples, "subengine_gateway_bytes_sent_total", kind="sse")
    assert sent is not None and sent >= received > 0


def test_one_append_is_one_hub_read_however_many_watch(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    followers = [Follower(gateway) for _ in range(8)]
    wait_for(
        lambda: (
            all("caught-up" in f.kinds() for f in followers)
            and metric(gateway, "subengine_gateway_watchers") == 8
        ),
        "every stream to catch up",
        timeout=20,
    )
    time.sleep(1.5)  # the hub's first head poll has run
    before = scrape(gateway.port)
    engine.append("orders", [subengine.NewEvent("k", "T", {"n": 1})])
    wait_for(lambda: all(len(f.events()) == 1 for f in followers), "the event", timeout=10)
    after = scrape(gateway.port)
    for follower in followers:
        follower.close()

    def grew(name: str) -> float:
        return (value(after, name) or 0) - (value(before, name) or 0)

    assert grew("subengine_gateway_hub_reads_total") == 1
    # every stream woke one event behind the head
    assert grew("subengine_gateway_watcher_lag_events_count") == 8
    assert grew("subengine_gateway_watcher_lag_events_sum") == 8


def test_a_lost_listen_connection_shows_as_a_reconnect(
    orders: str, gateway: GatewayProcess, sql: psycopg.Connection[Any]
) -> None:
    follower = Follower(gateway)
    wait_for(lambda: "caught-up" in follower.kinds(), "caught-up", timeout=10)
    wait_for(
        lambda: metric(gateway, "subengine_gateway_listen_connects_total") >= 1,
        "the first LISTEN",
        timeout=10,
    )
    connects = metric(gateway, "subengine_gateway_listen_connects_total")
    killed = sql.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND query ILIKE 'LISTEN%%'"
        " AND pid <> pg_backend_pid()"
    ).fetchone()
    assert killed is not None and killed[0] == 1
    wait_for(
        lambda: metric(gateway, "subengine_gateway_listen_connects_total") > connects,
        "a reconnect",
        timeout=20,
    )
    follower.close()


def test_an_event_stream_woken_after_its_stream_was_created_again_gets_a_reset_first(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    """No notification says a stream was deleted and created again (the hub learns it at
    its next head poll): an event stream woken by the new stream's append must not take
    its events after the old cursor's position (it skipped them, then sent them again
    after the hub's resync)."""
    engine.append(orders, [subengine.NewEvent("a", "T", {"n": n}) for n in range(2)])
    follower = Follower(gateway)
    wait_for(lambda: "caught-up" in follower.kinds(), "caught-up", timeout=20)
    engine.delete_stream(orders)
    engine.create_stream(orders, partitions=4)
    engine.append(orders, [subengine.NewEvent("a", "T", {"n": n}) for n in (10, 11, 12)])
    wait_for(lambda: len(follower.events()) >= 3, "the new stream's events", timeout=20)
    time.sleep(2)  # the hub's head poll has run: nothing is sent twice after it either
    follower.close()
    kinds = follower.kinds()
    assert "reset" in kinds and kinds.index("reset") < kinds.index("events"), kinds
    assert [event["data"]["n"] for event in follower.events()] == [10, 11, 12]
