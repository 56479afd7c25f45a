"""API keys at the gateway, over real HTTP: 401 without a usable key, 403 outside a key's
scopes and stream patterns (on every endpoint and inside a watch), a watch usable by its
id alone while its key lives, and a revoked key ending an open event stream."""

from __future__ import annotations

import ipaddress
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import web
from helpers import GatewayProcess, sse_frames, wait_for

import subengine

TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture
def keys(engine: subengine.Engine, orders: str) -> dict[str, Any]:
    engine.create_stream("payments", 2)
    engine.append(orders, [subengine.NewEvent("a", "t", {"n": 1})])
    _, reader = engine.create_api_key(["read"], ["orders*"], name="reader")
    _, writer = engine.create_api_key(["append"], ["*"], name="writer")
    return {"reader": reader, "writer": writer}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_without_a_usable_key_every_endpoint_answers_401(
    keys: dict[str, Any], gateway: GatewayProcess
) -> None:
    for headers in ({}, bearer("sek_000000000000_" + "A" * 43), {"Authorization": "Basic x"}):
        for path in ("/v1/streams", "/v1/streams/orders", "/v1/streams/orders/events"):
            answer = web.get(gateway.url + path, headers=headers, timeout=TIMEOUT)
            assert answer.status_code == 401, (path, headers)
            assert answer.json()["error"]["code"] == "unauthorized"
            assert answer.headers["WWW-Authenticate"] == "Bearer"
    # health needs no key
    assert web.get(f"{gateway.url}/healthz", timeout=TIMEOUT).status_code == 200


def test_scopes_and_stream_patterns_are_enforced(
    keys: dict[str, Any], gateway: GatewayProcess
) -> None:
    reader = bearer(keys["reader"])
    listed = web.get(f"{gateway.url}/v1/streams", headers=reader, timeout=TIMEOUT).json()
    assert [s["name"] for s in listed["streams"]] == ["orders"]
    page = web.get(f"{gateway.url}/v1/streams/orders/events", headers=reader, timeout=TIMEOUT)
    assert page.status_code == 200 and len(page.json()["events"]) == 1
    for path in ("/v1/streams/payments", "/v1/streams/payments/events"):
        answer = web.get(gateway.url + path, headers=reader, timeout=TIMEOUT)
        assert answer.status_code == 403 and answer.json()["error"]["code"] == "forbidden"
    # the append-only key may not read
    answer = web.get(
        f"{gateway.url}/v1/streams/orders/events", headers=bearer(keys["writer"]), timeout=TIMEOUT
    )
    assert answer.status_code == 403
    # nor may a reader watch a stream outside its patterns
    answer = web.post(
        f"{gateway.url}/v1/watch",
        headers=reader,
        json={"streams": {"orders": {}, "payments": {}}},
        timeout=TIMEOUT,
    )
    assert answer.status_code == 403 and "payments" in answer.json()["error"]["message"]


