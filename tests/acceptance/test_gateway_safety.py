"""The gateway's guards, over real sockets: a client whose socket takes nothing is closed
and holds nothing; CORS answers only configured origins; without a key, serve refuses
any address but loopback; a watch made on one gateway process is served by another; the
access log keeps cursors, watch ids and tokens out."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import web
from helpers import GatewayProcess, run_subengine, sse_frames, wait_for

import subengine

TIMEOUT = httpx.Timeout(30.0)


def sse_connections(gateway: GatewayProcess) -> float:
    answer = web.get(f"{gateway.url}/metrics", timeout=TIMEOUT).text
    for line in answer.splitlines():
        if line.startswith('subengine_gateway_connections{kind="sse"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_whose_socket_takes_nothing_is_closed(
    engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    # enough data that the server's writes block on a client that never reads
    blob = "x" * 4000
    for start in range(0, 3000, 500):
        engine.append(
            orders,
            [subengine.NewEvent(f"k{n}", "t", {"blob": blob}) for n in range(start, start + 500)],
        )
    with GatewayProcess(cli_env, "--slow-client-timeout", "1", tmp=tmp_path) as gateway:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", gateway.port))
        client.sendall(
            b"GET /v1/streams/orders/events?live=sse HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        )
        wait_for(lambda: sse_connections(gateway) == 1, "the stream to open", 30)
        # the client reads nothing; the server gives up on it and frees its place
        wait_for(lambda: sse_connections(gateway) == 0, "the slow client to be closed", 60)
        client.settimeout(30)
        received = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            chunk = client.recv(1 << 16)
            if not chunk:
                break
            received += len(chunk)
        else:
            raise AssertionError("the server never closed the slow client's connection")
        client.close()
        assert received < len(blob) * 3000  # it was cut off, not served to the end
        # the gateway goes on serving others
        page = web.get(f"{gateway.url}/v1/streams/orders/events?limit=1", timeout=TIMEOUT)
        assert page.status_code == 200


def test_a_live_client_that_stops_reading_for_a_while_loses_nothing(
    engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    # The hub sends a waiting stream its frames without waking its task; once the
    # client's socket is full, a send must wait, and the stream's task finishes it and
    # sends what came after, in order (issue 26).
    blob = "z" * 16000
    appends = 200  # about 3 MB: far more than the sockets between hold
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with GatewayProcess(cli_env, tmp=tmp_path) as gateway:
        client.connect(("127.0.0.1", gateway.port))
        client.sendall(
            b"GET /v1/streams/orders/events?live=sse&after=now HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        )
        client.settimeout(30)
        response = ChunkedResponse(client)
        response.read_until(b"event: caught-up")
        # the client reads nothing while every append (one event each) reaches it
        for n in range(appends):
            engine.append(orders, [subengine.NewEvent(f"k{n}", "t", {"n": n, "blob": blob})])
        received: dict[int, list[int]] = {}
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while len(seen) < appends:
            assert time.monotonic() < deadline, f"{len(seen)} of {appends} events arrived"
            for frame in response.frames():
                if b"\nevent: events\n" in frame:
                    data = json.loads(frame.split(b"\ndata: ", 1)[1])
                    received.setdefault(data["partition"], []).extend(
                        range(data["first"], data["last"] + 1)
                    )
                    seen.extend(event["data"]["n"] for event in data["events"])
        client.close()
    assert sorted(seen) == list(range(appends))  # each once
    for positions in received.values():  # in order, no gap
        assert positions == list(range(positions[0], positions[0] + len(positions)))


class ChunkedResponse:
    """The body of an HTTP/1.1 response with chunked encoding, read from a raw socket."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.raw = b""
        self.body = b""
        self.headers_done = False

    def _read(self) -> None:
        chunk = self.client.recv(1 << 16)
        if not chunk:
            raise AssertionError("the server closed the stream")
        self.raw += chunk
        if not self.headers_done:
            head, found, rest = self.raw.partition(b"\r\n\r\n")
            if not found:
                return
            assert head.startswith(b"HTTP/1.1 200"), head
            self.headers_done, self.raw = True, rest
        while True:
            size_line, found, rest = self.raw.partition(b"\r\n")
            if not found:
                return
            size = int(size_line, 16)
            if len(rest) < size + 2:
                return
            self.body += rest[:size]
            self.raw = rest[size + 2 :]

    def read_until(self, marker: bytes) -> None:
        while marker not in self.body:
            self._read()

    def frames(self) -> list[bytes]:
        """The whole SSE frames received so far and not yet returned (reads if none)."""
        while b"\n\n" not in self.body:
            self._read()
        *frames, self.body = self.body.split(b"\n\n")
        return frames


