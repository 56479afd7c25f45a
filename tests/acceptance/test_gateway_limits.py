"""The gateway's limits on a real `subengine serve` process: open connections per key and
event streams per process answered 429 with Retry-After, a place freed when a connection
ends, and the limits on a watch's streams and a body's size answered 400 and 413 (a body
over the limit read to its end first, so that its client reads the 413)."""

from __future__ import annotations

import inspect
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import web
from helpers import GatewayProcess, run_subengine, scrape, sse_frames, value, wait_for

import subengine
from subengine.gateway import GatewayConfig
from subengine.gateway._request_bodies import DISCARDED_AT_MOST

TIMEOUT = httpx.Timeout(30.0)
RETRY_AFTER = GatewayConfig().retry_after
BODY_LIMIT = 2048
# longer than uvicorn's keep-alive timeout: a server that has answered counts its
# connection idle from then on, and closes it under a client still to send its body
SLOW_START = inspect.signature(uvicorn.Config).parameters["timeout_keep_alive"].default + 1
OVERSIZED = 1 << 20
CHUNK = 1 << 16
SURFACES = {
    "v1": ("/v1/streams/orders/events", "application/json"),
    "ds": ("/ds/uploads", "application/octet-stream"),
}


@pytest.fixture
def small(cli_env: dict[str, str], tmp_path: Path) -> Iterator[GatewayProcess]:
    """A gateway that allows two open connections per key and one event stream."""
    args = ["--heartbeat", "1", "--max-connections-per-key", "2", "--max-event-streams", "1"]
    args += ["--max-streams-per-watch", "2", "--max-body-bytes", "2048"]
    with GatewayProcess(cli_env, *args, tmp=tmp_path) as process:
        yield process


class Held:
    """A long-poll or an event stream of 'orders', held open in a thread until `close()`."""

    def __init__(self, gateway: GatewayProcess, live: str) -> None:
        self.url = f"{gateway.url}/v1/streams/orders/events"
        self.live = live
        self.status: int | None = None
        self.open = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        params = {"live": self.live, "after": "now", "wait": "30"}
        with web.stream("GET", self.url, params=params, timeout=TIMEOUT) as response:
            self.status = response.status_code
            self.open.set()
            for _ in sse_frames(response.iter_lines()):
                if self._stop.is_set():
                    return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def connections(gateway: GatewayProcess, kind: str) -> float | None:
    return value(scrape(gateway.port), "subengine_gateway_connections", kind=kind)


def refused(answer: httpx.Response, code: str) -> None:
    assert answer.status_code == 429, answer.text
    assert answer.headers["Cache-Control"] == "no-store"
    assert RETRY_AFTER <= int(answer.headers["Retry-After"]) <= 2 * RETRY_AFTER
    error = answer.json()["error"]
    assert error["code"] == code and error["message"]


def test_a_key_holds_a_bounded_number_of_open_connections(
    engine: subengine.Engine, orders: str, small: GatewayProcess
) -> None:
    url = f"{small.url}/v1/streams/orders/events"
    stream = Held(small, "sse")
    poll = Held(small, "long-poll")
    wait_for(lambda: connections(small, "long_poll") == 1 and connections(small, "sse") == 1)
    third = web.get(url, params={"live": "long-poll", "wait": "1"}, timeout=TIMEOUT)
    refused(third, "too_many_connections")
    # no key exists: the message speaks of requests without one, not of "this key"
    message = third.json()["error"]["message"]
    assert message.startswith("requests without an API key hold 2 open long-polls"), message
    # a page is not held open: it is served
    assert web.get(url, timeout=TIMEOUT).status_code == 200
    # the long-poll answers, and its place is free again
    engine.append("orders", [subengine.NewEvent("k", "T", {})])
    poll.close()
    wait_for(lambda: connections(small, "long_poll") == 0, "the long-poll to end")
    again = web.get(
        url, params={"live": "long-poll", "after": "now", "wait": "0.2"}, timeout=TIMEOUT
    )
    assert again.status_code == 204
    stream.close()
    samples = scrape(small.port)
    assert value(samples, "subengine_gateway_rejected_total", limit="too_many_connections") == 1


