"""A slot's partition lock, held between batches on a lock connection of the slot's own,
and the backoff of partitions that met a database error. Locks only save wasted work:
correctness comes from the compare-and-set of every batch (invariant 3)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from subengine.db._locks import PartitionLocks, partition_locks
from subengine.db._sql import SQL, Db
from subengine.model._settings import Settings
from subengine.subscriptions._work import prepare_worker_connection

log = logging.getLogger("subengine.worker")

T = TypeVar("T")


class Held:
    """A slot's partition lock: the one it holds between batches (and whether that
    partition had work left after the last one), on a lock connection of the slot's own.

    Invariant 7 makes a slot switch partitions after a batch whenever an older event
    waits elsewhere, so a switch must be cheap: one statement takes the new lock and
    releases the old one. The connection is in autocommit mode, so it never sits idle in
    a transaction; its locks are session locks, gone if it ends.
    """

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        sql: SQL,
        provider: str,
        *,
        session_settings: bool = True,
    ) -> None:
        self._connect = connect
        self._sql = sql
        self._provider = provider
        self._session_settings = session_settings
        self._db: Db | None = None
        self._locks: PartitionLocks | None = None
        self.key: tuple[str, int] | None = None
        self.has_work = False
        self._lock_key: int | None = None

    def run(self, statement: Callable[[Db], T]) -> T:
        """Run a statement on the lock connection. A connection the server ended took
        the held lock with it (another worker may hold it now): it is forgotten, and the
        statement is made again and runs once more on a new connection."""
        for attempt in (1, 2):
            if self._db is None or self._db.conn.closed:
                self.close()
                db = Db(self._connect(), self._sql)
                try:
                    if self._session_settings:
                        prepare_worker_connection(db)
                    locks = partition_locks(self._provider, db)
                except BaseException:
                    db.conn.close()
                    raise
                self._db, self._locks = db, locks
            try:
                return statement(self._db)
            except psycopg.OperationalError:
                self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def try_lock(self, key: tuple[str, int], lock_key: int) -> bool:
        """Take the lock of `key` (keyed `lock_key`) and hold it instead of the one held."""
        if not self.run(lambda db: self._provided().take(lock_key, self._lock_key)):
            return False
        self.key, self._lock_key, self.has_work = key, lock_key, True
        return True

    def release(self) -> None:
        if self._lock_key is None:
            return
        lock_key = self._lock_key
        self._forget()
        try:
            if self._locks is not None:
                self._locks.release(lock_key)
        except psycopg.Error as error:  # the connection is gone, and the lock with it
            log.info("a partition lock's connection was gone (%s); so is the lock", error)
            self.close()

    def close(self) -> None:
        """Forget the lock and close the connection (which ends its locks)."""
        self._forget()
        locks, self._locks = self._locks, None
        if locks is not None:
            with contextlib.suppress(Exception):
                locks.close()
        if self._db is not None:
            with contextlib.suppress(psycopg.Error):
                self._db.conn.close()
            self._db = None

    def _provided(self) -> PartitionLocks:
        assert self._locks is not None, "run() made the lock connection's locks"
        return self._locks

    def _forget(self) -> None:
        self.key, self._lock_key = None, None


class Backoff:
    """Partitions that met a database error (or an unexpected one) and wait before the
    next try: `retry_delay` doubled per consecutive error, at most `retry_delay_max`.
    Kept in memory: such errors say nothing about the events, so nothing is recorded."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._until: dict[tuple[str, int], tuple[float, float]] = {}

    def failed(self, key: tuple[str, int]) -> float:
        """Note an error; the seconds to wait before the next try."""
        with self._lock:
            _, last = self._until.get(key, (0.0, 0.0))
            delay = min(
                self._settings.retry_delay if last == 0 else last * 2,
                self._settings.retry_delay_max,
            )
            self._until[key] = (time.monotonic() + delay, delay)
            return delay

    def succeeded(self, key: tuple[str, int]) -> None:
        if key in self._until:
            with self._lock:
                self._until.pop(key, None)

    def waiting(self, key: tuple[str, int]) -> bool:
        with self._lock:
            until = self._until.get(key)
            return until is not None and until[0] > time.monotonic()

    def next_retry_in(self) -> float:
        """Seconds until the first waiting partition may be tried (infinity: none)."""
        now = time.monotonic()
        with self._lock:
            ahead = [until - now for until, _ in self._until.values() if until > now]
        return min(ahead, default=math.inf)
