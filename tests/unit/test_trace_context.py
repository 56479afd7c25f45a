"""The W3C trace context rules of docs/tracing.md, without a database: which traceparent
and tracestate values are carried, how metadata takes them, and which a webhook delivery
sends on as headers."""

from __future__ import annotations

import orjson
import pytest

from subengine.gateway._delivery_bodies import batch_body, trace_headers
from subengine.model._tracing import carried_context, valid_traceparent, with_context

GOOD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
OTHER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


@pytest.mark.parametrize(
    "value",
    [GOOD, OTHER, "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future"],
)
def test_a_valid_traceparent_is_taken(value: str) -> None:
    assert valid_traceparent(value)


@pytest.mark.parametrize(
    "value",
    [
        "",
        7,
        None,
        GOOD.upper(),
        GOOD + "-more",  # version 00 has exactly four fields
        "ff" + GOOD[2:],  # version ff is invalid
        "00-" + "0" * 32 + "-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",
        " " + GOOD,
        GOOD[:-1],
    ],
)
def test_an_invalid_traceparent_is_ignored(value: object) -> None:
    assert not valid_traceparent(value)
    assert carried_context({"traceparent": value}) is None


def test_a_tracestate_goes_with_a_valid_traceparent_only() -> None:
    assert carried_context({"traceparent": GOOD, "tracestate": "a=1,b=2"}) == {
        "traceparent": GOOD,
        "tracestate": "a=1,b=2",
    }
    assert carried_context({"tracestate": "a=1"}) is None
    for bad in ("", "x" * 513, "a=\u00e9", "a=1\n", 5):
        assert carried_context({"traceparent": GOOD, "tracestate": bad}) == {"traceparent": GOOD}


def test_metadata_keeps_its_own_context() -> None:
    context = {"traceparent": GOOD}
    assert with_context(None, context) == context
    assert with_context({}, context) == context
    assert with_context({"user": "ann"}, context) == {"user": "ann", "traceparent": GOOD}
    own = {"traceparent": OTHER, "user": "ann"}
    assert with_context(own, {"traceparent": GOOD, "tracestate": "a=1"}) is own


def delivery(*metadata: dict[str, object]) -> bytes:
    events = b",".join(
        orjson.dumps({"id": str(i), "position": i + 1, "metadata": m, "data": {}})
        for i, m in enumerate(metadata)
    )
    return batch_body("hook", 1, "orders", 0, 0, len(metadata), events, b"", "cursor")


def test_a_delivery_carries_the_first_context_of_its_events() -> None:
    body = delivery({}, {"traceparent": "bad"}, {"traceparent": OTHER, "tracestate": "a=1"},
                    {"traceparent": GOOD})  # fmt: skip
    assert trace_headers(body) == {"traceparent": OTHER, "tracestate": "a=1"}


def test_a_delivery_without_context_has_no_trace_header() -> None:
    assert trace_headers(delivery({}, {"user": "ann"})) == {}
    # a traceparent in data is no event's context
    body = batch_body(
        "hook", 1, "orders", 0, 0, 1,
        orjson.dumps({"id": "1", "metadata": {}, "data": {"traceparent": GOOD}}), b"", "c",
    )  # fmt: skip
    assert trace_headers(body) == {}
    assert trace_headers(batch_body("hook", 1, "orders", 0, 0, 1, b"", b"{}", "c")) == {}
