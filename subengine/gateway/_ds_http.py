"""What the Durable Streams endpoints share (docs/durable-streams.md): the protocol's
header names, offsets, cursors, the headers every answer carries, and errors.

An offset is `EEEEEEEEEEEEEEEE_PPPPPPPPPPPPPPPP`: the engine stream's epoch (its
incarnation: a path deleted and created again is a new engine stream, with a higher
epoch) and the position of the last message read, both zero-padded to 16 digits, so
offsets sort as text in stream order, across incarnations too. `-1` is the beginning,
`now` the tail.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.responses import Response

from subengine.outside._durable_streams import format_offset

# the protocol's headers
NEXT_OFFSET = "Stream-Next-Offset"
UP_TO_DATE = "Stream-Up-To-Date"
CLOSED = "Stream-Closed"
CURSOR = "Stream-Cursor"
TTL = "Stream-TTL"
EXPIRES_AT = "Stream-Expires-At"
SEQ = "Stream-Seq"
SSE_ENCODING = "Stream-SSE-Data-Encoding"
PRODUCER_ID = "Producer-Id"
PRODUCER_EPOCH = "Producer-Epoch"
PRODUCER_SEQ = "Producer-Seq"
PRODUCER_EXPECTED_SEQ = "Producer-Expected-Seq"
PRODUCER_RECEIVED_SEQ = "Producer-Received-Seq"
FORKED_FROM = "Stream-Forked-From"
FORK_OFFSET = "Stream-Fork-Offset"
FORK_SUB_OFFSET = "Stream-Fork-Sub-Offset"
# ours: what a 410 Gone below the retention floor misses (a tombstone's fields)
FLOOR = "Subengine-Floor"
GAP_FROM = "Subengine-Gap-From"
GAP_TO = "Subengine-Gap-To"

NO_STORE = "no-store"
# A page of messages never changes (offsets are immutable), so it may be kept a while;
# `private`: answers depend on the API key (docs/durable-streams.md, "Caching").
CACHEABLE = "private, max-age=60, stale-while-revalidate=300"

# Every answer, errors included (PROTOCOL.md 12.7).
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Resource-Policy": "cross-origin",
}
REQUEST_HEADERS = (
    "Authorization",
    "Content-Type",
    "If-None-Match",
    "Last-Event-ID",
    "Stream-TTL",
    "Stream-Expires-At",
    "Stream-Seq",
    "Stream-Closed",
    "Producer-Id",
    "Producer-Epoch",
    "Producer-Seq",
    FORKED_FROM,
    FORK_OFFSET,
    FORK_SUB_OFFSET,
)
EXPOSED_HEADERS = (
    NEXT_OFFSET,
    UP_TO_DATE,
    CLOSED,
    CURSOR,
    TTL,
    EXPIRES_AT,
    SSE_ENCODING,
    PRODUCER_EPOCH,
    PRODUCER_SEQ,
    PRODUCER_EXPECTED_SEQ,
    PRODUCER_RECEIVED_SEQ,
    FLOOR,
    GAP_FROM,
    GAP_TO,
    "ETag",
    "Location",
    "Retry-After",
)

_OFFSET = re.compile(r"(\d{16})_(\d{16})")
# The protocol's interval cursors (PROTOCOL.md 10.1): 20-second intervals since this time.
_CURSOR_EPOCH = 1728432000.0  # 2024-10-09T00:00:00Z
_CURSOR_SECONDS = 20


class DsError(Exception):
    """An answer with an error status: a one-line text body naming the problem."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


def offset(epoch: int, position: int) -> str:
    return format_offset(epoch, position)


@dataclass(frozen=True, slots=True)
class Offset:
    """A parsed offset: `beginning` (-1), `now`, or (epoch, position)."""

    kind: str
    epoch: int = 0
    position: int = 0


def parse_offset(values: list[str]) -> Offset:
    """The `offset` query parameter (absent: the beginning); DsError 400 if malformed."""
    if not values:
        return Offset("beginning")
    if len(values) > 1:
        raise DsError(400, "give one offset parameter, not several")
    text = values[0]
    if text == "-1":
        return Offset("beginning")
    if text == "now":
        return Offset("now")
    match = _OFFSET.fullmatch(text)
    if match is None:
        raise DsError(400, f"malformed offset {text[:64]!r}: use one this server returned")
    return Offset("at", int(match[1]), int(match[2]))


def response_cursor(given: str | None) -> str:
    """The Stream-Cursor of a live answer: the current interval, or, when the client's
    cursor is not behind it, a later one (PROTOCOL.md 10.1: never backwards)."""
    current = int((time.time() - _CURSOR_EPOCH) // _CURSOR_SECONDS)
    if given is not None and given.isascii() and given.isdecimal() and len(given) < 20:
        client = int(given)
        if client >= current:
            jitter = random.randint(1, 3600)
            return str(client + max(1, jitter // _CURSOR_SECONDS))
    return str(current)


def closed_header(value: str | None) -> bool:
    """Whether a Stream-Closed header says `true` (any other value: as if absent)."""
    return value is not None and value.strip().lower() == "true"


def text_response(
    status: int,
    body: bytes | str = b"",
    headers: Mapping[str, str] | None = None,
    media_type: str | None = None,
) -> Response:
    headers = {**SECURITY_HEADERS, "Cache-Control": NO_STORE, **(headers or {})}
    return Response(body, status_code=status, headers=headers, media_type=media_type)


def error_response(error: DsError) -> Response:
    return text_response(
        error.status, error.message + "\n", error.headers, "text/plain; charset=utf-8"
    )
