"""What a delivery's body holds (docs/webhooks.md, "Deliveries"), on a real `subengine
serve`: each event as stored, its data passed through rather than decoded and encoded
again, so a number keeps every digit, and the body signed as sent."""

from __future__ import annotations

import json
from typing import Any

import httpx
import psycopg
import web
from helpers import GatewayProcess, Receiver, wait_for
from standardwebhooks import Webhook as Verifier

import subengine
from subengine import NewEvent
from subengine.gateway._delivery_bodies import event_body

TIMEOUT = httpx.Timeout(30.0)
# more digits than a float holds: decoded to a float and encoded again it reads 0.1
PRECISE = "0.10000000000000000000001"


def test_a_delivered_event_is_the_stored_one_to_the_last_digit(
    engine: subengine.Engine,
    orders: str,
    sql: psycopg.Connection[Any],
    hooks: GatewayProcess,
    receiver: Receiver,
) -> None:
    data = {"text": 'é ü \u2028 " \\ \n', "nested": {"list": [1, 2.5, None, True]}}
    [precise, plain] = engine.append(
        "orders", [NewEvent("k1", "T", {}), NewEvent("k2", "Tü", data, metadata={"by": "ü"})]
    )
    sql.execute(
        "UPDATE subengine.events SET data = %s::jsonb WHERE id = %s",
        ('{"x": ' + PRECISE + "}", precise.id),
    )
    body = {"callback": receiver.url, "streams": ["orders"], "start": "beginning"}
    answer = web.put(f"{hooks.url}/v1/webhooks/exact", json=body, timeout=TIMEOUT)
    assert answer.status_code == 202, answer.text
    secret = answer.json()["secret"]
    wait_for(lambda: sum(len(json.loads(d.body)["events"]) for d in receiver.of_type("events"))
             == 2, "both events delivered")  # fmt: skip
    sent: dict[str, Any] = {}
    for delivery in receiver.of_type("events"):
        batch = Verifier(secret).verify(delivery.body, delivery.headers)
        sent.update({event["id"]: event for event in batch["events"]})
        if any(event["id"] == str(precise.id) for event in batch["events"]):
            assert f'"data":{{"x": {PRECISE}}}' in delivery.body.decode()
    stored = {
        str(event.id): event_body(event, True)
        for partition in range(4)
        for event in engine.read("orders", partition, 0, 10)
        if isinstance(event, subengine.Event)
    }
    assert sent[str(plain.id)] == stored[str(plain.id)]
    assert {**sent[str(precise.id)], "data": None} == {**stored[str(precise.id)], "data": None}
