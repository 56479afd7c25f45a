"""The gateway's ASGI application: pull, long-poll, SSE and watches over HTTP (docs/gateway.md).

An entry point (DESIGN.md, layers): it parses requests, calls the engine and presents;
it runs no SQL. Every response is JSON (or an event stream) with an explicit
Cache-Control; every error is `{"error": {"code": ..., "message": ...}}` with a 4xx or 5xx
status naming the problem, and changes nothing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import random
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from subengine.engine._async_engine import AsyncEngine
from subengine.engine._engine import Engine
from subengine.gateway._auth import ANONYMOUS, Authenticator, Denied, Principal
from subengine.gateway._callbacks import (
    CallbackClient,
    CallbackPolicy,
    CallbackRefused,
    check_callback_url,
)
from subengine.gateway._connections import (
    LONG_POLL,
    PULL,
    SSE,
    WATCH,
    Busy,
    Connections,
    Slot,
)
from subengine.gateway._delivery import Deliveries, DeliveryConfig
from subengine.gateway._hub import Hub, Watcher, dumps
from subengine.gateway._metrics import GatewayMetrics
from subengine.gateway._reading import Reader, Selection
from subengine.gateway._sse import Blocked, EventStream, Gone, frame_text
from subengine.model._declarations import Start
from subengine.model._errors import (
    DatabaseUnavailable,
    EventIdConflict,
    InvalidEvent,
    InvalidInput,
    PartitionNotFound,
    StreamNotFound,
    SubengineError,
    WrongExpectedVersion,
)
from subengine.model._events import NewEvent
from subengine.model._gateway_cursor import GatewayCursor, InvalidCursor, StreamPosition
from subengine.model._names import validate_key, validate_stream_name, validate_type
from subengine.model._settings import Settings
from subengine.outside._webhooks import (
    Webhook,
    WebhookConflict,
    WebhookDefinition,
    WebhookNotFound,
    streams_of,
    validate_webhook_id,
)

log = logging.getLogger("subengine.gateway")

NO_STORE = "no-store"
# How often (at most; and at every heartbeat) an open event stream checks that its key
# still may read its streams.
KEY_CHECK_SECONDS = 10.0
# An event stream whose read failed (PostgreSQL out of reach) tries again after this
# long, doubled up to the longest.
_FIRST_RETRY_SECONDS = 0.1
_LONGEST_RETRY_SECONDS = 5.0
# A partition whose read found less than its known head is read again after this long,
# doubled up to the longest.
_FIRST_STALL_SECONDS = 0.005
_LONGEST_STALL_SECONDS = 0.5
CURSOR_HEADER = "Subengine-Cursor"
UP_TO_DATE_HEADER = "Subengine-Up-To-Date"


@dataclass(frozen=True)
class GatewayConfig:
    """How a gateway serves (docs/gateway.md, "Configuration")."""

    # seconds of silence on an event stream before a heartbeat comment
    heartbeat: float = 15.0
    # seconds an event stream stays open (each one ±10%) before the server closes it so
    # that load rebalances; the client resumes by cursor
    stream_lifetime: float = 600.0
    # seconds between head polls, the safety net for lost notifications
    poll_interval: float = 1.0
    # events per page: the default and the most a request may ask for
    page_limit: int = 100
    max_page_limit: int = 1000
    # seconds a long-poll may wait at most (and waits when `wait` is not given)
    max_wait: float = 60.0
    default_wait: float = 30.0
    # seconds a write may stay blocked on a client's socket before the stream is closed
    # with `error: slow`
    write_timeout: float = 30.0
    # seconds a watch id stays valid
    watch_ttl: float = 86_400.0
    # limits (docs/gateway.md, "Limits"); the connection limits are per process
    max_streams_per_watch: int = 16
    max_body_bytes: int = 1 << 20
    # open long-polls and event streams of one principal (API key)
    max_connections_per_key: int = 100
    # open event streams (SSE of a stream, and watches)
    max_event_streams: int = 10_000
    # seconds a client refused by a connection limit is asked to wait (Retry-After: this
    # to twice this, at random, so that refused clients do not all come back at once)
    retry_after: int = 5
    cors_origins: tuple[str, ...] = ()
    # webhooks (docs/webhooks.md): whether this process delivers them, how, and which
    # internal networks callbacks may reach (none: only global addresses)
    deliver: bool = True
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    callback_policy: CallbackPolicy = field(default_factory=CallbackPolicy)


class ApiError(Exception):
    """An answer with a 4xx or 5xx status and a JSON error naming the problem."""

    def __init__(
        self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    text = body if isinstance(body, str) else dumps(body)
    return Response(
        text,
        status_code=status,
        media_type="application/json",
        headers={"Cache-Control": NO_STORE, **(headers or {})},
    )


def error_response(error: ApiError) -> Response:
    body = {"error": {"code": error.code, "message": error.message}}
    return json_response(body, error.status, error.headers)


def _bad(message: str, code: str = "bad_request") -> ApiError:
    return ApiError(400, code, message)


def _translated(error: Exception) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, Denied):
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
        return ApiError(error.status, error.code, error.message, headers)
    if isinstance(error, Busy):
        return ApiError(429, error.code, error.message, {"Retry-After": str(error.retry_after)})
    if isinstance(error, InvalidCursor):
        return ApiError(400, "bad_cursor", str(error))
    if isinstance(error, WebhookNotFound):
        return ApiError(404, "webhook_not_found", str(error))
    if isinstance(error, WebhookConflict):
        return ApiError(409, "webhook_conflict", str(error))
    if isinstance(error, CallbackRefused):
        return ApiError(400, "callback_refused", str(error))
    if isinstance(error, StreamNotFound):
        return ApiError(404, "stream_not_found", str(error))
    if isinstance(error, PartitionNotFound):
        return ApiError(404, "partition_not_found", str(error))
    if isinstance(error, WrongExpectedVersion):
        return ApiError(409, "wrong_expected_version", str(error))
    if isinstance(error, EventIdConflict):
        return ApiError(409, "event_id_conflict", str(error))
    if isinstance(error, InvalidEvent):
        return ApiError(400, "bad_event", str(error))
    if isinstance(error, InvalidInput):
        return ApiError(400, "bad_request", str(error))
    if isinstance(error, DatabaseUnavailable):
        return ApiError(503, "unavailable", str(error), {"Retry-After": "1"})
    if isinstance(error, SubengineError):
        return ApiError(400, "bad_request", str(error))
    raise error


def _time(text: str, what: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise _bad(f"{what} is not an RFC 3339 time: {text[:64]!r}") from None
    if parsed.tzinfo is None:
        raise _bad(f"{what} has no time zone: {text[:64]!r}")
    return parsed


def _flag(value: str | None, what: str, default: bool) -> bool:
    if value is None:
        return default
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise _bad(f"{what} must be true or false, not {value[:32]!r}")


def _number(value: str | None, what: str, low: float, high: float, default: float) -> float:
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise _bad(f"{what} must be a number, not {value[:32]!r}") from None
    if not low <= number <= high:  # NaN fails too
        raise _bad(f"{what} must be from {low:g} to {high:g}, not {value[:32]!r}")
    return number


def _whole(value: str | None, what: str, low: int, high: int, default: int) -> int:
    if value is None:
        return default
    if not (value.isascii() and value.isdecimal()) or not low <= int(value) <= high:
        raise _bad(f"{what} must be a whole number from {low} to {high}, not {value[:32]!r}")
    return int(value)


def _names(values: list[str], what: str, validate: Any) -> frozenset[str] | None:
    if not values:
        return None
    try:
        return frozenset(validate(value) for value in values)
    except InvalidInput as error:
        raise _bad(f"{what}: {error}") from None


@dataclass(eq=False)
class Gateway:
    """The state of one gateway application: its engines, hub and configuration."""

    config: GatewayConfig
    engine: AsyncEngine
    read_engine: AsyncEngine
    own_engines: bool
    hub: Hub = field(init=False)
    auth: Authenticator = field(init=False)
    closing: asyncio.Event = field(init=False)
    # the event streams open now: the shutdown ends them, the watchdog checks their writes
    open_streams: set[EventStream] = field(init=False)
    connections: Connections = field(init=False)
    metrics: GatewayMetrics = field(init=False)
    # webhooks: a sync engine for their changes and deliveries, the callbacks' client
    sync_engine: Engine = field(init=False)
    callbacks: CallbackClient = field(init=False)
    deliveries: Deliveries | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.hub = Hub(self.engine, self.read_engine, self.config.poll_interval)
        self.auth = Authenticator(self.engine)
        self.closing = asyncio.Event()
        self.open_streams = set()
        self._watchdog: asyncio.Task[None] | None = None
        self.connections = Connections(
            self.config.max_connections_per_key,
            self.config.max_event_streams,
            self.config.retry_after,
        )
        listener = self.engine._listener
        self.metrics = GatewayMetrics(self.connections, self.hub, lambda: listener.connects)
        self.sync_engine = Engine(settings=self.engine.settings)
        self.callbacks = CallbackClient(self.config.callback_policy)
        if self.config.deliver:
            self.deliveries = Deliveries(
                self.sync_engine,
                self.callbacks,
                self.config.delivery,
                self.metrics.webhooks_seen,
            )
            self.metrics.watch_deliveries(self.deliveries)
            self.deliveries.start()

    def close_streams(self) -> None:
        """End every open event stream and long-poll now (each says why), so that a
        server shutting down does not wait for them."""
        self.closing.set()
        for stream in list(self.open_streams):
            stream.close()

    def watch_writes(self) -> None:
        """Make sure the watchdog of the open streams' writes runs."""
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(
                self._check_writes(), name="subengine-gateway-write-watchdog"
            )

    async def _check_writes(self) -> None:
        """About every second, end the writes blocked longer than the write timeout."""
        period = min(1.0, self.config.write_timeout / 4)
        loop = asyncio.get_running_loop()
        while self.open_streams:
            await asyncio.sleep(period)
            now = loop.time()
            for stream in list(self.open_streams):
                stream.check(now)

    async def close(self) -> None:
        self.closing.set()
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.deliveries is not None:
            await asyncio.to_thread(self.deliveries.stop)
        self.callbacks.close()
        await asyncio.to_thread(self.sync_engine.close)
        await self.hub.close()
        if self.own_engines:
            await self.engine.close()
            if self.read_engine is not self.engine:
                await self.read_engine.close()

    # starting points

    async def start_of(self, stream: str, request: Request) -> StreamPosition:
        """Where a read of `stream` starts: `after` (a cursor, `beginning` or `now`) or
        `since` (a time); an SSE request's Last-Event-ID wins over both."""
        params = request.query_params
        last_event_id = request.headers.get("last-event-id")
        if last_event_id:
            return _single(GatewayCursor.decode(last_event_id), stream)
        after, since = params.get("after"), params.get("since")
        if after is not None and since is not None:
            raise _bad("give either after or since, not both")
        return await self.resolve(stream, after, since)

    async def resolve(self, stream: str, after: str | None, since: str | None) -> StreamPosition:
        if since is not None:
            epoch, positions = await self.read_engine.positions_since(stream, _time(since, "since"))
            return StreamPosition(epoch, tuple(positions))
        if after is None or after == "beginning":
            found = await self.read_engine.epochs_and_heads([stream])
            if stream not in found:
                raise StreamNotFound(stream)
            return StreamPosition(found[stream][0], ())
        if after == "now":
            found = await self.read_engine.epochs_and_heads([stream])
            if stream not in found or found[stream][1] is None:
                raise StreamNotFound(stream)
            epoch, heads = found[stream]
            return StreamPosition(epoch, tuple(heads or ()))
        return _single(GatewayCursor.decode(after), stream)


