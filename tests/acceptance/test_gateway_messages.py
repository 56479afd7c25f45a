"""What the gateway says is what is so, on a real `subengine serve` process: a time whose
'+' the URL left unencoded is refused with the way to send it, and a stream's epoch is
the opaque number the docs say it is (a counter every stream shares, not 1)."""

from __future__ import annotations

import re
import socket

import httpx
import web
from helpers import ROOT, GatewayProcess

import subengine

TIMEOUT = httpx.Timeout(30.0)


def raw_get(gateway: GatewayProcess, target: str) -> tuple[int, str]:
    """GET `target` exactly as written (no client encodes it first): status and body."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as s:
        host = f"127.0.0.1:{gateway.port}"  # an open gateway answers loopback names only
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def test_a_time_zone_whose_plus_was_not_encoded_is_refused_saying_how_to_send_it(
    orders: str, gateway: GatewayProcess
) -> None:
    status, body = raw_get(
        gateway, "/v1/streams/orders/events?since=2026-11-23T10:15:00.123456+00:00"
    )
    assert status == 400
    message = httpx.Response(status, content=body).json()["error"]["message"]
    assert "'2026-11-23T10:15:00.123456 00:00'" in message
    assert "%2B" in message
    encoded = web.get(
        f"{gateway.url}/v1/streams/orders/events",
        params={"since": "2026-11-23T10:15:00.123456+00:00"},
        timeout=TIMEOUT,
    )
    assert encoded.status_code == 200


def test_an_epoch_is_an_opaque_number_shared_by_all_streams_as_documented(
    engine: subengine.Engine, gateway: GatewayProcess
) -> None:
    for name in ("first", "second"):
        engine.create_stream(name, 1)
    listed = web.get(f"{gateway.url}/v1/streams", timeout=TIMEOUT).json()["streams"]
    epochs = {stream["name"]: stream["epoch"] for stream in listed}
    # one counter for the schema: the second stream's first creation is not epoch 1
    assert epochs["second"] > epochs["first"] >= 1
    assert epochs == {name: engine.stream(name).epoch for name in epochs}
    page = (ROOT / "docs" / "gateway.md").read_text()
    assert "opaque number" in page
    assert not re.search(r'"epoch": 1\b', page)