def test_a_process_serves_a_bounded_number_of_event_streams(
    orders: str, small: GatewayProcess
) -> None:
    url = f"{small.url}/v1/streams/orders/events"
    first = Held(small, "sse")
    assert first.open.wait(10) and first.status == 200
    second = web.get(url, params={"live": "sse"}, timeout=TIMEOUT)
    refused(second, "too_many_event_streams")
    first.close()
    wait_for(lambda: connections(small, "sse") == 0, "the stream to end")
    after = Held(small, "sse")
    assert after.open.wait(10) and after.status == 200
    after.close()
    samples = scrape(small.port)
    assert value(samples, "subengine_gateway_rejected_total", limit="too_many_event_streams") == 1


def test_a_refused_stream_leaves_no_place_taken(orders: str, small: GatewayProcess) -> None:
    """Streams refused for a bad cursor or an unknown stream give their place back."""
    url = f"{small.url}/v1/streams"
    for path, params in (("nope", {}), ("orders", {"after": "c1.!!"})):
        answer = web.get(f"{url}/{path}/events", params={"live": "sse", **params})
        assert answer.status_code in (400, 404)
    samples = scrape(small.port)
    assert value(samples, "subengine_gateway_connections", kind="sse") == 0
    held = Held(small, "sse")
    assert held.open.wait(10) and held.status == 200
    held.close()


def test_a_watch_of_too_many_streams_is_a_bad_request_not_a_retry(
    small: GatewayProcess,
) -> None:
    body: dict[str, Any] = {"streams": {name: {} for name in ("a", "b", "c")}}
    answer = web.post(f"{small.url}/v1/watch", json=body, timeout=TIMEOUT)
    assert answer.status_code == 400
    assert "Retry-After" not in answer.headers
    assert answer.headers["Cache-Control"] == "no-store"
    assert answer.json()["error"]["code"] == "too_many_streams"
    assert "at most 2 streams" in answer.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/streams/orders/events", "/v1/watch"])
def test_a_body_over_the_limit_is_413(orders: str, small: GatewayProcess, path: str) -> None:
    events = [{"key": "k", "type": "T", "data": "x" * 1000} for _ in range(3)]
    answer = web.post(f"{small.url}{path}", json=events, timeout=TIMEOUT)
    assert answer.status_code == 413
    assert answer.headers["Cache-Control"] == "no-store"
    assert answer.json()["error"]["code"] == "too_large"
    assert "2048 bytes" in answer.json()["error"]["message"]


@pytest.fixture
def both_surfaces(cli_env: dict[str, str], tmp_path: Path) -> Iterator[GatewayProcess]:
    """A gateway with its Durable Streams surface, whose bodies are limited to 2048 bytes."""
    args = ["--durable-streams", "--max-body-bytes", str(BODY_LIMIT)]
    with GatewayProcess(cli_env, *args, tmp=tmp_path) as process:
        yield process


def post_head(path: str, content_type: str, length: int, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}"]
    lines += [f"Content-Length: {length}", *extra, "", ""]
    return "\r\n".join(lines).encode()