def _single(cursor: GatewayCursor, stream: str) -> StreamPosition:
    if set(cursor.streams) != {stream}:
        raise ApiError(400, "bad_cursor", f"the cursor is not one of stream {stream!r}")
    return cursor.streams[stream]


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def _selection(request: Request, stream: str) -> Selection:
    params = request.query_params
    return Selection(
        stream,
        keys=_names(params.getlist("key"), "key", validate_key),
        types=_names(params.getlist("type"), "type", validate_type),
        include_data=_flag(params.get("include_data"), "include_data", True),
    )


def _stream_name(request: Request) -> str:
    name = request.path_params["stream"]
    try:
        return validate_stream_name(name)
    except InvalidInput as error:
        raise _bad(str(error), "bad_stream_name") from None


# endpoints


async def list_streams(request: Request) -> Response:
    gateway = _gateway(request)
    principal = await gateway.auth.principal(request)
    if principal.key is not None and "read" not in principal.key.scopes:
        raise Denied(403, "forbidden", "this key may not read streams")
    streams = [s for s in await gateway.engine.streams() if principal.may(s.name, "read")]
    return json_response(
        {
            "streams": [
                {"name": s.name, "partitions": s.partitions, "epoch": s.epoch} for s in streams
            ]
        }
    )


async def show_stream(request: Request) -> Response:
    gateway = _gateway(request)
    stream = _stream_name(request)
    (await gateway.auth.principal(request)).require(stream, "read")
    found = await gateway.read_engine.stream(stream)
    states = await gateway.read_engine.partitions(stream)
    heads = tuple(state.head for state in states)
    now = GatewayCursor({stream: StreamPosition(found.epoch, heads)})
    return json_response(
        {
            "name": found.name,
            "epoch": found.epoch,
            "retention": found.retention,
            "partitions": [
                {
                    "partition": state.partition,
                    "head": state.head,
                    "head_time": None if state.head_time is None else state.head_time.isoformat(),
                    "floor": state.floor,
                }
                for state in states
            ],
            "cursor": now.encode(),
        }
    )


