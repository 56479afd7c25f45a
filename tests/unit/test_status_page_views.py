"""What the status page's views show of a snapshot (subengine/gateway/_ui_views.py): what a
key may see and act on, the summaries `subengine status` prints, and what a run of
snapshots adds (events per second, errors as they change). No database."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

from subengine.gateway._ui_views import (
    Board,
    Visibility,
    overview,
    shown_callback,
    subscription,
    summarise,
    webhooks,
    workers,
)
from subengine.outside._api_keys import ApiKey


def key(scopes: tuple[str, ...], streams: tuple[str, ...]) -> ApiKey:
    return ApiKey("0123456789ab", "k", scopes, streams, datetime.now(UTC), None)


def partition(name: str, number: int, lag: int, seconds: str | None, state: str) -> dict[str, Any]:
    return {
        "subscription": name,
        "partition": number,
        "position": 10 - lag,
        "lag": lag,
        "lag_seconds": seconds,
        "state": state,
        "attempts": 1 if state == "retrying" else 0,
        "last_error": "ValueError: boom" if state == "retrying" else None,
        "generation": 1,
    }


def snapshot(taken_at: str = "2026-11-23T10:00:00+00:00", appended: int = 100) -> dict[str, Any]:
    return {
        "taken_at": taken_at,
        "streams": [
            {"name": "orders", "retention": {"max_age": 604800}, "appended": appended},
            {"name": "payments", "retention": None, "appended": 5},
        ],
        "subscriptions": [
            {"name": "billing", "stream": "orders", "generation": 2, "paused": False},
            {"name": "ledger", "stream": "payments", "generation": 1, "paused": False},
        ],
        "partitions": [
            partition("billing", 0, 3, "9.900", "ok"),
            partition("billing", 1, 4, "10.500", "retrying"),
            partition("ledger", 0, 0, None, "idle"),
        ],
        "workers": [
            {"id": "w1", "subscriptions": ["billing", "ledger"], "connected": True},
            {"id": "w2", "subscriptions": ["ledger"], "connected": True},
            {"id": "w3", "subscriptions": ["billing"], "connected": False},
        ],
        "webhooks": [
            {
                "id": "h1",
                "streams": ["orders"],
                "callback": "https://u:p@hooks.example:8443/in?t=s#f",
            },
            {"id": "h2", "streams": ["payments"], "callback": "https://hooks.example/pay"},
        ],
        "dead_letters": [],
        "dead_letter_counts": {"billing": 2},
        "parked": [],
        "parked_counts": {},
    }


def test_a_summary_counts_as_subengine_status_does() -> None:
    billing = summarise(snapshot())["billing"]
    assert (billing["partitions"], billing["lag"], billing["ok"], billing["retrying"]) == (
        2,
        7,
        1,
        1,
    )
    assert billing["lag_seconds"] == "10.500"  # the largest as a number, kept as printed
    assert (billing["workers"], billing["dead_letters"], billing["generation"]) == (1, 2, 2)


def test_a_key_sees_only_the_streams_its_patterns_match_with_read_or_admin() -> None:
    data = Board().add(snapshot())
    reader = Visibility(key(("read",), ("orders*",)))
    shown = overview(data, reader)
    assert [s["name"] for s in shown["streams"]] == ["orders"]
    assert [s["subscription"] for s in shown["subscriptions"]] == ["billing"]
    assert not shown["subscriptions"][0]["may_act"]
    assert subscription(data, Board(), reader, "ledger") == {"name": "ledger", "missing": True}
    assert [w["id"] for w in webhooks(data, reader)["webhooks"]] == ["h1"]
    # the workers of what it sees, with only those subscriptions
    assert [(w["id"], w["subscriptions"]) for w in workers(data, reader)["workers"]] == [
        ("w1", ["billing"]),
        ("w3", ["billing"]),
    ]
    admin = Visibility(key(("admin",), ("payments",)))
    [ledger] = overview(data, admin)["subscriptions"]
    assert ledger["subscription"] == "ledger" and ledger["may_act"]
    assert overview(data, Visibility(key(("append",), ("*",))))["subscriptions"] == []
    assert all(s["may_act"] for s in overview(data, Visibility(None))["subscriptions"])


def test_a_webhook_callback_is_shown_without_what_may_be_a_secret() -> None:
    assert shown_callback("https://u:p@hooks.example:8443/in?t=s#f") == (
        "https://hooks.example:8443/in"
    )
    assert shown_callback("http://[::1]:9000/x?token=1") == "http://[::1]:9000/x"


def test_a_run_of_snapshots_gives_events_per_second_and_each_error_once() -> None:
    board = Board()
    first = board.add(snapshot("2026-11-23T10:00:00+00:00", 100))
    assert first["streams"][0]["events_per_second"] is None
    assert first["streams"][0]["retention"] == {"max_age": 604800}
    later = board.add(snapshot("2026-11-23T10:00:02+00:00", 150))
    assert later["streams"][0]["events_per_second"] == 25.0
    again = copy.deepcopy(snapshot("2026-11-23T10:00:03+00:00", 150))
    again["partitions"][1]["attempts"] = 2
    board.add(again)
    errors = board.errors["billing"]
    assert [(e["partition"], e["attempts"]) for e in errors] == [(1, 2), (1, 1)]
    assert overview(later, Visibility(None))["streams"][0]["retention"] == "max-age 7d"
    history = subscription(later, board, Visibility(None), "billing")["history"]
    assert history["lag"] == [7, 7, 7] and history["lag_seconds"] == [10.5, 10.5, 10.5]
