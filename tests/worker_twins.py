"""The sync and the async worker behind one interface, for the worker's contract tests
(tests/integration/test_worker_contract.py).

A behaviour is written once: its handlers say which statements an event (or a batch) makes
(`Effects`), or raise; `WorkerTwin.handler` registers them as a plain def that runs them on
the batch's `Connection`, or as an `async def` that awaits them on its `AsyncConnection`.
`WorkerTwin.running` runs the app's subscriptions on `Worker` (through `App.run_worker`),
or on `AsyncWorker` inside an event loop of the test's own, as an application would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from helpers import Running
from twins import EventLoopThread

import subengine

# what a handler does: statements with their parameters
Effects = list[tuple[str, Sequence[Any]]]

RECORD = "INSERT INTO effects VALUES (%s, %s, %s)"


def record(event: subengine.Event) -> Effects:
    """The event's effect: a row of the table `effects`."""
    return [(RECORD, (event.id, event.partition, event.position))]


class WorkerTwin:
    """Registers handlers and runs workers of one kind: "sync" or "async"."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def handler(
        self,
        sub: subengine.Subscription,
        body: Callable[[subengine.Event], Effects],
        event_type: str | None = None,
    ) -> None:
        if self.kind == "sync":

            def handle(event: subengine.Event, conn: Any) -> None:
                for statement, params in body(event):
                    conn.execute(statement, params)

            sub.handler(event_type)(handle)
            return

        async def handle_async(event: subengine.Event, conn: Any) -> None:
            for statement, params in body(event):
                await conn.execute(statement, params)

        sub.handler(event_type)(handle_async)

    def batch_handler(
        self,
        sub: subengine.Subscription,
        body: Callable[[Sequence[subengine.Event]], Effects],
    ) -> None:
        if self.kind == "sync":

            def handle(events: Sequence[subengine.Event], conn: Any) -> None:
                for statement, params in body(events):
                    if conn is not None:
                        conn.execute(statement, params)

            sub.batch_handler()(handle)
            return

        async def handle_async(events: Sequence[subengine.Event], conn: Any) -> None:
            for statement, params in body(events):
                if conn is not None:
                    await conn.execute(statement, params)

        sub.batch_handler()(handle_async)

    def gap_handler(
        self,
        sub: subengine.Subscription,
        body: Callable[[subengine.Tombstone], Effects],
    ) -> None:
        if self.kind == "sync":

            def handle(gap: subengine.Tombstone, conn: Any) -> None:
                for statement, params in body(gap):
                    conn.execute(statement, params)

            sub.gap_handler()(handle)
            return

        async def handle_async(gap: subengine.Tombstone, conn: Any) -> None:
            for statement, params in body(gap):
                await conn.execute(statement, params)

        sub.gap_handler()(handle_async)

    @contextmanager
    def running(
        self, app: subengine.App, engine: subengine.Engine, **options: Any
    ) -> Iterator[Any]:
        """The app's subscriptions at work until the block ends; what it raised fails the
        test."""
        if self.kind == "sync":
            with Running(app, engine, **options) as running:
                yield running
            return
        loop = EventLoopThread()
        try:
            worker = subengine.AsyncWorker(engine, list(app.subscriptions.values()), **options)
            stop = loop.run(asyncio.Event)
            task = asyncio.run_coroutine_threadsafe(worker.run(stop), loop.loop)
            try:
                yield worker
            finally:
                loop.loop.call_soon_threadsafe(stop.set)
                task.result(timeout=30)
        finally:
            loop.close()


@pytest.fixture(name="workers", params=["sync", "async"])
def workers_fixture(request: pytest.FixtureRequest) -> WorkerTwin:
    """`workers`: the sync worker with plain handlers, then the async worker with async
    ones. A contract module imports it (`from worker_twins import workers_fixture`)."""
    return WorkerTwin(request.param)
