"""Pages bounded in bytes (docs/gateway.md, "Reading events"): a page, a long-poll reply and
a catch-up frame of the event stream hold at most about 1 MiB of events, but for a single
larger event, which comes alone; read page after page, every event comes once, in order."""

from __future__ import annotations

import json
from typing import Any

import httpx
import web
from helpers import GatewayProcess, sse_frames

import subengine
from subengine.gateway._reading import PAGE_BYTES

TIMEOUT = httpx.Timeout(30.0)
BIG = 300_000  # characters of data per event: 3 to a page
HUGE = PAGE_BYTES - 100  # with the rest of its JSON, one event larger than a page


def fill(engine: subengine.Engine) -> list[int]:
    """Large events in 2 partitions, one of them larger than a page; their numbers."""
    engine.create_stream("big", partitions=2)
    sizes = [BIG] * 5 + [HUGE] + [BIG] * 4 + [10] * 3
    for n, size in enumerate(sizes):
        engine.append("big", [subengine.NewEvent(f"k{n % 2}", "t", {"n": n, "pad": "x" * size})])
    return list(range(len(sizes)))


def events_bytes(body: bytes) -> int:
    """The bytes of a page's events: its text between `"events":[` and `],"tombstones"`."""
    start = body.index(b'{"events":[') + len(b'{"events":[')
    return body.rindex(b'],"tombstones":') - start


def in_order(events: list[dict[str, Any]]) -> None:
    by_partition: dict[int, list[int]] = {}
    for event in events:
        by_partition.setdefault(event["partition"], []).append(event["position"])
    for positions in by_partition.values():
        assert positions == list(range(1, len(positions) + 1))


def test_pages_stay_within_a_mebibyte_and_read_every_event_once(
    gateway: GatewayProcess, engine: subengine.Engine
) -> None:
    numbers = fill(engine)
    url = f"{gateway.url}/v1/streams/big/events"
    cursor = "beginning"
    events: list[dict[str, Any]] = []
    pages: list[tuple[int, list[int]]] = []  # the bytes and the numbers of each page
    for _ in range(len(numbers) + 2):
        answer = web.get(url, params={"after": cursor, "limit": 1000}, timeout=TIMEOUT)
        assert answer.status_code == 200, answer.text
        page = answer.json()
        pages.append((events_bytes(answer.content), [e["data"]["n"] for e in page["events"]]))
        events += page["events"]
        cursor = page["cursor"]
        if page["up_to_date"]:
            break
    assert sorted(e["data"]["n"] for e in events) == numbers  # each once
    in_order(events)
    shown = [(size, ns) for size, ns in pages]
    assert [ns for size, ns in pages if size > PAGE_BYTES] == [[5]], shown  # alone
    assert pages[0][1] == [0, 1, 2], shown  # as many as fit: pages are not cut short
    assert sum(len(ns) for _, ns in pages) == len(numbers)
    # a limit still holds under the bound
    answer = web.get(url, params={"limit": 2}, timeout=TIMEOUT)
    assert len(answer.json()["events"]) == 2


def test_a_long_poll_gathers_no_more_than_a_page(
    gateway: GatewayProcess, engine: subengine.Engine
) -> None:
    fill(engine)
    url = f"{gateway.url}/v1/streams/big/events"
    params = {"live": "long-poll", "wait": "5", "linger": "5", "limit": "1000"}
    answer = web.get(url, params=params, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    assert 2 <= len(answer.json()["events"]) and events_bytes(answer.content) <= PAGE_BYTES


def test_catch_up_frames_stay_within_a_page(
    gateway: GatewayProcess, engine: subengine.Engine
) -> None:
    numbers = fill(engine)
    url = f"{gateway.url}/v1/streams/big/events"
    events: list[dict[str, Any]] = []
    with web.stream("GET", url, params={"live": "sse"}, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        for frame in sse_frames(response.iter_lines()):
            if frame.kind == "caught-up":
                break
            if frame.kind == "events":
                data = frame.data
                size = len(",".join(json.dumps(e) for e in data["events"]).encode())
                assert len(data["events"]) == 1 or size <= PAGE_BYTES
                events += data["events"]
    assert sorted(e["data"]["n"] for e in events) == numbers
    in_order(events)
