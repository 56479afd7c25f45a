"""`AsyncEngine`: `Engine`'s reads and appends for asyncio applications.

It is configured as an `Engine` is (a DSN, settings, or the embedded PostgreSQL), raises
the same errors, and runs the very `Query` objects the sync engine runs (built and
validated by the same functions), with `SQL.run_async` on a
`psycopg_pool.AsyncConnectionPool`. Only connecting and waiting differ.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from subengine.db._connection import (
    APPLICATION_NAME,
    PooledAsyncConnection,
    PoolWait,
    connect,
    connect_async,
    connect_options,
    connection_lost_error,
    needs_own_session,
    pooled,
)
from subengine.db._sql import SQL, Db
from subengine.engine._configure import configured
from subengine.model._cursor import Cursor
from subengine.model._declarations import Retention
from subengine.model._errors import DatabaseUnavailable
from subengine.model._event_fields import ALL_FIELDS
from subengine.model._events import Appended, Event, NewEvent, PartitionState, Stream, Tombstone
from subengine.model._records import (
    DeadLetter,
    ParkedKey,
    StoredSubscription,
    WorkerRegistration,
    WorkerStatus,
)
from subengine.model._settings import Settings
from subengine.outside import _api_keys
from subengine.outside._api_keys import ApiKey
from subengine.streams import _read, _retention, _streams
from subengine.streams._append import ExpectedVersion, append_events, prepare, schema_not_ready
from subengine.streams._listener import AsyncListener
from subengine.streams._read import EncodedPage, Page, RawEvent
from subengine.streams._tail import LISTENER_APPLICATION_NAME, AsyncTail
from subengine.subscriptions import _inspection, _parking, _stream_deletion, _subscriptions
from subengine.subscriptions._stream_deletion import DeletedStream
from subengine.subscriptions._subscriptions import SubscriptionPosition


class AsyncEngine:
    """Streams in one PostgreSQL database and schema, for asyncio.

    `dsn`, `schema` and `settings` are those of `Engine`. The pool opens on first use
    (or on `async with`); close it with `await engine.close()`.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.settings, self.dsn = configured(dsn, schema, settings)
        self.embedded = self.settings.dsn is None
        self.schema = self.settings.schema
        self.sql = SQL(self.schema)
        self._closed = False
        self._pool_errors_seen = 0
        self._pool = AsyncConnectionPool(
            self.dsn,
            connection_class=PooledAsyncConnection,
            min_size=self.settings.pool_min_size,
            max_size=self.settings.pool_max_size,
            timeout=self.settings.connect_timeout,
            kwargs=connect_options(self.settings.connect_timeout, APPLICATION_NAME),
            name="subengine-async",
            open=False,
        )
        self._listener = AsyncListener(self._listening_connection, self.sql)

    async def open(self) -> None:
        """Open the pool (done by the first call that needs a connection)."""
        if self._closed:
            raise DatabaseUnavailable("this AsyncEngine is closed")
        await self._pool.open()

    @property
    def listener(self) -> AsyncListener:
        """The engine's one LISTEN connection, shared by its tails and by the gateway's hub."""
        return self._listener

    async def close(self) -> None:
        """Stop its tails' listener and close every connection of the pool."""
        self._closed = True
        await self._listener.close()
        await self._pool.close()

    async def __aenter__(self) -> AsyncEngine:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @asynccontextmanager
    async def connection(
        self, *, autocommit: bool = False
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled connection in a transaction: committed on success, else rolled back.
        With `autocommit`, each statement is a transaction of its own instead.

        Waits and fails as `Engine.connection` does: ConfigurationError at once for what
        no retry fixes, DatabaseUnavailable for a connection lost on the way or a server
        that stays out of reach for `connect_timeout`.
        """
        conn = await self._checkout()
        lost = False
        try:
            if autocommit:
                await conn.set_autocommit(True)
            async with conn:
                yield conn
        except psycopg.Error as error:
            missing = schema_not_ready(error)
            if missing is not None:
                raise missing from error
            unavailable = connection_lost_error(error, self.dsn)
            if unavailable is None:
                raise
            lost = True
            raise unavailable from error
        finally:
            if autocommit and not conn.closed:
                if conn.info.transaction_status == TransactionStatus.IDLE:
                    await conn.set_autocommit(False)
                else:
                    await conn.close()  # not fit to go back as it is: the pool replaces it
            if isinstance(conn, PooledAsyncConnection):
                await self._pool.putconn(conn)
            else:
                await conn.close()
            if lost:
                await self._pool.check()  # the other idle connections are likely gone too

    async def _checkout(self) -> psycopg.AsyncConnection[Any]:
        """A connection of the pool, or one of our own that tells why the pool has none
        (see `Engine._checkout`, which this follows step by step)."""
        if self._pool.closed:
            await self.open()
        wait = PoolWait(self.dsn, self.settings.connect_timeout, self.settings.pool_max_size)
        while True:
            errors = self._pool.get_stats().get("connections_errors", 0)
            try:
                conn = await self._pool.getconn(timeout=wait.look())
            except PoolTimeout:
                pass
            else:
                self._pool_errors_seen = errors
                return conn
            if self._pool.get_stats().get("connections_errors", 0) == self._pool_errors_seen:
                wait.pool_busy()  # or one connection is on its way
                continue
            try:
                return await connect_async(self.dsn, wait.diagnosis_timeout())
            except psycopg.Error as error:
                wait.failed(error)

    async def connect(
        self,
        *,
        application_name: str = APPLICATION_NAME,
        autocommit: bool = False,
        session: str | None = None,
    ) -> psycopg.AsyncConnection[Any]:
        """A new connection of its own (not from the pool), with the engine's connect
        timeout; the caller closes it. `session`: see `Engine.connect`."""
        dsn = self.dsn
        if session is not None and self.settings.direct_dsn is not None:
            dsn = self.settings.direct_dsn
        conn = await connect_async(
            dsn,
            self.settings.connect_timeout,
            application_name=application_name,
            autocommit=autocommit,
        )
        if session is not None and pooled(conn):
            await conn.close()
            raise needs_own_session(session)
        return conn

    async def _listening_connection(self) -> psycopg.AsyncConnection[Any]:
        if self._closed:
            raise DatabaseUnavailable("this AsyncEngine is closed")
        return await self.connect(
            application_name=LISTENER_APPLICATION_NAME, autocommit=True, session="LISTEN"
        )

    # streams

    async def create_stream(
        self, name: str, partitions: int, *, retention: Retention | None = None
    ) -> Stream:
        """Create a stream with a fixed number of partitions and, optionally, a retention
        policy (without one, every event is kept)."""
        query = _streams.create_stream(name, partitions, retention)
        async with self.connection() as conn:
            created = await self.sql.run_async(conn, query)
            if created is None:
                raise await self.sql.run_async(conn, _streams.name_taken(name))
            return created

    async def streams(self) -> list[Stream]:
        """Every stream, by name."""
        async with self.connection() as conn:
            return await self.sql.run_async(conn, _streams.list_streams())

    async def delete_stream(
        self,
        name: str,
        *,
        force: bool = False,
        batch: int = _stream_deletion.DEFAULT_DELETE_BATCH,
    ) -> DeletedStream:
        """`Engine.delete_stream`. Its steps are the sync engine's, run in a thread on a
        connection of their own (autocommit, each batch its own transaction), so that
        the event loop never waits for them."""
        return await asyncio.to_thread(self._delete_stream, name, force, batch)

    def _delete_stream(self, name: str, force: bool, batch: int) -> DeletedStream:
        with connect(self.dsn, self.settings.connect_timeout, autocommit=True) as conn:
            return _stream_deletion.delete_stream(
                Db(conn, self.sql), name, force=force, batch=batch
            )

    async def set_retention(self, name: str, retention: Retention | None) -> Stream:
        """Change a stream's retention policy (None: keep every event from now on); the
        next pruning run applies it."""
        async with self.connection() as conn:
            return await self.sql.run_async(conn, _retention.set_retention(name, retention))

    async def stream(self, name: str) -> Stream:
        """One stream; raises StreamNotFound when it does not exist."""
        query = _streams.get_stream(name)
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    # append and read

    async def append(
        self,
        stream: str,
        events: Iterable[NewEvent],
        expected_version: ExpectedVersion = None,
    ) -> list[Appended]:
        """Append events in a transaction of their own; see `subengine.append`."""
        params = prepare(stream, events, expected_version, self.settings)
        if not params["keys"]:
            return []
        async with self.connection(autocommit=True) as conn:  # one statement: its own transaction
            return await self.sql.run_async(conn, append_events(params))

    async def read(
        self, stream: str, partition: int, after: int = 0, limit: int | None = None
    ) -> list[Event | Tombstone]:
        """Events of one partition after position `after`, in position order; first a
        `Tombstone` when retention removed positions after `after`."""
        query = _read.read_after(
            stream, partition, after, self.settings.read_limit if limit is None else limit
        )
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    async def read_json(
        self, stream: str, partition: int, after: int = 0, limit: int | None = None
    ) -> tuple[int, list[RawEvent | Tombstone]]:
        """The stream's epoch and what `read` gives, in one snapshot, with each event's
        data and metadata as their JSON text (`RawEvent`): for relaying events without
        decoding them (the gateway), and knowing which stream of the name they are of."""
        query = _read.read_after_raw(
            stream, partition, after, self.settings.read_limit if limit is None else limit
        )
        async with self.connection(autocommit=True) as conn:  # one statement: one snapshot
            return await self.sql.run_async(conn, query)

    async def read_since(
        self, stream: str, since: datetime, limit: int | None = None
    ) -> list[Event | Tombstone]:
        """Events of every partition recorded after `since` (not at it), oldest first."""
        query = _read.read_since(
            stream, since, self.settings.read_limit if limit is None else limit
        )
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    async def read_page(
        self, stream: str, positions: Sequence[int], limit: int | None = None
    ) -> Page:
        """Up to `limit` events of every partition after its position in `positions`,
        oldest first across partitions, with the tombstones of the gaps after them and,
        from the same snapshot, the stream's epoch, heads and floors (the gateway's
        catch-up read; see `subengine.streams._read.read_page`)."""
        query = _read.read_page(
            stream, positions, self.settings.read_limit if limit is None else limit
        )
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    async def read_page_json(
        self,
        stream: str,
        positions: Sequence[int],
        limit: int,
        *,
        keys: Iterable[str] | None = None,
        types: Iterable[str] | None = None,
        fields: frozenset[str] = ALL_FIELDS,
        max_bytes: int | None = None,
        oversize: bool = True,
    ) -> EncodedPage:
        """`read_page` with each event's JSON made by PostgreSQL as the gateway sends it,
        filtered and bounded in bytes (see `subengine.streams._read.read_page_json`)."""
        query = _read.read_page_json(
            stream,
            positions,
            limit,
            keys=keys,
            types=types,
            fields=fields,
            max_bytes=max_bytes,
            oversize=oversize,
        )
        async with self.connection(autocommit=True) as conn:  # one statement: one snapshot
            return await self.sql.run_async(conn, query)

    async def positions_since(self, stream: str, since: datetime) -> tuple[int, list[int]]:
        """The stream's epoch, and per partition the position just before its first event
        recorded after `since` (0 where retention removed such events)."""
        query = _read.positions_since(stream, since)
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    async def epochs_and_heads(
        self, streams: Sequence[str]
    ) -> dict[str, tuple[int, list[int] | None]]:
        """The epoch and heads of each of `streams` that exists (heads None while it is
        being deleted)."""
        query = _read.epochs_and_heads(streams)
        async with self.connection(autocommit=True) as conn:  # one statement: one snapshot
            return await self.sql.run_async(conn, query)

    async def partitions(self, stream: str) -> list[PartitionState]:
        """Head, head time and floor of every partition of a stream."""
        query = _streams.partition_states(stream)
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    async def heads(self, stream: str) -> dict[int, int]:
        """The head (last committed position) of every partition of a stream."""
        query = _streams.heads(stream)
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    # subscriptions and workers, as the sync engine reports them

    async def subscriptions(self) -> list[StoredSubscription]:
        """Every stored subscription: name, stream, start, generation, paused, created_at."""
        async with self.connection() as conn:
            return await self.sql.run_async(conn, _inspection.subscriptions())

    async def subscription_positions(self, name: str) -> list[SubscriptionPosition]:
        """Every partition's position of a stored subscription."""
        async with self.connection() as conn:
            return await self.sql.run_async(conn, _subscriptions.positions(name))

    async def dead_letters(
        self, name: str | None = None, everything: bool = False
    ) -> list[DeadLetter]:
        """Unresolved dead letters (all of them with `everything`), oldest first."""
        query = _inspection.dead_letters(name, everything)
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    async def parked_keys(
        self, name: str | None = None, key: str | None = None, everything: bool = False
    ) -> list[ParkedKey]:
        """Keys parked now (of subscription `name`, of `key`), oldest first; with
        `everything`, those retried, discarded or superseded by a reset too."""
        query = _parking.parked_keys(name, key, everything)
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    async def workers(self) -> list[WorkerStatus]:
        """The workers_status view's rows."""
        async with self.connection() as conn:
            return await self.sql.run_async(conn, _inspection.workers())

    async def prune_workers(self) -> list[WorkerRegistration]:
        """Remove the registrations of workers that are gone; the rows removed."""
        async with self.connection() as conn:
            return await self.sql.run_async(conn, _inspection.prune_workers())

    # the gateway's API keys and signing secrets

    async def create_api_key(
        self, scopes: Iterable[str], streams: Iterable[str], name: str | None = None
    ) -> tuple[ApiKey, str]:
        """`Engine.create_api_key`: the key and its token, which nothing can show again."""
        query = _api_keys.create_key(name, scopes, streams)
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    async def api_keys(self) -> list[ApiKey]:
        """Every API key, revoked ones included, oldest first (never their secrets)."""
        async with self.connection() as conn:
            return await self.sql.run_async(conn, _api_keys.list_keys())

    async def revoke_api_key(self, id: str) -> ApiKey:
        """`Engine.revoke_api_key`: ApiKeyNotFound when there is no key `id`."""
        query = _api_keys.revoke_key(id)
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    async def authenticate(self, token: str) -> ApiKey | None:
        """The API key of `token`, or None when the token is malformed, unknown, wrong or
        revoked (a malformed one costs no query). Never raises on a bad token."""
        query = _api_keys.authenticate(token)
        if query is None:
            return None
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    async def any_active_api_key(self) -> bool:
        """Whether any API key is not revoked; without one the gateway runs open."""
        async with self.connection() as conn:
            return await self.sql.run_async(conn, _api_keys.any_active_key())

    async def signing_secret(self, name: str) -> bytes:
        """`Engine.signing_secret`: the same bytes for every caller of the schema."""
        query = _api_keys.signing_secret(name)
        async with self.connection() as conn:
            return await self.sql.run_async(conn, query)

    # the live tail

    def tail(
        self,
        stream: str,
        after: Cursor | str | None = None,
        *,
        keys: Iterable[str] | None = None,
        types: Iterable[str] | None = None,
    ) -> AsyncTail:
        """Every event of `stream` after the cursor `after` (None: from the beginning),
        then each new one as it commits: `async for event in engine.tail(...)`. `keys`
        and `types` keep only events of those keys and types. See `Tail`."""
        return AsyncTail(self, stream, after, keys=keys, types=types)