async def read_events(request: Request) -> Response | EventStreamResponse:
    gateway = _gateway(request)
    stream = _stream_name(request)
    principal = await gateway.auth.principal(request)
    principal.require(stream, "read")
    live = request.query_params.get("live")
    if live not in (None, "long-poll", "sse"):
        raise _bad(f"live must be long-poll or sse, not {live[:32]!r}")
    selection = _selection(request, stream)
    if live == "sse":
        heartbeat = _number(
            request.query_params.get("heartbeat"), "heartbeat", 1, 60, gateway.config.heartbeat
        )
        slot = gateway.connections.admit(SSE, principal.id)
        with _released_on_error(slot):
            start = await gateway.start_of(stream, request)
            return await _event_stream(
                gateway, {stream: selection}, {stream: start}, heartbeat, principal, slot
            )
    limit = _whole(
        request.query_params.get("limit"),
        "limit",
        1,
        gateway.config.max_page_limit,
        gateway.config.page_limit,
    )
    if request.headers.get("last-event-id"):
        raise _bad("Last-Event-ID is for live=sse; give the cursor as after=")
    wait = 0.0
    if live == "long-poll":
        wait = _number(
            request.query_params.get("wait"),
            "wait",
            0,
            gateway.config.max_wait,
            gateway.config.default_wait,
        )
    slot = gateway.connections.admit(PULL if live is None else LONG_POLL, principal.id)
    try:
        start = await gateway.start_of(stream, request)
        reader = Reader(gateway.hub, {stream: selection}, {stream: start})
        if live is None:
            events, tombstones, up_to_date = await reader.page(stream, limit)
            answer = _page(reader, events, tombstones, up_to_date)
        else:
            answer = await _long_poll(gateway, reader, stream, limit, wait)
    finally:
        slot.release()
    gateway.metrics.sent(slot.kind, None, len(answer.body))
    return answer


def _page(
    reader: Reader, events: list[str], tombstones: list[dict[str, Any]], up_to_date: bool
) -> Response:
    cursor = reader.cursor.encode()
    resets = [json.loads(frame.data) for frame in reader.take_frames() if frame.kind == "reset"]
    body = (
        f'{{"events":[{",".join(events)}],"tombstones":{dumps(tombstones)},'
        f'"resets":{dumps(resets)},"cursor":{dumps(cursor)},'
        f'"up_to_date":{"true" if up_to_date else "false"}}}'
    )
    return json_response(
        body,
        headers={CURSOR_HEADER: cursor, UP_TO_DATE_HEADER: "true" if up_to_date else "false"},
    )


