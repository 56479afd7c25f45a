"""`AsyncWorker`: the worker inside an application's own event loop, where it awaits the
handlers of its async subscriptions (see `_async`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from subengine.engine._async_engine import AsyncEngine
from subengine.engine._engine import Engine
from subengine.model._declarations import Subscription
from subengine.worker._worker import Worker


class AsyncWorker:
    """Runs subscriptions, async ones among them, inside the caller's event loop.

        worker = subengine.AsyncWorker(engine, [billing])
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        ...
        stop.set()
        await task

    The async handlers are awaited on the loop that runs `run`, so they may use what the
    application made there (clients, an SQLAlchemy `AsyncEngine`); the worker's scheduling
    (looks, locks, the poller) runs in threads of its own and never blocks the loop.
    Subscriptions with plain handlers run there too, in the slots' threads.

    `engine` may be the application's `AsyncEngine`: the worker then makes an `Engine` of
    the same DSN and settings for its own threads, for the length of each run.
    """

    def __init__(
        self,
        engine: Engine | AsyncEngine,
        subscriptions: Sequence[Subscription],
        concurrency: int = 1,
        listen: bool = True,
        metrics_port: int | None = None,
        metrics_address: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._options: dict[str, Any] = {
            "concurrency": concurrency,
            "listen": listen,
            "metrics_port": metrics_port,
            "metrics_address": metrics_address,
        }
        self._engine = engine
        self._subscriptions = list(subscriptions)
        self.worker: Worker | None = None  # the current run's, for its id and metrics

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Work until `stop` is set or the task is cancelled: the current batches finish
        and every lock is released before it returns (a cancellation is raised again
        after that). An error that stops the worker is raised here."""
        loop = asyncio.get_running_loop()
        halt = threading.Event()
        done: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if done.done():
                return
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        def work() -> None:
            error: BaseException | None = None
            try:
                if isinstance(self._engine, Engine):
                    self._work(self._engine, loop, halt)
                else:
                    settings = self._engine.settings
                    with Engine(self._engine.dsn, settings=settings) as engine:
                        self._work(engine, loop, halt)
            except BaseException as failure:  # raised in `run`'s task
                error = failure
            loop.call_soon_threadsafe(settle, error)

        thread = threading.Thread(target=work, name="subengine-async-worker", daemon=True)
        thread.start()
        stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
        try:
            waits: set[asyncio.Future[Any]] = {done} if stopped is None else {done, stopped}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            halt.set()
            if stopped is not None:
                stopped.cancel()
            # the slots may be awaiting handlers on this loop: keep it turning for them
            while not done.done():
                try:
                    await asyncio.wait({done})
                except asyncio.CancelledError:
                    continue
        done.result()

    def _work(self, engine: Engine, loop: asyncio.AbstractEventLoop, halt: threading.Event) -> None:
        worker = Worker(engine, self._subscriptions, loop=loop, **self._options)
        self.worker = worker
        worker.run(halt)
