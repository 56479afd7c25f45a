"""The gateway's ASGI application: its routes, its errors answered as JSON, its lifespan,
and the ending of every open event stream when the server shuts down (docs/gateway.md).

An entry point (DESIGN.md, layers): the endpoints parse requests, call the engine and
present; they run no SQL.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

from subengine.engine._async_engine import AsyncEngine
from subengine.gateway._appends import append_events
from subengine.gateway._ds_app import DurableStreamsApp
from subengine.gateway._ds_http import EXPOSED_HEADERS, REQUEST_HEADERS
from subengine.gateway._ds_state import DurableStreamsState
from subengine.gateway._health import healthz, metrics, readyz
from subengine.gateway._http import (
    CURSOR_HEADER,
    SUPERSEDED_HEADER,
    UP_TO_DATE_HEADER,
    ApiError,
    api_error,
    error_response,
)
from subengine.gateway._remote_workers import ack, claim, extend, nack, release
from subengine.gateway._sse import HELD, HeldOpen
from subengine.gateway._state import Gateway, GatewayConfig
from subengine.gateway._stream_reads import list_streams, read_events, show_stream
from subengine.gateway._ui import ui_routes
from subengine.gateway._ui_page import close_status_page
from subengine.gateway._watches import create_watch, open_watch
from subengine.gateway._webhook_endpoints import delete_webhook, put_webhook, show_webhook
from subengine.model._settings import Settings


def _endpoint(handler: Any) -> Any:
    """`handler` with the gateway's errors answered as JSON."""

    async def endpoint(request: Request) -> Any:
        try:
            return await handler(request)
        except Exception as error:
            return error_response(api_error(error))

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
        durable = DurableStreamsState(gateway, config.durable_streams_long_poll)
        app.state.durable_streams = durable
        if config.durable_streams:
            durable.start()
        _open_gateways.add(gateway)
        restore = _chain_signals() if end_streams_on_signals else {}
        try:
            yield
        finally:
            for number, handler in restore.items():
                signal.signal(number, handler)
            _open_gateways.discard(gateway)
            await durable.close()
            await close_status_page(gateway)
            await gateway.close()

    routes: list[Route | Mount] = [
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
        # remote workers (docs/remote-workers.md)
        Route("/v1/subscriptions/{name}/claim", _endpoint(claim), methods=["POST"]),
        *(
            Route(
                f"/v1/subscriptions/{{name}}/leases/{{lease}}/{verb}",
                _endpoint(e),
                methods=["POST"],
            )
            for verb, e in (("ack", ack), ("extend", extend), ("release", release), ("nack", nack))
        ),
    ]
    if config.ui:
        routes += ui_routes()  # the status page (docs/status-page.md)
    allow_headers = ["Authorization", "Content-Type", "Last-Event-ID"]
    expose_headers = [CURSOR_HEADER, UP_TO_DATE_HEADER, SUPERSEDED_HEADER, "Retry-After"]
    if config.durable_streams:
        # any path under the prefix is a Durable Streams stream (docs/durable-streams.md)
        routes.append(Mount(config.durable_streams_prefix, app=DurableStreamsApp()))
        allow_headers += [name for name in REQUEST_HEADERS if name not in allow_headers]
        expose_headers += [name for name in EXPOSED_HEADERS if name not in expose_headers]
    middleware = []
    if config.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_origins),
                # every method a route answers (webhooks are PUT and DELETE)
                allow_methods=sorted(
                    {m for route in routes for m in getattr(route, "methods", None) or ()}
                ),
                allow_headers=allow_headers,
                expose_headers=expose_headers,
            )
        )
    return GatewayApp(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _not_allowed},
    )


# The middleware under which an event stream may start after the route returned: CORS
# only adds headers to what is sent. Other middleware added to the app may need the
# response to have started by then (Starlette's BaseHTTPMiddleware does).
_HOLDS_UNDER: frozenset[Any] = frozenset({CORSMiddleware})


class GatewayApp(Starlette):
    """The gateway's Starlette app, which runs an event stream its routes chose once
    they and the middleware have returned (`HeldOpen`), unless middleware added to it
    may not allow that (`_HOLDS_UNDER`). It writes through the send they passed on
    when there is middleware of the app's own (CORS), which may change what is sent;
    else through the server's own send: Starlette's wrappers of it only note that the
    response started, for the error handling that has returned (every frame to every
    watcher went through two more coroutines)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        if any(each.cls not in _HOLDS_UNDER for each in self.user_middleware):
            # middleware added to the app may need the response to have started when the
            # route returns (BaseHTTPMiddleware does): the response runs in place
            scope[HELD] = None
            await super().__call__(scope, receive, send)
            return
        # (a gateway app mounted in another one holds what its own routes chose)
        held: list[tuple[HeldOpen, Receive, Send]] = []
        scope[HELD] = held
        try:
            await super().__call__(scope, receive, send)
        except BaseException:
            for response, _, _ in held:  # it will not run
                response.slot.release()
            raise
        for response, response_receive, response_send in held:  # one at most
            response.sends_from_outside = _server_send(send)
            await response.serve(response_receive, response_send if self.user_middleware else send)


def _server_send(send: Send) -> bool:
    """Whether `send` is the server's own: a method of uvicorn's protocol (`subengine
    serve`), which needs no task of its own to write, not a wrapper of an outer app."""
    owner = getattr(send, "__self__", None)
    return owner is not None and type(owner).__module__.startswith("uvicorn.protocols.")


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
