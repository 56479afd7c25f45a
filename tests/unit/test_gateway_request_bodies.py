"""A request body over its limit is read to its end and thrown away, up to
DISCARDED_AT_MOST past the limit, before it is refused; one that grows past that is
refused without another read, and its refusal closes the connection."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.types import Message

from subengine.gateway._request_bodies import DISCARDED_AT_MOST, BodyTooLarge, read_limited_body

LIMIT = 1024
CHUNK = 1 << 16


class StreamedBody:
    """An ASGI request without a declared length whose body comes in `chunks` pieces."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.received = 0

    async def receive(self) -> Message:
        self.received += 1
        more = self.received < self.chunks
        return {"type": "http.request", "body": bytes(CHUNK), "more_body": more}

    def request(self) -> Request:
        return Request({"type": "http", "method": "POST", "headers": []}, self.receive)


def refusal(body: StreamedBody) -> BodyTooLarge:
    with pytest.raises(BodyTooLarge) as refused:
        asyncio.run(read_limited_body(body.request(), LIMIT))
    return refused.value


def test_a_body_over_the_limit_is_read_to_its_end_and_the_connection_kept() -> None:
    body = StreamedBody(chunks=DISCARDED_AT_MOST // CHUNK)
    refused = refusal(body)
    assert body.received == body.chunks
    assert not refused.close and refused.headers == {}
    assert str(refused) == f"the body is larger than {LIMIT} bytes"


def test_a_body_growing_past_what_is_read_is_refused_and_the_connection_closed() -> None:
    body = StreamedBody(chunks=2 * DISCARDED_AT_MOST // CHUNK)
    refused = refusal(body)
    assert body.received == (LIMIT + DISCARDED_AT_MOST) // CHUNK + 1
    assert refused.close and refused.headers == {"Connection": "close"}


def test_a_body_within_the_limit_is_the_body() -> None:
    async def receive() -> Message:
        return {"type": "http.request", "body": b"x" * LIMIT, "more_body": False}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    assert asyncio.run(read_limited_body(request, LIMIT)) == b"x" * LIMIT
