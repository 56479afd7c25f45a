"""Webhook subscriptions (docs/webhooks.md) on real `subengine serve` processes, delivering
to a real receiver on loopback (allowed with --callback-allow).

Consent comes first; deliveries keep per-partition order, each batch says where it
starts (`after`) and ends (`through`), is signed with Standard Webhooks headers and keeps
its webhook-id across retries; nothing is lost when the receiver is down or a delivering
process is killed; 410, lease expiry and the failure timeout end a subscription.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import web
from helpers import (
    DELIVERING,
    Delivery,
    GatewayProcess,
    Receiver,
    echo_and_accept,
    run_subengine,
    scrape,
    value,
    wait_for,
)
from standardwebhooks import Webhook as Verifier

import subengine
from subengine import NewEvent
from subengine.gateway import GatewayCursor, StreamPosition

TIMEOUT = httpx.Timeout(30.0)


def subscribe(
    gateway: GatewayProcess, webhook_id: str, callback: str, **fields: Any
) -> httpx.Response:
    body = {"callback": callback, "streams": ["orders"], **fields}
    return web.put(f"{gateway.url}/v1/webhooks/{webhook_id}", json=body, timeout=TIMEOUT)


def state(gateway: GatewayProcess, webhook_id: str) -> str | None:
    answer = web.get(f"{gateway.url}/v1/webhooks/{webhook_id}", timeout=TIMEOUT)
    return answer.json()["state"] if answer.status_code == 200 else None


def verified(delivery: Delivery, secret: str) -> Any:
    return Verifier(secret).verify(delivery.body, delivery.headers)


def batches(receiver: Receiver, secret: str) -> list[dict[str, Any]]:
    """The event batches `receiver` got, each verified with `secret`."""
    return [verified(d, secret) for d in receiver.of_type("events")]


def accepted_in_order(
    batches: list[dict[str, Any]], start: dict[int, int] | None = None
) -> dict[int, list[int]]:
    """Each partition's positions as a P3Sub subscriber accepts `batches` from `start`, in
    the order they arrived: a batch only when it starts right after the last one
    accepted; a repeat is dropped, and one that starts beyond fails the test."""
    taken: dict[int, list[int]] = {}
    last: dict[int, int] = dict(start or {})
    for batch in batches:
        partition = batch["partition"]
        if batch["after"] != last.get(partition, 0):
            assert batch["after"] < last.get(partition, 0), f"out of order: {batch}"
            continue
        taken.setdefault(partition, []).extend(e["position"] for e in batch["events"])
        last[partition] = batch["through"]
    return taken


def assert_nothing_more_sent(engine: subengine.Engine, receiver: Receiver) -> None:
    """An append now brings the receiver nothing (given 2 s to)."""
    sent = len(receiver.received)
    engine.append("orders", [NewEvent("k", "T", {})])
    time.sleep(2)
    assert len(receiver.received) == sent


def test_a_callback_consents_first_then_gets_every_event_in_order_signed(
    engine: subengine.Engine, orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    engine.append("orders", [NewEvent(f"before-{n}", "T", {"n": n}) for n in range(5)])
    start = engine.heads("orders")
    answer = subscribe(hooks, "sub-1", receiver.url, max_events=7)
    assert answer.status_code == 202, answer.text
    created = answer.json()
    assert created["state"] == "pending" and created["secret"].startswith("whsec_")
    secret = created["secret"]
    wait_for(lambda: state(hooks, "sub-1") == "active", "the consent")
    [challenge] = receiver.of_type("challenge")
    assert verified(challenge, secret)["subscription"] == "sub-1"
    assert "secret" not in web.get(f"{hooks.url}/v1/webhooks/sub-1").json()

    stored = engine.append("orders", [NewEvent(f"k{n % 9}", "T", {"n": n}) for n in range(60)])
    heads = engine.heads("orders")
    wanted = {
        p: list(range(heads[p] - sum(a.partition == p for a in stored) + 1, heads[p] + 1))
        for p in heads
    }
    wanted = {p: positions for p, positions in wanted.items() if positions}

    def batches() -> list[dict[str, Any]]:
        return [verified(d, secret) for d in receiver.of_type("events")]

    wait_for(lambda: accepted_in_order(batches(), start) == wanted, "every event delivered")
    for batch in batches():
        assert batch["subscription"] == "sub-1" and batch["generation"] == 1
        assert batch["stream"] == "orders" and batch["tombstones"] == []
        assert 1 <= len(batch["events"]) <= 7
        assert batch["through"] == batch["events"][-1]["position"]
        assert batch["after"] == batch["events"][0]["position"] - 1
        assert all(e["data"]["n"] >= 0 for e in batch["events"])  # events after the start only
    # nothing from before the subscription ("now" is the default start)
    assert {e["key"] for b in batches() for e in b["events"]}.isdisjoint(
        {f"before-{n}" for n in range(5)}
    )
    # a delivered batch's position commits after its POST, and successes are recorded
    # about every second: the lag and the count follow shortly
    wait_for(lambda: engine.webhook("sub-1").lag == 0, "no lag")
    wait_for(lambda: engine.webhook("sub-1").delivered == 60, "the count")
    assert engine.webhook("sub-1").state == "active"


def test_a_refused_challenge_ends_the_subscription(
    orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    receiver.answer = lambda delivery: (403, b"no thanks", {})
    assert subscribe(hooks, "unwanted", receiver.url).status_code == 202
    wait_for(lambda: state(hooks, "unwanted") is None, "the refusal")
    assert len(receiver.of_type("challenge")) == 1
    assert receiver.of_type("events") == []


def test_a_wrong_echo_is_a_refusal_too(
    orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    receiver.answer = lambda delivery: (200, b'{"challenge": "something else"}', {})
    assert subscribe(hooks, "echo", receiver.url).status_code == 202
    wait_for(lambda: state(hooks, "echo") is None, "the refusal")


def active(gateway: GatewayProcess, receiver: Receiver, webhook_id: str, **fields: Any) -> str:
    """Subscribe and wait for the consent; the secret."""
    answer = subscribe(gateway, webhook_id, receiver.url, **fields)
    assert answer.status_code == 202, answer.text
    wait_for(lambda: state(gateway, webhook_id) == "active", "the consent")
    return str(answer.json()["secret"])


def appended(engine: subengine.Engine, count: int, start: dict[int, int]) -> dict[int, list[int]]:
    """Append `count` events; each partition's new positions."""
    engine.append("orders", [NewEvent(f"k{n % 11}", "T", {"n": n}) for n in range(count)])
    heads = engine.heads("orders")
    return {p: list(range(start[p] + 1, heads[p] + 1)) for p in heads if heads[p] > start[p]}


