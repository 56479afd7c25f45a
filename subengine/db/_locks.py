"""Partition locks: the advisory lock a worker slot holds on a (subscription, partition)
while it works on it, on a lock connection of the slot's own.

Locks only keep workers from wasting effort on one partition; correctness never rests on
them (DESIGN.md invariant 3). The key is computed here and by the SQL function
`lock_class`, so the status views can tell which worker holds which partition.

Taking and giving back a lock is a service with providers (`partition_locks`, setting
`lock_provider`; docs/pooler.md, "Lock providers"):
- `pals` (the default): session advisory locks taken and released through pals, on a small
  autocommit SQLAlchemy engine of pals' own over the slot's lock connection (DESIGN.md,
  known pitfalls: never the engine the application or the worker uses). pals' `Locker`
  is not used: its check-in hook runs `pg_advisory_unlock_all()` whenever a connection
  goes back to its pool, a round trip per switch that the slot's one kept connection
  does not need.
- `builtin`: the same session locks by the worker's own statement, which takes the new
  lock and gives the old one back in one round trip.
- `rows`: no advisory lock at all, for a worker whose connections go through a
  transaction-mode pooler (a session lock would stay behind in a pooled server session).
  A transactional batch still locks its partition's position row (`lock_batch`) to its
  commit, so two slots never run one partition's batches at once: the second waits for
  the first. An at_least_once batch commits before its handlers run, so a worker refuses
  those subscriptions with this provider (worker/_state.py). The status views then show
  no holder.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any, Protocol

import psycopg

from subengine.db._sql import Db, Query, nothing


def lock_key(schema: str, subscription: str, partition: int) -> int:
    """The advisory lock of (subscription, partition): the SQL function lock_class's
    31 bits of MD5 of "schema.subscription", shifted left 32 bits, or'ed with the partition."""
    digest = hashlib.md5(f"{schema}.{subscription}".encode(), usedforsecurity=False).digest()
    return (int.from_bytes(digest[:4], "big") & 0x7FFFFFFF) << 32 | partition


def lock_partition(key: int, held: int | None) -> Query[bool]:
    """Take the lock `key` and, only if it was taken, release `held` (None: none held), in
    one round trip; whether it was taken."""
    return Query(
        "lock_partition",
        {"key": key, "held": held},
        lambda result: bool(result.rows and result.rows[0][0]),
    )


def unlock_partition(key: int) -> Query[None]:
    """Give the lock `key` back."""
    return Query("unlock_partition", {"key": key}, nothing)


class PartitionLocks(Protocol):
    """A slot's partition locks on its lock connection: `take(key, held)` takes the lock
    `key` and, only if it got it, gives back `held` (None: none held); whether it got it
    (the `rows` provider always gets it, and keeps no one off the partition)."""

    def take(self, key: int, held: int | None) -> bool: ...

    def release(self, key: int) -> None: ...

    def close(self) -> None:
        """Let go of what it keeps, before the lock connection closes."""


def partition_locks(provider: str, db: Db) -> PartitionLocks:
    """The partition locks of `provider` on the lock connection of `db`."""
    if provider == "pals":
        return _PalsLocks(db)
    if provider == "builtin":
        return _StatementLocks(db)
    return _NoLocks()


class _StatementLocks:
    def __init__(self, db: Db) -> None:
        self._db = db

    def take(self, key: int, held: int | None) -> bool:
        return self._db.run(lock_partition(key, held))

    def release(self, key: int) -> None:
        self._db.run(unlock_partition(key))

    def close(self) -> None:
        pass


class _PalsLocks:
    def __init__(self, db: Db) -> None:
        # imported here: a process that takes no partition lock (most commands) does not
        # pay for SQLAlchemy's import, a third of the command line's start-up
        import sqlalchemy as sa

        conn = db.conn
        # pals' own engine: one autocommit connection, the slot's (a StaticPool hands
        # out the same one), so its locks are the lock connection's and the status views
        # name the slot's worker as their holder
        self._engine = sa.create_engine(
            "postgresql+psycopg://",
            creator=lambda: conn,
            poolclass=sa.pool.StaticPool,
            isolation_level="AUTOCOMMIT",
            # an autocommit connection has nothing to roll back when pals gives it back
            pool_reset_on_return=None,
        )
        with _psycopg_errors():  # its first connect asks the server for its version
            self._conn = self._engine.connect()
        self._locks: dict[int, Any] = {}

    def take(self, key: int, held: int | None) -> bool:
        with _psycopg_errors():
            return self._take(key, held)

    def release(self, key: int) -> None:
        with _psycopg_errors():
            self._release(key)

    def close(self) -> None:
        # now, and not whenever the garbage collector finds them: pals' locks and
        # SQLAlchemy's pool have finalizers that would talk to a connection being closed
        for lock in self._locks.values():
            lock.conn = None
        self._locks.clear()
        self._conn.close()
        self._engine.dispose(close=False)  # the slot closes the connection itself

    def _take(self, key: int, held: int | None) -> bool:
        from pals.core import Lock as PalsLock  # type: ignore[import-untyped]

        lock = PalsLock(self._engine, key, f"subengine partition lock {key}", blocking=False)
        lock.conn = self._conn  # the kept connection: no check-out, no check-in per lock
        if not lock.acquire():
            # a pals Lock gives its lock back and closes its connection when collected:
            # this one holds nothing, and the connection is not its to close
            lock.conn = None
            return False
        self._locks[key] = lock
        if held is not None:
            self._release(held)
        return True

    def _release(self, key: int) -> None:
        lock = self._locks.pop(key, None)
        if lock is not None:
            # pals' release gives the lock back, then closes its connection, which for
            # this engine only returns the one kept connection to the StaticPool
            lock.conn = self._conn
            lock.release()
            self._conn = self._engine.connect()


@contextlib.contextmanager
def _psycopg_errors() -> Iterator[None]:
    """SQLAlchemy's wrapping of a psycopg error, taken off: the worker tells a lost
    connection from other errors by psycopg's classes, whatever the provider."""
    from sqlalchemy.exc import DBAPIError

    try:
        yield
    except DBAPIError as error:
        if isinstance(error.orig, psycopg.Error):
            raise error.orig from None
        raise


class _NoLocks:
    def close(self) -> None:
        pass

    def take(self, key: int, held: int | None) -> bool:
        return True

    def release(self, key: int) -> None:
        pass
