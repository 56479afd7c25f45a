"""Sending webhook deliveries: a POST of signed JSON to the callback URL a remote subscriber
registered (docs: the webhooks protocol), safe against server-side request forgery.

A callback reaches public addresses only, and the networks an operator allows
(`CallbackPolicy.allow`). The host name is resolved at every connect and every address it
resolves to is checked; the connection then goes to a checked address, never to the name,
so a name that answers otherwise later (DNS rebinding) cannot reach an internal address.
TLS still verifies the certificate against the URL's host name.

The HTTP/1.1 exchange is this module's own, on plain sockets, with httptools (uvicorn's
parser, in C) reading the answer. A POST of a 41 KB batch through httpcore took about
160 µs of CPU, most of it pure-Python parsing under the interpreter's lock, which all
delivery slots of a process share; this way it takes about 36 µs.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as LookupTimeout
from dataclasses import dataclass, field
from datetime import UTC
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

import certifi
import httptools
import httpx

from subengine.model._errors import InvalidInput, SubengineError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# (host, port) -> the host's addresses as text; the default asks the system resolver
Resolver = Callable[[str, int], list[str]]

MAX_URL_LENGTH = 2000
# Retry-After is honoured up to a day
MAX_RETRY_AFTER = 86400.0
# Idle connections a client keeps open for the next delivery, and for how long
KEEPALIVE_CONNECTIONS = 64
KEEPALIVE_SECONDS = 15.0
# Host-name look-ups running at once; one stuck in the system resolver holds its thread
# until the resolver gives up, though the delivery waiting for it has failed long before
LOOKUP_THREADS = 8

# Addresses a callback never reaches unless an allowlist entry covers them, each with what
# it is; the first match names the reason. `is_global` is checked as well, but its table
# differs between Python versions and misses some of these.
_NOT_PUBLIC: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(network), what)
    for network, what in (
        ("0.0.0.0/8", "this network"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "shared address space"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "protocol assignments"),
        ("192.0.2.0/24", "documentation"),
        ("192.88.99.0/24", "6to4 relay"),
        ("192.168.0.0/16", "private"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::/96", "IPv4-compatible"),
        ("::ffff:0:0:0/96", "IPv4-translated"),
        ("64:ff9b:1::/48", "local NAT64"),
        ("100::/64", "discard-only"),
        ("2001::/32", "Teredo"),
        ("2001::/23", "protocol assignments"),
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("5f00::/16", "segment routing"),
        ("fc00::/7", "unique local"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local"),
        ("ff00::/8", "multicast"),
    )
)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")


class CallbackRefused(InvalidInput):
    """The callback's host is, or resolves to, an address callbacks may not reach."""

    def __init__(self, host: str, address: IPAddress, reason: str) -> None:
        # one line that says what to do: the check runs where the PUT is answered too, so
        # an allowance given only to the delivering processes is not enough
        self.network = ipaddress.ip_network(address)  # the least that allows it
        super().__init__(
            f"callback host {host!r} refused: its address {address} is {reason}, and "
            "callbacks reach public addresses only; to allow it, start every gateway "
            f"process with `subengine serve --callback-allow {self.network}` (--no-deliver "
            "ones too: the process that answers the PUT checks it)"
        )
        self.host = host
        self.address = address
        self.reason = reason


class CallbackUnreachable(SubengineError):
    """A delivery failed on the way: no address, no connection, no answer in time, or an
    answer that is not HTTP."""

    def __init__(self, host: str, reason: str) -> None:
        super().__init__(f"callback host {host!r} unreachable: {reason}")
        self.host = host
        self.reason = reason


@dataclass(frozen=True)
class CallbackPolicy:
    """Where callbacks may go, and how long and how much a delivery may take."""

    # internal networks callbacks may reach besides the public addresses
    allow: tuple[IPNetwork, ...] = ()
    # resolving the host and connecting, all its addresses together
    connect_timeout: float = 5.0
    # the whole request: connect, send, and read the answer
    timeout: float = 10.0
    # the most of an answer's body that is read
    max_response_bytes: int = 65536

    def __post_init__(self) -> None:
        if not (self.connect_timeout > 0 and self.timeout > 0):
            raise InvalidInput(
                f"callback timeouts must be positive seconds, not connect_timeout="
                f"{self.connect_timeout} and timeout={self.timeout}"
            )
        if self.max_response_bytes < 0:
            raise InvalidInput(
                f"max_response_bytes must be 0 or more, not {self.max_response_bytes}"
            )

    @classmethod
    def from_text(cls, text: str) -> CallbackPolicy:
        """A policy allowing the comma-separated networks of `text` ("10.0.0.0/8,fd00::/8";
        blank: none), with the default limits."""
        if not text.strip():
            return cls()
        networks: list[IPNetwork] = []
        for entry in (part.strip() for part in text.split(",")):
            try:
                networks.append(ipaddress.ip_network(entry))
            except ValueError as exc:
                raise InvalidInput(
                    f"callback allowlist entry {entry!r} is not a network ({exc}); write "
                    "networks in CIDR notation, comma-separated: 10.0.0.0/8,fd00::/8"
                ) from None
        return cls(allow=tuple(networks))


