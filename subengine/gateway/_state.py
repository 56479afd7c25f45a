"""A gateway application's state and configuration: its engines, hub, open streams,
connection limits, metrics and webhook deliveries, and where a read of a stream starts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from starlette.requests import Request

from subengine.engine._async_engine import AsyncEngine
from subengine.engine._engine import Engine
from subengine.gateway._ahead import ReadsAhead
from subengine.gateway._auth import Authenticator
from subengine.gateway._callbacks import CallbackClient, CallbackPolicy
from subengine.gateway._connections import Connections, Sessions
from subengine.gateway._delivery import Deliveries, DeliveryConfig
from subengine.gateway._http import ApiError, bad_request, parse_time
from subengine.gateway._hub import Hub, Watcher
from subengine.gateway._metrics import GatewayMetrics
from subengine.gateway._reading import Selection
from subengine.gateway._sse import EventStream
from subengine.model._errors import StreamNotFound
from subengine.model._gateway_cursor import GatewayCursor, StreamPosition
from subengine.streams._listener import WEBHOOKS_CHANGED, Changes


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
    # events per page: the default and the most a request may ask for (a page also ends
    # at PAGE_BYTES of events' JSON: a page of 10,000 takes events of 100 bytes or less)
    page_limit: int = 100
    max_page_limit: int = 10_000
    # seconds a long-poll may wait at most (and waits when `wait` is not given)
    max_wait: float = 60.0
    default_wait: float = 30.0
    # seconds a write may stay blocked on a client's socket before the stream is closed
    # (a `close` frame of code `slow`)
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
    # the Durable Streams surface (docs/durable-streams.md): whether it is mounted, where,
    # and how long its long-polls wait for data
    durable_streams: bool = False
    durable_streams_prefix: str = "/ds"
    durable_streams_long_poll: float = 20.0
    # the status page at /ui (docs/status-page.md), and the application (MODULE:ATTR) whose
    # handlers its retries of dead letters run
    ui: bool = True
    ui_app: str | None = None
    # webhooks (docs/webhooks.md): whether this process delivers them, how, and which
    # internal networks callbacks may reach (none: only global addresses)
    deliver: bool = True
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    callback_policy: CallbackPolicy = field(default_factory=CallbackPolicy)


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
    # the in-flight long-poll of each subscriber's session
    sessions: Sessions = field(init=False)
    metrics: GatewayMetrics = field(init=False)
    # catch-up pages read ahead of the requests that will ask for them, for both APIs
    reads_ahead: ReadsAhead = field(init=False)
    # webhooks: a sync engine for their changes and deliveries, the callbacks' client
    sync_engine: Engine = field(init=False)
    callbacks: CallbackClient = field(init=False)
    deliveries: Deliveries | None = field(init=False, default=None)
    # the notified changes of the webhooks, which wake the deliveries
    webhook_changes: Changes | None = field(init=False, default=None)

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
        self.sessions = Sessions()
        listener = self.engine.listener
        self.metrics = GatewayMetrics(self.connections, self.hub, lambda: listener.connects)
        self.reads_ahead = ReadsAhead(self.metrics.pages_read_ahead)
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
            self.webhook_changes = listener.watch_changes(WEBHOOKS_CHANGED, self.deliveries.wake)
            self.deliveries.start(self.webhook_changes)

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
        await self.reads_ahead.close()
        # what is in flight finishes on the connections it has; nothing waits any more
        # for a connection PostgreSQL does not give (the database may be gone)
        self.sync_engine.stop_waiting()
        if self.deliveries is not None:
            await asyncio.to_thread(self.deliveries.stop)
        if self.webhook_changes is not None:
            self.engine.listener.unwatch_changes(self.webhook_changes)
        self.callbacks.close()
        self.auth.close()
        await asyncio.to_thread(self.sync_engine.close)
        await self.hub.close()
        if self.own_engines:
            await self.engine.close()
            if self.read_engine is not self.engine:
                await self.read_engine.close()

    # where a read starts, and the partitions it watches

    async def start_of(self, stream: str, request: Request) -> StreamPosition:
        """Where a read of `stream` starts: `after` (a cursor, `beginning` or `now`) or
        `since` (a time); an SSE request's Last-Event-ID wins over both."""
        params = request.query_params
        last_event_id = request.headers.get("last-event-id")
        if last_event_id:
            return _single(GatewayCursor.decode(last_event_id), stream)
        after, since = params.get("after"), params.get("since")
        if after is not None and since is not None:
            raise bad_request("give either after or since, not both")
        return await self.resolve(stream, after, since)

    async def resolve(self, stream: str, after: str | None, since: str | None) -> StreamPosition:
        if since is not None:
            epoch, positions = await self.read_engine.positions_since(
                stream, parse_time(since, "since")
            )
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

    async def watcher(
        self, selections: dict[str, Selection], shared_reads: bool = False, page_reads: bool = False
    ) -> Watcher:
        """A watcher of the partitions the selections read (those of their keys, if any),
        counted from what the hub knows of the streams it follows, else read; with
        `shared_reads`, one the hub wakes once its read of a moved partition is done;
        with `page_reads`, one woken at once whose read the hub starts (see `Watcher`)."""
        counts: dict[str, int] = {}
        for name in selections:
            known = self.hub.known(name)
            if known is not None:
                counts[name] = len(known[1])
        unknown = [name for name in selections if name not in counts]
        if unknown:
            found = await self.read_engine.epochs_and_heads(unknown)
            for name in unknown:
                heads = found[name][1] if name in found else None
                if heads is None:
                    raise StreamNotFound(name)
                counts[name] = len(heads)
        return Watcher(
            {name: selection.partitions(counts[name]) for name, selection in selections.items()},
            shared_reads,
            page_reads,
        )


def _single(cursor: GatewayCursor, stream: str) -> StreamPosition:
    if set(cursor.streams) != {stream}:
        raise ApiError(400, "bad_cursor", f"the cursor is not one of stream {stream!r}")
    return cursor.streams[stream]


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway
