"""Sync and async twins behind one interface, for the contract tests that run over both.

A contract test is written once against the sync twin's interface and asks the `twin`
fixture for its objects: with "sync" it gets `Engine`, `Tail`, `Reader` themselves; with
"async" it gets `AsyncEngine`, `AsyncTail`, `AsyncReader` behind a `Blocking` facade, each
call run to its end on an event loop that runs in a thread of its own, the whole time (as
a sync engine's listener runs in its thread), so that a test may block, wait in another
thread, or look at the database between calls. (psycopg's pool tests run one test over
both pool classes the same way, with a `pool_cls` fixture.)
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import subengine
from subengine.client import AsyncReader, Reader

# the longest one call of a contract test may take, however it waits
CALL_TIMEOUT = 120.0


class EventLoopThread:
    """An asyncio event loop running in a daemon thread until `close`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="twin-event-loop", daemon=True
        )
        self._thread.start()

    def run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`function(*args, **kwargs)`, called in the loop, awaited when it gives an
        awaitable; its result, or its exception raised here."""

        async def call() -> Any:
            result = function(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        future = asyncio.run_coroutine_threadsafe(call(), self.loop)
        return future.result(timeout=CALL_TIMEOUT)

    def close(self) -> None:
        self.run(self.loop.shutdown_asyncgens)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CALL_TIMEOUT)
        self.loop.close()


def blocking(value: Any, loop: EventLoopThread) -> Any:
    """`value` behind a `Blocking` facade if it is an async object (a context manager or
    an iterator), else itself."""
    if hasattr(value, "__aenter__") or hasattr(value, "__aiter__"):
        return Blocking(value, loop)
    return value


class Blocking:
    """An async object behind its sync twin's interface: each method call runs to its end
    in `loop` (from any thread); `with` enters and exits it, `for` iterates it."""

    def __init__(self, target: Any, loop: EventLoopThread) -> None:
        self._target = target
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            return blocking(self._loop.run(value, *args, **kwargs), self._loop)

        return call

    def __enter__(self) -> Any:
        return blocking(self._loop.run(self._target.__aenter__), self._loop)

    def __exit__(self, *exc_info: object) -> None:
        self._loop.run(self._target.__aexit__, *exc_info)

    def __iter__(self) -> Iterator[Any]:
        iterator = self._loop.run(self._target.__aiter__)
        while True:
            try:
                yield self._loop.run(iterator.__anext__)
            except StopAsyncIteration:
                return


class Twin:
    """Makes the sync twin of each pair ("sync"), or the async one behind `Blocking`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._loop = EventLoopThread() if kind == "async" else None

    def make(
        self, sync: Callable[..., Any], async_: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        if self._loop is None:
            return sync(*args, **kwargs)
        return blocking(self._loop.run(async_, *args, **kwargs), self._loop)

    def engine(self, *args: Any, **kwargs: Any) -> Any:
        """`Engine(...)` or `AsyncEngine(...)`."""
        return self.make(subengine.Engine, subengine.AsyncEngine, *args, **kwargs)

    def reader(self, *args: Any, **kwargs: Any) -> Any:
        """`Reader(...)` or `AsyncReader(...)`."""
        return self.make(Reader, AsyncReader, *args, **kwargs)

    def watch(self, *args: Any, **kwargs: Any) -> Any:
        """`Reader.watch(...)` or `AsyncReader.watch(...)`."""
        return self.make(Reader.watch, AsyncReader.watch, *args, **kwargs)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()


@pytest.fixture(name="twin", params=["sync", "async"])
def twin_fixture(request: pytest.FixtureRequest) -> Iterator[Twin]:
    """`twin`, each twin in turn: a test that asks for it runs once over the sync twin and
    once over the async one. A contract module imports it (`from twins import
    twin_fixture`)."""
    made = Twin(request.param)
    yield made
    made.close()


@pytest.fixture(name="either")
def either_fixture(twin: Twin, dsn: str) -> Iterator[Any]:
    """`either`: `Engine(dsn)`, or `AsyncEngine(dsn)` behind its sync facade, each in turn
    (it takes `twin`). A contract module imports it (`from twins import either_fixture`)."""
    with twin.engine(dsn) as engine:
        yield engine
