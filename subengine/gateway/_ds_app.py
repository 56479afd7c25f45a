"""The gateway's Durable Streams surface (docs/durable-streams.md; `serve --durable-streams`):
an ASGI application mounted under a prefix, where any path is a stream. This module
routes by method and answers the writes and HEAD; reads are `_ds_reads`.

An entry point (DESIGN.md, layers): it parses requests, calls the Durable Streams
storage of the engine (`engine/_durable_streams.py`) and presents; it runs no SQL.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from subengine.engine._ds_forks import ForkOf
from subengine.engine._durable_streams import BadMessage, NewStream
from subengine.gateway._auth import Denied, Principal
from subengine.gateway._connections import Busy
from subengine.gateway._ds_http import (
    CLOSED,
    EXPIRES_AT,
    FORK_OFFSET,
    FORK_SUB_OFFSET,
    FORKED_FROM,
    NEXT_OFFSET,
    PRODUCER_EPOCH,
    PRODUCER_EXPECTED_SEQ,
    PRODUCER_ID,
    PRODUCER_RECEIVED_SEQ,
    PRODUCER_SEQ,
    REQUEST_HEADERS,
    SECURITY_HEADERS,
    SEQ,
    TTL,
    DsError,
    closed_header,
    error_response,
    parse_offset,
    text_response,
)
from subengine.gateway._ds_reads import read_stream
from subengine.gateway._ds_state import DurableStreamsState
from subengine.gateway._ds_views import read_only, view_of
from subengine.gateway._request_bodies import BodyTooLarge, read_limited_body
from subengine.gateway._state import Gateway
from subengine.model._errors import DatabaseUnavailable, SchemaNotReady, StreamNotFound
from subengine.outside._durable_streams import ENGINE_PREFIX, CatalogStream, Producer, engine_name

log = logging.getLogger("subengine.gateway")

DEFAULT_CONTENT_TYPE = "application/octet-stream"
MAX_PATH = 2000
# Producer-Epoch and Producer-Seq: whole numbers up to 2^53 - 1, without a sign or zeros
# before them (PROTOCOL.md 5.2.1).
_WHOLE = re.compile(r"0|[1-9][0-9]{0,15}")
_MAX_WHOLE = 2**53 - 1
# Stream-TTL: seconds, in decimal without a sign, a point or zeros before it.
_TTL = re.compile(r"0|[1-9][0-9]{0,17}")
_METHODS = "GET, HEAD, PUT, POST, DELETE, OPTIONS"
# What a stream deleted softly answers (PROTOCOL.md 4.2: forks still read it).
GONE = "the stream at {!r} is deleted; forks of it still read it"
# The status of a refused fork, by the storage's outcome.
_FORK_STATUS = {
    "source_missing": 404,
    "source_deleted": 409,
    "content_type": 409,
    "bad_offset": 400,
}


class DurableStreamsApp:
    """The ASGI application of the Durable Streams surface; mount it under a prefix of
    the gateway's application (whose state holds the `Gateway` and the
    `DurableStreamsState`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        try:
            response = await self._answer(request)
        except DsError as error:
            response = error_response(error)
        except Denied as error:
            headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
            response = error_response(DsError(error.status, error.message, headers))
        except Busy as error:
            headers = {"Retry-After": str(error.retry_after)}
            response = error_response(DsError(429, error.message, headers))
        except (DatabaseUnavailable, SchemaNotReady) as error:
            response = error_response(DsError(503, str(error), {"Retry-After": "1"}))
        await response(scope, receive, send)

    async def _answer(self, request: Request) -> Any:
        state: DurableStreamsState = request.app.state.durable_streams
        path = stream_path(request)
        method = request.method
        if method == "OPTIONS":
            return _preflight(request, state.gateway)
        principal = await state.gateway.auth.principal(request)
        view = view_of(path)
        if view is not None:
            if method not in ("GET", "HEAD"):
                raise read_only(method)
            principal.require(view[0], "read")
        if method in ("GET", "HEAD"):
            if view is None:
                _require(principal, path, "read")
            if method == "HEAD":
                return await _head(state, path)
            return await read_stream(state, request, principal, path)
        _require(principal, path, "append")
        if method == "PUT":
            fork = _fork(request)
            if fork is not None:
                _require(principal, fork.path, "read")
            return await _create(state, request, path, fork)
        if method == "POST":
            return await _append(state, request, path)
        if method == "DELETE":
            return await _delete(state, path)
        raise DsError(405, f"{method} is not a method of a stream", {"Allow": _METHODS})


def stream_path(request: Request) -> str:
    """The stream's path: the request's path below the mount point."""
    path: str = request.scope["path"]
    root: str = request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    if not path.startswith("/") or path == "/" or len(path) > MAX_PATH:
        raise DsError(404, "no stream here: a stream's URL is the prefix and a path")
    if not path.isprintable():
        raise DsError(400, "a stream's path may not contain control characters")
    return path


