"""A delivery's body and signature made as bytes (gateway/_delivery_bodies.py): the body's
fields in the documented order, the events spliced in as given, and Standard Webhooks
signatures that the `standardwebhooks` package verifies, one per key during a rotation.
No database."""

from __future__ import annotations

import base64
import json

import pytest
from standardwebhooks import Webhook as Verifier
from standardwebhooks.webhooks import WebhookVerificationError

from subengine.gateway._delivery_bodies import batch_body, signed_headers
from subengine.model._gateway_cursor import GatewayCursor

OLD = "whsec_" + base64.b64encode(b"o" * 32).decode()
NEW = "whsec_" + base64.b64encode(b"n" * 24).decode()


def test_a_body_has_the_documented_fields_in_order_with_the_events_as_given() -> None:
    events = b'{"id":"a","data":{"x": 0.10000000000000000000001, "t": "\xc3\xa9"}},{"id":"b"}'
    body = batch_body("sub-1", 2, "orders", 3, 41, 45, events, b"", "c1.AAA")
    parsed = json.loads(body)
    assert list(parsed) == [
        "type", "subscription", "generation", "stream", "partition", "after", "through",
        "events", "tombstones", "cursor",
    ]  # fmt: skip
    assert parsed["events"] == [{"id": "a", "data": {"x": 0.1, "t": "é"}}, {"id": "b"}]
    assert b'"x": 0.10000000000000000000001' in body
    assert (parsed["type"], parsed["subscription"], parsed["generation"]) == ("events", "sub-1", 2)
    assert (parsed["after"], parsed["through"], parsed["tombstones"]) == (41, 45, [])
    assert parsed["cursor"] == "c1.AAA"


def test_a_tombstone_body_has_no_events() -> None:
    body = batch_body("s", 1, "orders", 0, 9, 20, b"", b'{"gap_from":10}', "c1.B")
    assert json.loads(body)["events"] == [] and json.loads(body)["tombstones"] == [{"gap_from": 10}]


@pytest.mark.parametrize("keys", [(NEW,), (NEW, OLD)])
def test_every_key_signs_the_body_as_sent(keys: tuple[str, ...]) -> None:
    body = batch_body("s", 1, "orders", 0, 0, 1, '{"t":"é \u2028"}'.encode(), b"", "c1.B")
    headers = signed_headers("msg_1", body, keys)
    assert headers["webhook-id"] == "msg_1"
    assert len(headers["webhook-signature"].split(" ")) == len(keys)
    for key in keys:
        assert Verifier(key).verify(body, headers)["events"] == [{"t": "é \u2028"}]
    with pytest.raises(WebhookVerificationError):
        Verifier(NEW).verify(body + b" ", headers)


def test_a_cursor_is_any_gateway_cursor_text() -> None:
    cursor = GatewayCursor({}).encode()
    assert json.loads(batch_body("s", 1, "o", 0, 0, 1, b"", b"", cursor))["cursor"] == cursor