def test_cors_answers_only_configured_origins(
    orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    url = "/v1/streams/orders/events"
    with GatewayProcess(cli_env, tmp=tmp_path) as plain:
        answer = web.get(plain.url + url, headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in answer.headers
    with GatewayProcess(cli_env, "--cors-origin", "https://app.example", tmp=tmp_path) as gateway:
        allowed = web.get(gateway.url + url, headers={"Origin": "https://app.example"})
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert "Subengine-Cursor" in allowed.headers["access-control-expose-headers"]
        preflight = web.options(
            gateway.url + url,
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "authorization,last-event-id",
            },
        )
        assert preflight.status_code == 200
        other = web.get(gateway.url + url, headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        # an event stream runs after the middleware returned, through its send (HeldOpen)
        with web.stream(
            "GET",
            f"{gateway.url}{url}?live=sse",
            headers={"Origin": "https://app.example"},
            timeout=TIMEOUT,
        ) as live:
            assert live.headers["content-type"].startswith("text/event-stream")
            assert live.headers["access-control-allow-origin"] == "https://app.example"


def test_cors_lets_a_browser_use_every_method_of_the_api(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """A browser app manages its webhooks (PUT, DELETE) as it reads and appends."""
    origin = {"Origin": "https://app.example"}
    url = "/v1/webhooks/hook-1"
    with GatewayProcess(cli_env, "--cors-origin", "https://app.example", tmp=tmp_path) as gateway:
        for method in ("PUT", "DELETE", "POST", "GET"):
            preflight = web.options(
                gateway.url + url,
                headers={
                    **origin,
                    "Access-Control-Request-Method": method,
                    "Access-Control-Request-Headers": "authorization,content-type",
                },
            )
            assert preflight.status_code == 200, (method, preflight.text)
            allowed = preflight.headers["access-control-allow-methods"].split(",")
            assert method in [m.strip() for m in allowed]
            assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        deleted = web.delete(gateway.url + url, headers=origin)
        assert deleted.headers["access-control-allow-origin"] == "https://app.example"


def test_without_a_key_serve_refuses_any_address_but_loopback(
    cli_env: dict[str, str],
) -> None:
    refused = run_subengine(cli_env, "serve", "--host", "0.0.0.0", "--port", "0", timeout=60)
    assert refused.returncode != 0
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to listen on 0.0.0.0" in lines[0], refused.stderr


def test_a_watch_made_on_one_process_is_served_by_another(
    engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    engine.append(orders, [subengine.NewEvent("a", "t", {"n": 0})])
    with (
        GatewayProcess(cli_env, tmp=tmp_path) as first,
        GatewayProcess(cli_env, tmp=tmp_path) as second,
    ):
        made = web.post(f"{first.url}/v1/watch", json={"streams": {"orders": {}}}, timeout=TIMEOUT)
        assert made.status_code == 201, made.text
        with web.stream("GET", second.url + made.json()["url"], timeout=TIMEOUT) as answer:
            assert answer.status_code == 200
            frames = sse_frames(answer.iter_lines())
            first_frame = next(f for f in frames if f.kind != ":")
        assert [e["data"]["n"] for e in first_frame.data["events"]] == [0]
        # a watch id changed by one character is refused
        wid = made.json()["wid"]
        forged = wid[:-2] + ("A" if wid[-2] != "A" else "B") + wid[-1]
        assert web.get(f"{second.url}/v1/watch/{forged}", timeout=TIMEOUT).status_code == 404


def test_the_access_log_hides_cursors_watch_ids_and_tokens(
    engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    engine.append(orders, [subengine.NewEvent("a", "t", {"n": 0})])
    _, token = engine.create_api_key(["read"], ["*"])
    auth = {"Authorization": f"Bearer {token}"}
    with GatewayProcess(cli_env, "--access-log", tmp=tmp_path) as gateway:
        url = f"{gateway.url}/v1/streams/orders"
        cursor = web.get(url, headers=auth, timeout=TIMEOUT).json()["cursor"]
        page = web.get(f"{url}/events", params={"after": cursor}, headers=auth)
        assert page.status_code == 200
        moved = page.json()["cursor"]
        body = {"streams": {"orders": {"after": cursor}}}
        wid = web.post(f"{gateway.url}/v1/watch", json=body, headers=auth).json()["wid"]
        with web.stream("GET", f"{gateway.url}/v1/watch/{wid}", timeout=TIMEOUT) as watch:
            assert watch.status_code == 200
            next(watch.iter_lines())
        sse = {**auth, "Last-Event-ID": moved}
        with web.stream("GET", f"{url}/events?live=sse", headers=sse) as stream:
            next(stream.iter_lines())
        # a token or cursor put where it does not belong is hidden too
        web.get(f"{url}/events", params={"token": token, "x": moved}, timeout=TIMEOUT)
        wait_for(lambda: gateway.output().count('HTTP/1.1" ') >= 6, "the access log lines")
    logged = gateway.output()
    for secret in (cursor, moved, wid, token, token.split("_")[-1]):
        assert secret not in logged
    assert "/v1/streams/orders/events?after=<redacted>" in logged
    assert "/v1/watch/<redacted>" in logged
    assert "token=<redacted>&x=<redacted>" in logged
