"""Sending webhook deliveries: a POST of signed JSON to the callback URL a remote subscriber
registered (docs: the webhooks protocol), safe against server-side request forgery.

A callback reaches public addresses only, and the networks an operator allows
(`CallbackPolicy.allow`). The host name is resolved at every connect and every address it
resolves to is checked; the connection then goes to a checked address, never to the name,
so a name that answers otherwise later (DNS rebinding) cannot reach an internal address.
TLS still verifies the certificate against the URL's host name.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as LookupTimeout
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

import httpcore
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
    return _Target(url=f"{parsed.scheme}://{netloc}{path}", host=host, port=port)


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


# When the post running in this thread must be over (time.monotonic()).
_deadline: ContextVar[float] = ContextVar("callback_deadline", default=math.inf)


def _within_deadline(timeout: float | None, expired: type[Exception]) -> float | None:
    """`timeout`, shortened to what is left of the current post's whole timeout; raises
    `expired` when nothing is left."""
    left = _deadline.get() - time.monotonic()
    if left <= 0:
        raise expired("the request took longer than its timeout")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose reads and writes end with the whole request's time."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _within_deadline(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _within_deadline(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        timeout = _within_deadline(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> object:
        return self._stream.get_extra_info(info)


class _CheckingBackend(httpcore.SyncBackend):
    """Connects to a host by resolving it and checking every address first, then to a
    checked address: the HTTP layer never resolves a name itself."""

    def __init__(self, client: CallbackClient) -> None:
        self._client = client

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        connect_until = time.monotonic() + self._client.policy.connect_timeout
        addresses = self._client._checked_addresses(
            host, port, _within_deadline(timeout, httpcore.ConnectTimeout)
        )
        failure = ""
        for address in addresses:
            left = connect_until - time.monotonic()
            if left <= 0:
                break
            try:
                stream = super().connect_tcp(
                    str(address),
                    port,
                    _within_deadline(left, httpcore.ConnectTimeout),
                    local_address,
                    socket_options,
                )
            except httpcore.ConnectTimeout:
                failure = f"connecting to {address} port {port} timed out"
            except httpcore.ConnectError as exc:
                failure = f"connecting to {address} port {port} failed: {_one_line(str(exc))}"
            else:
                return _DeadlineStream(stream)
        raise CallbackUnreachable(host, failure or "connecting timed out")


class CallbackClient:
    """Posts deliveries to callback URLs under a `CallbackPolicy`; one client serves many
    threads, keeping connections open per origin between deliveries.

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
        self._made: httpcore.ConnectionPool | None = None
        self._making = threading.Lock()
        self._closed = False

    @property
    def _pool(self) -> httpcore.ConnectionPool:
        """The connections, made at the first delivery: the default TLS context costs about
        17 ms of CPU (OpenSSL 3 reading the certificate authorities) in every gateway
        process, and one that delivers nothing never needs it."""
        pool = self._made
        if pool is None:
            with self._making:
                if self._closed:
                    raise RuntimeError("the callback client is closed")
                if self._made is None:
                    context = self._ssl_context
                    self._made = httpcore.ConnectionPool(
                        ssl_context=httpcore.default_ssl_context() if context is None else context,
                        max_connections=None,
                        max_keepalive_connections=KEEPALIVE_CONNECTIONS,
                        keepalive_expiry=KEEPALIVE_SECONDS,
                        network_backend=_CheckingBackend(self),
                    )
                pool = self._made
        return pool

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
        policy = self.policy
        timeouts = {
            "connect": policy.connect_timeout,
            "read": policy.timeout,
            "write": policy.timeout,
            "pool": policy.timeout,
        }
        reset = _deadline.set(time.monotonic() + policy.timeout)
        try:
            with self._pool.stream(
                "POST",
                target.url,
                headers=list(headers.items()),
                content=body,
                extensions={"timeout": timeouts},
            ) as response:
                content, truncated = _read_at_most(response, policy.max_response_bytes)
        except httpcore.TimeoutException:
            raise CallbackUnreachable(target.host, "no answer within the timeout") from None
        except httpcore.NetworkError as exc:
            raise CallbackUnreachable(
                target.host, f"the connection failed: {_one_line(str(exc))}"
            ) from None
        except httpcore.RemoteProtocolError:
            raise CallbackUnreachable(
                target.host, "the connection closed early or the answer is not HTTP/1.1"
            ) from None
        except httpcore.LocalProtocolError:
            # h11's message may quote a header, and headers carry signatures
            raise InvalidInput("a callback request header is not valid HTTP") from None
        finally:
            _deadline.reset(reset)
        names: dict[str, str] = {}
        for name, value in response.headers:
            key, text = name.decode("latin-1").lower(), value.decode("latin-1")
            names[key] = f"{names[key]}, {text}" if key in names else text
        return CallbackResponse(
            status=response.status, headers=names, body=content, truncated=truncated
        )

    def close(self) -> None:
        """Closes the open connections; the client is not used afterwards."""
        with self._making:
            self._closed = True
            if self._made is not None:
                self._made.close()
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


def _read_at_most(response: httpcore.Response, limit: int) -> tuple[bytes, bool]:
    """The first `limit` bytes of the body, and whether there was more (then the rest is
    not read: closing the response closes its connection)."""
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_stream():
        room = limit - size
        if len(chunk) > room:
            chunks.append(chunk[:room])
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


def _one_line(text: str) -> str:
    return " ".join(text.split())
