"""The gateway's access log: cursors, watch ids and tokens never reach a handler, in the
query string or the path, under their own names or others (subengine/gateway/_access_log.py)."""

from __future__ import annotations

import logging

import pytest

from subengine.gateway._access_log import RedactingFilter, redact_target


@pytest.mark.parametrize(
    ("target", "logged"),
    [
        (
            "/v1/streams/orders/events?after=c1.AAEG&limit=2",
            "/v1/streams/orders/events?after=<redacted>&limit=2",
        ),
        ("/v1/streams/orders/events?after=beginning", "/v1/streams/orders/events?after=<redacted>"),
        ("/v1/watch/w1.abc.def?heartbeat=5", "/v1/watch/<redacted>?heartbeat=5"),
        ("/events/v1/watch/anything", "/events/v1/watch/<redacted>"),
        (
            "/v1/streams/o/events?access_token=x&since=2026",
            "/v1/streams/o/events?access_token=<redacted>&since=2026",
        ),
        ("/v1/streams/o/events?q=sek_0123_abc", "/v1/streams/o/events?q=<redacted>"),
        ("/v1/streams/o/events?q=%20c1.AAEG", "/v1/streams/o/events?q=<redacted>"),
        ("/v1/streams/orders?c1.AAEG", "/v1/streams/orders?<redacted>"),
        ("/v1/streams/orders/events?key=k1&type=T", "/v1/streams/orders/events?key=k1&type=T"),
        ("/healthz", "/healthz"),
    ],
)
def test_a_target_keeps_only_what_grants_no_access(target: str, logged: str) -> None:
    assert redact_target(target) == logged


def test_the_filter_redacts_uvicorns_arguments_and_lines_of_other_shapes() -> None:
    def record(msg: str, args: tuple[object, ...] | None) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, msg, args, None)

    uvicorn = record(
        '%s - "%s %s HTTP/%s" %d', ("1.2.3.4:5", "GET", "/v1/watch/w1.x.y", "1.1", 200)
    )
    other = record("GET /v1/streams/o/events?after=c1.AAEG done", None)
    for each in (uvicorn, other):
        assert RedactingFilter().filter(each)
    assert uvicorn.getMessage() == '1.2.3.4:5 - "GET /v1/watch/<redacted> HTTP/1.1" 200'
    assert other.getMessage() == "GET /v1/streams/o/events?after=<redacted> done"