def test_retries_keep_the_webhook_id_and_honour_retry_after(
    engine: subengine.Engine, orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    secret = active(hooks, receiver, "retried")
    refusals = 0

    def busy_twice(delivery: Delivery) -> tuple[int, bytes, dict[str, str]]:
        nonlocal refusals
        if delivery.json()["type"] == "events" and refusals < 2:
            refusals += 1
            return 503, b"busy", {"Retry-After": "1"}
        return 204, b"", {}

    receiver.answer = busy_twice
    engine.append("orders", [NewEvent("one-key", "T", {})])
    wait_for(lambda: len(receiver.of_type("events")) == 3, "two retries and a success")
    attempts = receiver.of_type("events")
    assert len({d.headers["webhook-id"] for d in attempts}) == 1
    assert all(verified(d, secret)["events"][0]["key"] == "one-key" for d in attempts)

    def recorded() -> tuple[str, int, str | None]:
        hook = engine.webhook("retried")
        return hook.state, hook.attempts, hook.last_error

    # successes are recorded once per supervisor round, not with the delivery
    wait_for(lambda: recorded() == ("active", 0, None), "the success recorded")


def test_a_receiver_down_for_30_s_gets_every_event_in_order_when_it_is_back(
    engine: subengine.Engine, orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    secret = active(hooks, receiver, "patient", max_events=5)
    start = engine.heads("orders")
    receiver.down()
    wanted = appended(engine, 40, start)
    wait_for(lambda: engine.webhook("patient").state == "failing", "failing")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # more events while it is down
        wanted = appended(engine, 2, start)
        time.sleep(1)
    hook = engine.webhook("patient")
    assert hook.state == "failing" and hook.attempts >= 2 and hook.lag > 0
    assert "unreachable" in (hook.last_error or "")
    receiver.up()
    wait_for(
        lambda: accepted_in_order(batches(receiver, secret), start) == wanted,
        "every event",
        timeout=60,
    )
    wait_for(lambda: engine.webhook("patient").state == "active", "active again")
    wait_for(lambda: engine.webhook("patient").lag == 0, "no lag")


def test_a_killed_delivering_process_loses_nothing(
    engine: subengine.Engine,
    orders: str,
    cli_env: dict[str, str],
    tmp_path: Path,
    receiver: Receiver,
) -> None:
    first = GatewayProcess(cli_env, *DELIVERING, tmp=tmp_path).start()
    secret = active(first, receiver, "survivor", max_events=10)
    start = engine.heads("orders")
    slow = threading.Event()

    def slow_answer(delivery: Delivery) -> tuple[int, bytes, dict[str, str]]:
        if delivery.json()["type"] == "events" and not slow.is_set():
            time.sleep(3)  # the batch is in flight when its process is killed
        return 204, b"", {}

    receiver.answer = slow_answer
    wanted = appended(engine, 30, start)
    wait_for(lambda: receiver.of_type("events"), "a batch in flight")
    first.kill()
    slow.set()
    with GatewayProcess(cli_env, *DELIVERING, tmp=tmp_path):
        wait_for(
            lambda: accepted_in_order(batches(receiver, secret), start) == wanted,
            "every event",
            timeout=60,
        )
    # the batch in flight at the kill was sent again, under the same webhook-id
    ids = [d.headers["webhook-id"] for d in receiver.of_type("events")]
    assert len(ids) > len(set(ids))


def test_410_gone_cancels_the_subscription(
    engine: subengine.Engine, orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    active(hooks, receiver, "cancelled")
    receiver.answer = lambda d: (
        (200, b'{"challenge": "x"}', {}) if d.json()["type"] == "challenge" else (410, b"", {})
    )
    engine.append("orders", [NewEvent("k", "T", {})])
    wait_for(lambda: state(hooks, "cancelled") is None, "the cancellation")
    assert engine.webhooks() == []
    assert not [s for s in engine.subscriptions() if s.name.startswith("webhook.")]
    assert_nothing_more_sent(engine, receiver)


def test_a_lease_not_renewed_expires_and_is_cleaned_up(
    engine: subengine.Engine,
    orders: str,
    hooks: GatewayProcess,
    receiver: Receiver,
    sql: psycopg.Connection[Any],
) -> None:
    active(hooks, receiver, "leased", lease_seconds=60)
    # a renewal (the same PUT again) moves the lease on
    before = engine.webhook("leased").expires_at
    assert subscribe(hooks, "leased", receiver.url, lease_seconds=120).status_code == 200
    assert engine.webhook("leased").expires_at > before
    # the lease's end brought forward behind subengine's back: a change its own statements
    # make notifies every gateway, so this one does too (else it is seen at the next
    # safety poll, a minute away: docs/webhooks.md)
    sql.execute("UPDATE subengine.webhooks SET expires_at = now() WHERE id = 'leased'")
    sql.execute("SELECT pg_notify('subengine', 'gateway_webhooks')")
    wait_for(lambda: engine.webhook("leased").state == "expired", "the expiry")
    assert not [s for s in engine.subscriptions() if s.name.startswith("webhook.")]
    assert_nothing_more_sent(engine, receiver)


def test_failing_longer_than_the_failure_timeout_marks_it_failed_and_pull_still_works(
    engine: subengine.Engine,
    orders: str,
    cli_env: dict[str, str],
    tmp_path: Path,
    receiver: Receiver,
) -> None:
    timeout = ("--webhook-failure-timeout", "3")
    with GatewayProcess(cli_env, *DELIVERING, *timeout, tmp=tmp_path) as gateway:
        active(gateway, receiver, "broken")
        receiver.answer = lambda d: (500, b"oops", {})
        engine.append("orders", [NewEvent("k", "T", {})])
        wait_for(lambda: engine.webhook("broken").state == "failed", "failed")
        hook = engine.webhook("broken")
        assert hook.last_error == "the callback answered 500" and hook.lag == 1
        time.sleep(1)  # a retry sent just before the state changed has come
        assert_nothing_more_sent(engine, receiver)  # deliveries stopped
        pulled = web.get(f"{gateway.url}/v1/streams/orders/events?after=beginning", timeout=TIMEOUT)
        assert len(pulled.json()["events"]) == 2


def test_a_new_id_that_replaces_the_old_fences_it(
    engine: subengine.Engine, orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    active(hooks, receiver, "old")
    answer = subscribe(hooks, "new", receiver.url, replaces="old", start="beginning")
    assert answer.status_code == 202, answer.text
    assert state(hooks, "old") is None
    wait_for(lambda: state(hooks, "new") == "active", "the consent")
    engine.append("orders", [NewEvent("k", "T", {})])
    wait_for(lambda: receiver.of_type("events"), "a delivery")
    assert {d.json()["subscription"] for d in receiver.of_type("events")} == {"new"}


def test_a_rotated_secret_signs_beside_the_old_one_for_an_overlap(
    engine: subengine.Engine, orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    old = active(hooks, receiver, "rotating")
    new = "whsec_" + base64.b64encode(b"n" * 32).decode()
    answer = subscribe(hooks, "rotating", receiver.url, secret=new)
    assert answer.status_code == 200 and answer.json()["secret"] == new
    engine.append("orders", [NewEvent("k", "T", {})])
    wait_for(lambda: receiver.of_type("events"), "a delivery")
    [delivery] = receiver.of_type("events")
    assert verified(delivery, new) and verified(delivery, old)
    assert len(delivery.headers["webhook-signature"].split(" ")) == 2


def test_another_definition_under_the_same_id_is_a_conflict(
    orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    active(hooks, receiver, "fixed")
    answer = subscribe(hooks, "fixed", receiver.url, max_events=3)
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "webhook_conflict"


@pytest.mark.parametrize(
    ("callback", "why"),
    [
        ("http://127.0.0.1:{port}/hook", "loopback"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://[::ffff:127.0.0.1]:{port}/hook", "loopback"),
        ("http://10.1.2.3/hook", "private"),
    ],
)
def test_a_callback_to_a_private_address_is_refused_and_nothing_is_stored(
    orders: str, gateway: GatewayProcess, receiver: Receiver, callback: str, why: str
) -> None:
    answer = subscribe(gateway, "sneaky", callback.format(port=receiver.port))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "callback_refused" and why in error["message"]
    assert state(gateway, "sneaky") is None
    time.sleep(1)
    assert receiver.received == []


def test_a_redirect_is_not_followed(
    engine: subengine.Engine, orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    elsewhere = Receiver()
    try:
        active(hooks, receiver, "redirected")
        receiver.answer = lambda d: (307, b"", {"Location": elsewhere.url})
        engine.append("orders", [NewEvent("k", "T", {})])
        wait_for(lambda: engine.webhook("redirected").state == "failing", "failing")
        assert "307" in (engine.webhook("redirected").last_error or "")
        assert elsewhere.received == []
    finally:
        elsewhere.close()


def test_the_webhook_commands_show_and_delete(
    engine: subengine.Engine,
    orders: str,
    hooks: GatewayProcess,
    receiver: Receiver,
    cli_env: dict[str, str],
) -> None:
    secret = active(hooks, receiver, "shown")
    listed = run_subengine(cli_env, "webhook", "list")
    assert listed.returncode == 0, listed.stderr
    assert "shown" in listed.stdout and "active" in listed.stdout
    shown = run_subengine(cli_env, "webhook", "show", "shown", "--json")
    assert json.loads(shown.stdout)["callback"] == receiver.url
    assert secret not in listed.stdout + shown.stdout
    deleted = run_subengine(cli_env, "webhook", "delete", "shown")
    assert deleted.returncode == 0 and state(hooks, "shown") is None
    missing = run_subengine(cli_env, "webhook", "show", "shown")
    assert missing.returncode != 0 and "no webhook subscription 'shown'" in missing.stderr
    bad = run_subengine(cli_env, "webhook", "show", "no way")
    assert bad.returncode != 0 and "invalid webhook id" in bad.stderr


def test_replacing_a_webhook_that_is_gone_already_is_no_error(
    orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    answer = subscribe(hooks, "after-410", receiver.url, replaces="long-gone")
    assert answer.status_code == 202, answer.text


def test_without_data_an_event_still_carries_its_metadata(
    engine: subengine.Engine, orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    secret = active(hooks, receiver, "lean", include_data=False)
    engine.append("orders", [NewEvent("k", "T", {"secret": "payload"}, metadata={"by": "me"})])
    wait_for(lambda: receiver.of_type("events"), "a delivery")
    [event] = verified(receiver.of_type("events")[0], secret)["events"]
    assert event["metadata"] == {"by": "me"} and "data" not in event


def test_metrics_show_each_webhook_and_what_the_process_delivered(
    engine: subengine.Engine, orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    active(hooks, receiver, "measured")
    engine.append("orders", [NewEvent("k", "T", {}) for _ in range(3)])
    wait_for(
        lambda: value(scrape(hooks.port), "subengine_webhook_events_delivered_total") == 3,
        "the count",
    )
    wait_for(
        lambda: value(scrape(hooks.port), "subengine_webhook_lag_events", webhook="measured") == 0,
        "no lag",
    )
    success = "subengine_webhook_last_success_timestamp_seconds"
    wait_for(lambda: value(scrape(hooks.port), success, webhook="measured"), "a success")
    samples = scrape(hooks.port)
    assert value(samples, "subengine_webhook_state", webhook="measured", state="active") == 1
    assert value(samples, "subengine_webhook_state", webhook="measured", state="failing") == 0
    assert value(samples, "subengine_webhook_failed_attempts", webhook="measured") == 0
    assert value(samples, "subengine_webhook_deliveries_total", result="delivered") == 1
    assert value(samples, success, webhook="measured") == pytest.approx(time.time(), abs=60)


def test_a_webhook_is_seen_renewed_and_deleted_only_with_the_key_that_made_it(
    engine: subengine.Engine,
    orders: str,
    cli_env: dict[str, str],
    tmp_path: Path,
    receiver: Receiver,
) -> None:
    _, mine = engine.create_api_key(["read"], ["orders"], name="mine")
    _, theirs = engine.create_api_key(["read"], ["orders"], name="theirs")
    url = "/v1/webhooks/owned"
    body = {"callback": receiver.url, "streams": ["orders"]}
    with GatewayProcess(cli_env, *DELIVERING, tmp=tmp_path) as gateway:

        def call(method: str, token: str, **fields: Any) -> httpx.Response:
            return web.request(
                method,
                gateway.url + url,
                json={**body, **fields} if method == "PUT" else None,
                headers={"Authorization": f"Bearer {token}"},
                timeout=TIMEOUT,
            )

        created = call("PUT", mine)
        assert created.status_code == 202, created.text
        other_secret = "whsec_" + base64.b64encode(b"t" * 32).decode()
        renewed = call("PUT", theirs, secret=other_secret)
        assert renewed.status_code == 409 and "another API key" in renewed.text
        assert call("GET", theirs).status_code == 404
        assert call("DELETE", theirs).status_code == 404
        # nor replaced by a webhook of another key
        replacing = web.put(
            f"{gateway.url}/v1/webhooks/other",
            json={**body, "replaces": "owned"},
            headers={"Authorization": f"Bearer {theirs}"},
            timeout=TIMEOUT,
        )
        assert replacing.status_code == 202, replacing.text
        assert call("PUT", mine).status_code == 200
        wait_for(lambda: call("GET", mine).json()["state"] == "active", "the consent")
        [challenge] = [
            d for d in receiver.of_type("challenge") if d.json()["subscription"] == "owned"
        ]
        assert verified(challenge, created.json()["secret"])  # the secret is still its own


def test_with_a_filter_the_batches_still_chain_so_nothing_looks_missed(
    engine: subengine.Engine, orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    secret = active(hooks, receiver, "picky", streams={"orders": {"type": ["Wanted"]}})
    start = engine.heads("orders")
    engine.append("orders", [NewEvent(f"k{n}", "Other", {}) for n in range(8)])
    engine.append("orders", [NewEvent(f"k{n}", "Wanted", {"n": n}) for n in range(8)])
    heads = engine.heads("orders")
    wanted = {
        p: [
            e.position
            for e in engine.read("orders", p, start[p])
            if isinstance(e, subengine.Event) and e.type == "Wanted"
        ]
        for p in heads
        if heads[p] > start[p]
    }

    def through() -> dict[int, int]:
        reached = dict(start)
        for batch in batches(receiver, secret):
            reached[batch["partition"]] = max(reached[batch["partition"]], batch["through"])
        return reached

    wait_for(lambda: through() == heads, "every position passed")
    taken = accepted_in_order(batches(receiver, secret), start)
    assert {p: positions for p, positions in taken.items() if positions} == {
        p: positions for p, positions in wanted.items() if positions
    }
    assert all(e["type"] == "Wanted" for b in batches(receiver, secret) for e in b["events"])


def test_a_replaced_webhook_in_the_middle_of_retries_sends_nothing_more(
    engine: subengine.Engine, orders: str, hooks: GatewayProcess, receiver: Receiver
) -> None:
    # The old webhook's batch keeps failing, so it is in flight or about to be retried
    # when the new id replaces it: its position is deleted with it, so no retry follows.
    active(hooks, receiver, "retrying")
    receiver.answer = lambda d: (
        (503, b"", {}) if d.json().get("subscription") == "retrying" else echo_and_accept(d)
    )
    engine.append("orders", [NewEvent("k", "T", {})])

    def old_posts() -> int:
        return sum(d.json()["subscription"] == "retrying" for d in receiver.of_type("events"))

    wait_for(lambda: old_posts() >= 2, "a retry")
    answer = subscribe(hooks, "replacing", receiver.url, replaces="retrying")
    assert answer.status_code == 202, answer.text
    time.sleep(0.5)  # a POST already on the wire may still arrive
    after_replace = old_posts()
    time.sleep(3)  # retries came every second or so before
    assert old_posts() == after_replace
    assert state(hooks, "retrying") is None


def test_a_tombstone_batch_says_why_its_range_went_and_where_the_head_is(
    engine: subengine.Engine, hooks: GatewayProcess, receiver: Receiver
) -> None:
    engine.create_stream("feed", 1, retention=subengine.Retention(max_events=3))
    engine.append("feed", [NewEvent("k", "T", {"n": n}) for n in range(10)])
    engine.run_retention()
    # a subscriber resuming from before the gap ("beginning" would start at the floor)
    epoch = engine.stream("feed").epoch
    resumed = GatewayCursor({"feed": StreamPosition(epoch, (0,))}).encode()
    answer = subscribe(hooks, "gapped", receiver.url, streams=["feed"], start={"after": resumed})
    assert answer.status_code == 202, answer.text
    secret = answer.json()["secret"]
    wait_for(lambda: any(b["tombstones"] for b in batches(receiver, secret)), "the gap")
    [gap] = [t for b in batches(receiver, secret) for t in b["tombstones"]]
    assert (gap["gap_from"], gap["gap_to"], gap["reason"], gap["head"]) == (1, 7, "cap", 10)


def rounds(gateway: GatewayProcess) -> float:
    """The rounds the gateway's webhook supervisor ran (0 before the first scrape)."""
    return value(scrape(gateway.port), "subengine_webhook_rounds_total") or 0.0


def test_an_idle_gateway_does_not_look_every_second_yet_a_webhook_made_elsewhere_comes_at_once(
    engine: subengine.Engine,
    orders: str,
    cli_env: dict[str, str],
    hooks: GatewayProcess,
    receiver: Receiver,
) -> None:
    wait_for(lambda: rounds(hooks) >= 1, "the first round")
    time.sleep(2)  # its listener connects (which runs a round too)
    before = rounds(hooks)
    time.sleep(5)
    # no webhook, nothing notified, no deadline: no round (each one is a few statements
    # and two connections taken from the pool; they ran every second)
    assert rounds(hooks) - before <= 1

    # another process makes a webhook: its notification wakes the gateway, long before
    # the safety poll (a minute) would
    made = run_subengine(
        cli_env, "webhook", "create", "elsewhere", "--callback", receiver.url,
        "--stream", "orders", "--callback-allow", "127.0.0.0/8", "--json",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    secret = json.loads(made.stdout)["secret"]
    wait_for(lambda: state(hooks, "elsewhere") == "active", "the consent", timeout=20)
    engine.append("orders", [NewEvent("k", "T", {"n": n}) for n in range(3)])
    wait_for(
        lambda: sum(len(b["events"]) for b in batches(receiver, secret)) == 3,
        "the events delivered",
        timeout=20,
    )
