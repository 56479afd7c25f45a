"""Reads that carry only the fields they ask for (`fields=`, docs/gateway.md): pages,
long-polls, SSE frames (made by PostgreSQL while catching up, by the hub when live) and
watches, against a real `subengine serve` over real HTTP. Every event keeps its place,
the same events come as in a read of every field, and bad input is refused."""

from __future__ import annotations

import base64
import json
import threading
import time
from typing import Any

import httpx
import pytest
import web
from helpers import GatewayProcess, SseFrame, sse_frames

import subengine

TIMEOUT = httpx.Timeout(30.0)


def append(engine: subengine.Engine, stream: str, count: int, start: int = 0) -> None:
    engine.append(
        stream,
        [
            subengine.NewEvent(f"k{n % 7}", f"t{n % 2}", {"n": n})
            for n in range(start, start + count)
        ],
    )


def pull_all(url: str, **params: Any) -> list[Any]:
    events: list[Any] = []
    cursor = "beginning"
    for _ in range(100):
        answer = web.get(url, params={**params, "after": cursor, "limit": 4}, timeout=TIMEOUT)
        assert answer.status_code == 200, answer.text
        page = answer.json()
        events += page["events"]
        cursor = page["cursor"]
        if page["up_to_date"]:
            return events
    raise AssertionError("never up to date")


def places(events: list[Any]) -> list[tuple[int, int]]:
    return [(e["partition"], e["position"]) for e in events]


