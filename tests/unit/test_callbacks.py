"""The webhook callback sender (subengine/gateway/_callbacks.py): which addresses a callback
may reach, the URL check, and real deliveries to receivers on loopback: DNS rebinding,
redirects, bounded answers, timeouts, TLS against the URL's host name."""

from __future__ import annotations

import ipaddress
import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import pytest
import trustme
from helpers import wait_for

from subengine.gateway import _callbacks
from subengine.gateway._callbacks import (
    CallbackClient,
    CallbackPolicy,
    CallbackRefused,
    CallbackResponse,
    CallbackUnreachable,
    address_allowed,
    check_callback_url,
)
from subengine.model._errors import InvalidInput

LOOPBACK = CallbackPolicy.from_text("127.0.0.0/8,::1/128")
# Short limits, so that a test of a timeout is quick; no test asserts how long one took.
QUICK = CallbackPolicy(allow=LOOPBACK.allow, connect_timeout=1.0, timeout=0.5)
PUBLIC = "93.184.216.34"
SIGNATURE = "v1,c2lnbmF0dXJlLW5vdC10by1iZS1sb2dnZWQ="
HEADERS = {"content-type": "application/json", "webhook-signature": SIGNATURE}
BODY = json.dumps({"type": "events", "subscription": "s1"}).encode()

Answer = Callable[["Handler"], None]


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # many delivery threads connect at once

    def __init__(self, answer: Answer) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.answer = answer
        self.requests: list[Received] = []
        self.connections = 0
        self.hung_up = 0  # connections the receiver ended
        self.release = threading.Event()  # ends answers that wait

    def verify_request(self, request: Any, client_address: Any) -> bool:
        self.connections += 1
        return True

    def shutdown_request(self, request: Any) -> None:
        super().shutdown_request(request)
        self.hung_up += 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up early is expected here."""


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps connections open between requests
    served = 0  # requests of this connection so far, for answers that count them

    def do_POST(self) -> None:
        server = cast(Server, self.server)
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        server.requests.append(
            Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
        )
        server.answer(self)

    def reply(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


class Receiver:
    """A callback receiver on 127.0.0.1 that records what reaches it."""

    def __init__(self, answer: Answer) -> None:
        self.server = Server(answer)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def url(self, path: str = "/hook", host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    @property
    def requests(self) -> list[Received]:
        return self.server.requests

    @property
    def connections(self) -> int:
        return self.server.connections

    def close(self) -> None:
        self.server.release.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()


def ok(handler: Handler) -> None:
    handler.reply(200, b'{"ok": true}', content_type="application/json")


@pytest.fixture
def receivers() -> Iterator[Callable[[Answer], Receiver]]:
    started: list[Receiver] = []

    def start(answer: Answer = ok) -> Receiver:
        started.append(Receiver(answer))
        return started[-1]

    yield start
    for receiver in started:
        receiver.close()


@pytest.fixture
def clients() -> Iterator[Callable[..., CallbackClient]]:
    made: list[CallbackClient] = []

    def make(policy: CallbackPolicy = LOOPBACK, **options: Any) -> CallbackClient:
        made.append(CallbackClient(policy, **options))
        return made[-1]

    yield make
    for client in made:
        client.close()


def answers(*addresses: str) -> Callable[[str, int], list[str]]:
    """A resolver that gives every host the same addresses."""
    return lambda host, port: list(addresses)


class Rebinding:
    """A resolver that answers a public address the first time, loopback afterwards."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        return [PUBLIC] if self.calls == 1 else ["127.0.0.1"]


