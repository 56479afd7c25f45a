"""The P3Sub subscriber (`subengine.client.Subscriber`, docs/webhooks.md) against a real
`subengine serve` that delivers to it, served by uvicorn in this process: pushes bring
every event once and in order; behind a proxy that loses 30% of the deliveries, its
pulls fill what the pushes missed and it subscribes again under a new id; a new
subscriber resumes from the cursor the last one handed out."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import web
from helpers import GatewayProcess, LossyProxy, free_port, serving, wait_for

import subengine
from subengine import NewEvent
from subengine.client import Event, Subscriber
from subengine.gateway import GatewayCursor

TIMEOUT = 60.0


def append(engine: subengine.Engine, count: int) -> list[uuid.UUID]:
    stored = engine.append("orders", [NewEvent(f"k{n % 7}", "T", {"n": n}) for n in range(count)])
    return [appended.id for appended in stored]


def collect(subscriber: Subscriber, count: int) -> list[Event]:
    """The next `count` events of the subscriber's queue (nothing else may come)."""
    taken: list[Event] = []
    deadline = time.monotonic() + TIMEOUT
    while len(taken) < count:
        item = subscriber.get(timeout=max(0.0, deadline - time.monotonic()))
        assert item is not None, f"only {len(taken)} of {count} events came"
        assert isinstance(item, Event), item
        taken.append(item)
    return taken


def assert_once_in_order(
    events: Sequence[Event], appended: Sequence[uuid.UUID], before: dict[int, int]
) -> None:
    """`events` are the `appended` ones, each once, each partition's in position order
    right after its head `before`."""
    assert sorted(str(e.id) for e in events) == sorted(str(i) for i in appended)
    for partition in {e.partition for e in events}:
        positions = [e.position for e in events if e.partition == partition]
        start = before.get(partition, 0) + 1
        assert positions == list(range(start, start + len(positions))), partition


def heads_of(cursor: str | None) -> dict[int, int]:
    return dict(enumerate(GatewayCursor.decode(cursor).streams["orders"].positions))


def webhook_state(gateway: GatewayProcess, webhook_id: str) -> str | None:
    answer = web.get(f"{gateway.url}/v1/webhooks/{webhook_id}", timeout=TIMEOUT)
    return str(answer.json()["state"]) if answer.status_code == 200 else None


@contextmanager
def subscribed(
    gateway: GatewayProcess, *, lossy: float = 0.0, **options: Any
) -> Iterator[Subscriber]:
    """A started Subscriber of `orders`, served by uvicorn, its callback reached directly
    or (with `lossy`) through a LossyProxy losing that share of the deliveries."""
    port = free_port()
    with serving_callback(port, lossy) as callback:
        subscriber = Subscriber(gateway.url, callback, ["orders"], **options)
        with serving(subscriber, port), subscriber:
            yield subscriber


@contextmanager
def serving_callback(port: int, lossy: float) -> Iterator[str]:
    if not lossy:
        yield f"http://127.0.0.1:{port}/hook"
        return
    proxy = LossyProxy(f"http://127.0.0.1:{port}", lossy, seed=15)
    try:
        yield proxy.url
        assert proxy.lost > 0
    finally:
        proxy.close()


def test_pushes_bring_every_event_once_in_order(
    engine: subengine.Engine, orders: str, delivering_gateway: GatewayProcess
) -> None:
    append(engine, 5)  # before the subscriber: not for it ("now")
    before = engine.heads("orders")
    with subscribed(delivering_gateway, pull_after=600) as subscriber:
        first = subscriber.subscription_id
        wait_for(lambda: webhook_state(delivering_gateway, first) == "active", "the consent")
        appended = append(engine, 60)
        events = collect(subscriber, 60)
        assert_once_in_order(events, appended, before)
        assert heads_of(subscriber.cursor) == engine.heads("orders")
        assert subscriber.resubscriptions == 0 and subscriber.subscription_id == first
        # pushed, not pulled (the gateway counts a delivery once it is answered)
        wait_for(lambda: engine.webhook(first).delivered == 60, "the deliveries counted")
    assert webhook_state(delivering_gateway, first) is None  # closing cancelled it


def test_behind_a_proxy_losing_30_percent_every_event_comes_once_in_order_under_a_new_id(
    engine: subengine.Engine, orders: str, delivering_gateway: GatewayProcess
) -> None:
    before = engine.heads("orders")
    appended: list[uuid.UUID] = []

    def append_in_bursts() -> None:
        for _ in range(8):
            appended.extend(append(engine, 25))
            time.sleep(1.0)  # quiet for longer than pull_after

    with subscribed(delivering_gateway, lossy=0.3, pull_after=0.3) as subscriber:
        first = subscriber.subscription_id
        appending = threading.Thread(target=append_in_bursts)
        appending.start()
        events = collect(subscriber, 200)
        appending.join()
        assert_once_in_order(events, appended, before)
        assert subscriber.get(timeout=1.0) is None  # nothing more, in particular no repeat
        assert heads_of(subscriber.cursor) == engine.heads("orders")
        assert subscriber.resubscriptions >= 1 and subscriber.subscription_id != first
        # the old subscriptions are gone; the last one is taken up
        current = subscriber.subscription_id
        wait_for(lambda: webhook_state(delivering_gateway, current) == "active", "the consent")
        assert [hook.id for hook in engine.webhooks()] == [current]


def test_a_new_subscriber_resumes_from_the_cursor_the_last_one_handed_out(
    engine: subengine.Engine, orders: str, delivering_gateway: GatewayProcess
) -> None:
    before = engine.heads("orders")
    appended = append(engine, 30)
    with subscribed(delivering_gateway, start="beginning", pull_after=600) as subscriber:
        events = collect(subscriber, 12)
        stored = subscriber.cursor  # as the application stores it with its effects
    assert engine.webhooks() == []
    appended += append(engine, 10)
    with subscribed(delivering_gateway, cursor=stored, pull_after=600) as subscriber:
        events += collect(subscriber, 28)
        assert subscriber.get(timeout=1.0) is None
    assert_once_in_order(events, appended, before)


def test_a_subscriber_since_a_time_gets_what_came_after_it_not_at_it(
    engine: subengine.Engine, orders: str, delivering_gateway: GatewayProcess
) -> None:
    # P3Sub's T0: the time of the last event the subscriber has
    append(engine, 5)
    last_had = engine.read_since("orders", datetime(2000, 1, 1, tzinfo=UTC))[-1]
    assert isinstance(last_had, subengine.Event)
    before = engine.heads("orders")
    appended = append(engine, 20)
    with subscribed(delivering_gateway, since=last_had.recorded_at, pull_after=600) as subscriber:
        assert_once_in_order(collect(subscriber, 20), appended, before)
        assert subscriber.get(timeout=1.0) is None  # none of those it had