@dataclass(frozen=True)
class CallbackResponse:
    """A callback's answer: its status, its headers (lower-case names; repeated ones joined
    with ", ") and the start of its body, `truncated` when there was more."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    truncated: bool = False

    def retry_after(self, now: float | None = None) -> float | None:
        """The Retry-After header in seconds from `now` (Unix time; default: the clock),
        within 0 to a day; None when it is absent or unreadable."""
        value = self.headers.get("retry-after", "").strip()
        if not value:
            return None
        if value.isascii() and value.isdigit():
            seconds = float(value) if len(value) <= 9 else MAX_RETRY_AFTER
        else:
            try:
                when = parsedate_to_datetime(value)
            except (TypeError, ValueError):
                return None
            if when.tzinfo is None:  # "-0000": UTC, by RFC 5322
                when = when.replace(tzinfo=UTC)
            seconds = when.timestamp() - (time.time() if now is None else now)
        return min(max(seconds, 0.0), MAX_RETRY_AFTER)


@dataclass(frozen=True)
class _Target:
    url: str  # normalized
    host: str  # as it is resolved: lower case, IDNA-encoded, an IPv6 address without [ ]
    port: int
    tls: bool
    authority: bytes  # the Host header: the host as written in the URL, and a port not default
    path: bytes  # with the query


def check_callback_url(url: str) -> str:
    """`url` normalized (lower-case scheme and host, IDNA host, no default port) if it is a
    valid callback URL: http or https, a host, no user or password, no fragment, a port from
    1 to 65535, at most 2000 characters. Raises InvalidInput otherwise. The host is not
    resolved here: `CallbackClient.check_now` does that."""
    return _parse(url).url


# a delivery parses its callback URL again at every POST otherwise (measured: 6 % of a
# delivering process's time); a URL that is refused raises again each time
@functools.lru_cache(maxsize=1024)
def _parse(url: str) -> _Target:
    if len(url) > MAX_URL_LENGTH:
        raise InvalidInput(
            f"callback URL has {len(url)} characters; at most {MAX_URL_LENGTH} are allowed"
        )
    if any(char.isspace() or not char.isprintable() for char in url):
        raise InvalidInput("callback URL contains a space or a control character")
    try:
        parsed = httpx.URL(url)
        authority = urlsplit(url).netloc
    except (httpx.InvalidURL, ValueError) as exc:
        raise InvalidInput(f"callback URL is not a valid URL: {_one_line(str(exc))}") from None
    if parsed.scheme not in ("http", "https"):
        found = f", not {parsed.scheme}:" if parsed.scheme else ""
        raise InvalidInput(f"callback URL must begin with http:// or https://{found}")
    if parsed.userinfo or "@" in authority:
        raise InvalidInput(
            "callback URL must not carry a user name or password; the signature of each "
            "delivery authenticates it"
        )
    if parsed.fragment or "#" in url:
        raise InvalidInput("callback URL must not have a fragment (#...)")
    host = parsed.raw_host.decode("ascii").lower()
    if not host:
        raise InvalidInput("callback URL has no host; it looks like https://host[:port]/path")
    if ":" in host:
        try:
            if "%" in host:
                raise ValueError("zone")
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise InvalidInput(f"callback host [{host}] is not an IPv6 address") from None
        netloc = f"[{host}]"
    else:
        labels = host.removesuffix(".").split(".")
        if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
            raise InvalidInput(f"callback host {host!r} is not a valid host name")
        netloc = host
    default = 443 if parsed.scheme == "https" else 80
    port = default if parsed.port is None else parsed.port
    if not 1 <= port <= 65535:
        raise InvalidInput(f"callback port {port} is outside 1 to 65535")
    if port != default:
        netloc += f":{port}"
    path = parsed.raw_path.decode("ascii") or "/"
    return _Target(
        url=f"{parsed.scheme}://{netloc}{path}",
        host=host,
        port=port,
        tls=parsed.scheme == "https",
        authority=netloc.encode("ascii"),
        path=path.encode("ascii"),
    )


def address_allowed(address: IPAddress, policy: CallbackPolicy) -> bool:
    """Whether a callback may connect to `address`: it is in `policy.allow`, or public."""
    return _refusal(address, policy) is None


def _refusal(address: IPAddress, policy: CallbackPolicy) -> str | None:
    """Why a callback may not connect to `address`, or None when it may."""
    if any(address in network for network in policy.allow):
        return None
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped
        if mapped is not None:
            # The socket connects to the IPv4 address itself: allowed where that one is.
            reason = _refusal(mapped, policy)
            return None if reason is None else f"IPv4-mapped {mapped}, {reason}"
        embedded = address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            # A relay or translator elsewhere reaches it: no allowlist entry reaches through.
            reason = _not_public(embedded)
            if reason is not None:
                return f"a 6to4 or NAT64 address of {embedded}, {reason}"
    return _not_public(address)


def _not_public(address: IPAddress) -> str | None:
    for network, what in _NOT_PUBLIC:
        if address in network:
            return f"in {network} ({what})"
    return None if address.is_global else "not globally reachable"


def resolve_host(host: str, port: int) -> list[str]:
    """The addresses of `host` by the system resolver, for a TCP connection to `port`."""
    answers = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(answer[4][0]) for answer in answers))


# A request header's name (an HTTP token) and value (no control character but tab)
_HEADER_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(rb"[^\x00-\x08\x0a-\x1f\x7f]*")
_READ_SIZE = 65536
# The most an answer's status line and headers may take (h11, used before, allowed 16 KiB)
MAX_HEAD_BYTES = 65536


class _Expired(Exception):
    """The request's whole time is up."""


