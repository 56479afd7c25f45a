"""Appending over HTTP: `POST /v1/streams/{stream}/events` on a real `subengine serve` process.

The events are stored as the engine's append stores them (idempotent by id, with expected
versions), the answer says where each one is, and bad input is a JSON error naming the
event and field that changed nothing.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import web
from helpers import GatewayProcess, run_subengine, snapshot, stored_events

import subengine

TIMEOUT = httpx.Timeout(30.0)


def post(gateway: GatewayProcess, body: Any, stream: str = "orders") -> httpx.Response:
    return web.post(f"{gateway.url}/v1/streams/{stream}/events", json=body, timeout=TIMEOUT)


def test_posted_events_are_stored_as_given_and_where_the_answer_says(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    event_id = str(uuid.uuid4())
    answer = post(
        gateway,
        [
            {
                "key": "order-1",
                "type": "OrderPlaced",
                "data": {"total": 30},
                "metadata": {"by": "me"},
                "id": event_id,
                "occurred_at": "2026-01-02T03:04:05+01:00",
            },
            {"key": "order-1", "type": "OrderPaid", "data": [1, "two", None]},
        ],
    )
    assert answer.status_code == 201, answer.text
    assert answer.headers["Cache-Control"] == "no-store"
    appended = answer.json()["appended"]
    assert [a["key_version"] for a in appended] == [1, 2]
    assert appended[0]["id"] == event_id and not any(a["duplicate"] for a in appended)
    partition = subengine.partition_for("order-1", 4)
    assert {a["partition"] for a in appended} == {partition}
    stored = stored_events(engine.read("orders", partition))
    assert [(e.position, str(e.id)) for e in stored] == [(a["position"], a["id"]) for a in appended]
    first, second = stored
    assert (first.type, first.data, first.metadata) == ("OrderPlaced", {"total": 30}, {"by": "me"})
    assert first.occurred_at == datetime(2026, 1, 2, 2, 4, 5, tzinfo=UTC)
    assert (second.data, second.metadata) == ([1, "two", None], {})


# Events as clients write them. The gateway decodes a body with orjson and sends it to
# PostgreSQL as one jsonb array where it can vouch for that (the first), and otherwise
# as the engine's append does (the second: orjson would read its long integer as a float).
WRITTEN = [
    rb"""[{"key": "a", "type": "T", "data": {"z": 1, "a": [1e2, 1.50, -0.0, 1e-7, 1e16]}},
 {"key": "a", "type": "T", "data": {"s": "\u00e9\ud83d\ude00\u2028 \"q\" \\ \/", "d": 1, "d": 2},
  "metadata": {"m": "\u0041"}},
 {"key": "b\u00e9", "type": "T", "data": null, "metadata": null},
 {"key": "b", "type": "T", "data": "text", "id": "{0190A2B3-C4D5-7E6F-8A9B-0C1D2E3F4A5B}",
  "occurred_at": "2026-01-02t03:04:05.1234567z"}]""",
    rb"""[{"key": "c", "type": "T", "data": [12345678901234567890123, 0.1, [], {}, true]}]""",
]


def test_posted_data_is_stored_as_the_engines_append_stores_it(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("mirror", partitions=4)
    for body in WRITTEN:
        answer = web.post(
            f"{gateway.url}/v1/streams/orders/events",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=TIMEOUT,
        )
        assert answer.status_code == 201, answer.text
        engine.append("mirror", [subengine.NewEvent.from_json(f) for f in json.loads(body)])
    query = """
    SELECT key, key_version, type, data::text, metadata::text, partition, position,
           nullif(occurred_at, recorded_at)
      FROM subengine.events WHERE stream = %s ORDER BY partition, position"""
    posted = sql.execute(query, ("orders",)).fetchall()
    assert posted == sql.execute(query, ("mirror",)).fetchall()
    assert any("12345678901234567890123" in row[3] for row in posted)


def test_a_retry_is_answered_200_and_stores_nothing_again(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    events = [
        {"key": f"k{n}", "type": "T", "data": {"n": n}, "id": str(uuid.uuid4())} for n in range(3)
    ]
    first = post(gateway, events)
    again = post(gateway, events)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.headers["Cache-Control"] == "no-store"
    assert [a["duplicate"] for a in again.json()["appended"]] == [True, True, True]
    where = [(a["partition"], a["position"]) for a in first.json()["appended"]]
    assert [(a["partition"], a["position"]) for a in again.json()["appended"]] == where
    assert sum(engine.heads("orders").values()) == 3
    # one new event among the stored ones: 201, and only it is new
    mixed = post(gateway, [*events, {"key": "k9", "type": "T", "data": {}}])
    assert mixed.status_code == 201
    assert [a["duplicate"] for a in mixed.json()["appended"]] == [True, True, True, False]


def test_expected_versions_guard_the_append(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess, sql: psycopg.Connection[Any]
) -> None:
    def placed(key: str) -> dict[str, Any]:
        return {"key": key, "type": "OrderPlaced", "data": {}}

    assert post(gateway, {"events": [placed("a")], "expected_version": 0}).status_code == 201
    before = snapshot(sql)
    stale = post(gateway, {"events": [placed("a")], "expected_version": 0})
    assert stale.status_code == 409
    assert stale.headers["Cache-Control"] == "no-store"
    error = stale.json()["error"]
    assert error["code"] == "wrong_expected_version"
    assert "at version 1" in error["message"] and "expected version 0" in error["message"]
    assert snapshot(sql) == before
    both = post(gateway, {"events": [placed("a"), placed("b")], "expected_version": {"a": 1}})
    assert both.status_code == 201
    assert [a["key_version"] for a in both.json()["appended"]] == [2, 1]


def test_an_id_that_names_another_event_is_a_conflict(
    orders: str, gateway: GatewayProcess, sql: psycopg.Connection[Any]
) -> None:
    event_id = str(uuid.uuid4())
    assert post(gateway, [{"key": "a", "type": "T", "data": 1, "id": event_id}]).status_code == 201
    before = snapshot(sql)
    clash = post(gateway, [{"key": "b", "type": "T", "data": 1, "id": event_id}])
    assert clash.status_code == 409
    assert clash.json()["error"]["code"] == "event_id_conflict"
    assert event_id in clash.json()["error"]["message"]
    assert snapshot(sql) == before


def test_a_posted_event_wakes_a_long_poll(orders: str, gateway: GatewayProcess) -> None:
    url = f"{gateway.url}/v1/streams/orders/events"
    answers: list[httpx.Response] = []
    poll = threading.Thread(
        target=lambda: answers.append(
            web.get(url, params={"after": "now", "live": "long-poll"}, timeout=TIMEOUT)
        )
    )
    poll.start()
    time.sleep(0.5)
    assert post(gateway, [{"key": "a", "type": "T", "data": {"n": 7}}]).status_code == 201
    poll.join(30)
    assert answers and answers[0].status_code == 200
    assert [e["data"] for e in answers[0].json()["events"]] == [{"n": 7}]


GOOD = {"key": "a", "type": "T", "data": {}}


BAD_BODIES: list[tuple[Any, int, str, list[str]]] = [
    ([GOOD, {"key": "a", "type": "T"}], 400, "bad_event", ["event 1", "'data'"]),
    ([GOOD, {**GOOD, "colour": 1}], 400, "bad_event", ["event 1", "'colour'"]),
    ([GOOD, {**GOOD, "id": "not-a-uuid"}], 400, "bad_event", ["event 1", "id"]),
    ([GOOD, {**GOOD, "id": 7}], 400, "bad_event", ["event 1", "id must be a string"]),
    (
        [GOOD, {**GOOD, "occurred_at": "2026-01-02T03:04:05"}],
        400,
        "bad_event",
        ["event 1", "occurred_at", "RFC 3339"],
    ),
    (
        [GOOD, {**GOOD, "occurred_at": "2026-01-02"}],
        400,
        "bad_event",
        ["event 1", "occurred_at"],
    ),
    ([GOOD, {**GOOD, "key": ""}], 400, "bad_event", ["event 1", "key"]),
    ([GOOD, {**GOOD, "type": 5}], 400, "bad_event", ["event 1", "type"]),
    ([GOOD, {**GOOD, "metadata": [1]}], 400, "bad_event", ["event 1", "metadata"]),
    ([GOOD, {**GOOD, "data": "a\u0000b"}], 400, "bad_event", ["event 1", "data", "NUL"]),
    ([GOOD, "an event"], 400, "bad_event", ["event 1", "JSON object"]),
    ([], 400, "bad_request", ["no event"]),
    ({"events": [GOOD], "expected": 1}, 400, "bad_request", ["'expected'"]),
    ({"events": GOOD}, 400, "bad_request", ["events"]),
    ({"events": [GOOD], "expected_version": "1"}, 400, "bad_request", ["expected_version"]),
    ({"events": [GOOD], "expected_version": True}, 400, "bad_request", ["expected_version"]),
    (
        {"events": [GOOD], "expected_version": {"zz": 1}},
        400,
        "bad_request",
        ["expected_version", "'zz'"],
    ),
    ({"events": [GOOD], "expected_version": {"a": -1}}, 400, "bad_request", ["a"]),
    ("just text", 400, "bad_request", ["array"]),
]


def test_bad_input_names_the_event_and_field_and_changes_nothing(
    stored: str, gateway: GatewayProcess, sql: psycopg.Connection[Any]
) -> None:
    before = snapshot(sql)
    for body, status, code, words in BAD_BODIES:
        answer = post(gateway, body)
        assert answer.status_code == status, (body, answer.text)
        assert answer.headers["Cache-Control"] == "no-store"
        error = answer.json()["error"]
        assert error["code"] == code, (body, error)
        for word in words:
            assert word in error["message"], (body, error)
    assert snapshot(sql) == before


GOOD_TEXT = b'[{"key":"a","type":"T","data":1}]'
BAD_REQUESTS: list[tuple[str, bytes, dict[str, str], int, str]] = [
    ("nope", GOOD_TEXT, {}, 404, "stream_not_found"),
    ("%00drop", GOOD_TEXT, {}, 400, "bad_stream_name"),
    ("orders", b'[{"key":"a","type":"T","data":1}', {}, 400, "bad_request"),
    ("orders", b'[{"key":"a","type":"T","data":NaN}]', {}, 400, "bad_event"),
    ("orders", b"[" + b"1" * 5000 + b"]", {}, 400, "bad_request"),
    ("orders", b"[" * 100_000, {}, 400, "bad_request"),
    (
        "orders",
        b'[{"key":"a","type":"T","data":"' + b"x" * (1 << 20) + b'"}]',
        {},
        413,
        "too_large",
    ),
    (
        "orders",
        b'[{"key":"a","type":"T","data":1}]',
        {"Content-Type": "text/plain"},
        415,
        "unsupported_media_type",
    ),
    ("orders", GOOD_TEXT, {"Content-Type": ""}, 415, "unsupported_media_type"),
]


def test_bad_requests_are_json_errors_and_change_nothing(
    stored: str, gateway: GatewayProcess, sql: psycopg.Connection[Any]
) -> None:
    before = snapshot(sql)
    for stream, content, headers, status, code in BAD_REQUESTS:
        answer = web.post(
            f"{gateway.url}/v1/streams/{stream}/events",
            content=content,
            headers={"Content-Type": "application/json", **headers},
            timeout=TIMEOUT,
        )
        assert answer.status_code == status, (content[:80], answer.text)
        assert answer.headers["Cache-Control"] == "no-store"
        error = answer.json()["error"]
        assert error["code"] == code and error["message"], (content[:80], error)
    assert snapshot(sql) == before


def test_a_body_over_the_limit_is_refused_as_it_streams_in(
    stored: str, gateway: GatewayProcess, sql: psycopg.Connection[Any]
) -> None:
    """No Content-Length to trust: the gateway counts what arrives."""
    before = snapshot(sql)

    def chunks() -> Any:
        yield b'[{"key":"a","type":"T","data":"'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}]'

    answer = web.post(
        f"{gateway.url}/v1/streams/orders/events",
        content=chunks(),
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "too_large"
    assert snapshot(sql) == before


def test_the_command_and_the_gateway_read_an_event_by_one_rule(
    stored: str,
    gateway: GatewayProcess,
    cli_env: dict[str, str],
    sql: psycopg.Connection[Any],
    tmp_path: Path,
) -> None:
    before = snapshot(sql)
    for bad in (
        {**GOOD, "occurred_at": "2026-01-02T03:04"},
        {**GOOD, "id": "12"},
        {**GOOD, "extra": 1},
    ):
        answer = post(gateway, [bad])
        reason = answer.json()["error"]["message"].removeprefix("event 0: ")
        path = tmp_path / "events.jsonl"
        path.write_text(httpx.Request("POST", "/", json=bad).content.decode() + "\n")
        result = run_subengine(cli_env, "append", "orders", "--file", str(path))
        assert result.returncode == 1
        assert result.stderr.strip() == f"error: {path} line 1: {reason}"
    assert snapshot(sql) == before
