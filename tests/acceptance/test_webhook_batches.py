"""A retried webhook batch is the same batch (docs/webhooks.md, DESIGN.md "A retry is the
same batch"): its bounds are stored when it is first read, so every attempt, from any
`subengine serve` process, sends the same events under the same webhook-id, however many
events were appended meanwhile; only after it succeeds does the next batch start. A
receiver that applies each webhook-id once then applies every event exactly once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import web
from helpers import DELIVERING, Delivery, GatewayProcess, Receiver, echo_and_accept, wait_for
from standardwebhooks import Webhook as Verifier

import subengine
from subengine import NewEvent

KEY = "one-key"  # every event in one partition: a retry could grow


def subscribe(gateway: GatewayProcess, receiver: Receiver, webhook_id: str, **fields: Any) -> str:
    """Subscribe `receiver` to `orders` and wait for its consent; the secret."""
    body = {"callback": receiver.url, "streams": ["orders"], **fields}
    answer = web.put(f"{gateway.url}/v1/webhooks/{webhook_id}", json=body, timeout=30)
    assert answer.status_code == 202, answer.text

    def active() -> bool:
        shown = web.get(f"{gateway.url}/v1/webhooks/{webhook_id}", timeout=30)
        return bool(shown.json()["state"] == "active")

    wait_for(active, "the consent")
    return str(answer.json()["secret"])


def append(engine: subengine.Engine, count: int, tag: str) -> list[str]:
    stored = engine.append("orders", [NewEvent(KEY, "T", {"tag": tag}) for _ in range(count)])
    return [str(event.id) for event in stored]


class Deduplicating:
    """A receiver's application: it applies a batch's events once per webhook-id, as a
    Standard Webhooks receiver that de-duplicates by id would."""

    def __init__(self, secret: str) -> None:
        self._verifier = Verifier(secret)
        self.seen: set[str] = set()
        self.applied: Counter[str] = Counter()

    def apply(self, deliveries: list[Delivery]) -> Counter[str]:
        for delivery in deliveries:
            message = delivery.headers["webhook-id"]
            if message in self.seen:
                continue
            self.seen.add(message)
            batch = self._verifier.verify(delivery.body, delivery.headers)
            self.applied.update(event["id"] for event in batch["events"])
        return self.applied


def test_a_batch_that_grew_between_attempts_is_sent_again_as_it_was(
    engine: subengine.Engine,
    orders: str,
    cli_env: dict[str, str],
    tmp_path: Path,
    receiver: Receiver,
) -> None:
    with GatewayProcess(cli_env, *DELIVERING, tmp=tmp_path) as gateway:
        secret = subscribe(gateway, receiver, "grown", max_events=50)
        first_attempt = threading.Event()
        later: list[str] = []

        def fail_the_first_and_grow_it(delivery: Delivery) -> tuple[int, bytes, dict[str, str]]:
            if delivery.json()["type"] == "events" and not first_attempt.is_set():
                first_attempt.set()
                later.extend(append(engine, 5, "later"))  # committed before the retry
                return 503, b"busy", {"Retry-After": "1"}
            return echo_and_accept(delivery)

        receiver.answer = fail_the_first_and_grow_it
        first = append(engine, 3, "first")
        wait_for(lambda: len(receiver.of_type("events")) >= 3, "the retry and the next batch")
        attempt, retry, following = (
            Verifier(secret).verify(d.body, d.headers) for d in receiver.of_type("events")[:3]
        )
        deliveries = receiver.of_type("events")
        assert deliveries[1].headers["webhook-id"] == deliveries[0].headers["webhook-id"]
        assert retry == attempt
        assert [e["id"] for e in retry["events"]] == first
        assert retry["through"] - retry["after"] == 3
        # only then the next batch, right after it, with the events appended meanwhile
        assert deliveries[2].headers["webhook-id"] != deliveries[0].headers["webhook-id"]
        assert following["after"] == retry["through"]
        assert [e["id"] for e in following["events"]] == later


def test_a_batch_in_flight_when_its_process_is_killed_comes_again_as_it_was(
    engine: subengine.Engine,
    orders: str,
    cli_env: dict[str, str],
    tmp_path: Path,
    receiver: Receiver,
) -> None:
    first = GatewayProcess(cli_env, *DELIVERING, tmp=tmp_path).start()
    try:
        secret = subscribe(first, receiver, "survivor", max_events=20)
        killed = threading.Event()

        def slow_first(delivery: Delivery) -> tuple[int, bytes, dict[str, str]]:
            if delivery.json()["type"] == "events" and not killed.is_set():
                time.sleep(3)  # in flight when its process is killed (the answer is lost)
            return echo_and_accept(delivery)

        receiver.answer = slow_first
        wanted = append(engine, 4, "first")
        wait_for(lambda: receiver.of_type("events"), "a batch in flight")
        wanted += append(engine, 6, "meanwhile")  # the batch in flight would grow by these
        first.kill()
        killed.set()
    finally:
        if first.process is not None and first.process.poll() is None:
            first.kill()
    application = Deduplicating(secret)
    with GatewayProcess(cli_env, *DELIVERING, tmp=tmp_path):
        wait_for(
            lambda: set(application.apply(receiver.of_type("events"))) == set(wanted),
            "every event applied",
            timeout=60,
        )
        wait_for(lambda: engine.webhook("survivor").lag == 0, "no lag")
    assert application.applied == Counter(wanted)  # each exactly once
    [in_flight, again, *_] = receiver.of_type("events")
    assert again.headers["webhook-id"] == in_flight.headers["webhook-id"]
    sent, resent = (Verifier(secret).verify(d.body, d.headers) for d in (in_flight, again))
    assert resent == sent and len(sent["events"]) == 4
