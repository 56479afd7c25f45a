"""Who is asking: API keys sent as `Authorization: Bearer <token>` (docs/gateway.md, "API keys").

While no active key exists in the database the gateway is open to its own host only
(requests from loopback addresses; `subengine serve` also refuses to listen on others);
once one exists, every request needs one. Keys are checked
in the database, which stores only their hashes. Answers are cached until a key changes:
a change notifies every gateway process (DESIGN.md, known pitfalls: a timer cache is a
window of wrong answers), so a revoked key is refused as soon as that notification
arrives (the only window is its delivery, milliseconds). While
the process's LISTEN connection is down, nothing cached is trusted: every request reads
the database. A token never appears in a log line or an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from starlette.requests import Request

from subengine.engine._async_engine import AsyncEngine
from subengine.gateway._connections import ANONYMOUS
from subengine.outside._api_keys import ApiKey
from subengine.streams._listener import Changes

T = TypeVar("T")


class Denied(Exception):
    """401 (no usable key) or 403 (the key may not do this)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller: an API key, or anyone while the gateway is open (key None)."""

    key: ApiKey | None

    @property
    def id(self) -> str:
        return ANONYMOUS if self.key is None else self.key.id

    def may(self, stream: str, scope: str) -> bool:
        return self.key is None or self.key.allows(stream, scope)

    def require(self, stream: str, scope: str) -> None:
        if not self.may(stream, scope):
            raise Denied(403, "forbidden", f"this key may not {scope} stream {stream!r}")


class Authenticator:
    """Checks Bearer tokens against the database, with a cache that a change of any key
    (a notification) empties. Make it in the event loop it serves; `close` it."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._changes = engine.listener.watch_changes()
        self._required = _Cached(engine.any_active_api_key, self._changes)
        # the answer for each token's digest, read at version `_tokens_version`
        self._tokens: dict[bytes, ApiKey | None] = {}
        self._tokens_version = -1
        self._by_id = _Cached(self._active_keys, self._changes)

    def close(self) -> None:
        self.engine.listener.unwatch_changes(self._changes)

    async def required(self) -> bool:
        return await self._required.get()

    async def principal(self, request: Request) -> Principal:
        header = request.headers.get("authorization")
        if header is None:
            if await self.required():
                raise Denied(
                    401,
                    "unauthorized",
                    "this gateway needs an API key: send 'Authorization: Bearer <key>'",
                )
            if not _loopback(request) or not loopback_host(request):
                # open only to its own host, whatever address the server listens on (its
                # last key may have been revoked while it listened on all of them), and by
                # a loopback name: a page of another site whose DNS name was rebound to
                # 127.0.0.1 sends its own name as Host
                raise Denied(
                    401,
                    "unauthorized",
                    "this gateway has no API key, so it answers only requests from its own "
                    "host sent to a loopback name (localhost, 127.0.0.1, [::1]); create a key "
                    "with 'subengine gateway key create'",
                )
            return Principal(None)
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Denied(401, "unauthorized", "send the API key as 'Authorization: Bearer <key>'")
        key = await self._key(token.strip())
        if key is None:
            raise Denied(401, "unauthorized", "the API key is unknown or revoked")
        return Principal(key)

    async def _key(self, token: str) -> ApiKey | None:
        digest = hashlib.sha256(token.encode(errors="replace")).digest()
        version = self._changes.version
        if self._trusted(self._tokens_version) and digest in self._tokens:
            return self._tokens[digest]
        key = await self.engine.authenticate(token)
        # an answer read before a change is not kept: it may be the old one
        if version > self._tokens_version or len(self._tokens) > 10_000:
            self._tokens, self._tokens_version = {}, version
        if version == self._tokens_version:
            self._tokens[digest] = key
        return key

    def _trusted(self, version: int) -> bool:
        return self._changes.listening and version == self._changes.version

    async def key_by_id(self, key_id: str) -> ApiKey | None:
        """The active key of this id (for a watch id, which names its key)."""
        return (await self._by_id.get()).get(key_id)

    async def _active_keys(self) -> dict[str, ApiKey]:
        return {key.id: key for key in await self.engine.api_keys() if key.revoked_at is None}


class _Cached(Generic[T]):
    """A value read from the database again after every change `changes` counts, and
    at every call while the listener is not listening. Callers that find it stale while
    it is being read again (since that change) wait for that one read: a thousand event
    streams checking their key at once make one query, not a thousand."""

    def __init__(self, read: Callable[[], Awaitable[T]], changes: Changes) -> None:
        self._read = read
        self._changes = changes
        self._value: tuple[int, T] | None = None
        self._reading: tuple[int, asyncio.Future[T]] | None = None

    async def get(self) -> T:
        version = self._changes.version
        if self._value is not None and self._changes.listening and self._value[0] == version:
            return self._value[1]
        if self._reading is None or self._reading[0] != version:
            self._reading = (version, asyncio.ensure_future(self._refresh(version)))
        return await asyncio.shield(self._reading[1])

    async def _refresh(self, version: int) -> T:
        try:
            value = await self._read()
            if self._value is None or self._value[0] <= version:
                self._value = (version, value)
            return value
        finally:
            if self._reading is not None and self._reading[0] == version:
                self._reading = None


def _loopback(request: Request) -> bool:
    if request.client is None:  # not over a socket (an in-process test client)
        return True
    try:
        return ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:
        return request.client.host == "localhost"


def loopback_host(request: Request) -> bool:
    """Whether the request was sent to a loopback name (its Host header): `localhost` or
    a loopback address, with any port."""
    if request.client is None:  # not over a socket (an in-process test client)
        return True
    host = request.headers.get("host", "")
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return loopback_name(name.strip("[]"))


def loopback_name(name: str) -> bool:
    """Whether a host name or address is this host's: `localhost` or a loopback address."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