def _require(principal: Principal, path: str, scope: str) -> None:
    """A key's stream patterns name engine streams; a Durable Streams stream's engine
    stream is `ds.` and its path's letters, so a key with the pattern `ds.*` (or `*`)
    may use every path, one with `ds.orders*` the paths that start with /orders."""
    if principal.key is None:
        return
    name = engine_name(path)
    if not principal.may(name, scope) and not principal.may(ENGINE_PREFIX, scope):
        raise Denied(403, "forbidden", f"this key may not {scope} the stream at {path!r}")


def _preflight(request: Request, gateway: Gateway) -> Response:
    """A CORS preflight: the methods and headers the protocol uses; the origin is
    allowed only when `--cors-origin` names it."""
    headers = {
        **SECURITY_HEADERS,
        "Access-Control-Allow-Methods": _METHODS,
        "Access-Control-Allow-Headers": ", ".join(REQUEST_HEADERS),
        "Access-Control-Max-Age": "600",
        "Cache-Control": "no-store",
    }
    origin = request.headers.get("origin")
    if origin is not None and origin in gateway.config.cors_origins:
        headers["Access-Control-Allow-Origin"] = origin
        headers["Vary"] = "Origin"
    return Response(status_code=204, headers=headers)


def stream_headers(found: CatalogStream, tail: int | None = None) -> dict[str, str]:
    """Content-Type and Stream-Next-Offset of a stream, and Stream-Closed if it is."""
    headers = {
        "Content-Type": found.content_type,
        NEXT_OFFSET: found.offset_at(found.tail if tail is None else tail),
    }
    if found.closed:
        headers[CLOSED] = "true"
    return headers


async def _head(state: DurableStreamsState, path: str) -> Response:
    found = await state.lookup(path)
    if found is None:
        raise DsError(404, f"no stream at {path!r}")
    if found.deleted:
        raise DsError(410, GONE.format(path))
    headers = stream_headers(found)
    if found.ttl_seconds is not None:
        headers[TTL] = str(found.ttl_seconds)
    if found.expires_at is not None:
        headers[EXPIRES_AT] = found.expires_at.isoformat().replace("+00:00", "Z")
    return text_response(200, b"", headers)


async def _body(request: Request, limit: int) -> bytes:
    try:
        return await read_limited_body(request, limit)
    except BodyTooLarge as refused:
        raise DsError(413, str(refused), refused.headers) from None


def _expiry(request: Request) -> tuple[int | None, datetime | None]:
    ttl_text = request.headers.get("stream-ttl")
    expires_text = request.headers.get("stream-expires-at")
    if ttl_text is not None and expires_text is not None:
        raise DsError(400, "give Stream-TTL or Stream-Expires-At, not both")
    ttl = None
    if ttl_text is not None:
        if _TTL.fullmatch(ttl_text) is None:
            raise DsError(400, f"Stream-TTL must be whole seconds, not {ttl_text[:32]!r}")
        ttl = int(ttl_text)
    expires_at = None
    if expires_text is not None:
        try:
            expires_at = datetime.fromisoformat(expires_text)
        except ValueError:
            expires_at = None
        if expires_at is None or expires_at.tzinfo is None or "T" not in expires_text.upper():
            raise DsError(
                400, f"Stream-Expires-At must be an RFC 3339 time, not {expires_text[:64]!r}"
            )
    return ttl, expires_at


def _fork(request: Request) -> ForkOf | None:
    """What a PUT's Stream-Forked-From, Stream-Fork-Offset and Stream-Fork-Sub-Offset
    ask (None: no fork). The source's path is relative to the prefix, like the
    request's own; one that starts with the prefix is the whole URL path, and is taken
    below it."""
    source = request.headers.get(FORKED_FROM.lower())
    offset_text = request.headers.get(FORK_OFFSET.lower())
    sub_text = request.headers.get(FORK_SUB_OFFSET.lower())
    if source is None:
        if offset_text is not None or sub_text is not None:
            raise DsError(400, f"{FORK_OFFSET} and {FORK_SUB_OFFSET} need {FORKED_FROM}")
        return None
    root: str = request.scope.get("root_path", "")
    if root and source.startswith(root + "/"):
        source = source[len(root) :]
    if not source.startswith("/") or len(source) > MAX_PATH or not source.isprintable():
        raise DsError(400, f"{FORKED_FROM} must be the path of a stream of this server")
    sub = 0
    if sub_text is not None:
        if _WHOLE.fullmatch(sub_text) is None:
            raise DsError(400, f"{FORK_SUB_OFFSET} must be a whole number, not {sub_text[:32]!r}")
        sub = int(sub_text)
    if offset_text is None:
        if sub:
            raise DsError(400, f"{FORK_SUB_OFFSET} needs the {FORK_OFFSET} it counts from")
        return ForkOf(source)
    at = parse_offset([offset_text])
    if at.kind != "at":
        raise DsError(400, f"{FORK_OFFSET} must be an offset the source returned")
    return ForkOf(source, (at.epoch, at.position), offset_text, sub)


