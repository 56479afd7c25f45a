"""The webhook subscriber without a server (subengine/client/_webhooks.py): deliveries
signed as the gateway signs them go to `receive`; its pulls and PUTs go to a stand-in
for the gateway's HTTP API of one stream, `orders`, of two partitions."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from helpers import wait_for
from standardwebhooks import Webhook

from subengine.client import Event, Item, Reset, StreamOptions, Subscriber, Tombstone
from subengine.gateway import GatewayCursor, StreamPosition

SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
TIME = "2026-11-23T18:00:00+00:00"


def cursor(*positions: int, epoch: int = 1) -> str:
    return GatewayCursor({"orders": StreamPosition(epoch, positions)}).encode()


def positions(text: str | None) -> tuple[int, ...]:
    return GatewayCursor.decode(text).streams["orders"].positions


def event(partition: int, position: int, kind: str = "placed") -> dict[str, Any]:
    return {
        "stream": "orders",
        "partition": partition,
        "position": position,
        "id": str(uuid.UUID(int=partition << 32 | position)),
        "key": f"order-{position}",
        "key_version": 1,
        "type": kind,
        "metadata": {},
        "occurred_at": TIME,
        "recorded_at": TIME,
        "data": {"n": position},
    }


class Gateway:
    """The parts of the gateway a subscriber calls, over one stream `orders` (epoch 1,
    two partitions): its description, its pages (with `type` filters), and PUT and
    DELETE of webhooks, which it records."""

    def __init__(self) -> None:
        self.stored: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        self.puts: list[tuple[str, dict[str, Any]]] = []
        self.deletes: list[str] = []
        self.pulls = 0
        self.unavailable = False
        self.lock = threading.Lock()

    def append(self, partition: int, *kinds: str) -> None:
        events = self.stored[partition]
        events += [event(partition, len(events) + n, kind) for n, kind in enumerate(kinds, 1)]

    def heads(self) -> tuple[int, ...]:
        return tuple(len(self.stored[partition]) for partition in (0, 1))

    def handle(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            return self._handle(request)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        subscription = path.rsplit("/", 1)[1]
        if request.method == "PUT":
            body = json.loads(request.content)  # a `replaces` that is gone is no error
            self.puts.append((subscription, body))
            return httpx.Response(202, json={})
        if request.method == "DELETE":
            self.deletes.append(subscription)
            return httpx.Response(204)
        if path == "/v1/streams/orders":
            return httpx.Response(200, json={"epoch": 1, "cursor": cursor(*self.heads())})
        self.pulls += 1
        if self.unavailable:
            return httpx.Response(503, json={"error": {"code": "unavailable", "message": "x"}})
        return httpx.Response(200, json=self._page(request.url.params))

    def _page(self, params: httpx.QueryParams) -> dict[str, Any]:
        at = list(positions(params["after"]) or (0, 0))
        limit, kinds = int(params["limit"]), params.get_list("type")
        found: list[dict[str, Any]] = []
        for partition in (0, 1):
            for stored in self.stored[partition][at[partition] :]:
                if len(found) == limit:
                    break
                if not kinds or stored["type"] in kinds:
                    found.append(stored)
                at[partition] = stored["position"]
        return {
            "events": found,
            "tombstones": [],
            "resets": [],
            "cursor": cursor(*at),
            "up_to_date": tuple(at) == self.heads(),
        }


@pytest.fixture
def gateway() -> Gateway:
    return Gateway()


def subscriber(gateway: Gateway, streams: Any = ("orders",), **options: Any) -> Subscriber:
    settings: dict[str, Any] = {"cursor": cursor(0, 0), "secret": SECRET, "pull_after": 3600.0}
    return Subscriber(
        "http://gateway",
        "http://app/hooks",
        streams,
        client=httpx.Client(transport=httpx.MockTransport(gateway.handle)),
        **{**settings, **options},
    )


@pytest.fixture
def sub(gateway: Gateway) -> Iterator[Subscriber]:
    with subscriber(gateway) as started:
        yield started


def signed(
    body: dict[str, Any],
    *,
    secret: str = SECRET,
    webhook_id: str | None = None,
    at: datetime | None = None,
) -> tuple[bytes, dict[str, str]]:
    raw = json.dumps(body).encode()
    webhook_id = webhook_id or f"msg_{uuid.uuid4().hex}"
    at = at or datetime.now(UTC)
    return raw, {
        "Content-Type": "application/json",
        "Webhook-Id": webhook_id,
        "Webhook-Timestamp": str(int(at.timestamp())),
        "Webhook-Signature": Webhook(secret).sign(webhook_id, at, raw.decode()),
    }


def batch(
    sub: Subscriber,
    partition: int,
    after: int,
    through: int,
    *numbers: int,
    subscription: str | None = None,
) -> dict[str, Any]:
    """A delivery of the events `numbers` of a partition, covering after+1..through."""
    return {
        "type": "events",
        "subscription": subscription or sub.subscription_id,
        "generation": 1,
        "stream": "orders",
        "partition": partition,
        "after": after,
        "through": through,
        "events": [event(partition, number) for number in numbers],
        "tombstones": [],
        "cursor": cursor(through, 0) if partition == 0 else cursor(0, through),
    }


def push(sub: Subscriber, body: dict[str, Any], **signing: Any) -> int:
    status, _ = sub.receive(*signed(body, **signing))
    return status


def taken(sub: Subscriber) -> list[tuple[int, int]]:
    """(partition, position) of every item waiting in the queue, taking them."""
    items: list[Item] = []
    while (item := sub.get(timeout=0)) is not None:
        items.append(item)
    return [(item.partition, item.position) for item in items if not isinstance(item, Reset)]


def test_batches_that_follow_each_other_are_queued_in_order(sub: Subscriber) -> None:
    assert push(sub, batch(sub, 0, 0, 2, 1, 2)) == 200
    assert push(sub, batch(sub, 1, 0, 1, 1)) == 200
    assert push(sub, batch(sub, 0, 2, 3, 3)) == 200
    assert taken(sub) == [(0, 1), (0, 2), (1, 1), (0, 3)]
    assert positions(sub.cursor) == (3, 1)


def test_the_cursor_after_each_item_resumes_right_after_it(sub: Subscriber) -> None:
    # positions 3, 4 and 6 were passed over by a filter
    push(sub, batch(sub, 0, 0, 6, 2, 5))
    assert isinstance(sub.get(timeout=0), Event)
    assert positions(sub.cursor) == (2, 0)
    assert isinstance(sub.get(timeout=0), Event)
    assert positions(sub.cursor) == (6, 0)


def test_a_repeated_delivery_is_answered_200_and_queued_once(sub: Subscriber) -> None:
    body, headers = signed(batch(sub, 0, 0, 2, 1, 2), webhook_id="msg_1")
    assert sub.receive(body, headers) == (200, b"")
    assert sub.receive(body, headers) == (200, b"")
    # the same id is known by itself, whatever it carries
    assert push(sub, batch(sub, 0, 2, 3, 3), webhook_id="msg_1") == 200
    assert taken(sub) == [(0, 1), (0, 2)]


def test_a_delivery_signed_with_another_secret_is_refused(sub: Subscriber) -> None:
    other = "whsec_" + "C2FVsBQIhrscChlQIMV+b5sSYspob7oD"
    assert push(sub, batch(sub, 0, 0, 1, 1), secret=other) == 401
    assert taken(sub) == []


@pytest.mark.parametrize("age", [timedelta(minutes=10), timedelta(minutes=-10)])
def test_a_timestamp_too_far_from_now_is_refused(sub: Subscriber, age: timedelta) -> None:
    assert push(sub, batch(sub, 0, 0, 1, 1), at=datetime.now(UTC) - age) == 401
    assert taken(sub) == []


@pytest.mark.parametrize(
    "header,value",
    [
        ("Webhook-Signature", "garbage"),
        ("Webhook-Signature", "v1,"),
        ("Webhook-Signature", "v1,not base64!"),
        ("Webhook-Signature", "v1,é"),
        ("Webhook-Signature", ""),
        ("Webhook-Timestamp", "yesterday"),
        ("Webhook-Timestamp", "1e9"),
        ("Webhook-Id", ""),
    ],
)
def test_a_malformed_signature_header_is_refused(sub: Subscriber, header: str, value: str) -> None:
    body, headers = signed(batch(sub, 0, 0, 1, 1))
    assert sub.receive(body, {**headers, header: value})[0] == 401


def test_a_body_that_is_not_utf8_is_refused(sub: Subscriber) -> None:
    body, headers = signed(batch(sub, 0, 0, 1, 1))
    assert sub.receive(body + b"\xff", headers)[0] == 401


def test_a_batch_is_not_queued_before_its_predecessor(gateway: Gateway, sub: Subscriber) -> None:
    gateway.unavailable = True  # the pull that would fill the gap fails
    assert push(sub, batch(sub, 0, 2, 3, 3)) == 503
    assert taken(sub) == []
    assert push(sub, batch(sub, 0, 0, 2, 1, 2)) == 200
    assert push(sub, batch(sub, 0, 2, 3, 3)) == 200  # the gateway's retry
    assert taken(sub) == [(0, 1), (0, 2), (0, 3)]


def test_a_batch_that_overlaps_the_queue_adds_only_its_new_part(sub: Subscriber) -> None:
    push(sub, batch(sub, 0, 0, 2, 1, 2))
    assert push(sub, batch(sub, 0, 1, 4, 2, 3, 4)) == 200
    assert push(sub, batch(sub, 0, 0, 1, 1)) == 200
    assert taken(sub) == [(0, 1), (0, 2), (0, 3), (0, 4)]


def test_a_tombstone_batch_is_queued_when_it_follows(sub: Subscriber) -> None:
    gone = batch(sub, 0, 0, 4)
    gone["tombstones"] = [
        {
            "stream": "orders",
            "partition": 0,
            "gap_from": 1,
            "gap_to": 4,
            "floor": 5,
            "reason": "retention",
        }
    ]
    assert push(sub, gone) == 200
    assert push(sub, batch(sub, 0, 4, 5, 5)) == 200
    tombstone, after = sub.get(timeout=0), sub.get(timeout=0)
    assert isinstance(tombstone, Tombstone) and (tombstone.gap_from, tombstone.gap_to) == (1, 4)
    assert isinstance(after, Event) and after.position == 5


def test_a_challenge_is_answered_for_the_current_subscription_only(sub: Subscriber) -> None:
    challenge = {"type": "challenge", "challenge": "abc-123", "lease_seconds": 60}
    current = sub.receive(*signed({**challenge, "subscription": sub.subscription_id}))
    assert current == (200, b'{"challenge": "abc-123"}')
    assert sub.receive(*signed({**challenge, "subscription": "sub-other"}))[0] == 410


def test_a_delivery_of_a_subscription_left_with_another_secret_is_answered_410(
    sub: Subscriber,
) -> None:
    old = "whsec_" + "C2FVsBQIhrscChlQIMV+b5sSYspob7oD"
    assert push(sub, batch(sub, 0, 0, 1, 1, subscription="sub-before"), secret=old) == 410


def test_a_gap_in_pushes_is_pulled_and_the_subscription_replaced(
    gateway: Gateway, sub: Subscriber
) -> None:
    gateway.append(0, "placed", "placed", "placed", "placed", "placed")
    old = sub.subscription_id
    # the pushes of positions 1 to 3 never came
    assert push(sub, batch(sub, 0, 3, 5, 4, 5, subscription=old)) == 200
    assert taken(sub) == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5)]
    assert sub.resubscriptions == 1 and sub.subscription_id != old
    replacing, definition = gateway.puts[-1]
    assert replacing == sub.subscription_id and definition["replaces"] == old
    assert positions(definition["start"]["after"]) == (5, 0)
    # the old subscription is refused from now on, the new one taken
    assert push(sub, batch(sub, 0, 5, 6, 6, subscription=old)) == 410
    assert push(sub, batch(sub, 0, 5, 6, 6)) == 200
    assert taken(sub) == [(0, 6)]


def test_a_gap_left_by_a_filter_is_bridged_without_a_new_subscription(
    gateway: Gateway,
) -> None:
    gateway.append(0, "paid", "paid", "paid", "placed")
    streams = {"orders": StreamOptions(types=["placed"])}
    with subscriber(gateway, streams=streams) as sub:
        assert gateway.puts[0][1]["streams"] == {"orders": {"type": ["placed"]}}
        # positions 1 to 3 were filtered out: no batch covered them
        assert push(sub, batch(sub, 0, 3, 4, 4)) == 200
        assert taken(sub) == [(0, 4)]
        assert sub.resubscriptions == 0


def test_a_full_queue_asks_the_gateway_to_retry(gateway: Gateway) -> None:
    with subscriber(gateway, max_queued=1) as sub:
        assert push(sub, batch(sub, 0, 0, 1, 1)) == 200
        assert push(sub, batch(sub, 0, 1, 2, 2)) == 503
        assert taken(sub) == [(0, 1)]
        assert push(sub, batch(sub, 0, 1, 2, 2)) == 200


def test_pushes_it_refused_itself_make_the_timer_pull_but_not_subscribe_again(
    gateway: Gateway,
) -> None:
    gateway.append(0, "placed", "placed")
    with subscriber(gateway, max_queued=1, pull_after=0.3) as sub:
        assert push(sub, batch(sub, 0, 0, 1, 1)) == 200
        assert push(sub, batch(sub, 0, 1, 2, 2)) == 503  # the queue is full
        assert taken(sub) == [(0, 1)]
        # the gateway waits before it pushes position 2 again; the timer pulls it first
        second = sub.get(timeout=5)
        assert isinstance(second, Event) and second.position == 2
        assert sub.resubscriptions == 0 and len(gateway.puts) == 1


def test_when_pushes_stop_the_timer_pulls_and_subscribes_again(gateway: Gateway) -> None:
    gateway.append(1, "placed", "placed")
    with subscriber(gateway, pull_after=0.1) as sub:
        old = sub.subscription_id
        first, second = sub.get(timeout=5), sub.get(timeout=5)
        assert isinstance(first, Event) and isinstance(second, Event)
        assert (first.partition, first.position, second.position) == (1, 1, 2)
        assert sub.resubscriptions == 1
        wait_for(lambda: len(gateway.puts) == 2, "the new subscription", timeout=5)
        assert gateway.puts[-1][1]["replaces"] == old


def test_a_pull_that_finds_nothing_keeps_the_subscription(gateway: Gateway) -> None:
    with subscriber(gateway, pull_after=0.05) as sub:
        threading.Event().wait(0.3)
        assert gateway.pulls >= 2
        assert sub.resubscriptions == 0 and len(gateway.puts) == 1


def test_starting_now_subscribes_from_the_heads(gateway: Gateway) -> None:
    gateway.append(0, "placed", "placed")
    with subscriber(gateway, cursor=None, start="now", secret=None) as sub:
        assert positions(sub.cursor) == (2, 0)
        subscription, definition = gateway.puts[0]
        assert subscription == sub.subscription_id
        assert definition["start"] == {"after": sub.cursor}
        assert definition["secret"].startswith("whsec_")
        challenge = {"type": "challenge", "subscription": subscription, "challenge": "c"}
        assert sub.receive(*signed(challenge, secret=definition["secret"]))[0] == 200
        assert definition["callback"] == "http://app/hooks"
        assert definition["streams"] == {"orders": {}}


def test_close_cancels_the_subscription_and_ends_the_queue(gateway: Gateway) -> None:
    sub = subscriber(gateway)
    sub.start()
    subscription = sub.subscription_id
    sub.close()
    assert gateway.deletes == [subscription]
    assert sub.get() is None
    assert push(sub, batch(sub, 0, 0, 1, 1)) == 410


def test_the_asgi_app_answers_deliveries(sub: Subscriber) -> None:
    async def post(body: bytes, headers: dict[str, str]) -> httpx.Response:
        transport = httpx.ASGITransport(app=sub)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post("/hooks", content=body, headers=headers)

    challenge = {"type": "challenge", "subscription": sub.subscription_id, "challenge": "c"}
    answer = asyncio.run(post(*signed(challenge)))
    assert answer.status_code == 200 and answer.json() == {"challenge": "c"}
    assert asyncio.run(post(*signed(batch(sub, 0, 0, 1, 1)))).status_code == 200
    assert taken(sub) == [(0, 1)]
    too_large = b" " * (4 * 1024 * 1024 + 1)
    assert asyncio.run(post(too_large, {})).status_code == 413


def test_a_new_subscription_replacing_one_already_gone_is_made_all_the_same(
    gateway: Gateway, sub: Subscriber
) -> None:
    gateway.append(0, "placed", "placed")
    old = sub.subscription_id
    gateway.deletes.append(old)  # the gateway deleted it (a 410, an expired lease)
    assert push(sub, batch(sub, 0, 1, 2, 2, subscription=old)) == 200
    assert taken(sub) == [(0, 1), (0, 2)]
    # the gateway takes a `replaces` that is gone as done (test_webhooks.py checks it)
    subscription, definition = gateway.puts[-1]
    assert subscription == sub.subscription_id != old and definition["replaces"] == old


def test_a_batch_of_another_stream_is_refused(sub: Subscriber) -> None:
    elsewhere = GatewayCursor({"payments": StreamPosition(1, (1,))}).encode()
    other = {**batch(sub, 0, 0, 1), "stream": "payments", "cursor": elsewhere}
    assert push(sub, other) == 400


def test_a_subscriber_refuses_fields_its_webhooks_cannot_carry(gateway: Gateway) -> None:
    """A webhook's events carry every field, or all but data (`include_data`)."""
    with pytest.raises(ValueError, match=r"not StreamOptions\.fields"):
        subscriber(gateway, {"orders": StreamOptions(fields=["data"])})