async def _long_poll(
    gateway: Gateway, reader: Reader, stream: str, limit: int, wait: float
) -> Response:
    """A page as soon as anything after the cursor exists, or 204 when `wait` ends."""
    deadline = time.monotonic() + wait
    watcher = await _watcher(gateway, reader.selections)
    gateway.hub.add(watcher)
    try:
        while True:
            watcher.take()  # what moves from now on wakes the wait below
            events, tombstones, up_to_date = await reader.page(stream, limit)
            if events or tombstones or reader.frames_out:
                return _page(reader, events, tombstones, up_to_date)
            left = deadline - time.monotonic()
            if left <= 0 or gateway.closing.is_set():
                break
            if up_to_date:
                closing = asyncio.ensure_future(gateway.closing.wait())
                woken = asyncio.ensure_future(watcher.event.wait())
                gateway.metrics.long_polls_waiting.inc()
                try:
                    await asyncio.wait(
                        {woken, closing}, timeout=left, return_when="FIRST_COMPLETED"
                    )
                finally:
                    gateway.metrics.long_polls_waiting.dec()
                    woken.cancel()
                    closing.cancel()
    finally:
        gateway.hub.remove(watcher)
    cursor = reader.cursor.encode()
    return Response(
        status_code=204,
        headers={"Cache-Control": NO_STORE, CURSOR_HEADER: cursor, UP_TO_DATE_HEADER: "true"},
    )


async def _watcher(gateway: Gateway, selections: dict[str, Selection]) -> Watcher:
    """A watcher of the partitions the selections read (those of their keys, if any)."""
    found = await gateway.read_engine.epochs_and_heads(list(selections))
    for name in selections:
        if name not in found or found[name][1] is None:
            raise StreamNotFound(name)
    return Watcher(
        {
            name: selection.partitions(len(found[name][1] or ()))
            for name, selection in selections.items()
        }
    )


@contextmanager
def _released_on_error(slot: Slot) -> Iterator[None]:
    """Give `slot` back if what follows fails before a response takes it over."""
    try:
        yield
    except BaseException:
        slot.release()
        raise


async def _event_stream(
    gateway: Gateway,
    selections: dict[str, Selection],
    start: dict[str, StreamPosition],
    heartbeat: float,
    principal: Principal,
    slot: Slot,
) -> EventStreamResponse:
    """The event stream of `selections`, which holds `slot` until it ends."""
    watcher = await _watcher(gateway, selections)
    return EventStreamResponse(gateway, selections, start, heartbeat, watcher, principal, slot)