async def _create(
    state: DurableStreamsState, request: Request, path: str, fork: ForkOf | None
) -> Response:
    content_type = request.headers.get("content-type") or None
    if content_type is None and fork is None:
        content_type = DEFAULT_CONTENT_TYPE
    if content_type is not None and (
        not content_type.strip() or len(content_type) > 255 or not content_type.isprintable()
    ):
        raise DsError(400, "Content-Type must be a media type")
    ttl, expires_at = _expiry(request)
    close = closed_header(request.headers.get("stream-closed"))
    body = await _body(request, state.gateway.config.max_body_bytes)
    new = NewStream(content_type and content_type.strip(), ttl, expires_at, close, body, fork)
    try:
        created = await state.store.create(path, new)
    except BadMessage as error:
        raise DsError(400, str(error)) from None
    outcome = created.outcome
    if outcome in _FORK_STATUS:
        raise DsError(_FORK_STATUS[outcome], created.detail)
    if outcome == "deleted":
        raise DsError(409, GONE.format(path) + ": the path is taken until they are gone")
    if outcome == "conflict":
        raise DsError(409, f"a stream with another configuration exists at {path!r}")
    assert created.stream is not None
    headers = stream_headers(created.stream)
    if outcome == "exists":
        return text_response(200, b"", headers)
    headers["Location"] = str(request.url.replace(query=""))
    return text_response(201, b"", headers)


def _producer(request: Request) -> Producer | None:
    given = [request.headers.get(name) for name in (PRODUCER_ID, PRODUCER_EPOCH, PRODUCER_SEQ)]
    if all(value is None for value in given):
        return None
    producer_id, epoch, seq = given
    if producer_id is None or epoch is None or seq is None:
        raise DsError(400, "give Producer-Id, Producer-Epoch and Producer-Seq together")
    if not producer_id.strip():
        raise DsError(400, "Producer-Id may not be empty")
    numbers = []
    for name, value in ((PRODUCER_EPOCH, epoch), (PRODUCER_SEQ, seq)):
        if _WHOLE.fullmatch(value) is None or int(value) > _MAX_WHOLE:
            raise DsError(400, f"{name} must be a whole number up to 2^53-1, not {value[:32]!r}")
        numbers.append(int(value))
    return Producer(producer_id, numbers[0], numbers[1])


async def _append(state: DurableStreamsState, request: Request, path: str) -> Response:
    producer = _producer(request)
    close = closed_header(request.headers.get("stream-closed"))
    seq = request.headers.get(SEQ.lower())
    body = await _body(request, state.gateway.config.max_body_bytes)
    content_type = request.headers.get("content-type")
    if not body and not close:
        raise DsError(400, "an append needs a body (or Stream-Closed: true to close)")
    if body and not content_type:
        raise DsError(400, "an append with a body needs its Content-Type")
    try:
        done = await state.store.append(
            path, content_type, body, close=close, seq=seq, producer=producer
        )
    except StreamNotFound:
        raise DsError(404, f"no stream at {path!r}") from None
    except BadMessage as error:
        raise DsError(400, str(error)) from None
    outcome = done.outcome
    if outcome == "deleted":
        raise DsError(410, GONE.format(path))
    headers = {NEXT_OFFSET: done.stream.offset_at(done.tail)}
    if done.closed:
        headers[CLOSED] = "true"
    check = done.producer
    if check is not None:
        headers[PRODUCER_EPOCH] = str(check.epoch)
        headers[PRODUCER_SEQ] = str(check.seq)
    if outcome == "appended":
        return text_response(200 if producer is not None else 204, b"", headers)
    if outcome in ("closed_only", "duplicate"):
        return text_response(204, b"", headers)
    if outcome == "closed":
        raise DsError(409, f"the stream at {path!r} is closed", headers)
    if outcome == "content_type":
        raise DsError(409, f"the stream's Content-Type is {done.stream.content_type}")
    if outcome == "seq":
        raise DsError(409, "Stream-Seq must be above the last one (compared as bytes)")
    assert check is not None
    if outcome == "stale_epoch":
        raise DsError(
            403, "a newer epoch of this producer wrote", {PRODUCER_EPOCH: str(check.epoch)}
        )
    if outcome == "bad_epoch_seq":
        raise DsError(400, "a producer's new epoch starts at Producer-Seq 0")
    assert producer is not None
    gap = {PRODUCER_EXPECTED_SEQ: str(check.seq), PRODUCER_RECEIVED_SEQ: str(producer.seq)}
    raise DsError(409, f"Producer-Seq {producer.seq} skips ahead of {check.seq}", gap)


async def _delete(state: DurableStreamsState, path: str) -> Response:
    outcome = await state.store.delete(path)
    if outcome == "missing":
        raise DsError(404, f"no stream at {path!r}")
    if outcome == "gone":
        raise DsError(410, GONE.format(path))
    if outcome == "subscribed":
        raise DsError(409, "subscriptions of the engine stream consume it; delete them first")
    state.poke()
    return text_response(204)