def test_a_page_carries_the_fields_asked_for_and_the_same_events(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    append(engine, orders, 30)
    url = f"{gateway.url}/v1/streams/orders/events"
    every = pull_all(url)
    assert list(every[0]) == [
        "stream",
        "partition",
        "position",
        "id",
        "key",
        "key_version",
        "type",
        "metadata",
        "occurred_at",
        "recorded_at",
        "data",
    ]
    lean = pull_all(url, fields="data")
    assert places(lean) == places(every)
    assert [e for e in lean] == [
        {"partition": e["partition"], "position": e["position"], "data": e["data"]} for e in every
    ]
    # repeated, or with commas, in any order: the events' own order of fields
    some = pull_all(url, fields=["type,id", "key"])
    assert [list(e) for e in some] == [["partition", "position", "id", "key", "type"]] * 30
    # no field but the place (an empty name is none)
    assert pull_all(url, fields="") == [{"partition": p, "position": q} for p, q in places(every)]
    # with filters: what they keep, the fields asked for
    filtered = pull_all(url, fields="key", key="k3")
    assert [e["key"] for e in filtered] == ["k3"] * len([e for e in every if e["key"] == "k3"])


def test_a_long_poll_carries_the_fields_asked_for(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    url = f"{gateway.url}/v1/streams/orders/events"
    params = {"after": "now", "live": "long-poll", "wait": "0.2", "fields": "type,data"}
    empty = web.get(url, params=params, timeout=TIMEOUT)
    assert empty.status_code == 204
    answers: list[httpx.Response] = []
    polled = {**params, "after": empty.headers["Subengine-Cursor"], "wait": "30"}
    poll = threading.Thread(target=lambda: answers.append(web.get(url, params=polled)))
    poll.start()
    time.sleep(0.3)
    append(engine, orders, 1, start=1)  # woken: the hub's read, encoded by the gateway
    poll.join(30)
    assert answers and answers[0].status_code == 200, answers
    (event,) = answers[0].json()["events"]
    assert event == {
        "partition": event["partition"],
        "position": 1,
        "type": "t1",
        "data": {"n": 1},
    }


def frames_until(url: str, params: dict[str, str], count: int) -> list[SseFrame]:
    """The `events` frames of an event stream until they hold `count` events."""
    got: list[SseFrame] = []
    with web.stream("GET", url, params=params, timeout=TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        for frame in sse_frames(response.iter_lines()):
            if frame.kind == "events":
                got.append(frame)
            if sum(len(f.data["events"]) for f in got) >= count:
                return got
    raise AssertionError("the event stream ended")


def test_sse_readers_at_one_cursor_each_get_their_own_fields(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    """Catch-up frames (PostgreSQL's text) and live ones (the hub's, of one shared read
    for readers that stand at the same cursor) both carry what each reader asked for."""
    append(engine, orders, 8)
    url = f"{gateway.url}/v1/streams/orders/events"
    asks = {"every": None, "data": "data", "metadata": "stream,metadata", "place": ""}
    got: dict[str, list[SseFrame]] = {}

    def read(name: str, fields: str | None) -> None:
        params = {"live": "sse", "after": "beginning"}
        if fields is not None:
            params["fields"] = fields
        got[name] = frames_until(url, params, 16)

    readers = [threading.Thread(target=read, args=item) for item in asks.items()]
    for reader in readers:
        reader.start()
    time.sleep(1.0)  # all caught up: what follows is live
    for n in range(8, 16):
        append(engine, orders, 1, start=n)
    for reader in readers:
        reader.join(30)
    every = [e for frame in got["every"] for e in frame.data["events"]]
    assert sorted(e["data"]["n"] for e in every) == list(range(16))
    for name, fields in asks.items():
        events = [e for frame in got[name] for e in frame.data["events"]]
        assert sorted(places(events)) == sorted(places(every)), name
        if fields is None:
            continue
        wanted = {"partition", "position", *filter(None, fields.split(","))}
        by_place = {(e["partition"], e["position"]): e for e in every}
        for event in events:
            whole = by_place[event["partition"], event["position"]]
            assert event == {k: v for k, v in whole.items() if k in wanted}, name


def test_a_watch_carries_the_fields_each_stream_asks_for(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    engine.create_stream("payments", partitions=2)
    append(engine, orders, 3)
    append(engine, "payments", 3)
    body = {
        "streams": {
            "orders": {"after": "beginning", "fields": ["data"]},
            "payments": {"after": "beginning", "include_data": False},
        }
    }
    made = web.post(f"{gateway.url}/v1/watch", json=body, timeout=TIMEOUT)
    assert made.status_code == 201, made.text
    frames = frames_until(gateway.url + made.json()["url"], {}, 6)
    by_stream: dict[str, list[Any]] = {"orders": [], "payments": []}
    for frame in frames:
        by_stream[frame.data["stream"]] += frame.data["events"]
    assert all(list(e) == ["partition", "position", "data"] for e in by_stream["orders"])
    assert all("data" not in e and "id" in e for e in by_stream["payments"])
    assert len(by_stream["orders"]) == len(by_stream["payments"]) == 3
    # the id keeps each stream's entry as gateways before `fields` read it (name, keys,
    # types, include_data) and names the fields apart: such a gateway sends whole events
    body_text = made.json()["wid"].split(".")[1]
    payload = json.loads(base64.urlsafe_b64decode(body_text + "=" * (-len(body_text) % 4)))
    assert sorted(payload["s"]) == [["orders", None, None, True], ["payments", None, None, False]]
    assert payload["f"] == {"orders": "partition,position,data"}


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"fields": "data,colour"}, "'colour'"),
        ({"fields": "data", "include_data": "false"}, "not both"),
        ({"fields": " data"}, "' data'"),
    ],
)
def test_a_read_asking_for_unknown_fields_is_refused(
    orders: str, gateway: GatewayProcess, params: dict[str, str], named: str
) -> None:
    for live in ({}, {"live": "sse"}, {"live": "long-poll", "wait": "0"}):
        answer = web.get(
            f"{gateway.url}/v1/streams/orders/events", params={**params, **live}, timeout=TIMEOUT
        )
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "bad_request" and named in error["message"], error


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"fields": "data"}, "must be a list"),
        ({"fields": ["data", 3]}, "must be a list"),
        ({"fields": ["colour"]}, "'colour'"),
        ({"fields": ["data"], "include_data": True}, "not both"),
        ({"include_data": None}, "true or false"),
    ],
)
def test_a_watch_asking_for_unknown_fields_is_refused(
    orders: str, gateway: GatewayProcess, options: dict[str, Any], named: str
) -> None:
    body = {"streams": {"orders": options}}
    answer = web.post(f"{gateway.url}/v1/watch", json=body, timeout=TIMEOUT)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "bad_request" and named in error["message"], error
    assert "orders" in error["message"]


def test_a_page_of_small_events_holds_up_to_ten_thousand(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    """Pages end at 1 MiB of JSON or at `limit`, which goes to 10,000: a catch-up of
    small events takes few requests."""
    for start in range(0, 6000, 1000):
        append(engine, orders, 1000, start)
    url = f"{gateway.url}/v1/streams/orders/events"
    answer = web.get(url, params={"limit": 10_000, "fields": "data"}, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    page = answer.json()
    assert page["up_to_date"] and len(page["events"]) == 6000
    assert sorted(e["data"]["n"] for e in page["events"]) == list(range(6000))
    whole = web.get(url, params={"limit": 10_000}, timeout=TIMEOUT)  # ends at 1 MiB
    assert not whole.json()["up_to_date"] and len(whole.content) < (1 << 20) + 500