class EventStreamResponse:
    """An SSE response of one stream or a watch: catch up by pages, say `caught-up`,
    then follow the hub's wake-ups, with heartbeats, until the client leaves, the
    stream's lifetime ends, or the server shuts down."""

    def __init__(
        self,
        gateway: Gateway,
        selections: dict[str, Selection],
        start: dict[str, StreamPosition],
        heartbeat: float,
        watcher: Watcher,
        principal: Principal,
        slot: Slot,
    ) -> None:
        self.principal = principal
        self.gateway = gateway
        self.selections = selections
        self.start = start
        self.heartbeat = heartbeat
        self.watcher = watcher
        self.slot = slot  # released when the response ends, however it ends

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway, config = self.gateway, self.gateway.config
        watcher = self.watcher
        stream = EventStream(receive, send, watcher.event, config.write_timeout)
        reader = Reader(gateway.hub, self.selections, self.start)
        lifetime = config.stream_lifetime * random.uniform(0.9, 1.1)
        ends = time.monotonic() + lifetime
        gateway.open_streams.add(stream)
        gateway.watch_writes()
        try:
            if gateway.closing.is_set():
                stream.close()
            gateway.hub.add(watcher)
            await stream.start(
                [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", NO_STORE.encode()),
                    (b"x-accel-buffering", b"no"),
                ]
            )
            await self._write(stream, None, "retry: 1000\n\n")
            await self._run(stream, reader, watcher, ends)
        except Gone:
            pass
        except Blocked:
            # the socket takes nothing: a last word if it can, then close
            try:
                await asyncio.wait_for(
                    send(
                        {
                            "type": "http.response.body",
                            "body": _error_frame("slow", "the client reads too slowly").encode(),
                            "more_body": True,
                        }
                    ),
                    0.1,
                )
            except Exception:
                pass
        finally:
            gateway.open_streams.discard(stream)
            self.slot.release()
            gateway.hub.remove(watcher)
            await stream.end()

    async def _write(self, stream: EventStream, frame_type: str | None, text: str) -> None:
        sent_before = stream.bytes_sent
        await stream.write(text)
        self.gateway.metrics.sent(self.slot.kind, frame_type, stream.bytes_sent - sent_before)

    async def _send_frames(self, stream: EventStream, reader: Reader) -> bool:
        """Send the frames the reader made; whether there were any."""
        frames = reader.take_frames()
        for frame in frames:
            await self._write(stream, frame.kind, frame_text(frame.kind, frame.data, frame.cursor))
        return bool(frames)

    async def _catch_up(self, stream: EventStream, reader: Reader) -> None:
        limit = self.gateway.config.max_page_limit
        pending = set(self.selections)
        while pending:
            for name in sorted(pending):
                if await reader.catch_up_frames(name, limit):
                    pending.discard(name)
                await self._send_frames(stream, reader)

    async def _run(
        self, stream: EventStream, reader: Reader, watcher: Watcher, ends: float
    ) -> None:
        caught_up = False
        quiet_since = checked = time.monotonic()
        # spread over time, so that streams opened together do not check together
        check_every = min(KEY_CHECK_SECONDS, self.heartbeat) * random.uniform(0.8, 1.2)
        pending: set[tuple[str, int]] = set()
        # partitions whose head is known to be ahead of what a read found (a replica
        # that has yet to replay it): read again after `stall`, doubled up to the longest
        stalled: set[tuple[str, int]] = set()
        stall = _FIRST_STALL_SECONDS
        delay = _FIRST_RETRY_SECONDS
        watcher.wake_all()  # the first round catches up
        while True:
            changed, resync = watcher.take()
            try:
                if resync:
                    pending.clear()
                    await self._catch_up(stream, reader)
                    if not caught_up:
                        caught_up = True
                        await self._write(
                            stream,
                            "caught-up",
                            frame_text("caught-up", "{}", reader.cursor.encode()),
                        )
                        quiet_since = time.monotonic()
                behind = reader.behind(changed)
                if behind:
                    self.gateway.metrics.watcher_lag.observe(reader.lag(behind))
                pending |= behind
                while pending and not stream.closing:
                    name, partition = pending.pop()
                    more, moved = await reader.live_frames(name, partition)
                    if more:
                        (pending if moved else stalled).add((name, partition))
                    if await self._send_frames(stream, reader):
                        quiet_since = time.monotonic()
                now = time.monotonic()
                if now >= checked + check_every:
                    checked = now
                    if not await self._still_allowed():
                        await stream.write(
                            _error_frame("forbidden", "the API key was revoked or lost its rights")
                        )
                        return
                delay = _FIRST_RETRY_SECONDS
            except StreamNotFound as error:
                await self._write(stream, "error", _error_frame("stream_not_found", str(error)))
                return
            except DatabaseUnavailable as error:
                # the stream stays open: look at everything again once PostgreSQL answers
                log.warning("gateway read failed, retrying in %.1fs: %s", delay, error)
                watcher.take()
                await stream.wait(delay)  # woken early by the client leaving or a shutdown
                watcher.wake_all()
                delay = min(2 * delay, _LONGEST_RETRY_SECONDS)
                if not stream.closing:
                    continue
            except SubengineError as error:  # after the above: a cursor that no longer fits, say
                code = "bad_cursor" if isinstance(error, InvalidCursor) else "bad_request"
                await self._write(stream, "error", _error_frame(code, str(error)))
                return
            now = time.monotonic()
            if stream.closing:
                await self._write(
                    stream, "error", _error_frame("shutdown", "the server is shutting down")
                )
                return
            if now >= ends:
                await self._write(
                    stream,
                    "error",
                    _error_frame("rotate", "the stream's lifetime ended: resume by cursor"),
                )
                return
            beat_at = quiet_since + self.heartbeat
            if now >= beat_at:
                await self._write(stream, "heartbeat", ": hb\n\n")
                quiet_since = now
                continue
            if stalled:
                await stream.wait(min(beat_at, ends, now + stall) - now)
                pending |= stalled
                stalled.clear()
                stall = min(2 * stall, _LONGEST_STALL_SECONDS)
                continue
            stall = _FIRST_STALL_SECONDS
            await stream.wait(min(beat_at, ends) - now)

    async def _still_allowed(self) -> bool:
        key = self.principal.key
        if key is None:
            return not await self.gateway.auth.required()
        current = await self.gateway.auth.key_by_id(key.id)
        return current is not None and all(current.allows(name, "read") for name in self.selections)


def _error_frame(code: str, message: str) -> str:
    return frame_text("error", dumps({"code": code, "message": message}), None)


# appends


async def append_events(request: Request) -> Response:
    """Append a JSON array of events, or `{"events": [...], "expected_version": ...}`, in
    one transaction: 201 when any event was stored now, 200 when every one was stored
    before (a retry), with where each event is."""
    gateway = _gateway(request)
    stream = _stream_name(request)
    (await gateway.auth.principal(request)).require(stream, "append")
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        # a browser sends a cross-origin POST of another type without asking first (no
        # CORS preflight); a write must not be one
        raise ApiError(
            415, "unsupported_media_type", "send the events as Content-Type: application/json"
        )
    body = await _json_body(request, gateway.config.max_body_bytes)
    given, expected_version = _append_request(body)
    events = []
    for index, fields in enumerate(given):
        try:
            events.append(NewEvent.from_json(fields))
        except InvalidInput as error:
            raise ApiError(400, "bad_event", f"event {index}: {error}") from None
    stored = await gateway.engine.append(stream, events, expected_version)
    appended = [
        {
            "partition": a.partition,
            "position": a.position,
            "id": str(a.id),
            "key_version": a.key_version,
            "duplicate": a.duplicate,
        }
        for a in stored
    ]
    every_one_stored_before = all(a.duplicate for a in stored)
    return json_response({"appended": appended}, 200 if every_one_stored_before else 201)


def _append_request(body: Any) -> tuple[list[Any], Any]:
    """The events and expected version of an append's body (checked by the engine)."""
    if isinstance(body, list):
        events, expected_version = body, None
    elif isinstance(body, dict):
        unknown = set(body) - {"events", "expected_version"}
        if unknown:
            raise _bad(f"unknown field {sorted(unknown)[0]!r}")
        if not isinstance(body.get("events"), list):
            raise _bad('expected {"events": [...], "expected_version": ...}')
        events, expected_version = body["events"], body.get("expected_version")
    else:
        raise _bad('expected an array of events or {"events": [...]}')
    if not events:
        raise _bad("the append holds no event")
    return events, expected_version


