"""The gateway's cursor text: it round-trips, stays URL-safe and bounded, and anything it
did not write is refused with InvalidCursor (one line, never a crash)."""

from __future__ import annotations

import base64
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from subengine.model._gateway_cursor import (
    MAX_CURSOR_TEXT,
    GatewayCursor,
    InvalidCursor,
    StreamPosition,
)

names = st.from_regex(r"[a-z][a-z0-9_.-]{0,20}", fullmatch=True)
positions = st.lists(st.integers(0, 2**63 - 1), max_size=40).map(tuple)
cursors = st.dictionaries(
    names, st.builds(StreamPosition, st.integers(0, 2**63 - 1), positions), max_size=5
).map(GatewayCursor)


@given(cursors)
def test_a_cursor_round_trips_as_url_safe_text(cursor: GatewayCursor) -> None:
    text = cursor.encode()
    assert text.startswith("c1.")
    assert set(text[3:]) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert GatewayCursor.decode(text) == cursor


def test_a_cursor_of_a_thousand_partitions_is_compressed_and_short() -> None:
    cursor = GatewayCursor({"orders": StreamPosition(3, tuple(range(5000, 6024)))})
    text = cursor.encode()
    assert len(text) < 2500 and len(text) <= MAX_CURSOR_TEXT
    assert GatewayCursor.decode(text) == cursor


def _text(payload: bytes) -> str:
    return "c1." + base64.urlsafe_b64encode(payload).rstrip(b"=").decode()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "orders:1,2",
        "c1.",
        "c1.!!",
        "c2.AAEGb3JkZXJzAQQCAAEA",
        "c1." + "A" * (MAX_CURSOR_TEXT + 1),
        _text(b"\x07"),  # an unknown flag
        _text(b"\x00\x01\x06orders\x01\x04\x02\x00"),  # truncated
        _text(b"\x00\x01\x06orders\x01\x00\x00"),  # trailing bytes
        _text(b"\x00\x01\x03a:b\x01\x00"),  # not a stream name
        _text(b"\x00\x02\x01a\x01\x00\x01a\x01\x00"),  # a stream twice
        _text(b"\x00\x01\x01a" + b"\xff" * 12),  # a number out of range
        _text(b"\x01" + zlib.compress(b"\x00" * 5_000_000)),  # inflates without bound
        _text(b"\x01garbage"),
    ],
)
def test_text_it_did_not_write_is_refused(text: str) -> None:
    with pytest.raises(InvalidCursor) as refused:
        GatewayCursor.decode(text)
    assert "\n" not in str(refused.value)


@given(st.text(max_size=200))
def test_any_text_is_a_cursor_or_refused(text: str) -> None:
    try:
        GatewayCursor.decode("c1." + text)
    except InvalidCursor:
        pass