# --- which addresses a callback may reach ---


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "::1",
        "10.1.2.3",
        "172.16.0.1",
        "172.31.255.254",
        "192.168.1.1",
        "169.254.169.254",  # the cloud metadata service
        "100.64.0.1",  # shared address space (carrier-grade NAT)
        "0.0.0.0",
        "255.255.255.255",
        "198.18.0.1",
        "192.0.2.1",
        "224.0.0.1",
        "::",
        "::ffff:127.0.0.1",  # IPv4-mapped
        "::ffff:169.254.169.254",
        "::7f00:1",  # IPv4-compatible
        "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
        "64:ff9b:1::1",  # local-use NAT64
        "2002:7f00:1::",  # 6to4 of 127.0.0.1
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
        "2001:db8::1",
        "fc00::1",
        "fd00:ec2::254",  # the metadata service over IPv6
        "fe80::1",
        "fec0::1",
        "ff02::1",
    ],
)
def test_internal_addresses_are_refused(address: str) -> None:
    assert not address_allowed(ipaddress.ip_address(address), CallbackPolicy())


@pytest.mark.parametrize(
    "address",
    ["8.8.8.8", PUBLIC, "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"],
)
def test_public_addresses_are_allowed(address: str) -> None:
    assert address_allowed(ipaddress.ip_address(address), CallbackPolicy())


def test_the_allowlist_admits_its_networks_only() -> None:
    policy = CallbackPolicy.from_text("127.0.0.0/8")
    assert address_allowed(ipaddress.ip_address("127.0.0.1"), policy)
    assert address_allowed(ipaddress.ip_address("::ffff:127.0.0.1"), policy)
    assert not address_allowed(ipaddress.ip_address("10.0.0.1"), policy)
    assert not address_allowed(ipaddress.ip_address("::1"), policy)


def test_the_allowlist_does_not_reach_through_nat64_or_6to4() -> None:
    policy = CallbackPolicy.from_text("127.0.0.0/8")
    assert not address_allowed(ipaddress.ip_address("64:ff9b::7f00:1"), policy)
    assert not address_allowed(ipaddress.ip_address("2002:7f00:1::"), policy)


def test_the_allowlist_is_read_from_comma_separated_networks() -> None:
    policy = CallbackPolicy.from_text(" 127.0.0.0/8 , ::1/128")
    assert policy.allow == (
        ipaddress.ip_network("127.0.0.0/8"),
        ipaddress.ip_network("::1/128"),
    )
    assert CallbackPolicy.from_text("  ").allow == ()


@pytest.mark.parametrize("text", ["10.0.0.1/8", "localhost", "10.0.0.0/8,", "10.0.0.0/33"])
def test_a_bad_allowlist_entry_is_named_in_one_line(text: str) -> None:
    with pytest.raises(InvalidInput, match="allowlist entry") as raised:
        CallbackPolicy.from_text(text)
    assert "\n" not in str(raised.value)


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(InvalidInput, match="positive"):
        CallbackPolicy(timeout=0)


# --- the URL ---


def test_a_callback_url_is_normalized() -> None:
    assert check_callback_url("HTTPS://Hooks.Example.COM:443/in?x=1") == (
        "https://hooks.example.com/in?x=1"
    )
    assert check_callback_url("http://example.com:8080") == "http://example.com:8080/"
    assert check_callback_url("https://bücher.example/") == "https://xn--bcher-kva.example/"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://example.com/hook", "http:// or https://"),
        ("example.com/hook", "http:// or https://"),
        ("http:///hook", "no host"),
        ("https://user:pw@example.com/hook", "user name or password"),
        ("https://user@example.com/hook", "user name or password"),
        ("https://example.com/hook#part", "fragment"),
        ("https://example.com:0/hook", "port 0"),
        ("https://example.com:70000/hook", "port 70000"),
        ("https://exa mple.com/hook", "space"),
        ("https://example.com/\nhook", "control character"),
        ("https://exa%20mple.com/hook", "not a valid host name"),
        ("https://exa]mple.com/hook", "not a valid URL"),
        ("https://example.com/" + "a" * 2000, "at most 2000"),
    ],
)
def test_a_bad_callback_url_is_refused_in_one_line(url: str, says: str) -> None:
    with pytest.raises(InvalidInput, match=says) as raised:
        check_callback_url(url)
    assert "\n" not in str(raised.value)
    assert "pw" not in str(raised.value)


