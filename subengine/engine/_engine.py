"""`Engine`: the entry point that owns a connection pool and runs subengine's operations.

Thread-safe; close it (or use it as a context manager) to release its connections.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolTimeout

from subengine.db import _migrate
from subengine.db._connection import (
    APPLICATION_NAME,
    PgConnection,
    PooledConnection,
    PoolWait,
    connect,
    connect_options,
    connection_lost_error,
    needs_own_session,
    one_line,
    pooled,
)
from subengine.db._loop import loop_db
from subengine.db._sql import SQL, Db
from subengine.engine._configure import configured
from subengine.engine._gateway_storage import GatewayStorage
from subengine.engine._parked import ParkedKeys
from subengine.engine._remote_leases import RemoteLeases
from subengine.model._cursor import Cursor
from subengine.model._declarations import Retention, Start, Subscription
from subengine.model._errors import DatabaseUnavailable
from subengine.model._events import Appended, Event, NewEvent, PartitionState, Stream, Tombstone
from subengine.model._records import (
    DeadLetter,
    PartitionStatus,
    StoredSubscription,
    SubscriptionSummary,
    WorkerRegistration,
    WorkerStatus,
)
from subengine.model._settings import Settings
from subengine.streams import _read, _retention, _streams
from subengine.streams._append import (
    ExpectedVersion,
    append_prepared,
    prepare,
    schema_not_ready,
)
from subengine.streams._listener import Listener
from subengine.streams._retention import PartitionCut, RetentionRun
from subengine.streams._tail import LISTENER_APPLICATION_NAME, Tail
from subengine.subscriptions import _batches, _inspection, _stream_deletion, _subscriptions
from subengine.subscriptions._batches import BatchOutcome
from subengine.subscriptions._stream_deletion import DeletedStream
from subengine.subscriptions._subscriptions import Deleted, SubscriptionPosition

# The pool logs every failed connection attempt, from a background thread. Where the
# application configured no logging they would all land on stderr; subengine reports the
# failure once, as DatabaseUnavailable. Configured handlers still receive them.
logging.getLogger("psycopg.pool").addHandler(logging.NullHandler())
# Seconds `close` gives each thread of the pool after `stop_waiting` (instead of five).
_IMPATIENT_CLOSE_SECONDS = 0.25


class Engine(GatewayStorage, ParkedKeys, RemoteLeases):
    """Streams in one PostgreSQL database and schema.

    `dsn` is a PostgreSQL URL or libpq conninfo; without one (and without SUBENGINE_DSN)
    an embedded PostgreSQL is started, or reused, in SUBENGINE_HOME.
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
        # the pool's count of failed connection attempts when it last gave a connection
        self._pool_errors_seen = 0
        self._pool = ConnectionPool(
            self.dsn,
            connection_class=PooledConnection,
            min_size=self.settings.pool_min_size,
            max_size=self.settings.pool_max_size,
            timeout=self.settings.connect_timeout,
            kwargs=connect_options(self.settings.connect_timeout, APPLICATION_NAME),
            name="subengine",
            open=True,
        )
        self._closed = False
        # set by stop_waiting: a call that finds no free connection fails instead of waiting
        self._impatient = threading.Event()
        # its tails' LISTEN connection, opened by the first tail
        self._listener = Listener(self._listening_connection, self.sql)

    @property
    def listener(self) -> Listener:
        """The engine's one LISTEN connection, shared by its tails."""
        return self._listener

    def close(self) -> None:
        """End its tails, stop their listener and close every connection of the pool;
        later tails are refused. After `stop_waiting`, it does not wait for the pool's
        threads that still try to connect."""
        self._closed = True
        self._listener.close()
        if self._impatient.is_set():
            # its threads may be stuck connecting to a server that is gone: not joined
            # for long (they are daemon threads)
            self._pool.close(timeout=_IMPATIENT_CLOSE_SECONDS)
        else:
            self._pool.close()

    def stop_waiting(self) -> None:
        """From now on, a call that finds no connection free in the pool (within half a
        second, or the look it is in) fails with DatabaseUnavailable instead of waiting
        up to `connect_timeout` for PostgreSQL: for a shutdown, which must not wait for a
        database that is gone, while calls that have their connection still finish."""
        self._impatient.set()

    def reachable(self, timeout: float) -> bool:
        """Whether PostgreSQL accepts a new connection within `timeout` seconds (libpq
        waits two at least)."""
        try:
            connect(self.dsn, timeout).close()
        except psycopg.Error:
            return False
        return True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextmanager
    def connection(self, *, autocommit: bool = False) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection in a transaction: committed on success, else rolled back.
        With `autocommit`, each statement is a transaction of its own instead: for one
        statement, that saves the round trips of BEGIN and COMMIT.

        Waits up to `connect_timeout` for PostgreSQL while it refuses connections or is
        starting (saying so on stderr, as a warning, after half a second), and raises
        ConfigurationError at once for what no retry fixes (a wrong password, database,
        role or host name). A connection lost on the way (the server restarted, a backend
        was terminated) raises DatabaseUnavailable, the psycopg error as its cause.
        """
        conn = self._checkout()
        lost = False
        try:
            if autocommit:
                conn.autocommit = True
            with conn:
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
                    conn.autocommit = False
                else:
                    conn.close()  # not fit to go back as it is: the pool replaces it
            if isinstance(conn, PooledConnection):
                self._pool.putconn(conn)
            else:
                conn.close()
            if lost:
                # The server restarted, or terminated backends: the pool's other idle
                # connections are most likely gone too. Weed them out now, so the next
                # call gets a live one (a closed socket fails its check at once).
                self._pool.check()

    def _checkout(self) -> PgConnection:
        """A connection of the pool, or of our own; see `connection` for the waiting.

        While the pool fails to connect, a connection attempt of our own tells why: a
        problem no retry fixes raises at once; one that a starting server explains is
        reported once and waited out. Once the server answers again, and the pool (which
        retries with a growing back-off) still has nothing, the caller gets that fresh
        connection instead of waiting for the pool's next attempt.
        """
        wait = PoolWait(self.dsn, self.settings.connect_timeout, self.settings.pool_max_size)
        while True:
            errors = self._pool.get_stats().get("connections_errors", 0)
            try:
                conn = self._pool.getconn(timeout=wait.look(self._impatient.is_set()))
            except PoolTimeout:
                pass
            else:
                self._pool_errors_seen = errors
                return conn
            if self._impatient.is_set():
                raise DatabaseUnavailable(
                    "no free connection to PostgreSQL came at once, and this engine is "
                    "shutting down: it waits no longer"
                )
            if self._pool.get_stats().get("connections_errors", 0) == self._pool_errors_seen:
                wait.pool_busy()  # or one connection is on its way
                continue
            try:
                return connect(self.dsn, wait.diagnosis_timeout())
            except psycopg.Error as error:
                wait.failed(error)

    def connect(
        self,
        *,
        application_name: str = APPLICATION_NAME,
        autocommit: bool = False,
        session: str | None = None,
    ) -> psycopg.Connection[Any]:
        """A new connection of its own (not from the pool), with the engine's connect
        timeout; the caller closes it. `session` names what needs a session of its own
        on it (LISTEN, session locks or settings): it then goes to SUBENGINE_DIRECT_DSN
        when set, and a connection through a pooler is refused (ConfigurationError)."""
        dsn = self.dsn
        if session is not None and self.settings.direct_dsn is not None:
            dsn = self.settings.direct_dsn
        conn = connect(
            dsn,
            self.settings.connect_timeout,
            application_name=application_name,
            autocommit=autocommit,
        )
        if session is not None and pooled(conn):
            conn.close()
            raise needs_own_session(session)
        return conn

    def _listening_connection(self) -> psycopg.Connection[Any]:
        if self._closed:
            raise DatabaseUnavailable("this Engine is closed")
        return self.connect(
            application_name=LISTENER_APPLICATION_NAME, autocommit=True, session="LISTEN"
        )

    # schema

    def migrate(self) -> None:
        """Create or upgrade subengine's schema (safe from many processes at once)."""
        with self.connection():
            pass  # waits for a server that is starting, and fails early on a wrong DSN
        try:
            _migrate.upgrade(self.dsn, self.schema, self.settings.connect_timeout)
        except psycopg.OperationalError as error:
            raise DatabaseUnavailable(f"could not migrate: {one_line(str(error))}") from None

    def schema_revision(self) -> str | None:
        """The migration revision the database is at (None: never migrated)."""
        return _migrate.current_revision(self.dsn, self.schema, self.settings.connect_timeout)

    # streams

    def create_stream(
        self, name: str, partitions: int, *, retention: Retention | None = None
    ) -> Stream:
        """Create a stream with a fixed number of partitions and, optionally, a retention
        policy (without one, every event is kept)."""
        query = _streams.create_stream(name, partitions, retention)
        with self.connection() as conn:
            created = self.sql.run(conn, query)
            if created is None:
                raise self.sql.run(conn, _streams.name_taken(name))
            return created

    def streams(self) -> list[Stream]:
        """Every stream, by name."""
        with self.connection() as conn:
            return self.sql.run(conn, _streams.list_streams())

    def delete_stream(
        self,
        name: str,
        *,
        force: bool = False,
        batch: int = _stream_deletion.DEFAULT_DELETE_BATCH,
    ) -> DeletedStream:
        """Delete a stream with its partitions and events, `batch` events per transaction.

        Refused while subscriptions of it are stored, unless `force`, which deletes them
        too (positions, dead letters, gaps), even while connected workers run them.
        Appends to the stream fail from the delete's first step; running the delete
        again finishes one that was interrupted. A stream created later under the name
        has a new epoch."""
        with self.connect(autocommit=True) as conn:
            return _stream_deletion.delete_stream(
                Db(conn, self.sql), name, force=force, batch=batch
            )

    def set_retention(self, name: str, retention: Retention | None) -> Stream:
        """Change a stream's retention policy (None: keep every event from now on); the
        next pruning run applies it."""
        with self.connection() as conn:
            return self.sql.run(conn, _retention.set_retention(name, retention))

    def run_retention(
        self,
        stream: str | None = None,
        *,
        dry_run: bool = False,
        batch: int = _retention.DEFAULT_PRUNE_BATCH,
        plan: Callable[[Sequence[PartitionCut]], None] | None = None,
        progress: _retention.Progress | None = None,
    ) -> RetentionRun:
        """Prune what the streams' retention policies no longer keep (every stream with
        one, or `stream`), `batch` events per transaction; with `dry_run`, only report
        what would go. If another pruner runs now, returns at once with `locked` set."""
        with self.connect(autocommit=True, session="the pruner's lock") as conn:
            return _retention.run_retention(
                Db(conn, self.sql),
                self.schema,
                stream,
                batch=batch,
                dry_run=dry_run,
                plan=plan,
                progress=progress,
            )

    def stream(self, name: str) -> Stream:
        """One stream; raises StreamNotFound when it does not exist."""
        query = _streams.get_stream(name)
        with self.connection() as conn:
            return self.sql.run(conn, query)

    # append and read

    def append(
        self,
        stream: str,
        events: Iterable[NewEvent],
        expected_version: ExpectedVersion = None,
    ) -> list[Appended]:
        """Append events in a transaction of their own; see `subengine.append`."""
        params = prepare(stream, events, expected_version, self.settings)
        with self.connection(autocommit=True) as conn:  # one statement: its own transaction
            return append_prepared(conn, params, self.settings)

    def read(
        self, stream: str, partition: int, after: int = 0, limit: int | None = None
    ) -> list[Event | Tombstone]:
        """Events of one partition after position `after`, in position order; first a
        `Tombstone` when retention removed positions after `after`."""
        query = _read.read_after(
            stream, partition, after, self.settings.read_limit if limit is None else limit
        )
        with self.connection() as conn:
            return self.sql.run(conn, query)

    def read_since(
        self, stream: str, since: datetime, limit: int | None = None
    ) -> list[Event | Tombstone]:
        """Events of every partition recorded after `since` (not at it), oldest first.

        For finding a starting point by time; to catch up, keep positions and use `read`.
        """
        query = _read.read_since(
            stream, since, self.settings.read_limit if limit is None else limit
        )
        with self.connection() as conn:
            return self.sql.run(conn, query)

    def read_page(
        self, stream: str, positions: Sequence[int], limit: int | None = None
    ) -> _read.Page:
        """Up to `limit` events of every partition after its position in `positions`,
        oldest first across partitions, with the tombstones of the gaps after them and,
        from the same snapshot, the stream's epoch, heads and floors (a read by cursor;
        see `subengine.streams._read.read_page`)."""
        query = _read.read_page(
            stream, positions, self.settings.read_limit if limit is None else limit
        )
        with self.connection() as conn:
            return self.sql.run(conn, query)

    def positions_since(self, stream: str, since: datetime) -> tuple[int, list[int]]:
        """The stream's epoch, and per partition the position just before its first event
        recorded after `since` (0 where retention removed such events)."""
        query = _read.positions_since(stream, since)
        with self.connection() as conn:
            return self.sql.run(conn, query)

    def partitions(self, stream: str) -> list[PartitionState]:
        """Head, head time and floor of every partition of a stream."""
        query = _streams.partition_states(stream)
        with self.connection() as conn:
            return self.sql.run(conn, query)

    @contextmanager
    def db(self) -> Iterator[Db]:
        """`connection()` with the schema's queries: a transaction of its own."""
        with self.connection() as conn:
            yield Db(conn, self.sql)

    # subscriptions

    def ensure_subscription(self, subscription: Subscription) -> None:
        """Store a subscription on first use; raise SubscriptionMismatch if it disagrees."""
        with self.db() as db:
            _subscriptions.ensure_subscription(db, subscription)

    def reset_subscription(self, name: str, to: Start, *, dry_run: bool = False) -> dict[int, int]:
        """Move the positions of subscription `name` to `to` ('beginning', 'end', a time,
        or a map of partition to position, which moves only the partitions it names) in a
        new generation; every partition's position after the reset. With `dry_run`, what
        the reset would do, changing nothing."""
        with self.db() as db:
            return _subscriptions.reset_subscription(db, name, to, dry_run=dry_run)

    def delete_subscription(self, name: str, *, force: bool = False) -> Deleted:
        """Delete a stored subscription with its positions and dead letters, in one
        transaction. Refused while connected workers run it, unless `force` (their
        batches then commit nothing, and they leave it alone)."""
        with self.db() as db:
            return _subscriptions.delete_subscription(db, name, force=force)

    def skip_gap(self, name: str, partition: int) -> Tombstone:
        """Accept the gap retention left before subscription `name`'s position in
        `partition` (state `gap`): record it in the gaps table, move the position past
        it and restart the partition. The gap it passed; InvalidInput if there is none."""
        with self.db() as db:
            return _subscriptions.skip_gap(db, name, partition)

    def subscription_positions(self, name: str) -> list[SubscriptionPosition]:
        """Every partition's position of a stored subscription."""
        with self.connection() as conn:
            return self.sql.run(conn, _subscriptions.positions(name))

    def process_batch(self, subscription: Subscription, partition: int) -> BatchOutcome | None:
        """Handle the next batch of one partition exactly once (see process_batch)."""
        with self._handlers_db(subscription) as db:
            return _batches.process_batch(db, subscription, partition)

    @contextmanager
    def _handlers_db(self, subscription: Subscription, autocommit: bool = False) -> Iterator[Db]:
        """Where a call runs `subscription`'s handlers: a pooled connection in a
        transaction (an autocommit connection of its own, a transaction per step, with
        `autocommit`), or for async handlers an autocommit AsyncConnection in an event
        loop thread of its own, where they are awaited (each step of those calls opens
        its transaction)."""
        if subscription.is_async:
            with loop_db(self.dsn, self.settings.connect_timeout, self.sql) as db:
                yield db
        elif autocommit:
            with self.connect(autocommit=True) as conn:
                yield Db(conn, self.sql)
        else:
            with self.db() as db:
                yield db

    # operating

    def subscriptions(self) -> list[StoredSubscription]:
        """Every stored subscription: name, stream, start, generation, paused, created_at."""
        with self.connection() as conn:
            return self.sql.run(conn, _inspection.subscriptions())

    def subscription_summary(self, name: str | None = None) -> list[SubscriptionSummary]:
        """Per subscription: partitions, lag (events, seconds), states, workers."""
        with self.db() as db:
            return _inspection.summary(db, name)

    def subscription_status(self, name: str | None = None) -> list[PartitionStatus]:
        """The subscription_status view's rows (one per subscription and partition)."""
        with self.db() as db:
            return _inspection.status(db, name)

    def pause_subscription(self, name: str) -> None:
        """Stop workers from taking the subscription's partitions (batches in flight end)."""
        with self.db() as db:
            _inspection.set_paused(db, name, True)

    def resume_subscription(self, name: str) -> list[int]:
        """Lift a pause and restart stopped partitions; the partitions restarted."""
        with self.db() as db:
            return _inspection.set_paused(db, name, False)

    def workers(self) -> list[WorkerStatus]:
        """The workers_status view's rows."""
        with self.connection() as conn:
            return self.sql.run(conn, _inspection.workers())

    def prune_workers(self) -> list[WorkerRegistration]:
        """Remove the registrations of workers that are gone; the rows removed."""
        with self.connection() as conn:
            return self.sql.run(conn, _inspection.prune_workers())

    def dead_letters(self, name: str | None = None, everything: bool = False) -> list[DeadLetter]:
        """Unresolved dead letters (all of them with `everything`), oldest first."""
        query = _inspection.dead_letters(name, everything)
        with self.connection() as conn:
            return self.sql.run(conn, query)

    def retry_dead_letter(
        self, subscription: Subscription, partition: int, position: int
    ) -> str | None:
        """Run a dead letter through the handlers again; None on success, else the error."""
        with self._handlers_db(subscription) as db:
            return _inspection.retry_dead_letter(db, subscription, partition, position)

    def discard_dead_letter(self, name: str, partition: int, position: int) -> None:
        """Mark a dead letter discarded (it stays, resolved)."""
        with self.db() as db:
            _inspection.discard_dead_letter(db, name, partition, position)

    def heads(self, stream: str) -> dict[int, int]:
        """The head (last committed position) of every partition of a stream."""
        query = _streams.heads(stream)
        with self.connection() as conn:
            return self.sql.run(conn, query)

    def tail(
        self,
        stream: str,
        after: Cursor | str | None = None,
        *,
        keys: Iterable[str] | None = None,
        types: Iterable[str] | None = None,
    ) -> Tail:
        """Every event of `stream` after the cursor `after` (None: from the beginning),
        then each new one as it commits: `for event in engine.tail(...)`. `keys` and
        `types` keep only events of those keys and types; `tail.cursor` is where it
        stands. All tails of an engine share one listening connection."""
        return Tail(self, stream, after, keys=keys, types=types)