def test_a_watch_is_read_by_its_id_until_its_key_is_revoked(
    engine: subengine.Engine, keys: dict[str, Any], gateway: GatewayProcess
) -> None:
    created = web.post(
        f"{gateway.url}/v1/watch",
        headers=bearer(keys["reader"]),
        json={"streams": {"orders": {"after": "beginning"}}, "heartbeat": 1},
        timeout=TIMEOUT,
    )
    assert created.status_code == 201, created.text
    url = gateway.url + created.json()["url"]
    # another key may not use it
    _, other = engine.create_api_key(["read"], ["*"], name="other")
    assert web.get(url, headers=bearer(other), timeout=TIMEOUT).status_code == 403
    # without a header (a browser's EventSource), the id stands for its key
    with web.stream("GET", url, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        frames = sse_frames(response.iter_lines())
        kinds = []
        for frame in frames:
            kinds.append(frame.kind)
            if frame.kind == "caught-up":
                engine.revoke_api_key(next(k.id for k in engine.api_keys() if k.name == "reader"))
            if frame.kind == "close":
                assert frame.data["code"] == "forbidden"
                break
    assert kinds[0] == "events" and "caught-up" in kinds and kinds[-1] == "close"
    assert web.get(url, timeout=TIMEOUT).status_code == 403


def test_a_revoked_key_ends_an_event_stream_that_frames_keep_busy(
    engine: subengine.Engine, keys: dict[str, Any], gateway: GatewayProcess
) -> None:
    """While appends flow, the hub hands a waiting event stream its frames without waking
    its task (issue 26); the stream still wakes to look at its key, and ends once the
    key is revoked."""
    url = f"{gateway.url}/v1/streams/orders/events?live=sse&after=now&heartbeat=1"
    reader = next(key.id for key in engine.api_keys() if key.name == "reader")
    stop = threading.Event()

    def appending() -> None:
        for n in range(600):  # 30 s at most
            if stop.wait(0.05):
                return
            engine.append("orders", [subengine.NewEvent("a", "t", {"n": n})])

    appender = threading.Thread(target=appending, daemon=True)
    try:
        with web.stream("GET", url, headers=bearer(keys["reader"]), timeout=TIMEOUT) as response:
            assert response.status_code == 200
            kinds: list[str] = []
            for frame in sse_frames(response.iter_lines()):
                kinds.append(frame.kind)
                if frame.kind == "caught-up":
                    appender.start()
                if frame.kind == "events" and kinds.count("events") == 5:
                    engine.revoke_api_key(reader)  # frames keep coming meanwhile
                if frame.kind == "close":
                    assert frame.data["code"] == "forbidden"
                    break
                assert appender.is_alive() or not appender.ident, "the appends ended first"
    finally:
        stop.set()
        if appender.ident:
            appender.join(30)
    assert kinds[-1] == "close" and kinds.count("events") >= 5


def test_tokens_never_reach_the_gateways_output(
    keys: dict[str, Any], gateway: GatewayProcess
) -> None:
    for token in keys.values():
        web.get(f"{gateway.url}/v1/streams", headers=bearer(token), timeout=TIMEOUT)
        web.get(f"{gateway.url}/v1/streams/x/events", headers=bearer(token), timeout=TIMEOUT)
    output = gateway.output()
    for token in keys.values():
        assert token not in output
        # the secret part, after "sek_<id>_" (it is base64url: it may hold '_' itself)
        secret = token[len("sek_") + 12 + 1 :]
        assert len(secret) == 43 and secret not in output


def test_appending_needs_a_key_with_the_append_scope(
    engine: subengine.Engine, keys: dict[str, Any], gateway: GatewayProcess
) -> None:
    url = f"{gateway.url}/v1/streams/orders/events"
    body = [{"key": "a", "type": "t", "data": {"n": 2}}]
    before = engine.heads("orders")
    for headers, status in (({}, 401), (bearer(keys["reader"]), 403)):
        answer = web.post(url, json=body, headers=headers, timeout=TIMEOUT)
        assert answer.status_code == status, answer.text
    assert engine.heads("orders") == before
    answer = web.post(url, json=body, headers=bearer(keys["writer"]), timeout=TIMEOUT)
    assert answer.status_code == 201, answer.text


def _an_address_of_this_host_not_loopback() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: only a route is chosen
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_loopback else str(address)


def test_with_its_last_key_revoked_the_gateway_answers_only_its_own_host(
    engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    address = _an_address_of_this_host_not_loopback()
    if address is None:
        pytest.skip("this machine has no address but loopback to reach the gateway by")
    key, _ = engine.create_api_key(["read"], ["*"], name="only")
    with GatewayProcess(cli_env, "--host", "0.0.0.0", tmp=tmp_path) as gateway:
        engine.revoke_api_key(key.id)
        remote = f"http://{address}:{gateway.port}/v1/streams/orders/events"
        wait_for(
            lambda: web.get(remote, timeout=TIMEOUT).status_code == 401,
            "the open gateway to refuse another host",
            30,
        )
        answer = web.get(remote, timeout=TIMEOUT)
        assert answer.json()["error"]["code"] == "unauthorized"
        local = web.get(f"{gateway.url}/v1/streams/orders/events", timeout=TIMEOUT)
        assert local.status_code == 200


def test_an_open_gateway_answers_only_requests_sent_to_a_loopback_name(
    gateway: GatewayProcess, orders: str
) -> None:
    # a page of another site whose DNS name now points at 127.0.0.1 (DNS rebinding) sends
    # its own name as Host: an open gateway must not let it read, append or add webhooks
    url = f"{gateway.url}/v1/streams/orders/events"
    for host in ("evil.example", f"evil.example:{gateway.port}", "127.0.0.1.nip.example"):
        refused = web.get(url, headers={"Host": host}, timeout=TIMEOUT)
        assert refused.status_code == 401, host
        assert "loopback name" in refused.json()["error"]["message"]
    for host in ("localhost", f"localhost:{gateway.port}", f"127.0.0.1:{gateway.port}"):
        assert web.get(url, headers={"Host": host}, timeout=TIMEOUT).status_code == 200, host


def test_a_key_change_reaches_every_gateway_process_by_its_notification(
    engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """No cache window beyond the notification's delivery: a key revoked is refused, and a
    gateway left without a key is open (to its host), by each process as soon as the
    change's notification reaches it, and from then on; a first key closes them again.

    The notification reaches a process a moment after the change commits (milliseconds,
    more on a loaded machine), so a request sent in that moment may still get the old
    answer: the test waits for the new one, then checks that it holds."""
    _, token = engine.create_api_key(["read"], ["*"], name="only")
    key_id = token.split("_")[1]
    url = "/v1/streams/orders/events"
    with (
        GatewayProcess(cli_env, tmp=tmp_path) as first,
        GatewayProcess(cli_env, tmp=tmp_path) as second,
    ):
        processes = (first, second)

        def statuses(headers: dict[str, str]) -> list[int]:
            return [
                web.get(p.url + url, headers=headers, timeout=TIMEOUT).status_code
                for p in processes
            ]

        def settles(headers: dict[str, str], expected: list[int], what: str) -> None:
            wait_for(lambda: statuses(headers) == expected, what, timeout=10)
            for _ in range(3):  # and no process goes back to a cached answer
                assert statuses(headers) == expected, what

        for _ in range(3):  # answers each process has cached
            assert statuses(bearer(token)) == [200, 200]
            assert statuses({}) == [401, 401]
        engine.revoke_api_key(key_id)
        settles(bearer(token), [401, 401], "the revoked key refused by both processes")
        settles({}, [200, 200], "both processes open with no key left")
        engine.create_api_key(["read"], ["*"], name="next")
        settles({}, [401, 401], "both processes closed by the first new key")
