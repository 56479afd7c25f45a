"""A `Db` whose statements run on an `AsyncConnection`, in an event loop of another thread.

The batch transaction (`subscriptions._batches`), the failure and parking records and
the worker's scheduling are written once, as plain calls on a `Db`. For a subscription
whose handlers are `async def`, the worker hands them a `LoopDb`: the same named queries
(`SQL.run_async`) and the same transactions run on an `AsyncConnection` owned by an
event loop (the application's own, or one the worker runs), and the handlers are awaited
there on that connection, in that transaction. The calling thread waits for each step,
so the logic above stays one piece of code for both kinds of handler (DESIGN.md,
"sync and async share everything but the connection").
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg

from subengine.db._connection import connect_async
from subengine.db._sql import SQL, Db, Query

T = TypeVar("T")


class LoopDb(Db):
    """An `AsyncConnection` on `loop`, used from another thread as a `Db`.

    `conn` is the AsyncConnection itself: the worker reads only its `broken` and
    `closed`, which both kinds of connection have; nothing calls a sync method on it,
    because the handlers of a subscription with async handlers are awaited (`wait`).
    """

    __slots__ = ("async_conn", "loop")

    def __init__(
        self,
        async_conn: psycopg.AsyncConnection[Any],
        sql: SQL,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(async_conn, sql)  # type: ignore[arg-type]
        self.async_conn = async_conn
        self.loop = loop

    def wait(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` on the loop and wait for its result (or its exception, raised
        here). Never from the loop's own thread: it would wait for itself."""
        if _running_loop() is self.loop:
            work.close()
            raise RuntimeError("a LoopDb is used from a thread other than its loop's")
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def run(self, query: Query[T]) -> T:
        return self.wait(self.sql.run_async(self.async_conn, query))

    @contextmanager
    def transaction(self, force_rollback: bool = False) -> Iterator[psycopg.Transaction]:
        """A transaction (a savepoint inside one) on the AsyncConnection."""
        manager = self.async_conn.transaction(force_rollback=force_rollback)
        entered = self.wait(_awaited(manager.__aenter__()))
        try:
            yield entered  # type: ignore[misc]  # nothing uses it but as a context
        except BaseException as error:
            exit = manager.__aexit__(type(error), error, error.__traceback__)
            if not self.wait(_awaited(exit)):
                raise
        else:
            self.wait(_awaited(manager.__aexit__(None, None, None)))


async def _awaited(work: Awaitable[T]) -> T:
    return await work


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class EventLoopThread:
    """An event loop running in a daemon thread of its own until `close`: where a worker
    that is not given a loop awaits its async handlers."""

    def __init__(self, name: str = "subengine-event-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def close(self, timeout: float) -> None:
        """Stop the loop (after what it runs now) and close it."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.loop.close()


@contextmanager
def loop_db(dsn: str, connect_timeout: float, sql: SQL) -> Iterator[LoopDb]:
    """A LoopDb of its own, on a new autocommit AsyncConnection in an event loop thread
    of its own, for a call made outside any worker (a dead letter's retry, say) that
    runs async handlers; each step opens its own transaction (`Db.transaction`)."""
    thread = EventLoopThread("subengine-handlers")
    try:
        conn = asyncio.run_coroutine_threadsafe(
            connect_async(dsn, connect_timeout, autocommit=True), thread.loop
        ).result()
        try:
            yield LoopDb(conn, sql, thread.loop)
        finally:
            asyncio.run_coroutine_threadsafe(conn.close(), thread.loop).result()
    finally:
        thread.close(connect_timeout)
