"""The gateway as outside subscribers meet it: a real `subengine serve` process over real HTTP.

Pull by cursor and by time, long-poll, SSE of one stream: every position exactly once,
resumable from every cursor it hands out, gaps as tombstones, a re-created stream as a
reset, and bad input answered with a JSON error that names it.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import Any

import httpx
import psycopg
import pytest
import web
from helpers import GatewayProcess, SseFrame, server_now, sse_frames, wait_for

import subengine

# one bound for every wait on the gateway in these tests
TIMEOUT = httpx.Timeout(30.0)


def append(engine: subengine.Engine, stream: str, count: int, start: int = 0) -> None:
    engine.append(
        stream,
        [subengine.NewEvent(f"k{n % 7}", "created", {"n": n}) for n in range(start, start + count)],
    )


def pull_all(url: str, after: str = "beginning", limit: int = 3) -> tuple[list[Any], str]:
    """Every event after `after`, page by page until up to date, and the last cursor."""
    events: list[Any] = []
    cursor = after
    for _ in range(1000):
        page = web.get(url, params={"after": cursor, "limit": limit}, timeout=TIMEOUT)
        assert page.status_code == 200, page.text
        body = page.json()
        assert page.headers["Subengine-Cursor"] == body["cursor"]
        assert page.headers["Cache-Control"] == "no-store"
        events += body["events"]
        cursor = body["cursor"]
        if body["up_to_date"]:
            return events, cursor
    raise AssertionError("never up to date")


def numbers(events: list[Any]) -> list[int]:
    return sorted(event["data"]["n"] for event in events)


def frames_until(
    url: str, stop: Any, headers: dict[str, str] | None = None, params: Any = None
) -> list[SseFrame]:
    """The frames of an event stream, until `stop(frames)` is true (then it disconnects)."""
    got: list[SseFrame] = []
    with web.stream("GET", url, headers=headers, params=params, timeout=TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for frame in sse_frames(response.iter_lines()):
            got.append(frame)
            if stop(got):
                break
    return got


def events_of(frames: list[SseFrame]) -> list[Any]:
    return [event for frame in frames if frame.kind == "events" for event in frame.data["events"]]


def test_streams_and_their_heads(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    append(engine, orders, 5)
    listed = web.get(f"{gateway.url}/v1/streams", timeout=TIMEOUT)
    assert listed.headers["Cache-Control"] == "no-store"
    assert listed.json() == {
        "streams": [{"name": "orders", "partitions": 4, "epoch": engine.stream("orders").epoch}]
    }
    shown = web.get(f"{gateway.url}/v1/streams/orders", timeout=TIMEOUT).json()
    heads = engine.heads("orders")
    assert [p["head"] for p in shown["partitions"]] == [heads[p] for p in range(4)]
    assert [p["floor"] for p in shown["partitions"]] == [1, 1, 1, 1]
    # its cursor is "now": a read from it has nothing until the next append
    page = web.get(
        f"{gateway.url}/v1/streams/orders/events",
        params={"after": shown["cursor"]},
        timeout=TIMEOUT,
    ).json()
    assert page["events"] == [] and page["up_to_date"] is True
    append(engine, orders, 1, start=5)
    page = web.get(
        f"{gateway.url}/v1/streams/orders/events",
        params={"after": shown["cursor"]},
        timeout=TIMEOUT,
    ).json()
    assert numbers(page["events"]) == [5]


def test_pages_give_every_event_once_oldest_first(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    append(engine, orders, 20)
    url = f"{gateway.url}/v1/streams/orders/events"
    events, cursor = pull_all(url, limit=3)
    assert numbers(events) == list(range(20))
    times = [datetime.fromisoformat(e["recorded_at"]) for e in events]
    assert times == sorted(times)
    for partition in range(4):
        positions = [e["position"] for e in events if e["partition"] == partition]
        assert positions == list(range(1, len(positions) + 1))
    # resuming from the last cursor gives only what came after
    append(engine, orders, 3, start=20)
    more, _ = pull_all(url, after=cursor)
    assert numbers(more) == [20, 21, 22]


def test_filters_and_metadata_only(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    append(engine, orders, 14)
    url = f"{gateway.url}/v1/streams/orders/events"
    page = web.get(
        url, params={"key": ["k1", "k2"], "include_data": "false", "limit": 100}, timeout=TIMEOUT
    ).json()
    assert sorted(e["key"] for e in page["events"]) == ["k1", "k1", "k2", "k2"]
    assert all("data" not in e for e in page["events"])
    assert page["up_to_date"] is True  # the others were passed over, not left behind


def test_since_is_exact_per_partition(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    append(engine, orders, 6)
    middle = server_now(engine)
    append(engine, orders, 6, start=6)
    page = web.get(
        f"{gateway.url}/v1/streams/orders/events",
        params={"since": middle.isoformat(), "limit": 100},
        timeout=TIMEOUT,
    ).json()
    assert numbers(page["events"]) == list(range(6, 12))


def test_long_poll_answers_when_an_event_commits_or_204(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    url = f"{gateway.url}/v1/streams/orders/events"
    empty = web.get(
        url, params={"after": "now", "live": "long-poll", "wait": "0.5"}, timeout=TIMEOUT
    )
    assert empty.status_code == 204
    cursor = empty.headers["Subengine-Cursor"]
    answer: list[httpx.Response] = []
    poll = threading.Thread(
        target=lambda: answer.append(
            web.get(
                url, params={"after": cursor, "live": "long-poll", "wait": "30"}, timeout=TIMEOUT
            )
        )
    )
    poll.start()
    time.sleep(0.5)
    assert not answer, "the long-poll answered before anything was appended"
    append(engine, orders, 1)
    poll.join(30)
    assert answer and answer[0].status_code == 200
    assert numbers(answer[0].json()["events"]) == [0]


def test_sse_catches_up_then_follows_and_resumes_from_every_id(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    append(engine, orders, 10)
    url = f"{gateway.url}/v1/streams/orders/events"

    def appended_later() -> None:
        time.sleep(0.5)
        append(engine, orders, 5, start=10)

    later = threading.Thread(target=appended_later)
    later.start()
    frames = frames_until(
        url,
        lambda got: len(events_of(got)) >= 15,
        params={"live": "sse", "after": "beginning"},
    )
    later.join()
    assert numbers(events_of(frames)) == list(range(15))
    kinds = [frame.kind for frame in frames if frame.kind != ":"]
    assert "caught-up" in kinds
    # every frame's id resumes exactly after it, through Last-Event-ID
    ids = [(i, frame.id) for i, frame in enumerate(frames) if frame.id is not None]
    for index, frame_id in ids:
        assert frame_id is not None
        seen = numbers(events_of(frames[: index + 1]))
        rest = frames_until(
            url,
            lambda got: any(f.kind == "caught-up" for f in got),
            headers={"Last-Event-ID": frame_id},
            params={"live": "sse", "after": "beginning"},  # the header wins
        )
        assert sorted(seen + numbers(events_of(rest))) == list(range(15))


def test_a_cursor_below_the_floor_gets_the_exact_tombstone_first(
    engine: subengine.Engine, gateway: GatewayProcess, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("feed", 1, retention=subengine.Retention(max_events=5))
    engine.append("feed", [subengine.NewEvent("k", "t", {"n": n}) for n in range(12)])
    url = f"{gateway.url}/v1/streams/feed/events"
    start = web.get(url, params={"limit": 2}, timeout=TIMEOUT).json()
    assert numbers(start["events"]) == [0, 1]
    engine.run_retention()
    page = web.get(url, params={"after": start["cursor"], "limit": 100}, timeout=TIMEOUT).json()
    assert page["tombstones"] == [
        {
            "stream": "feed",
            "partition": 0,
            "gap_from": 3,
            "gap_to": 7,
            "floor": 8,
            "reason": "cap",
            "head": 12,
            # a new request: the gap was there when it came
            "cursor_below_floor": True,
        }
    ]
    assert numbers(page["events"]) == [7, 8, 9, 10, 11]
    frames = frames_until(
        url,
        lambda got: any(f.kind == "caught-up" for f in got),
        params={"live": "sse", "after": start["cursor"]},
    )
    kinds = [f.kind for f in frames if f.kind != ":"]
    assert kinds[:2] == ["tombstone", "events"]
    tombstone = frames[[f.kind for f in frames].index("tombstone")].data
    assert (tombstone["gap_to"], tombstone["reason"], tombstone["head"]) == (7, "cap", 12)


def test_a_re_created_stream_gives_reset(engine: subengine.Engine, gateway: GatewayProcess) -> None:
    engine.create_stream("temp", 2)
    engine.append("temp", [subengine.NewEvent("a", "t", {"n": 0})])
    url = f"{gateway.url}/v1/streams/temp/events"
    first = web.get(url, timeout=TIMEOUT).json()
    engine.delete_stream("temp")
    engine.create_stream("temp", 2)
    engine.append("temp", [subengine.NewEvent("b", "t", {"n": 1})])
    page = web.get(url, params={"after": first["cursor"]}, timeout=TIMEOUT).json()
    assert [r["stream"] for r in page["resets"]] == ["temp"]
    assert numbers(page["events"]) == [1]
    frames = frames_until(
        url,
        lambda got: any(f.kind == "caught-up" for f in got),
        params={"live": "sse", "after": first["cursor"]},
    )
    kinds = [f.kind for f in frames if f.kind != ":"]
    assert kinds == ["reset", "events", "caught-up"]


def test_a_stream_re_created_with_other_partitions_gives_reset_not_an_error(
    engine: subengine.Engine, gateway: GatewayProcess
) -> None:
    engine.create_stream("resized", 2)
    engine.append("resized", [subengine.NewEvent("a", "t", {"n": 0})])
    url = f"{gateway.url}/v1/streams/resized/events"
    first = web.get(url, timeout=TIMEOUT).json()
    engine.delete_stream("resized")
    engine.create_stream("resized", 5)
    engine.append("resized", [subengine.NewEvent("b", "t", {"n": 1})])
    page = web.get(url, params={"after": first["cursor"]}, timeout=TIMEOUT)
    assert page.status_code == 200, page.text
    assert [r["stream"] for r in page.json()["resets"]] == ["resized"]
    assert numbers(page.json()["events"]) == [1]
    frames = frames_until(
        url,
        lambda got: any(f.kind in ("caught-up", "error") for f in got),
        params={"live": "sse", "after": first["cursor"]},
    )
    assert [f.kind for f in frames if f.kind != ":"] == ["reset", "events", "caught-up"]


@pytest.mark.parametrize(
    ("path", "params", "status", "code"),
    [
        ("/v1/streams/nope/events", {}, 404, "stream_not_found"),
        ("/v1/streams/orders/events", {"after": "c1.!!"}, 400, "bad_cursor"),
        ("/v1/streams/orders/events", {"after": "c1.AAEGb3JkZXJzAQQCAA"}, 400, "bad_cursor"),
        ("/v1/streams/orders/events", {"since": "yesterday"}, 400, "bad_request"),
        ("/v1/streams/orders/events", {"since": "2026-01-01T00:00:00"}, 400, "bad_request"),
        ("/v1/streams/orders/events", {"limit": "0"}, 400, "bad_request"),
        ("/v1/streams/orders/events", {"limit": "10001"}, 400, "bad_request"),
        ("/v1/streams/orders/events", {"limit": "²"}, 400, "bad_request"),
        ("/v1/streams/orders/events", {"live": "push"}, 400, "bad_request"),
        ("/v1/streams/orders/events", {"live": "long-poll", "wait": "nan"}, 400, "bad_request"),
        ("/v1/streams/orders/events", {"key": "x" * 2000}, 400, "bad_request"),
        ("/v1/streams/%00drop/events", {}, 400, "bad_stream_name"),
        ("/v1/nothing", {}, 404, "not_found"),
    ],
)
def test_bad_input_is_a_json_error_naming_it(
    orders: str, gateway: GatewayProcess, path: str, params: dict[str, str], status: int, code: str
) -> None:
    answer = web.get(f"{gateway.url}{path}", params=params, timeout=TIMEOUT)
    assert answer.status_code == status, answer.text
    assert answer.headers["Cache-Control"] == "no-store"
    error = answer.json()["error"]
    assert error["code"] == code and error["message"]


def test_shutdown_ends_open_streams_with_a_reason(
    orders: str, cli_env: dict[str, str], tmp_path: Any
) -> None:
    process = GatewayProcess(cli_env, tmp=tmp_path).start()
    frames: list[SseFrame] = []

    def listen() -> None:
        frames.extend(
            frames_until(
                f"{process.url}/v1/streams/orders/events",
                lambda got: any(f.kind == "close" for f in got),
                params={"live": "sse"},
            )
        )

    listener = threading.Thread(target=listen)
    listener.start()
    wait_for(lambda: any(f.kind == "caught-up" for f in frames) or listener.is_alive(), timeout=10)
    time.sleep(0.5)
    assert process.stop(timeout=10) == 0
    listener.join(10)
    assert [f.data["code"] for f in frames if f.kind == "close"] == ["shutdown"]