class _Stale(Exception):
    """The connection ended before any of the answer came: a kept one may have been
    closed by the receiver as the request went out."""


class _ClosedEarly(Exception):
    """The connection ended in the middle of the answer."""


class _Unread(Exception):
    """The receiver answered 2xx before it read the whole request."""


# what a socket raises when the peer has reset or closed the connection under a send
_BROKEN = (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError)


class _HeadTooLarge(Exception):
    """The answer's status line and headers passed MAX_HEAD_BYTES."""


def _request_head(target: _Target, headers: Mapping[str, str], length: int) -> bytes:
    """The request line and headers of a POST of `length` bytes to `target` (`headers`
    has neither Host nor Content-Length); InvalidInput for a header that is not valid HTTP
    (without quoting it: headers carry signatures)."""
    lines = [b"POST %s HTTP/1.1\r\nHost: %s\r\n" % (target.path, target.authority)]
    for name, value in headers.items():
        try:
            raw_name, raw_value = name.encode("latin-1"), value.encode("latin-1")
        except UnicodeEncodeError:
            raw_name = raw_value = b"\x00"
        if not (_HEADER_NAME.fullmatch(raw_name) and _HEADER_VALUE.fullmatch(raw_value)):
            raise InvalidInput("a callback request header is not valid HTTP")
        lines.append(b"%s: %s\r\n" % (raw_name, raw_value))
    lines.append(b"Content-Length: %d\r\n\r\n" % length)
    return b"".join(lines)


@dataclass(eq=False, slots=True)
class _Answer:
    """An answer as httptools reads it (its callbacks), its body cut at `limit` bytes."""

    limit: int
    parser: httptools.HttpResponseParser | None = None
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    size: int = 0
    started: bool = False  # any byte of it came
    headers_done: bool = False
    complete: bool = False
    keep_alive: bool = False  # the connection may carry the next request (known at the end)
    truncated: bool = False
    trailing: bool = False  # bytes came after the answer: the connection is not kept

    def on_message_begin(self) -> None:
        self.trailing = self.complete

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.complete:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return
        room = self.limit - self.size
        if len(body) > room:
            body, self.truncated = body[:room], True
        self.body.append(body)
        self.size += len(body)

    def on_message_complete(self) -> None:
        assert self.parser is not None
        if self.complete:
            return
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the next one is the answer
            self.headers, self.body, self.size, self.headers_done = [], [], 0, False
        else:
            self.status, self.complete = status, True
            self.keep_alive = self.parser.should_keep_alive()

    def ends_at_close(self) -> bool:
        """Whether the body runs until the connection closes (no length, not chunked)."""
        return self.headers_done and not any(
            name.lower() in (b"content-length", b"transfer-encoding") for name, _ in self.headers
        )


def _default_ssl_context() -> ssl.SSLContext:
    """The system's certificate authorities (and SSL_CERT_FILE or SSL_CERT_DIR), and
    certifi's, as httpcore's default context trusts."""
    context = ssl.create_default_context()
    context.load_verify_locations(certifi.where())
    return context


