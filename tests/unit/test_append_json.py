"""The gateway's fast path for appended JSON: orjson decodes a body only where it gives
what json.loads gives, `prepare_json` vouches only for events the general path (NewEvent.
from_json, then prepare) takes, and sends what that path would store."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from subengine import Settings
from subengine.model._errors import InvalidInput
from subengine.model._events import NewEvent, new_event_id_bytes
from subengine.model._json import fast_loads
from subengine.streams._append import prepare
from subengine.streams._append_json import prepare_json

SMALL = Settings().with_changes(max_event_bytes=300)


def general_path_takes(events: list[Any], settings: Settings) -> bool:
    try:
        prepare("s", [NewEvent.from_json(event) for event in events], None, settings)
    except InvalidInput:
        return False
    return True


def sent(params: dict[str, Any]) -> list[Any]:
    payload: bytes = params["events"].obj
    return list(json.loads(payload))


@pytest.mark.parametrize(
    "text",
    [
        b'{"n": 12345678901234567890123}',  # orjson: a float
        b'{"n": -9999999999999999999}',  # below -2**63: a float
        b'{"n": "1234567890123456789"}',  # in a string, but a digit run is a digit run
        b"[NaN]",
        b'["\\ud800"]',  # a lone surrogate, which json.loads takes
        b"\xef\xbb\xbf[1]",  # a byte order mark, which json.loads takes
        "[1]".encode("utf-16"),
        b"[" * 1025 + b"]" * 1025,
    ],
)
def test_orjson_is_not_trusted_where_it_could_differ(text: bytes) -> None:
    with pytest.raises(ValueError):
        fast_loads(text)


@pytest.mark.parametrize(
    "text",
    [
        b'[{"key": "a", "type": "T", "data": {"z": 1e2, "a": [1.50, -0.0, 1e-7, 0.1]}}]',
        b'{"n": 922337203685477580, "m": -922337203685477580, "e": 1E+300, "f": 2.5e-300}',
        b'{"s": "\\u00e9\\ud83d\\ude00\\u2028 \\"q\\" \\\\ \\/", "d": 1, "d": 2}',
    ],
)
def test_orjson_decodes_what_json_loads_decodes(text: bytes) -> None:
    decoded = fast_loads(text)
    assert repr(decoded) == repr(json.loads(text))


@given(value=st.recursive(st.integers() | st.floats() | st.text(), st.lists, max_leaves=8))
def test_whatever_orjson_decodes_json_loads_decodes_alike(value: Any) -> None:
    text = json.dumps(value).encode()
    try:
        decoded = fast_loads(text)
    except ValueError:
        return
    assert repr(decoded) == repr(json.loads(text))


def test_new_ids_as_bytes_are_time_ordered_uuids() -> None:
    made = new_event_id_bytes(50)
    ids = [uuid.UUID(bytes=made[i : i + 16]) for i in range(0, len(made), 16)]
    assert len(set(ids)) == 50
    assert {(i.version, i.variant) for i in ids} == {(7, uuid.RFC_4122)}
    assert len({i.int >> 80 for i in ids}) == 1  # one millisecond for the call
    assert new_event_id_bytes(0) == b""


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=["Cs"])),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=16,
)
event_fields = st.fixed_dictionaries(
    {},
    optional={
        "key": st.sampled_from(["a", "", " b ", "\x00", "é", 7]),
        "type": st.sampled_from(["T", "", " T", "x" * 201, None]),
        "data": json_values,
        "metadata": st.none()
        | st.dictionaries(st.text(max_size=3), json_values, max_size=2)
        | st.just([1]),
        "id": st.none() | st.just(str(uuid.uuid4()).upper()) | st.just("nope") | st.just(5),
        "occurred_at": st.none()
        | st.sampled_from(
            ["2026-01-02t03:04:05.1234567z", "2026-01-02T03:04:05+14:00", "0001-01-01T00:00:00Z"]
        )
        | st.just("2026-01-02"),
        "colour": st.just(1),
    },
)


@given(events=st.lists(event_fields | json_values, min_size=1, max_size=4))
def test_prepare_json_vouches_only_for_what_the_general_path_takes(events: list[Any]) -> None:
    params = prepare_json("s", events, None, SMALL)
    if params is not None:
        assert general_path_takes(events, SMALL)
        for event, written in zip(events, sent(params), strict=True):
            assert json.dumps(written["data"]) == json.dumps(event["data"])
            assert written.get("metadata") == event.get("metadata")


def test_ids_and_times_are_sent_as_the_general_path_reads_them() -> None:
    given_id = "{0190A2B3-C4D5-7E6F-8A9B-0C1D2E3F4A5B}"
    event = {"key": "a", "type": "T", "data": 1, "id": given_id}
    event["occurred_at"] = "2026-01-02t03:04:05.1234567z"
    params = prepare_json("s", [event], None, SMALL)
    assert params is not None
    (written,) = sent(params)
    general = NewEvent.from_json(event)
    assert written["id"] == str(general.id)
    assert written["occurred_at"] == "2026-01-02T03:04:05.123456+00:00"  # cut, not rounded
    assert event["id"] == given_id  # the caller's event is left as it was


def test_an_event_whose_floats_the_general_path_writes_longer_is_left_to_it() -> None:
    # json writes 1e-07 in 5 bytes, orjson in 4 ("1e-7"): orjson's size is under the
    # limit, the general path's over it, and it is the one to say so
    data = [1e-07] * 55
    assert len(json.dumps(data, separators=(",", ":"))) + 2 > 300
    events = [{"key": "a", "type": "T", "data": data}]
    assert prepare_json("s", events, None, SMALL) is None
    assert not general_path_takes(events, SMALL)


@pytest.mark.parametrize(
    "events",
    [
        [{"key": "a", "type": "T", "data": "a\u0000b"}],
        [{"key": "a", "type": "T", "data": {"k\u0000": 1}}],
        [{"key": "a", "type": "T", "data": 1, "metadata": {"m": "\u0000"}}],
    ],
)
def test_a_nul_is_left_to_the_general_path_to_name(events: list[Any]) -> None:
    assert prepare_json("s", events, None, SMALL) is None
    assert not general_path_takes(events, SMALL)


def test_an_escaped_backslash_before_u0000_is_data() -> None:
    events = [{"key": "a", "type": "T", "data": "\\u0000"}]
    assert general_path_takes(events, SMALL)
    assert prepare_json("s", events, None, SMALL) is None  # the general path says so