# --- Retry-After ---


def response(**headers: str) -> CallbackResponse:
    return CallbackResponse(status=503, headers=headers, body=b"")


def test_retry_after_in_seconds() -> None:
    assert response(**{"retry-after": "120"}).retry_after() == 120.0


def test_retry_after_as_an_http_date() -> None:
    now = 1_445_412_480.0  # Wed, 21 Oct 2015 07:28:00 GMT
    later = format_datetime(datetime.fromtimestamp(now + 90, tz=UTC), usegmt=True)
    assert response(**{"retry-after": later}).retry_after(now) == 90.0
    assert response(**{"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}).retry_after(now) == 0.0
    assert response(**{"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}).retry_after(now + 5) == (
        0.0
    )


def test_retry_after_is_at_most_a_day() -> None:
    assert response(**{"retry-after": "999999"}).retry_after() == 86400.0
    assert response(**{"retry-after": "9" * 5000}).retry_after() == 86400.0


@pytest.mark.parametrize("value", ["soon", "-5", "1.5", "", "Wed, 99 Foo 2015"])
def test_an_unreadable_retry_after_is_none(value: str) -> None:
    assert response(**{"retry-after": value}).retry_after() is None
    assert response().retry_after() is None


# --- deliveries ---


def test_a_delivery_arrives_with_its_body_and_headers(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    receiver = receivers(ok)
    answer = clients().post(receiver.url("/hook?s=1"), BODY, HEADERS)
    assert (answer.status, answer.body, answer.truncated) == (200, b'{"ok": true}', False)
    assert answer.headers["content-type"] == "application/json"
    [received] = receiver.requests
    assert (received.path, received.body) == ("/hook?s=1", BODY)
    assert received.headers["webhook-signature"] == SIGNATURE
    assert received.headers["content-length"] == str(len(BODY))


def test_loopback_is_refused_without_the_allowlist_and_nothing_connects(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    receiver = receivers(ok)
    client = clients(CallbackPolicy())
    for url in (receiver.url(), receiver.url(host="[::ffff:127.0.0.1]")):
        with pytest.raises(CallbackRefused, match="loopback"):
            client.post(url, BODY, HEADERS)
    with pytest.raises(CallbackRefused):
        client.check_now(receiver.url())
    assert receiver.connections == 0


def test_the_metadata_address_is_refused(clients: Callable[..., CallbackClient]) -> None:
    with pytest.raises(CallbackRefused, match=r"169\.254\.169\.254 is in 169\.254\.0\.0/16"):
        clients(CallbackPolicy()).post("http://169.254.169.254/latest/", BODY, HEADERS)


def test_the_name_is_resolved_by_the_client_only(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    # hooks.invalid has no address in DNS: it arrives only if the connection goes to
    # the address the client's resolver gave and checked.
    receiver = receivers(ok)
    client = clients(resolve=answers("127.0.0.1"))
    assert client.post(receiver.url(host="hooks.invalid"), BODY, HEADERS).status == 200
    assert receiver.requests[0].headers["host"] == f"hooks.invalid:{receiver.port}"


def test_a_name_rebound_to_loopback_after_the_check_is_refused_at_connect(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    receiver = receivers(ok)
    resolver = Rebinding()
    client = clients(CallbackPolicy(), resolve=resolver)
    url = receiver.url(host="rebind.invalid")
    client.check_now(url)
    with pytest.raises(CallbackRefused, match=r"'rebind\.invalid' refused"):
        client.post(url, BODY, HEADERS)
    assert resolver.calls == 2
    assert receiver.connections == 0


@pytest.mark.parametrize(
    ("policy", "addresses"),
    [(CallbackPolicy(), (PUBLIC, "10.0.0.1")), (LOOPBACK, ("127.0.0.1", "10.0.0.1"))],
)
def test_a_name_with_one_address_not_allowed_is_refused(
    receivers: Callable[[Answer], Receiver],
    clients: Callable[..., CallbackClient],
    policy: CallbackPolicy,
    addresses: tuple[str, ...],
) -> None:
    receiver = receivers(ok)
    client = clients(policy, resolve=answers(*addresses))
    url = receiver.url(host="mixed.invalid")
    with pytest.raises(CallbackRefused, match=r"10\.0\.0\.1 is in 10\.0\.0\.0/8 \(private\)"):
        client.check_now(url)
    with pytest.raises(CallbackRefused):
        client.post(url, BODY, HEADERS)
    assert receiver.connections == 0


def test_a_redirect_is_answered_not_followed(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    target = receivers(ok)

    def redirect(handler: Handler) -> None:
        handler.reply(302, location=target.url())

    answer = clients().post(receivers(redirect).url(), BODY, HEADERS)
    assert (answer.status, answer.headers["location"]) == (302, target.url())
    assert target.connections == 0


def test_a_large_answer_is_cut_at_the_limit(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    def large(handler: Handler) -> None:
        handler.reply(200, b"x" * 1_000_000)

    def exact(handler: Handler) -> None:
        handler.reply(200, b"y" * 1000)

    client = clients(CallbackPolicy(allow=LOOPBACK.allow, max_response_bytes=1000))
    cut = client.post(receivers(large).url(), BODY, HEADERS)
    assert (cut.body, cut.truncated) == (b"x" * 1000, True)
    whole = client.post(receivers(exact).url(), BODY, HEADERS)
    assert (whole.body, whole.truncated) == (b"y" * 1000, False)


def test_a_receiver_that_never_answers_times_out(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    def never(handler: Handler) -> None:
        cast(Server, handler.server).release.wait()

    with pytest.raises(CallbackUnreachable, match="no answer within the timeout") as raised:
        clients(QUICK).post(receivers(never).url(), BODY, HEADERS)
    assert SIGNATURE not in str(raised.value) and "events" not in str(raised.value)


def test_an_answer_dripping_in_ends_at_the_whole_timeout(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    # Every byte comes well within the read timeout; only the whole request's ends it.
    def drip(handler: Handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        for _ in range(1000):
            if cast(Server, handler.server).release.wait(0.05):
                return
            handler.wfile.write(b"x")
            handler.wfile.flush()

    with pytest.raises(CallbackUnreachable, match="no answer within the timeout"):
        clients(QUICK).post(receivers(drip).url(), BODY, HEADERS)


def test_no_listener_is_unreachable_without_the_url_in_the_message(
    clients: Callable[..., CallbackClient],
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(CallbackUnreachable, match=r"'127\.0\.0\.1' unreachable") as raised:
        clients(QUICK).post(f"http://127.0.0.1:{port}/hook?token=Sekrit", BODY, HEADERS)
    assert "Sekrit" not in str(raised.value) and "\n" not in str(raised.value)


def test_a_name_that_does_not_resolve_is_unreachable(
    clients: Callable[..., CallbackClient],
) -> None:
    def failing(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    client = clients(QUICK, resolve=failing)
    with pytest.raises(CallbackUnreachable, match="resolving the host name failed"):
        client.post("http://nowhere.invalid/hook", BODY, HEADERS)
    with pytest.raises(CallbackUnreachable):
        client.check_now("http://nowhere.invalid/hook")


def test_a_resolver_that_hangs_times_out(clients: Callable[..., CallbackClient]) -> None:
    released = threading.Event()

    def hanging(host: str, port: int) -> list[str]:
        released.wait()
        return ["127.0.0.1"]

    try:
        with pytest.raises(CallbackUnreachable, match="timed out"):
            clients(QUICK, resolve=hanging).post("http://slow.invalid/hook", BODY, HEADERS)
    finally:
        released.set()


def test_connections_are_kept_open_between_deliveries(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    receiver = receivers(ok)
    client = clients()
    for _ in range(3):
        assert client.post(receiver.url(), BODY, HEADERS).status == 200
    assert (len(receiver.requests), receiver.connections) == (3, 1)


def test_a_kept_connection_the_receiver_closed_is_replaced(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    def then_close(handler: Handler) -> None:
        ok(handler)
        handler.close_connection = True  # without saying so

    receiver = receivers(then_close)
    client = clients()
    for n in range(1, 3):
        assert client.post(receiver.url(), BODY, HEADERS).status == 200
        wait_for(lambda: receiver.server.hung_up == n, "the receiver to hang up")  # noqa: B023
    assert (len(receiver.requests), receiver.connections) == (2, 2)


def test_a_kept_connection_closed_instead_of_an_answer_is_tried_once_more_on_a_new_one(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    # the receiver's idle timeout can end a connection as a request goes out on it
    def second_unanswered(handler: Handler) -> None:
        handler.served += 1
        if handler.served == 2:
            handler.close_connection = True
        else:
            ok(handler)

    receiver = receivers(second_unanswered)
    client = clients()
    for _ in range(2):
        assert client.post(receiver.url(), BODY, HEADERS).status == 200
    assert (len(receiver.requests), receiver.connections) == (3, 2)


def test_a_chunked_answer_and_one_that_ends_at_close_are_read_whole(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    def chunked(handler: Handler) -> None:
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        handler.wfile.write(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")

    def until_close(handler: Handler) -> None:
        handler.send_response(200)
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(b"the whole answer")
        handler.close_connection = True

    def interim_first(handler: Handler) -> None:
        handler.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        handler.reply(201, b"made", x_final="yes")

    client = clients()
    assert client.post(receivers(chunked).url(), BODY, HEADERS).body == b"abcde"
    assert client.post(receivers(until_close).url(), BODY, HEADERS).body == b"the whole answer"
    answer = client.post(receivers(interim_first).url(), BODY, HEADERS)
    assert (answer.status, answer.body, answer.headers["x-final"]) == (201, b"made", "yes")


@pytest.mark.parametrize(
    "headers",
    [
        {"webhook-signature": SIGNATURE + "\r\nx-injected: 1"},
        {"bad name": "value"},
        {"webhook-id": "caf\u00e9\u20ac"},
    ],
)
def test_a_request_header_that_is_not_valid_http_is_refused_before_connecting(
    headers: dict[str, str],
    receivers: Callable[[Answer], Receiver],
    clients: Callable[..., CallbackClient],
) -> None:
    receiver = receivers(ok)
    with pytest.raises(InvalidInput, match=r"^a callback request header is not valid HTTP$"):
        clients().post(receiver.url(), BODY, headers)
    assert receiver.connections == 0


def test_an_answer_that_is_not_http_is_unreachable_in_one_line(
    clients: Callable[..., CallbackClient],
) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def babble() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")

        thread = threading.Thread(target=babble, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
        with pytest.raises(CallbackUnreachable, match=r"not HTTP/1\.1") as raised:
            clients(QUICK).post(url, BODY, HEADERS)
        assert "\n" not in str(raised.value)
        thread.join(5)


@contextmanager
def raw_receiver(
    answer: bytes, early: bool = False, tls: ssl.SSLContext | None = None
) -> Iterator[tuple[str, list[int]]]:
    """A receiver that reads each request (Content-Length bodies) and writes `answer`
    as it is; its URL, and the requests each of its connections got. An `early` one
    answers once it has the request's head and closes the connection without reading
    the body (as a server refusing a body too large may). With `tls`, it serves https
    (the URL names hooks.example)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    served: list[int] = []
    stop = threading.Event()

    def answer_requests(conn: socket.socket) -> None:
        data = b""
        while True:
            head, end, rest = data.partition(b"\r\n\r\n")
            if end and early:
                served[-1] += 1
                conn.sendall(answer)
                return
            if end:
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r")[0])
                if len(rest) >= length:
                    served[-1] += 1
                    data = rest[length:]
                    conn.sendall(answer)
                    continue
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            served.append(0)
            with conn, suppress(OSError):  # the client may hang up as it likes
                conn.settimeout(None)
                if tls is None:
                    answer_requests(conn)
                else:
                    with tls.wrap_socket(conn, server_side=True) as wrapped:
                        answer_requests(wrapped)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        port = listener.getsockname()[1]
        host = "127.0.0.1" if tls is None else "hooks.example"
        yield f"{'http' if tls is None else 'https'}://{host}:{port}/hook", served
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_bytes_after_an_answer_are_not_taken_for_it_and_end_the_connection(
    clients: Callable[..., CallbackClient],
) -> None:
    ok_then_more = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        b"HTTP/1.1 500 Oops\r\nX-Extra: 1\r\nContent-Length: 3\r\n\r\nbad"
    )
    for answer in (ok_then_more, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok and junk"):
        with raw_receiver(answer) as (url, served):
            client = clients()
            for _ in range(2):
                got = client.post(url, BODY, HEADERS)
                assert (got.status, got.body, "x-extra" in got.headers) == (200, b"ok", False)
            assert served == [1, 1]  # none of them kept


@contextmanager
def early_receiver(
    answer: bytes, tls: bool, clients: Callable[..., CallbackClient]
) -> Iterator[tuple[str, list[int], CallbackClient]]:
    """An early `raw_receiver` (https with `tls`), and a client that trusts it."""
    if not tls:
        with raw_receiver(answer, early=True) as (url, served):
            yield url, served, clients()
        return
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("hooks.example").configure_cert(context)
    with raw_receiver(answer, early=True, tls=context) as (url, served):
        yield url, served, clients(resolve=answers("127.0.0.1"), ssl_context=trusting(ca))


# more than the sockets' buffers hold: a send to a receiver that reads none fails midway
BIG = b"x" * (8 << 20)


def test_an_answer_sent_before_the_body_was_read_is_the_answer(
    clients: Callable[..., CallbackClient],
) -> None:
    # over https too, where the answer can be read after the failed send most times,
    # not always (OpenSSL may refuse to read once a write failed): not tested there
    too_large = b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\nRetry-After: 7\r\n\r\n"
    with early_receiver(too_large, False, clients) as (url, served, client):
        for _ in range(2):  # the connection is not kept
            answer = client.post(url, BIG, HEADERS)
            assert (answer.status, answer.headers["retry-after"]) == (413, "7")
        assert served == [1, 1]


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_2xx_sent_before_the_body_was_read_is_no_delivery(
    clients: Callable[..., CallbackClient], tls: bool
) -> None:
    accepted = b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n"
    # over https the answer may not be read at all (see above): a failure either way
    reason = "2xx before it read the whole batch" if not tls else "2xx before|closed early"
    with (
        early_receiver(accepted, tls, clients) as (url, _, client),
        pytest.raises(CallbackUnreachable, match=reason),
    ):
        client.post(url, BIG, HEADERS)


def test_an_upgrade_answer_is_unreachable_not_an_error_of_the_client(
    clients: Callable[..., CallbackClient],
) -> None:
    upgrade = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    with (
        raw_receiver(upgrade) as (url, _),
        pytest.raises(CallbackUnreachable, match=r"not HTTP/1\.1"),
    ):
        clients(QUICK).post(url, BODY, HEADERS)


def test_answer_headers_past_the_limit_end_the_request(
    clients: Callable[..., CallbackClient],
) -> None:
    endless = b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * (2 * _callbacks.MAX_HEAD_BYTES)
    with (
        raw_receiver(endless) as (url, _),
        pytest.raises(CallbackUnreachable, match="headers are larger than 65536 bytes"),
    ):
        clients(QUICK).post(url, BODY, HEADERS)


def test_a_closed_client_makes_no_connections_afterwards(
    receivers: Callable[[Answer], Receiver],
) -> None:
    receiver = receivers(ok)
    client = CallbackClient(LOOPBACK)
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.post(receiver.url(), BODY, HEADERS)
    assert receiver.requests == []


def test_one_client_serves_many_threads(
    receivers: Callable[[Answer], Receiver], clients: Callable[..., CallbackClient]
) -> None:
    receiver = receivers(ok)
    client = clients()
    bodies = [f'{{"n": {n}}}'.encode() for n in range(40)]
    with ThreadPoolExecutor(8) as threads:
        statuses = list(threads.map(lambda body: client.post(receiver.url(), body, {}), bodies))
    assert statuses and all(answer.status == 200 for answer in statuses)
    assert sorted(received.body for received in receiver.requests) == sorted(bodies)


# --- TLS ---


@contextmanager
def tls_receiver(certificate_for: str, ca: trustme.CA) -> Iterator[tuple[Receiver, list[str]]]:
    """A receiver serving https with a certificate for `certificate_for`, and the server
    names (SNI) its clients asked for."""
    names: list[str] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(certificate_for).configure_cert(context)

    def record(sock: ssl.SSLObject, name: str | None, context: ssl.SSLContext) -> None:
        names.append(name or "")

    context.sni_callback = record
    receiver = Receiver(ok)
    receiver.server.socket = context.wrap_socket(
        receiver.server.socket, server_side=True, do_handshake_on_connect=False
    )
    try:
        yield receiver, names
    finally:
        receiver.close()


def trusting(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


def test_tls_verifies_the_url_host_while_connecting_to_the_checked_address(
    clients: Callable[..., CallbackClient],
) -> None:
    ca = trustme.CA()
    with tls_receiver("hooks.example", ca) as (receiver, names):
        client = clients(resolve=answers("127.0.0.1"), ssl_context=trusting(ca))
        answer = client.post(f"https://hooks.example:{receiver.port}/hook", BODY, HEADERS)
        assert answer.status == 200
        assert names == ["hooks.example"]


def test_the_default_tls_context_is_made_at_the_first_https_delivery_only(
    receivers: Callable[[Answer], Receiver],
    clients: Callable[..., CallbackClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # it costs about 17 ms of CPU in every gateway process, most of which deliver nothing
    ca = trustme.CA()
    made: list[ssl.SSLContext] = []

    def counted() -> ssl.SSLContext:
        made.append(trusting(ca))
        return made[-1]

    monkeypatch.setattr(_callbacks, "_default_ssl_context", counted)
    client = clients(resolve=answers("127.0.0.1"))
    assert client.post(receivers(ok).url(), BODY, HEADERS).status == 200
    assert made == []
    with tls_receiver("hooks.example", ca) as (receiver, _):
        for _ in range(2):
            answer = client.post(f"https://hooks.example:{receiver.port}/hook", BODY, HEADERS)
            assert answer.status == 200
    assert len(made) == 1


def test_the_default_tls_context_trusts_the_systems_authorities_as_well_as_certifis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clients: Callable[..., CallbackClient]
) -> None:
    # an internal receiver (--callback-allow) has a certificate of the company's own
    # authority, which the system trusts (here through SSL_CERT_FILE) and certifi does not
    ca = trustme.CA()
    bundle = tmp_path / "company-ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    with tls_receiver("hooks.example", ca) as (receiver, _):
        client = clients(resolve=answers("127.0.0.1"))
        answer = client.post(f"https://hooks.example:{receiver.port}/hook", BODY, HEADERS)
        assert answer.status == 200


def test_tls_refuses_a_certificate_for_another_host(
    clients: Callable[..., CallbackClient],
) -> None:
    ca = trustme.CA()
    with tls_receiver("other.example", ca) as (receiver, _):
        client = clients(resolve=answers("127.0.0.1"), ssl_context=trusting(ca))
        with pytest.raises(CallbackUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
            client.post(f"https://hooks.example:{receiver.port}/hook", BODY, HEADERS)
        assert receiver.requests == []
