"""Operating webhook subscriptions (docs/webhooks.md, "Operating") against a real database
and a real `subengine serve` delivering to a receiver on loopback: `subengine webhook
create` subscribes like the PUT and shows the secret once; `pause` stops deliveries and
keeps the positions, `resume` goes on from there; `replay` delivers again from a cursor
or a time in a new generation, and a batch in flight across it commits nothing.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import web
from helpers import (
    DELIVERING,
    Delivery,
    GatewayProcess,
    Receiver,
    echo_and_accept,
    invoke,
    run_subengine,
    wait_for,
)
from standardwebhooks import Webhook as Verifier

import subengine
from subengine import NewEvent

KEY = "one-key"  # every event in one partition


def create(cli_env: dict[str, str], webhook_id: str, receiver: Receiver, *args: str) -> Any:
    """`subengine webhook create` of stream orders, with loopback allowed; its JSON."""
    made = invoke(
        cli_env, "webhook", "create", webhook_id, "--callback", receiver.url,
        "--stream", "orders", "--callback-allow", "127.0.0.0/8", "--json", *args,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout)


def active(engine: subengine.Engine, webhook_id: str) -> None:
    wait_for(lambda: engine.webhook(webhook_id).state == "active", "the consent")


def batches(receiver: Receiver, secret: str) -> list[dict[str, Any]]:
    return [Verifier(secret).verify(d.body, d.headers) for d in receiver.of_type("events")]


def positions(batch: dict[str, Any]) -> list[int]:
    return [event["position"] for event in batch["events"]]


def test_create_subscribes_like_the_put_and_shows_the_secret_once(
    engine: subengine.Engine,
    orders: str,
    hooks: GatewayProcess,
    receiver: Receiver,
    cli_env: dict[str, str],
) -> None:
    engine.append("orders", [NewEvent(KEY, "Other", {}), NewEvent(KEY, "Wanted", {"n": 1})])
    made = create(
        cli_env, "made-here", receiver, "--type", "Wanted", "--start", "beginning",
        "--max-events", "5",
    )  # fmt: skip
    assert made["state"] == "pending" and made["secret"].startswith("whsec_")
    assert made["streams"] == {"orders": {"type": ["Wanted"]}} and made["max_events"] == 5
    active(engine, "made-here")
    wait_for(lambda: receiver.of_type("events"), "a delivery")
    [batch] = batches(receiver, made["secret"])
    assert [e["type"] for e in batch["events"]] == ["Wanted"] and batch["after"] == 0
    # never shown again: not by show, not when the same definition renews the lease
    shown = invoke(cli_env, "webhook", "show", "made-here")
    assert made["secret"] not in shown.stdout and "paused: False" in shown.stdout
    again = invoke(
        cli_env, "webhook", "create", "made-here", "--callback", receiver.url, "--stream",
        "orders", "--type", "Wanted", "--max-events", "5", "--callback-allow", "127.0.0.0/8",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "renewed" in again.stdout and "secret" not in again.stdout
    # another definition under the id: refused, in one line
    other = invoke(
        cli_env, "webhook", "create", "made-here", "--callback", receiver.url,
        "--stream", "orders", "--callback-allow", "127.0.0.0/8",
    )  # fmt: skip
    assert other.returncode != 0 and "another callback, streams or options" in other.stderr


def test_create_refuses_a_callback_it_may_not_reach_and_stores_nothing(
    engine: subengine.Engine, orders: str, receiver: Receiver, cli_env: dict[str, str]
) -> None:
    refused = invoke(
        cli_env, "webhook", "create", "internal", "--callback", receiver.url, "--stream", "orders"
    )
    assert refused.returncode != 0
    [line] = refused.stderr.strip().splitlines()
    assert "loopback" in line and "--callback-allow 127.0.0.1/32" in line
    unknown = invoke(
        cli_env, "webhook", "create", "nowhere", "--callback", receiver.url,
        "--stream", "no-such-stream", "--callback-allow", "127.0.0.0/8",
    )  # fmt: skip
    assert unknown.returncode != 0 and "no-such-stream" in unknown.stderr
    assert engine.webhooks() == []


def test_a_paused_webhook_delivers_nothing_and_resumes_where_it_stood(
    engine: subengine.Engine,
    orders: str,
    hooks: GatewayProcess,
    receiver: Receiver,
    cli_env: dict[str, str],
) -> None:
    secret = create(cli_env, "pausable", receiver)["secret"]
    active(engine, "pausable")
    engine.append("orders", [NewEvent(KEY, "T", {}) for _ in range(2)])
    wait_for(lambda: engine.webhook("pausable").lag == 0, "the first events delivered")
    paused = invoke(cli_env, "webhook", "pause", "pausable")
    assert paused.returncode == 0, paused.stderr
    sent = len(receiver.of_type("events"))
    engine.append("orders", [NewEvent(KEY, "T", {}) for _ in range(3)])
    time.sleep(3)  # the gateway looks every second
    assert len(receiver.of_type("events")) == sent
    hook = engine.webhook("pausable")
    assert hook.paused and hook.lag == 3 and hook.state == "active"
    listed = invoke(cli_env, "webhook", "list", "--json")
    assert json.loads(listed.stdout)["paused"] is True
    resumed = invoke(cli_env, "webhook", "resume", "pausable")
    assert resumed.returncode == 0, resumed.stderr
    wait_for(lambda: engine.webhook("pausable").lag == 0, "the rest delivered")
    delivered = [p for batch in batches(receiver, secret) for p in positions(batch)]
    assert delivered == [1, 2, 3, 4, 5]
    assert not engine.webhook("pausable").paused


def test_replay_delivers_again_from_a_cursor_or_a_time_in_a_new_generation(
    engine: subengine.Engine,
    orders: str,
    hooks: GatewayProcess,
    receiver: Receiver,
    cli_env: dict[str, str],
) -> None:
    secret = create(cli_env, "replayed", receiver)["secret"]
    active(engine, "replayed")
    cursor = web.get(f"{hooks.url}/v1/streams/orders", timeout=30).json()["cursor"]
    engine.append("orders", [NewEvent(KEY, "T", {}) for _ in range(3)])
    time.sleep(0.01)
    middle = datetime.now(UTC)
    engine.append("orders", [NewEvent(KEY, "T", {}) for _ in range(2)])
    wait_for(lambda: engine.webhook("replayed").lag == 0, "every event delivered")
    sent = len(receiver.of_type("events"))

    replayed = invoke(cli_env, "webhook", "replay", "replayed", "--after", cursor)
    assert replayed.returncode == 0, replayed.stderr
    wait_for(lambda: engine.webhook("replayed").lag == 0, "delivered again")
    again = batches(receiver, secret)[sent:]
    assert [p for b in again for p in positions(b)] == [1, 2, 3, 4, 5]
    assert {b["generation"] for b in again} == {2} and again[0]["after"] == 0
    sent = len(receiver.of_type("events"))

    by_time = invoke(
        cli_env, "webhook", "replay", "replayed", "--since", middle.isoformat(), "--json"
    )
    assert by_time.returncode == 0, by_time.stderr
    assert json.loads(by_time.stdout)["stream"] == "orders"
    wait_for(lambda: engine.webhook("replayed").lag == 0, "delivered again")
    again = batches(receiver, secret)[sent:]
    assert [p for b in again for p in positions(b)] == [4, 5]
    assert {b["generation"] for b in again} == {3}

    for bad in (["--since", "yesterday"], [], ["--after", "not-a-cursor"]):
        refused = invoke(cli_env, "webhook", "replay", "replayed", *bad)
        assert refused.returncode != 0 and refused.stderr.strip().count("\n") <= 1, bad
    missing = invoke(cli_env, "webhook", "replay", "nobody", "--since", middle.isoformat())
    assert missing.returncode != 0 and "no webhook subscription 'nobody'" in missing.stderr


def test_a_batch_in_flight_across_a_replay_commits_nothing(
    engine: subengine.Engine,
    orders: str,
    hooks: GatewayProcess,
    receiver: Receiver,
    cli_env: dict[str, str],
) -> None:
    secret = create(cli_env, "fenced", receiver)["secret"]
    active(engine, "fenced")
    cursor = web.get(f"{hooks.url}/v1/streams/orders", timeout=30).json()["cursor"]
    replayed = threading.Event()

    def replay_while_in_flight(delivery: Delivery) -> tuple[int, bytes, dict[str, str]]:
        if delivery.json()["type"] == "events" and not replayed.is_set():
            replayed.set()
            # a process: this runs in the receiver's thread, beside the test's
            done = run_subengine(cli_env, "webhook", "replay", "fenced", "--after", cursor)
            assert done.returncode == 0, done.stderr
        return echo_and_accept(delivery)  # a success, for a generation that is gone

    receiver.answer = replay_while_in_flight
    engine.append("orders", [NewEvent(KEY, "T", {}) for _ in range(3)])
    wait_for(lambda: len(receiver.of_type("events")) >= 2, "the batch sent again")
    wait_for(lambda: engine.webhook("fenced").lag == 0, "no lag")
    first, second = batches(receiver, secret)[:2]
    assert (first["generation"], second["generation"]) == (1, 2)
    assert positions(first) == positions(second) == [1, 2, 3]


def test_create_for_an_api_key_makes_it_that_keys_alone(
    engine: subengine.Engine,
    orders: str,
    receiver: Receiver,
    cli_env: dict[str, str],
    tmp_path: Path,
) -> None:
    owner, mine = engine.create_api_key(["read"], ["orders"], name="mine")
    _, theirs = engine.create_api_key(["read"], ["orders"], name="theirs")
    create(cli_env, "owned", receiver, "--api-key", owner.id)
    unknown = invoke(
        cli_env, "webhook", "create", "stray", "--callback", receiver.url, "--stream", "orders",
        "--callback-allow", "127.0.0.0/8", "--api-key", "no-such-key",
    )  # fmt: skip
    assert unknown.returncode != 0 and "no API key 'no-such-key'" in unknown.stderr
    with GatewayProcess(cli_env, *DELIVERING, tmp=tmp_path) as gateway:

        def shown(token: str) -> int:
            answer = web.get(
                f"{gateway.url}/v1/webhooks/owned",
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
            return answer.status_code

        assert (shown(mine), shown(theirs)) == (200, 404)
    assert [hook.id for hook in engine.webhooks()] == ["owned"]