# watches


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


async def create_watch(request: Request) -> Response:
    gateway = _gateway(request)
    principal = await gateway.auth.principal(request)
    body = await _json_body(request, gateway.config.max_body_bytes)
    if not isinstance(body, dict) or not isinstance(body.get("streams"), dict):
        raise _bad('expected {"streams": {"<stream>": {...}, ...}}')
    streams = body["streams"]
    if not streams:
        raise _bad("a watch needs at least one stream")
    if len(streams) > gateway.config.max_streams_per_watch:
        # not 429: the same request would never succeed, so nothing invites a retry
        raise _bad(
            f"a watch has at most {gateway.config.max_streams_per_watch} streams; "
            "split these into several watches",
            "too_many_streams",
        )
    unknown = set(body) - {"streams", "heartbeat"}
    if unknown:
        raise _bad(f"unknown field {sorted(unknown)[0]!r}")
    heartbeat = body.get("heartbeat", gateway.config.heartbeat)
    if not isinstance(heartbeat, int | float) or not 1 <= heartbeat <= 60:
        raise _bad("heartbeat must be a number of seconds from 1 to 60")
    spec = []
    positions: dict[str, StreamPosition] = {}
    for name, options in streams.items():
        try:
            validate_stream_name(name)
        except InvalidInput as error:
            raise _bad(str(error), "bad_stream_name") from None
        principal.require(name, "read")
        if not isinstance(options, dict):
            raise _bad(f"the options of stream {name!r} must be an object")
        unknown = set(options) - {"after", "since", "key", "type", "include_data"}
        if unknown:
            raise _bad(f"unknown option {sorted(unknown)[0]!r} for stream {name!r}")
        keys = _list_option(options, "key", name, validate_key)
        types = _list_option(options, "type", name, validate_type)
        include_data = options.get("include_data", True)
        if not isinstance(include_data, bool):
            raise _bad(f"include_data of stream {name!r} must be true or false")
        after, since = options.get("after"), options.get("since")
        if after is not None and since is not None:
            raise _bad(f"give stream {name!r} either after or since, not both")
        if not isinstance(after, str | None) or not isinstance(since, str | None):
            raise _bad(f"after and since of stream {name!r} must be strings")
        positions[name] = await gateway.resolve(name, after, since)
        spec.append([name, keys, types, include_data])
    expires = int(time.time() + gateway.config.watch_ttl)
    payload = {
        "k": None if principal.key is None else principal.key.id,
        "x": expires,
        "h": heartbeat,
        "s": spec,
        "c": GatewayCursor(positions).encode(),
    }
    wid = await _sign(gateway, payload)
    return json_response(
        {
            "wid": wid,
            "url": f"/v1/watch/{wid}",
            "cursor": payload["c"],
            "expires_at": datetime.fromtimestamp(expires).astimezone().isoformat(),
        },
        201,
    )


def _list_option(options: dict[str, Any], what: str, stream: str, validate: Any) -> Any:
    value = options.get(what)
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise _bad(f"{what} of stream {stream!r} must be a non-empty list of strings")
    try:
        return sorted({validate(item) for item in value})
    except InvalidInput as error:
        raise _bad(f"{what} of stream {stream!r}: {error}") from None


async def _signing_key(gateway: Gateway) -> bytes:
    secret: bytes = await gateway.engine.signing_secret("watch")
    return secret


async def _sign(gateway: Gateway, payload: dict[str, Any]) -> str:
    body = _b64(json.dumps(payload, separators=(",", ":")).encode())
    mac = hmac.new(await _signing_key(gateway), body.encode(), hashlib.sha256).digest()
    return f"w1.{body}.{_b64(mac)}"


async def _verify(gateway: Gateway, wid: str) -> dict[str, Any]:
    parts = wid.split(".")
    if len(parts) != 3 or parts[0] != "w1" or len(wid) > 32_768:
        raise ApiError(404, "watch_not_found", "no such watch (malformed id)")
    _, body, mac = parts
    expected = hmac.new(await _signing_key(gateway), body.encode(), hashlib.sha256).digest()
    try:
        given = _unb64(mac)
        payload = json.loads(_unb64(body))
    except ValueError:
        raise ApiError(404, "watch_not_found", "no such watch (malformed id)") from None
    if not hmac.compare_digest(expected, given):
        raise ApiError(404, "watch_not_found", "no such watch (bad signature)")
    if not isinstance(payload, dict) or payload.get("x", 0) < time.time():
        raise ApiError(410, "watch_expired", "the watch has expired: create a new one")
    return payload


async def open_watch(request: Request) -> Response | EventStreamResponse:
    gateway = _gateway(request)
    payload = await _verify(gateway, request.path_params["wid"])
    selections = {
        name: Selection(
            name,
            None if keys is None else frozenset(keys),
            None if types is None else frozenset(types),
            include_data,
        )
        for name, keys, types, include_data in payload["s"]
    }
    principal = await _watch_principal(gateway, request, payload.get("k"))
    for name in selections:
        principal.require(name, "read")
    last_event_id = request.headers.get("last-event-id") or request.query_params.get("after")
    cursor = GatewayCursor.decode(last_event_id or payload["c"])
    if set(cursor.streams) != set(selections):
        raise ApiError(400, "bad_cursor", "the cursor does not name the watch's streams")
    slot = gateway.connections.admit(WATCH, principal.id)
    with _released_on_error(slot):
        return await _event_stream(
            gateway, selections, dict(cursor.streams), payload["h"], principal, slot
        )


