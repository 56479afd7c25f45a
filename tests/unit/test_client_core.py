"""The client's core without a gateway: which items are new, the cursor after each, the
SSE parser, the backoff and the long-poll fallback rule (subengine/client/_core.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from subengine.client import Event, GatewayError, Reconnect, Reset, StreamOptions, Tombstone
from subengine.client._core import ReadCore, Resume, SseFrame, SseParser, selection_of
from subengine.gateway import GatewayCursor, StreamPosition
from subengine.model._errors import InvalidInput

TIME = "2026-11-23T18:00:00+00:00"


def cursor(epoch: int, *positions: int) -> str:
    return GatewayCursor({"orders": StreamPosition(epoch, positions)}).encode()


def positions(text: str | None) -> tuple[int, tuple[int, ...]]:
    at = GatewayCursor.decode(text).streams["orders"]
    return at.epoch, at.positions


def event(partition: int, position: int) -> dict[str, Any]:
    return {
        "stream": "orders",
        "partition": partition,
        "position": position,
        "id": "0190a5f0-0000-7000-8000-000000000000",
        "key": "k",
        "key_version": position,
        "type": "created",
        "metadata": {},
        "occurred_at": TIME,
        "recorded_at": TIME,
        "data": {"p": partition, "n": position},
    }


def events_frame(partition: int, first: int, last: int) -> str:
    return json.dumps(
        {
            "stream": "orders",
            "partition": partition,
            "first": first,
            "last": last,
            "head": last,
            "events": [event(partition, n) for n in range(first, last + 1)],
        }
    )


def core(after: str | None = None, selection: Any = None, **options: Any) -> ReadCore:
    settings: dict[str, Any] = {
        "since": None,
        "api_key": None,
        "heartbeat": 1.0,
        "page_limit": None,
        "long_poll_wait": 5.0,
        "timeout": 5.0,
        "reconnect": Reconnect(),
        **options,
    }
    chosen = selection_of((), (), True) if selection is None else selection
    return ReadCore("orders", chosen, after=after, **settings)


def delivered(batch: list[tuple[Any, str]]) -> list[tuple[int, int]]:
    return [(item.partition, item.position) for item, _ in batch]


def test_positions_at_or_below_the_cursor_are_dropped() -> None:
    reading = core(after=cursor(1, 3, 0))
    batch = reading.frame("events", events_frame(0, 2, 5), cursor(1, 5, 0))
    assert delivered(batch) == [(0, 4), (0, 5)]
    again = reading.frame("events", events_frame(0, 4, 6), cursor(1, 6, 0))
    assert delivered(again) == [(0, 6)]


def test_the_cursor_after_each_item_stands_right_after_it() -> None:
    reading = core(after=cursor(1, 0, 0))
    page = {
        "events": [event(0, 1), event(1, 1), event(0, 2)],
        "tombstones": [],
        "resets": [],
        "cursor": cursor(1, 3, 1),  # position 3 of partition 0 was passed over
        "up_to_date": True,
    }
    batch = reading.page(page)
    assert [positions(text)[1] for _, text in batch] == [(1, 0), (1, 1), (3, 1)]
    assert reading.up_to_date


def test_a_tombstone_comes_with_the_cursor_past_its_gap() -> None:
    reading = core(after=cursor(1, 2))
    gap = {"stream": "orders", "partition": 0, "gap_from": 3, "gap_to": 7, "floor": 8}
    page = {
        "events": [event(0, 8)],
        "tombstones": [gap],
        "resets": [],
        "cursor": cursor(1, 8),
        "up_to_date": True,
    }
    batch = reading.page(page)
    assert batch[0][0] == Tombstone("orders", 0, 3, 7, 8, "retention")
    assert positions(batch[0][1]) == (1, (7,))
    assert isinstance(batch[1][0], Event) and batch[1][1] == cursor(1, 8)


def test_a_new_epoch_starts_the_marks_afresh_and_its_reset_is_delivered_once() -> None:
    reading = core(after=cursor(1, 9, 9))
    reset = {"stream": "orders", "previous_epoch": 1, "epoch": 2, "reason": "re-created"}
    first = reading.frame("reset", json.dumps(reset), cursor(2))
    assert [item for item, _ in first] == [Reset("orders", 1, 2, "re-created")]
    assert delivered(reading.frame("events", events_frame(1, 1, 2), cursor(2, 0, 2))) == [
        (1, 1),
        (1, 2),
    ]
    assert reading.frame("reset", json.dumps(reset), cursor(2, 0, 2)) == []


def test_an_error_frame_resumes_or_raises_by_its_code() -> None:
    reading = core()
    with pytest.raises(Resume):
        reading.frame("close", '{"code": "rotate", "message": "m"}', None)
    with pytest.raises(GatewayError, match="stream_not_found"):
        reading.frame("close", '{"code": "stream_not_found", "message": "gone"}', None)


def test_the_sse_parser_reads_frames_comments_and_ids() -> None:
    parser = SseParser()
    lines = ["retry: 1000", "", ": hb", "id: c1.x", "event: events", "data: {", "data: }", ""]
    frames = [frame for line in lines if (frame := parser.feed(line)) is not None]
    assert frames == [SseFrame(":", "hb", None), SseFrame("events", "{\n}", "c1.x")]


@pytest.mark.parametrize("failures", [1, 2, 5, 40, 10_000])
def test_the_backoff_grows_to_its_bound_with_jitter(failures: int) -> None:
    policy = Reconnect(delay=0.5, max_delay=8.0)
    bound = min(8.0, 0.5 * 2.0 ** min(failures - 1, 60))
    assert all(bound / 2 <= policy.backoff(failures) <= bound for _ in range(50))


def test_short_connections_in_a_row_switch_to_long_poll_for_the_period() -> None:
    reading = core(reconnect=Reconnect(short_connection=5, short_connections=3))
    reading.up_to_date = True
    reading.sse_ended(lived=1, delivered=False, rotated=False, now=100)
    reading.sse_ended(lived=9, delivered=False, rotated=False, now=110)  # long: count again
    reading.sse_ended(lived=1, delivered=True, rotated=False, now=111)  # delivered: again
    reading.sse_ended(lived=0, delivered=False, rotated=True, now=112)  # rotated: again
    for now in (113, 114):
        reading.sse_ended(lived=1, delivered=False, rotated=False, now=now)
    assert reading.mode(now=115) == "sse"
    reading.sse_ended(lived=1, delivered=False, rotated=False, now=115)
    assert reading.mode(now=116) == "long-poll"
    params = reading.next_call(now=116).params
    assert ("live", "long-poll") in params and ("wait", "5") in params
    assert reading.mode(now=115 + 300) == "sse"


def test_a_readers_long_polls_name_one_session_of_its_own() -> None:
    """So that the gateway answers a long-poll the reader gave up on when it retries."""
    sessions = []
    for reading in (core(), core()):
        reading.up_to_date = True
        reading.long_poll_until = float("inf")
        calls = [dict(reading.next_call(now=now).params) for now in (0, 1)]
        assert calls[0]["session"] == calls[1]["session"]
        sessions.append(calls[0]["session"])
    assert sessions[0] != sessions[1]


def test_the_api_key_is_sent_as_a_bearer_token_and_the_cursor_as_last_event_id() -> None:
    reading = core(after=cursor(1, 4), api_key="s3cret")
    reading.up_to_date = True
    call = reading.next_call(now=0)
    assert call.mode == "sse"
    assert call.headers["Authorization"] == "Bearer s3cret"
    assert call.headers["Last-Event-ID"] == cursor(1, 4)
    assert call.read_timeout == 2.0  # twice the heartbeat


def test_a_read_of_some_fields_asks_for_them_and_fills_the_rest_with_none() -> None:
    reading = core(selection=selection_of((), (), True, ["data", "key"]))
    assert ("fields", "data,key") in reading.next_call(now=0).params
    page = {
        "events": [{"partition": 0, "position": 1, "key": "k", "data": {"n": 1}}],
        "tombstones": [],
        "resets": [],
        "cursor": cursor(1, 1),
        "up_to_date": True,
    }
    ((item, _),) = reading.page(page)
    assert item == Event("orders", 0, 1, None, "k", None, None, {"n": 1}, None, None, None)
    # in a frame, the stream is the frame's
    frame = json.dumps(
        {"stream": "orders", "partition": 0, "events": [{"partition": 0, "position": 2}]}
    )
    ((item, _),) = reading.frame("events", frame, cursor(1, 2))
    assert isinstance(item, Event)
    assert (item.stream, item.position, item.id, item.data) == ("orders", 2, None, None)


@pytest.mark.parametrize(
    ("fields", "include_data", "named"),
    [
        (["colour"], True, "'colour'"),
        (["data"], False, "not both"),
        ("data,key", True, "'data,key'"),
        ([3], True, "not 3"),
    ],
)
def test_a_read_of_unknown_fields_is_refused_before_any_request(
    fields: Any, include_data: bool, named: str
) -> None:
    with pytest.raises(InvalidInput, match=named):
        selection_of((), (), include_data, fields)
    with pytest.raises(InvalidInput, match=named):
        StreamOptions(
            fields=[fields] if isinstance(fields, str) else fields, include_data=include_data
        )
    with pytest.raises(InvalidInput, match="a list"):
        StreamOptions(fields="data")  # type: ignore[arg-type]
