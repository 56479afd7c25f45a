"""An event stream runs after the routing and middleware that chose it have returned
(issue 26: their coroutine frames made a quarter of an idle connection's memory), writes
through the `send` they passed on, and gives its connection slot back if it never runs."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from subengine.gateway._app import GatewayApp
from subengine.gateway._connections import SSE, Connections
from subengine.gateway._sse import HeldOpen


class Probe(HeldOpen):
    def __init__(self, log: list[str], connections: Connections) -> None:
        self.log = log
        self.slot = connections.admit(SSE, "someone")
        self.send: Send | None = None

    async def serve(self, receive: Receive, send: Send) -> None:
        self.log.append("serve")
        self.send = send
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"held"})
        finally:
            self.slot.release()


class Recorder:
    """A middleware that notes when it returns, and adds a header to every response."""

    def __init__(self, app: ASGIApp, log: list[str], fail: bool = False) -> None:
        self.app = app
        self.log = log
        self.fail = fail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def marked(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message["headers"], (b"x-recorder", b"yes")]
            await send(message)

        await self.app(scope, receive, marked)
        self.log.append("middleware returned")
        if self.fail:
            raise RuntimeError("after the route")


def make_app(
    app_class: type[Any], log: list[str], fail: bool = False, middleware: bool = True
) -> Any:
    connections = Connections(10, 10, 1)
    probes: list[Probe] = []

    async def route(request: Request) -> Probe:
        probes.append(Probe(log, connections))
        return probes[-1]

    recorder = [Middleware(Recorder, log=log, fail=fail)] if middleware else []
    app = app_class(routes=[Route("/live", route)], middleware=recorder)
    app.probes = probes
    return app, connections


def get(app: Any) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/live")

    return asyncio.run(call())


def test_the_gateway_app_runs_an_event_stream_after_its_middleware_returned() -> None:
    log: list[str] = []
    app, connections = make_app(GatewayApp, log)
    answer = get(app)
    assert answer.text == "held"
    assert answer.headers["x-recorder"] == "yes"  # through the middleware's send
    assert log == ["middleware returned", "serve"]
    assert connections.event_streams() == 0


def test_under_another_app_an_event_stream_runs_in_place() -> None:
    log: list[str] = []
    app, _ = make_app(Starlette, log)
    answer = get(app)
    assert answer.text == "held"
    assert log == ["serve", "middleware returned"]


def test_an_event_stream_that_never_runs_gives_its_slot_back() -> None:
    log: list[str] = []
    app, connections = make_app(GatewayApp, log, fail=True)
    with pytest.raises(RuntimeError, match="after the route"):
        get(app)
    assert log == ["middleware returned"]
    assert connections.event_streams() == 0


def test_without_middleware_of_its_own_an_event_stream_writes_through_the_server() -> None:
    """Starlette's wrappers of `send` only note that a response started, for error
    handling that has returned: each frame skips them."""
    app, connections = make_app(GatewayApp, [], middleware=False)
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