def _alive(sock: socket.socket) -> bool:
    """Whether a kept connection is still open with nothing unasked waiting on it (a
    receiver closes idle connections when it likes). A TLS record that carries no data (a
    session ticket) is read and is no sign of death."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
        return True
    except OSError:
        return False
    return False  # closed, or sent what nobody asked for


class CallbackClient:
    """Posts deliveries to callback URLs under a `CallbackPolicy`; one client serves many
    threads, keeping connections open per origin between deliveries (at most
    KEEPALIVE_CONNECTIONS, each at most KEEPALIVE_SECONDS idle).

    `resolve(host, port)` gives a host's addresses (default: the system resolver);
    `ssl_context` verifies https callbacks (default: the usual certificate authorities).
    """

    def __init__(
        self,
        policy: CallbackPolicy,
        resolve: Resolver | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.policy = policy
        self._resolve = resolve_host if resolve is None else resolve
        self._lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="callback-lookup")
        self._ssl_context = ssl_context
        self._lock = threading.Lock()
        # idle connections, the most recently used last: (origin, socket, idle since)
        self._idle: list[tuple[tuple[bool, str, int], socket.socket, float]] = []
        self._closed = False

    def _tls(self) -> ssl.SSLContext:
        """The TLS context, made at the first https delivery: the default one costs about
        17 ms of CPU (OpenSSL 3 reading the certificate authorities) in every gateway
        process, and one that delivers nothing over https never needs it."""
        with self._lock:
            if self._ssl_context is None:
                self._ssl_context = _default_ssl_context()
            return self._ssl_context

    def check_now(self, url: str) -> None:
        """Checks `url` when it is registered: raises InvalidInput for a malformed URL,
        CallbackRefused unless every address of its host may be reached, and
        CallbackUnreachable when the host cannot be resolved."""
        target = _parse(url)
        self._checked_addresses(target.host, target.port, self.policy.connect_timeout)

    def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> CallbackResponse:
        """POSTs `body` with `headers` (Host and Content-Length are added) to `url` and
        returns the answer, a redirect included: redirects are not followed. Raises
        CallbackRefused when the host resolves to an address that may not be reached, and
        CallbackUnreachable when there is no connection or no answer within the timeouts."""
        target = _parse(url)
        if self._closed:
            raise RuntimeError("the callback client is closed")
        request = _request_head(target, headers, len(body)) + body
        deadline = time.monotonic() + self.policy.timeout
        origin = (target.tls, target.host, target.port)
        try:
            sock = self._kept(origin)
            if sock is not None:
                try:
                    return self._exchange(target, origin, sock, request, deadline)
                except _Stale:
                    # closed as the request went out, or before, and nothing came back:
                    # once more, on a new connection (a delivery the receiver took
                    # before the connection ended is then sent twice, under the same
                    # webhook-id, as any retry is: docs/webhooks.md)
                    pass
            sock = self._connect(target, deadline)
            return self._exchange(target, origin, sock, request, deadline)
        except (_Expired, TimeoutError):
            raise CallbackUnreachable(target.host, "no answer within the timeout") from None
        except (_Stale, _ClosedEarly, httptools.HttpParserError, httptools.HttpParserUpgrade):
            raise CallbackUnreachable(
                target.host, "the connection closed early or the answer is not HTTP/1.1"
            ) from None
        except _Unread:
            raise CallbackUnreachable(
                target.host, "the callback answered 2xx before it read the whole batch"
            ) from None
        except _HeadTooLarge:
            raise CallbackUnreachable(
                target.host, f"the answer's headers are larger than {MAX_HEAD_BYTES} bytes"
            ) from None
        except OSError as exc:  # ssl.SSLError too
            raise CallbackUnreachable(
                target.host, f"the connection failed: {_one_line(str(exc))}"
            ) from None

    def _exchange(
        self,
        target: _Target,
        origin: tuple[bool, str, int],
        sock: socket.socket,
        request: bytes,
        deadline: float,
    ) -> CallbackResponse:
        """Send `request` on `sock` and read the answer, by `deadline`; the connection is
        kept for the next one when the answer allows it, else closed."""
        answer = _Answer(self.policy.max_response_bytes)
        parser = answer.parser = httptools.HttpResponseParser(answer)
        kept = sent = False
        head = 0  # bytes received before the headers ended
        try:
            sock.settimeout(_left(deadline))
            try:
                sock.sendall(request)
                sent = True
            except _BROKEN:
                # the receiver stopped reading: it may have answered first (413, say)
                pass
            while not (answer.complete or answer.truncated):
                sock.settimeout(_left(deadline))
                data = sock.recv(_READ_SIZE)
                if not data:
                    if answer.ends_at_close():
                        break
                    raise _Stale
                answer.started = True
                if not answer.headers_done:
                    head += len(data)
                try:
                    parser.feed_data(data)
                except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                    if not answer.complete:
                        raise
                    answer.trailing = True  # what follows the answer is none of ours
                if not answer.headers_done and head > MAX_HEAD_BYTES:
                    raise _HeadTooLarge
            kept = sent and answer.complete and answer.keep_alive and not answer.trailing
        except (_Stale, *_BROKEN):
            raise (_ClosedEarly if answer.started else _Stale) from None
        finally:
            if kept:
                self._keep(origin, sock)
            else:
                sock.close()
        status = answer.status or parser.get_status_code()
        if not sent and 200 <= status < 300:
            raise _Unread  # it cannot have taken the batch
        names: dict[str, str] = {}
        for name, value in answer.headers:
            key, text = name.decode("latin-1").lower(), value.decode("latin-1")
            names[key] = f"{names[key]}, {text}" if key in names else text
        return CallbackResponse(
            status=status,
            headers=names,
            body=b"".join(answer.body),
            truncated=answer.truncated,
        )

    def _kept(self, origin: tuple[bool, str, int]) -> socket.socket | None:
        """A kept connection to `origin` that is still open, if there is one."""
        now = time.monotonic()
        while True:
            with self._lock:
                for index in range(len(self._idle) - 1, -1, -1):
                    if self._idle[index][0] == origin:
                        _, sock, since = self._idle.pop(index)
                        break
                else:
                    return None
            if now - since < KEEPALIVE_SECONDS and _alive(sock):
                return sock
            sock.close()

    def _keep(self, origin: tuple[bool, str, int], sock: socket.socket) -> None:
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._idle.append((origin, sock, time.monotonic()))
            if len(self._idle) > KEEPALIVE_CONNECTIONS:
                self._idle.pop(0)[1].close()

    def _connect(self, target: _Target, deadline: float) -> socket.socket:
        """A new connection to a checked address of the target's host (TLS for https,
        verified against the URL's host name)."""
        connect_until = min(time.monotonic() + self.policy.connect_timeout, deadline)
        addresses = self._checked_addresses(target.host, target.port, _left(connect_until))
        failure = ""
        for address in addresses:
            left = connect_until - time.monotonic()
            if left <= 0:
                break
            try:
                sock = socket.create_connection((str(address), target.port), timeout=left)
            except TimeoutError:
                failure = f"connecting to {address} port {target.port} timed out"
                continue
            except OSError as exc:
                failure = f"connecting to {address} port {target.port} failed: " + _one_line(
                    str(exc)
                )
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not target.tls:
                return sock
            try:
                sock.settimeout(_left(connect_until))
                return self._tls().wrap_socket(sock, server_hostname=target.host)
            except BaseException:
                sock.close()
                raise
        raise CallbackUnreachable(target.host, failure or "connecting timed out")

    def close(self) -> None:
        """Closes the open connections; the client is not used afterwards."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for _, sock, _ in idle:
            sock.close()
        self._lookups.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _checked_addresses(self, host: str, port: int, timeout: float | None) -> list[IPAddress]:
        """The addresses of `host`, resolved now, after checking every one of them."""
        try:
            addresses: list[IPAddress] = [ipaddress.ip_address(host)]
        except ValueError:
            addresses = self._lookup(host, port, timeout)
        if not addresses:
            raise CallbackUnreachable(host, "the host name has no address")
        for address in addresses:
            reason = _refusal(address, self.policy)
            if reason is not None:
                raise CallbackRefused(host, address, reason)
        return addresses

    def _lookup(self, host: str, port: int, timeout: float | None) -> list[IPAddress]:
        answer = self._lookups.submit(self._resolve, host, port)
        try:
            texts = answer.result(timeout)
        except LookupTimeout:
            answer.cancel()
            raise CallbackUnreachable(host, "resolving the host name timed out") from None
        except OSError as exc:
            raise CallbackUnreachable(
                host, f"resolving the host name failed: {_one_line(str(exc))}"
            ) from None
        addresses: list[IPAddress] = []
        for text in texts:
            try:
                addresses.append(ipaddress.ip_address(text))
            except ValueError:
                raise CallbackUnreachable(
                    host, f"the resolver answered {text!r}, which is not an IP address"
                ) from None
        return addresses


def _left(deadline: float) -> float:
    """Seconds until `deadline`; _Expired once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Expired
    return left


def _one_line(text: str) -> str:
    return " ".join(text.split())
