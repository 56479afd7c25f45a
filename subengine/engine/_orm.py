"""A SQLAlchemy `Session` inside a handler's transaction.

    @billing.handler("OrderPlaced")
    def placed(event, conn):
        with subengine.sqlalchemy_session(conn) as session:
            session.add(Order(id=event.key, total=event.data["total"]))

The session runs its statements on the worker's connection, in the batch's transaction,
so its writes commit with the position or not at all (invariant 2). The transaction is
the worker's: the session's `commit()` and `rollback()` do not end it (commit flushes;
to undo the batch, raise). The session is flushed when the block ends.

An async handler gets the same with an `AsyncSession` on its `AsyncConnection`:

    @billing.handler("OrderPlaced")
    async def placed(event, conn):
        async with subengine.async_sqlalchemy_session(conn) as session:
            session.add(Order(id=event.key, total=event.data["total"]))
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import psycopg

# SQLAlchemy is imported on first use: `import subengine` should not pay for its ORM.
if TYPE_CHECKING:
    import sqlalchemy
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
    from sqlalchemy.orm import Session

# One SQLAlchemy engine per worker connection, made on first use: making one runs the
# dialect's first-connect queries, which a batch should not pay for every time. Nothing
# the engine holds refers to its connection strongly, so the entry goes with the
# connection.
_engines: weakref.WeakKeyDictionary[psycopg.Connection[Any], sqlalchemy.Engine] = (
    weakref.WeakKeyDictionary()
)
_async_engines: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], AsyncEngine] = (
    weakref.WeakKeyDictionary()
)


class _Weak:
    """A worker's connection, held weakly, its attributes passed through."""

    def __init__(self, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
        self._conn = weakref.ref(conn)

    def __getattr__(self, name: str) -> Any:
        conn = self._conn()
        if conn is None:
            raise psycopg.InterfaceError("the handler's connection is gone")
        return getattr(conn, name)


class _Borrowed(_Weak):
    """The worker's connection as SQLAlchemy sees it: everything but ending the
    transaction, or the connection, which stay the worker's to do."""

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass


def _engine_for(conn: psycopg.Connection[Any]) -> sqlalchemy.Engine:
    engine = _engines.get(conn)
    if engine is None:
        import sqlalchemy
        from sqlalchemy.pool import StaticPool

        borrowed = _Borrowed(conn)
        engine = sqlalchemy.create_engine(
            "postgresql+psycopg://",
            creator=lambda: borrowed,
            poolclass=StaticPool,
            pool_reset_on_return=None,
            # the hstore lookup wants a real psycopg Connection, not the wrapper
            use_native_hstore=False,
        )
        _engines[conn] = engine
    return engine


@contextmanager
def sqlalchemy_session(conn: psycopg.Connection[Any], **options: Any) -> Iterator[Session]:
    """A Session on the handler's connection and transaction, flushed at the end.

    `options` go to `Session(...)` (e.g. `expire_on_commit=False`).
    """
    if conn is None:
        raise TypeError(
            "sqlalchemy_session needs the handler's connection; at-least-once handlers "
            "have none (their work is not in the batch's transaction)"
        )
    from sqlalchemy.orm import Session

    with Session(bind=_engine_for(conn), **options) as session:
        yield session
        session.flush()


class _AsyncBorrowed(_Weak):
    """`_Borrowed` for an AsyncConnection: SQLAlchemy awaits these, and they do nothing."""

    async def commit(self) -> None:
        pass

    async def rollback(self) -> None:
        pass

    async def close(self) -> None:
        pass


def _async_engine_for(conn: psycopg.AsyncConnection[Any]) -> AsyncEngine:
    engine = _async_engines.get(conn)
    if engine is None:
        from sqlalchemy.ext.asyncio import create_async_engine
        from sqlalchemy.pool import StaticPool

        borrowed = _AsyncBorrowed(conn)

        async def creator() -> Any:
            return borrowed

        engine = create_async_engine(
            "postgresql+psycopg://",
            async_creator=creator,
            poolclass=StaticPool,
            pool_reset_on_return=None,
            use_native_hstore=False,
        )
        _async_engines[conn] = engine
    return engine


@asynccontextmanager
async def async_sqlalchemy_session(
    conn: psycopg.AsyncConnection[Any], **options: Any
) -> AsyncIterator[AsyncSession]:
    """An AsyncSession on an async handler's connection and transaction, flushed at the
    end (see `sqlalchemy_session`)."""
    if conn is None:
        raise TypeError(
            "async_sqlalchemy_session needs the handler's connection; at-least-once "
            "handlers have none (their work is not in the batch's transaction)"
        )
    from sqlalchemy.ext.asyncio import AsyncSession

    async with AsyncSession(bind=_async_engine_for(conn), **options) as session:
        yield session
        await session.flush()