def read_answer(client: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length, read from a raw connection."""
    data = b""
    for _ in range(1000):
        head, separator, rest = data.partition(b"\r\n\r\n")
        if separator:
            status_line, *lines = head.decode("latin-1").split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines)
            length = int(headers["content-length"])
            if len(rest) >= length:
                return int(status_line.split()[1]), headers, rest[:length]
        received = client.recv(CHUNK)
        assert received, f"the connection closed before a whole answer: {data[:200]!r}"
        data += received
    raise AssertionError(f"no whole answer in 1000 reads: {data[:200]!r}")


def assert_refused_as_too_large(surface: str, answer: tuple[int, dict[str, str], bytes]) -> None:
    status, headers, body = answer
    assert status == 413, body
    assert f"larger than {BODY_LIMIT} bytes" in body.decode()
    if surface == "v1":
        assert json.loads(body)["error"]["code"] == "too_large"
    else:
        assert headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("surface", SURFACES)
def test_a_client_that_sends_its_whole_oversized_body_before_reading_gets_the_413(
    orders: str, both_surfaces: GatewayProcess, surface: str
) -> None:
    """However slowly the body comes, the gateway reads it to its end before it answers:
    it does not leave the connection to be closed under a client still sending, which
    would see a reset instead of the 413. The connection then serves the next request."""
    path, content_type = SURFACES[surface]
    if surface == "ds":
        assert web.put(f"{both_surfaces.url}{path}", timeout=TIMEOUT).status_code == 201
    with socket.create_connection(("127.0.0.1", both_surfaces.port), timeout=30) as client:
        client.sendall(post_head(path, content_type, OVERSIZED))
        time.sleep(SLOW_START)
        for _ in range(OVERSIZED // CHUNK):
            client.sendall(bytes(CHUNK))
        assert_refused_as_too_large(surface, read_answer(client))
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_answer(client)[0] == 200


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize(
    ("length", "extra"),
    [
        (BODY_LIMIT + DISCARDED_AT_MOST + 1, ()),
        (OVERSIZED, ("Expect: 100-continue",)),
    ],
    ids=["beyond-what-is-read", "expecting-100-continue"],
)
def test_a_body_the_gateway_will_not_read_is_refused_at_once_and_the_connection_closed(
    orders: str, both_surfaces: GatewayProcess, surface: str, length: int, extra: tuple[str]
) -> None:
    """Declared beyond what the gateway reads to throw away, or not sent yet (the client
    waits for `100 Continue`): the 413 comes at once, without the body, and says that
    the connection closes, since the rest of the body will not be read."""
    path, content_type = SURFACES[surface]
    if surface == "ds":
        assert web.put(f"{both_surfaces.url}{path}", timeout=TIMEOUT).status_code == 201
    with socket.create_connection(("127.0.0.1", both_surfaces.port), timeout=30) as client:
        client.sendall(post_head(path, content_type, length, *extra))
        answer = read_answer(client)
        assert_refused_as_too_large(surface, answer)
        assert answer[1]["connection"] == "close"
        assert client.recv(CHUNK) == b""


def test_serve_documents_each_limit_and_its_default(cli_env: dict[str, str]) -> None:
    result = run_subengine(cli_env, "serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    defaults = GatewayConfig()
    options: dict[str, Any] = {
        "--max-connections-per-key": defaults.max_connections_per_key,
        "--max-event-streams": defaults.max_event_streams,
        "--max-streams-per-watch": defaults.max_streams_per_watch,
        "--max-body-bytes": defaults.max_body_bytes,
        "--heartbeat": defaults.heartbeat,
    }
    for option, default in options.items():
        described = text.split(option, 1)[1].split(" --", 1)[0]
        assert f"[default: {default};" in described, (option, described)


def test_a_long_poll_whose_client_left_gives_its_place_back_at_once(
    orders: str, small: GatewayProcess
) -> None:
    """Two clients that give up on a minute's long-poll after a second do not lock their
    key out for the rest of that minute."""
    url = f"{small.url}/v1/streams/orders/events"
    params = {"live": "long-poll", "after": "now", "wait": "60"}
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):
            web.get(url, params=params, timeout=httpx.Timeout(30.0, read=1.0))
    wait_for(
        lambda: (
            connections(small, "long_poll") == 0
            and value(scrape(small.port), "subengine_gateway_long_polls_waiting") == 0
        ),
        "the long-polls of the clients gone to end",
        timeout=20,
    )
    again = web.get(url, params={**params, "wait": "0.2"}, timeout=TIMEOUT)
    assert again.status_code == 204
    samples = scrape(small.port)
    assert value(samples, "subengine_gateway_rejected_total", limit="too_many_connections") == 0
