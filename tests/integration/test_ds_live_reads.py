"""A Durable Streams live reader woken by an append, in process on a real PostgreSQL: it
looks at the catalog and reads the messages after its offset in one statement, and gets
what a lookup and a read would give, or 404 when the path is another stream now. An event
stream asked for while the gateway shuts down is a 503 to retry, not one that ends at
once."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

import subengine
from subengine.db._sql import Query
from subengine.engine._durable_streams import DurableStreams, NewStream
from subengine.gateway import GatewayConfig, close_all_streams, create_app
from subengine.gateway._ahead import ReadsAhead
from subengine.gateway._ds_http import DsError
from subengine.gateway._ds_reads import _look_again
from subengine.gateway._ds_state import DurableStreamsState

JSON = "application/json"


def recording(engine: subengine.AsyncEngine) -> list[tuple[str, bool]]:
    """The names of the statements `engine` runs from now on, and whether each ran on
    its own (autocommit: no BEGIN and COMMIT round trips)."""
    names: list[tuple[str, bool]] = []
    run = engine.sql.run_async

    async def recorded(conn: Any, query: Query[Any]) -> Any:
        names.append((query.name, conn.autocommit))
        return await run(conn, query)

    engine.sql.run_async = recorded  # type: ignore[method-assign]
    return names


async def append(store: DurableStreams, path: str, *messages: Any) -> None:
    body = json.dumps(list(messages)).encode()
    await store.append(path, JSON, body, close=False, seq=None, producer=None)


def state_of(engine: subengine.AsyncEngine) -> DurableStreamsState:
    outcomes = Counter("pages", "pages read ahead", ["outcome"], registry=CollectorRegistry())
    gateway = SimpleNamespace(engine=engine, read_engine=engine, reads_ahead=ReadsAhead(outcomes))
    return DurableStreamsState(gateway, long_poll_timeout=30.0)  # type: ignore[arg-type]


def test_a_woken_reader_looks_up_and_reads_in_one_statement(
    async_engine: subengine.AsyncEngine, runner: asyncio.Runner
) -> None:
    state = state_of(async_engine)
    store = state.store

    async def woken() -> tuple[list[tuple[str, bool]], Any, Any, Any]:
        await store.create("/a", NewStream(JSON, None, None, False))
        await append(store, "/a", {"n": 1})
        known = await store.stream("/a")
        assert known is not None
        await append(store, "/a", {"n": 2}, {"n": 3})
        names = recording(async_engine)
        found, messages = await _look_again(state, "/a", known, known.tail)
        statements = list(names)  # what follows is the test's own
        looked = await store.stream("/a")
        assert looked is not None
        return statements, (found, messages), looked, await store.read(looked, known.tail)

    names, woke, looked, read = runner.run(woken())
    assert names == [("ds_stream_and_json", True)]
    assert woke == (looked, read)
    assert [json.loads(text) for _, text in read] == [{"n": 2}, {"n": 3}]


def test_a_reader_woken_after_its_path_was_created_again_gets_404(
    async_engine: subengine.AsyncEngine, runner: asyncio.Runner
) -> None:
    """None of the new stream's messages go out under the offsets of the old one."""
    state = state_of(async_engine)
    store = state.store

    async def woken() -> None:
        await store.create("/a", NewStream(JSON, None, None, False))
        known = await store.stream("/a")
        assert known is not None
        await store.delete("/a")
        await store.create("/a", NewStream(JSON, None, None, False))
        await append(store, "/a", {"n": 1})
        await _look_again(state, "/a", known, 0)

    with pytest.raises(DsError) as raised:
        runner.run(woken())
    assert raised.value.status == 404


def test_a_woken_reader_of_a_byte_stream_reads_as_before(
    async_engine: subengine.AsyncEngine, runner: asyncio.Runner
) -> None:
    state = state_of(async_engine)
    store = state.store

    async def woken() -> Any:
        await store.create("/b", NewStream("text/plain", None, None, False))
        known = await store.stream("/b")
        assert known is not None
        await store.append("/b", "text/plain", b"hello", close=False, seq=None, producer=None)
        names = recording(async_engine)
        return names, await _look_again(state, "/b", known, 0)

    names, (found, messages) = runner.run(woken())
    assert names == [("ds_stream", True), ("ds_read_bytes", True)]
    assert found.tail == 1
    assert [(position, bytes(body)) for position, body in messages] == [(1, b"hello")]


def test_an_event_stream_asked_for_while_the_gateway_shuts_down_is_503(dsn: str) -> None:
    """Between the stop signal (which ends the open streams) and the listener's close the
    server still takes requests: an event stream it started then would end at once, and
    the TypeScript client, after three such in a row, ends its read as if the stream were
    done. It is a 503 with Retry-After instead, which the client retries."""
    app = create_app(GatewayConfig(durable_streams=True), dsn=dsn)

    async def asked() -> tuple[httpx.Response, httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://127.0.0.1"
            ) as client:
                created = await client.put(
                    "/ds/orders", headers={"Content-Type": JSON}, content=b'[{"n": 1}]'
                )
                assert created.status_code == 201
                close_all_streams()  # what SIGTERM does first
                sse = await client.get("/ds/orders", params={"offset": "-1", "live": "sse"})
                page = await client.get("/ds/orders", params={"offset": "-1"})
                return sse, page

    sse, page = asyncio.run(asked())
    assert sse.status_code == 503
    assert sse.headers["Retry-After"] == "1"
    assert not sse.headers["Content-Type"].startswith("text/event-stream")
    assert (page.status_code, page.json()) == (200, [{"n": 1}])  # reads that end still work
