"""Async handlers: the worker's batches of subscriptions whose handlers are `async def`.

The slots, the looks for work, the partition locks, the poller and the error policies
are the worker's own (one scheduler for every subscription, so oldest first and fairness
hold across both kinds). What changes for an async subscription is the batch: its
transaction runs on an `AsyncConnection` of the slot's own, on an event loop, and the
handlers are awaited there with that connection (`LoopDb`), so their writes and the
compare-and-set of the position commit together (invariants 2 and 3).

The event loop is the application's when it runs the worker with `AsyncWorker.run` (in a
FastAPI or Starlette lifespan, say), else one the worker runs in a thread of its own.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg

from subengine.db._connection import connect_async
from subengine.db._loop import LoopDb
from subengine.worker._state import RECONNECT_DELAY_SECONDS, WorkerState


class LoopConnections:
    """The AsyncConnection of each slot (thread) of a worker on `loop`: made when the slot
    first handles an async subscription, and again after it broke."""

    def __init__(self, state: WorkerState, loop: asyncio.AbstractEventLoop) -> None:
        self._state = state
        self.loop = loop
        self._lock = threading.Lock()
        self._dbs: dict[int, LoopDb] = {}

    def db(self) -> LoopDb:
        """The calling slot's connection, as a Db whose statements run on the loop."""
        thread = threading.get_ident()
        with self._lock:
            db = self._dbs.pop(thread, None)
        if db is not None and (db.async_conn.broken or db.async_conn.closed):
            self._close(db.async_conn)
            db = None
        if db is None:
            engine = self._state.engine
            conn = asyncio.run_coroutine_threadsafe(
                connect_async(
                    engine.dsn,
                    engine.settings.connect_timeout,
                    application_name=self._state.application_name,
                ),
                self.loop,
            ).result()
            db = LoopDb(conn, engine.sql, self.loop)
        with self._lock:
            self._dbs[thread] = db
        return db

    def close(self) -> None:
        """Close every slot's connection (the slots have stopped)."""
        with self._lock:
            dbs, self._dbs = list(self._dbs.values()), {}
        for db in dbs:
            self._close(db.async_conn)

    def _close(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if self.loop.is_closed():
            return
        try:
            future = asyncio.run_coroutine_threadsafe(conn.close(), self.loop)
            future.result(timeout=RECONNECT_DELAY_SECONDS)
        except Exception:
            pass
