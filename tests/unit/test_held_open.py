"""An event stream runs after the routing and middleware that chose it have returned
(issue 26: their coroutine frames made a quarter of an idle connection's memory), writes
through the `send` they passed on, and gives its connection slot back if it never runs."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from typing import Any

import httpx
import pytest
import uvicorn
import web
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from subengine.gateway._app import GatewayApp
from subengine.gateway._connections import SSE, Connections
from subengine.gateway._sse import HeldOpen

ORIGIN = "https://app.example"


class Probe(HeldOpen):
    def __init__(self, log: list[str], connections: Connections, request: Request) -> None:
        self.log = log
        self.slot = connections.admit(SSE, "someone")
        self.send: Send | None = None
        self.request = weakref.ref(request)

    async def serve(self, receive: Receive, send: Send) -> None:
        gc.collect()
        self.log.append("serve" if self.request() is not None else "serve, the route gone")
        self.send = send
        self.from_outside = self.sends_from_outside
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"held"})
        finally:
            self.slot.release()


class Failing(Probe):
    """Held, and then the request fails before the held response could run."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)
        raise RuntimeError("after holding")


def make_app(
    app_class: type[Any],
    log: list[str],
    cors: bool = False,
    probe: type[Probe] = Probe,
) -> Any:
    connections = Connections(10, 10, 1)
    probes: list[Probe] = []

    async def route(request: Request) -> Probe:
        probes.append(probe(log, connections, request))
        return probes[-1]

    middleware = [Middleware(CORSMiddleware, allow_origins=[ORIGIN])] if cors else []
    app = app_class(routes=[Route("/live", route)], middleware=middleware)
    app.probes = probes
    return app, connections


def get(app: Any) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/live", headers={"Origin": ORIGIN})

    return asyncio.run(call())


def test_the_gateway_app_runs_an_event_stream_once_its_route_is_gone() -> None:
    """The route's frames, and the request they hold, are freed before it runs."""
    log: list[str] = []
    app, connections = make_app(GatewayApp, log, cors=True)
    answer = get(app)
    assert answer.text == "held"
    assert answer.headers["access-control-allow-origin"] == ORIGIN  # through CORS' send
    assert log == ["serve, the route gone"]
    assert connections.event_streams() == 0


def test_under_another_app_an_event_stream_runs_in_place() -> None:
    log: list[str] = []
    app, _ = make_app(Starlette, log, cors=True)
    answer = get(app)
    assert answer.text == "held"
    assert log == ["serve"]


def test_an_event_stream_that_never_runs_gives_its_slot_back() -> None:
    log: list[str] = []
    app, connections = make_app(GatewayApp, log, probe=Failing)
    with pytest.raises(RuntimeError, match="after holding"):
        get(app)
    assert log == []
    assert connections.event_streams() == 0


def test_without_middleware_of_its_own_an_event_stream_writes_through_the_server() -> None:
    """Starlette's wrappers of `send` only note that a response started, for error
    handling that has returned: each frame skips them."""
    app, connections = make_app(GatewayApp, [])
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/live",
        "raw_path": b"/live",
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1234),
    }
    asyncio.run(app(scope, receive, send))
    (probe,) = app.probes
    assert probe.send is send
    assert [message["type"] for message in sent] == ["http.response.start", "http.response.body"]
    assert connections.event_streams() == 0


def test_under_middleware_that_needs_a_started_response_an_event_stream_runs_in_place() -> None:
    """Starlette's BaseHTTPMiddleware fails a route that returns before its response
    starts: under middleware other than CORS, the gateway app holds nothing."""
    log: list[str] = []
    app, connections = make_app(GatewayApp, log)

    async def passing(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        log.append("base middleware")
        return response

    app.add_middleware(BaseHTTPMiddleware, dispatch=passing)
    answer = get(app)
    assert answer.status_code == 200 and answer.text == "held"
    assert log == ["serve", "base middleware"]  # in place: the route still there
    assert connections.event_streams() == 0


def served_by_uvicorn(app: Any) -> httpx.Response:
    """A GET of /live from `app` served by uvicorn on a loopback port."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        return web.get(f"http://127.0.0.1:{port}/live", headers={"Origin": ORIGIN}, timeout=30)
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.parametrize("cors", [False, True])
def test_an_event_stream_may_be_written_from_outside_its_task_only_through_the_server(
    cors: bool,
) -> None:
    """The hub writes frames to waiting event streams from outside their tasks (issue 26):
    only through uvicorn's own send (under the app's CORS middleware or none), which needs
    no task; through any other, each stream's task writes."""
    app, _ = make_app(GatewayApp, [], cors=cors)
    assert served_by_uvicorn(app).text == "held"
    assert [probe.from_outside for probe in app.probes] == [True]
    app, _ = make_app(GatewayApp, [], cors=cors)
    assert get(app).text == "held"  # httpx's in-process transport: its own send
    assert [probe.from_outside for probe in app.probes] == [False]