async def _watch_principal(gateway: Gateway, request: Request, key_id: Any) -> Principal:
    """Who reads a watch: the key that created it, still active. The watch id stands
    for it (a browser's EventSource cannot send a header); a key sent along must be
    that one."""
    if request.headers.get("authorization") is not None:
        principal = await gateway.auth.principal(request)
        if principal.id != (key_id or ANONYMOUS):
            raise Denied(403, "forbidden", "this watch was created with another key")
        return principal
    if key_id is None:
        if await gateway.auth.required():
            raise Denied(
                401,
                "unauthorized",
                "this watch was created without a key, and the "
                "gateway now needs one: create a new watch",
            )
        # as any request without a key: open mode, from this host only
        return await gateway.auth.principal(request)
    key = await gateway.auth.key_by_id(str(key_id))
    if key is None:
        raise Denied(403, "forbidden", "the key that created this watch was revoked")
    return Principal(key)


async def _json_body(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if (
        declared is not None
        and declared.isascii()
        and declared.isdecimal()
        and int(declared) > limit
    ):
        raise ApiError(413, "too_large", f"the body is larger than {limit} bytes")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "too_large", f"the body is larger than {limit} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        raise _bad("the body is not JSON") from None


# webhooks (docs/webhooks.md)

_WEBHOOK_FIELDS = frozenset(
    {
        "callback",
        "streams",
        "start",
        "include_data",
        "max_events",
        "lease_seconds",
        "secret",
        "replaces",
    }
)


async def put_webhook(request: Request) -> Response:
    """Subscribe a callback (pending until it echoes the challenge), or renew the lease
    of the same subscription: 202 when created, 200 when renewed."""
    gateway = _gateway(request)
    principal = await gateway.auth.principal(request)
    webhook_id = validate_webhook_id(request.path_params["webhook_id"])
    body = await _json_body(request, gateway.config.max_body_bytes)
    if not isinstance(body, dict):
        raise _bad('expected {"callback": "...", "streams": {...}, ...}')
    unknown = set(body) - _WEBHOOK_FIELDS
    if unknown:
        raise _bad(f"unknown field {sorted(unknown)[0]!r}")
    if not isinstance(body.get("callback"), str):
        raise _bad("callback must be the URL deliveries are posted to")
    callback = check_callback_url(body["callback"])
    streams = streams_of(body.get("streams"))
    for stream in streams:
        principal.require(stream.stream, "read")
    definition = WebhookDefinition(
        callback,
        streams,
        include_data=body.get("include_data", True),
        max_events=body.get("max_events", 100),
        lease_seconds=body.get("lease_seconds", 86_400),
    )
    replaces = body.get("replaces")  # the engine deletes it if it is there and this key's
    starts = {
        s.stream: await _webhook_start(gateway, s.stream, body.get("start", "now")) for s in streams
    }
    # refused now when its name resolves to an address deliveries may not reach; every
    # delivery checks again, on the address it connects to
    await asyncio.to_thread(gateway.callbacks.check_now, callback)
    put = await asyncio.to_thread(
        gateway.sync_engine.put_webhook,
        webhook_id,
        definition,
        starts,
        secret=body.get("secret"),
        replaces=replaces,
        key_id=None if principal.key is None else principal.key.id,
    )
    if gateway.deliveries is not None:
        gateway.deliveries.wake()
    shown = put.webhook.to_json()
    if put.secret is not None:
        shown["secret"] = put.secret
    return json_response(shown, 202 if put.created else 200)


async def _webhook_start(gateway: Gateway, stream: str, start: Any) -> Start:
    """Where a webhook's engine subscription of `stream` starts: "now", "beginning",
    {"after": cursor} (of this stream's epoch) or {"since": time}."""
    if start == "beginning":
        return "beginning"
    if start == "now":
        found = await gateway.engine.epochs_and_heads([stream])
        if stream not in found or found[stream][1] is None:
            raise StreamNotFound(stream)
        return dict(enumerate(found[stream][1] or ()))
    if not isinstance(start, dict) or len(start) != 1 or not set(start) <= {"after", "since"}:
        raise _bad('start must be "now", "beginning", {"after": "<cursor>"} or {"since": "<time>"}')
    if "since" in start:
        if not isinstance(start["since"], str):
            raise _bad("since must be an RFC 3339 time")
        _, positions = await gateway.engine.positions_since(stream, _time(start["since"], "since"))
        return dict(enumerate(positions))
    cursor = GatewayCursor.decode(start["after"])
    if stream not in cursor.streams:
        raise ApiError(400, "bad_cursor", f"the cursor has no position in stream {stream!r}")
    at = cursor.streams[stream]
    found = await gateway.engine.epochs_and_heads([stream])
    if stream not in found:
        raise StreamNotFound(stream)
    if found[stream][0] != at.epoch:
        raise ApiError(
            409,
            "reset",
            f"stream {stream!r} was deleted and created again since the cursor was made; "
            "start from the beginning of the new stream",
        )
    return dict(enumerate(at.positions)) if at.positions else "beginning"


async def _owned_webhook(gateway: Gateway, principal: Principal, webhook_id: Any) -> Webhook:
    """The webhook `webhook_id`, if `principal` may see and change it (it was made with
    the same key, or in open mode); WebhookNotFound otherwise (not saying it exists)."""
    webhook_id = validate_webhook_id(webhook_id)
    found = await asyncio.to_thread(gateway.sync_engine.webhook, webhook_id)
    made_by = found.key_id
    if made_by is not None and (principal.key is None or principal.key.id != made_by):
        raise WebhookNotFound(webhook_id)
    return found


async def show_webhook(request: Request) -> Response:
    gateway = _gateway(request)
    principal = await gateway.auth.principal(request)
    found = await _owned_webhook(gateway, principal, request.path_params["webhook_id"])
    return json_response(found.to_json())


async def delete_webhook(request: Request) -> Response:
    """Cancel a webhook subscription: nothing more is sent under its id."""
    gateway = _gateway(request)
    principal = await gateway.auth.principal(request)
    found = await _owned_webhook(gateway, principal, request.path_params["webhook_id"])
    await asyncio.to_thread(gateway.sync_engine.delete_webhook, found.id)
    if gateway.deliveries is not None:
        gateway.deliveries.wake()
    return Response(status_code=204, headers={"Cache-Control": NO_STORE})


# health and errors


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def metrics(request: Request) -> Response:
    """The gateway's metrics in Prometheus' text format (docs/gateway.md, "Metrics")."""
    gateway = _gateway(request)
    return Response(
        generate_latest(gateway.metrics.registry),
        media_type=CONTENT_TYPE_LATEST,
        headers={"Cache-Control": NO_STORE},
    )


async def readyz(request: Request) -> Response:
    gateway = _gateway(request)
    try:
        await asyncio.wait_for(gateway.read_engine.streams(), 5)
    except Exception:
        return json_response({"status": "unavailable"}, 503, {"Retry-After": "1"})
    return json_response({"status": "ready"})


def _endpoint(handler: Any) -> Any:
    """`handler` with the gateway's errors answered as JSON."""

    async def endpoint(request: Request) -> Any:
        try:
            return await handler(request)
        except Exception as error:
            return error_response(_translated(error))

    endpoint.__name__ = handler.__name__
    return endpoint


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(404, "not_found", f"no such endpoint: {request.url.path}"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(
        ApiError(405, "method_not_allowed", f"{request.method} is not allowed here")
    )


def create_app(
    config: GatewayConfig | None = None,
    *,
    end_streams_on_signals: bool = False,
    engine: AsyncEngine | None = None,
    read_engine: AsyncEngine | None = None,
    dsn: str | None = None,
    read_dsn: str | None = None,
    settings: Settings | None = None,
) -> Starlette:
    """The gateway as an ASGI application, to serve with uvicorn (`subengine serve`) or to
    mount in an application of one's own. Give it an `AsyncEngine` (and one for reads,
    e.g. on a streaming replica), or a DSN and settings to make its own.

    A server shutting down should first call `close_all_streams()` (or the gateway's
    `close_streams`), or it waits on open event streams; `end_streams_on_signals` does
    that on SIGINT and SIGTERM, before the server's own handler runs."""
    config = config or GatewayConfig()
    owned = engine is None
    primary = engine or AsyncEngine(dsn, settings=settings)
    if read_engine is None:
        read_engine = AsyncEngine(read_dsn, settings=settings) if read_dsn else primary

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gateway = Gateway(config, primary, read_engine, owned)
        app.state.gateway = gateway
        _open_gateways.add(gateway)
        restore = _chain_signals() if end_streams_on_signals else {}
        try:
            yield
        finally:
            for number, handler in restore.items():
                signal.signal(number, handler)
            _open_gateways.discard(gateway)
            await gateway.close()

    routes = [
        Route("/healthz", _endpoint(healthz)),
        Route("/readyz", _endpoint(readyz)),
        Route("/metrics", _endpoint(metrics)),
        Route("/v1/streams", _endpoint(list_streams)),
        Route("/v1/streams/{stream}", _endpoint(show_stream)),
        Route("/v1/streams/{stream}/events", _endpoint(read_events)),
        Route("/v1/streams/{stream}/events", _endpoint(append_events), methods=["POST"]),
        Route("/v1/watch", _endpoint(create_watch), methods=["POST"]),
        Route("/v1/watch/{wid}", _endpoint(open_watch)),
        Route("/v1/webhooks/{webhook_id}", _endpoint(put_webhook), methods=["PUT"]),
        Route("/v1/webhooks/{webhook_id}", _endpoint(show_webhook)),
        Route("/v1/webhooks/{webhook_id}", _endpoint(delete_webhook), methods=["DELETE"]),
    ]
    middleware = []
    if config.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type", "Last-Event-ID"],
                expose_headers=[CURSOR_HEADER, UP_TO_DATE_HEADER],
            )
        )
    return Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _not_allowed},
    )


# the gateways open in this process, which `subengine serve` tells to end their streams
# when the server shuts down
_open_gateways: set[Gateway] = set()


def close_all_streams() -> None:
    """End the open event streams and long-polls of every gateway of this process."""
    for gateway in list(_open_gateways):
        gateway.close_streams()


def _chain_signals() -> dict[int, Any]:
    """Make SIGINT and SIGTERM end the open streams, then do what they did before (the
    server's shutdown). Returns the handlers to put back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    loop = asyncio.get_running_loop()
    restore: dict[int, Any] = {}
    for number in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(number)
        if not callable(previous):
            continue

        def chained(signum: int, frame: Any, previous: Any = previous) -> None:
            loop.call_soon_threadsafe(close_all_streams)
            previous(signum, frame)

        restore[number] = previous
        signal.signal(number, chained)
    return restore
