"""Who is asking: API keys sent as `Authorization: Bearer <token>` (docs/gateway.md, "API keys").

While no active key exists in the database the gateway is open to its own host only
(requests from loopback addresses; `subengine serve` also refuses to listen on others);
once one exists, every request needs one. Keys are checked
in the database, which stores only their hashes; a key's answer is kept for a few
seconds, so a revoked key stops working within `CACHE_SECONDS`. A token never appears
in a log line or an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from starlette.requests import Request

from subengine.engine._async_engine import AsyncEngine
from subengine.outside._api_keys import ApiKey

CACHE_SECONDS = 2.0
T = TypeVar("T")
ANONYMOUS = "anonymous"


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
    """Checks Bearer tokens against the database, with a short cache."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._required = _Cached(engine.any_active_api_key)
        self._tokens: dict[bytes, tuple[float, ApiKey | None]] = {}
        self._by_id = _Cached(self._active_keys)

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
            if not _loopback(request):
                # open only to its own host, whatever address the server listens on (its
                # last key may have been revoked while it listened on all of them)
                raise Denied(
                    401,
                    "unauthorized",
                    "this gateway has no API key, so it answers only requests from its own "
                    "host; create a key with 'subengine gateway key create'",
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
        now = time.monotonic()
        cached = self._tokens.get(digest)
        if cached is not None and now - cached[0] <= CACHE_SECONDS:
            return cached[1]
        key = await self.engine.authenticate(token)
        if len(self._tokens) > 10_000:
            self._tokens.clear()
        self._tokens[digest] = (now, key)
        return key

    async def key_by_id(self, key_id: str) -> ApiKey | None:
        """The active key of this id (for a watch id, which names its key)."""
        return (await self._by_id.get()).get(key_id)

    async def _active_keys(self) -> dict[str, ApiKey]:
        return {key.id: key for key in await self.engine.api_keys() if key.revoked_at is None}


class _Cached(Generic[T]):
    """A value read from the database at most once per CACHE_SECONDS: callers that find
    it stale while it is being read again wait for that one read (a thousand event
    streams checking their key at once make one query, not a thousand)."""

    def __init__(self, read: Callable[[], Awaitable[T]]) -> None:
        self._read = read
        self._value: tuple[float, T] | None = None
        self._reading: asyncio.Future[T] | None = None

    async def get(self) -> T:
        if self._value is not None and time.monotonic() - self._value[0] <= CACHE_SECONDS:
            return self._value[1]
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self._reading)

    async def _refresh(self) -> T:
        try:
            value = await self._read()
            self._value = (time.monotonic(), value)
            return value
        finally:
            self._reading = None


def _loopback(request: Request) -> bool:
    if request.client is None:  # not over a socket (an in-process test client)
        return True
    try:
        return ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:
        return request.client.host == "localhost"
