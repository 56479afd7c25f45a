"""The live tail: every event of a stream, from a cursor on, as it commits.

The seed's durable subscription, with push only waking (DESIGN.md, the gateway's first
principle): a tail pulls by position until it has read every head it knows of, then waits
for its engine's listener to offer a new head (or for the poll interval, the safety net),
and pulls again. Every (re)connection of the listener makes the tail read all heads again:
the "one last pull" after the subscription started. Events come only from reads after the
cursor, and any position at or below the cursor is dropped, so a position is never
skipped (positions are dense and commit in order, invariant 1) and never repeated. A
read that starts below a partition's floor yields a `Tombstone` for exactly the removed
positions before the events after them.

`TailState` is that bookkeeping, without I/O; `Tail` (sync) and `AsyncTail` run it on an
engine's connections.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Protocol

import psycopg

from subengine.db._sql import SQL, Query
from subengine.model._cursor import Cursor
from subengine.model._errors import InvalidInput
from subengine.model._events import Event, Tombstone
from subengine.model._names import validate_key, validate_stream_name, validate_type
from subengine.model._settings import Settings
from subengine.streams import _read, _streams
from subengine.streams._listener import AsyncListener, Listener, TaskInbox

After = Cursor | str | None
# what a tail yields: an event, or the tombstone of a gap before the next ones
Item = Event | Tombstone


def _filter(
    values: Iterable[str] | None, what: str, validate: Callable[[object], str]
) -> frozenset[str] | None:
    if values is None:
        return None
    if isinstance(values, str):
        raise InvalidInput(f"{what} must be a collection of {what}, not one string")
    return frozenset(validate(value) for value in values)


class TailState:
    """Where a tail stands and what it knows: the cursor, the heads it learnt, and the
    events read but not yet delivered."""

    def __init__(
        self,
        stream: str,
        after: After,
        keys: Iterable[str] | None,
        types: Iterable[str] | None,
        read_limit: int,
    ) -> None:
        validate_stream_name(stream)
        if isinstance(after, str):
            after = Cursor.parse(after)
        elif after is None:
            after = Cursor(stream)
        elif not isinstance(after, Cursor):
            raise InvalidInput(f"after must be a Cursor, its text or None, not {after!r}")
        if after.stream != stream:
            raise InvalidInput(f"the cursor is of stream {after.stream!r}, not {stream!r}")
        self.stream = stream
        self.keys = _filter(keys, "keys", validate_key)
        self.types = _filter(types, "types", validate_type)
        self.read_limit = read_limit
        self._positions = list(after.positions)
        self._cursor: Cursor | None = after
        # the partition count, once the stream's heads were read (or the cursor's own)
        self.partitions = len(self._positions) or None
        self._known: dict[int, int] = {}  # committed heads learnt, per partition
        self.look_at_heads = True  # read every head before trusting `_known`
        self._unread: deque[Item] = deque()
        self._read_last = -1  # the partition read last

    @property
    def cursor(self) -> Cursor:
        if self._cursor is None:
            self._cursor = Cursor(self.stream, tuple(self._positions))
        return self._cursor

    def next_event(self) -> Item | None:
        """The next event read and wanted, or a gap (a tombstone, whatever the filters:
        the gap may have held wanted events); the cursor moves past those passed over."""
        while self._unread:
            event = self._unread.popleft()
            if event.position <= self._positions[event.partition]:
                continue  # seen already
            self._positions[event.partition] = event.position
            self._cursor = None
            if isinstance(event, Tombstone):
                return event
            if (self.keys is None or event.key in self.keys) and (
                self.types is None or event.type in self.types
            ):
                return event
        return None

    def learn(self, heads: dict[int, int]) -> None:
        """Heads the listener offered."""
        for partition, head in heads.items():
            if partition >= 0 and head > self._known.get(partition, 0):
                self._known[partition] = head

    def heads_query(self) -> Query[dict[int, int]]:
        return _streams.heads(self.stream)

    def learn_all(self, heads: dict[int, int]) -> None:
        """Every head, as the heads query read them."""
        if self.partitions is None:
            self.partitions = len(heads)
            self._positions = [0] * self.partitions
            self._cursor = None
        elif len(heads) != self.partitions:
            raise InvalidInput(
                f"the cursor has {self.partitions} positions, but stream {self.stream!r} "
                f"has {len(heads)} partitions"
            )
        self.learn(heads)
        self.look_at_heads = False

    def behind(self) -> list[int]:
        """The partitions with a known head past the cursor, to read now (none while
        events read earlier are still to be delivered), from the one after the partition
        read last, so that a busy partition cannot keep the others waiting."""
        partitions = self.partitions
        if self._unread or partitions is None:
            return []
        start = self._read_last + 1
        return sorted(
            (
                p
                for p, head in self._known.items()
                if p < partitions and head > self._positions[p]  # not of an older stream
            ),
            key=lambda p: (p - start) % partitions,
        )

    def full(self) -> bool:
        """Whether enough events wait to be delivered to stop reading for now: a tail
        far behind holds about one read's worth, however many partitions are behind."""
        return len(self._unread) >= self.read_limit

    def read_query(self, partition: int) -> Query[list[Item]]:
        return _read.read_after(self.stream, partition, self._positions[partition], self.read_limit)

    def read(self, partition: int, events: list[Item]) -> None:
        """What a read of `partition` after the cursor gave."""
        self._read_last = partition
        self._unread.extend(events)
        if len(events) < self.read_limit:
            # everything committed up to the read: the head is its last event (the same
            # as any head learnt before the read began, which a notification sent after
            # its commit told of)
            self._known[partition] = events[-1].position if events else self._positions[partition]

    def has_work(self) -> bool:
        return self.look_at_heads or bool(self.behind())


class SyncSource(Protocol):
    """What a sync tail needs of its engine (`Engine` is one)."""

    settings: Settings
    sql: SQL

    def connection(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...

    @property
    def listener(self) -> Listener: ...


LISTENER_APPLICATION_NAME = "subengine-tail"


class AsyncSource(Protocol):
    """What an async tail needs of its engine (`AsyncEngine` is one)."""

    settings: Settings
    sql: SQL

    def connection(self) -> AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]: ...

    @property
    def listener(self) -> AsyncListener: ...


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


class Tail:
    """Every event of a stream after a cursor, live: `for event in engine.tail(...)`.

    `cursor` is where the tail stands after the event it last gave (filtered-out events
    move it too): store it with what the event changed, and `engine.tail(stream,
    after=cursor)` resumes. `next_event(timeout)` waits at most `timeout` seconds.
    Iteration ends only when the tail is closed (`close()`, from any thread).
    """

    def __init__(
        self,
        engine: SyncSource,
        stream: str,
        after: After = None,
        *,
        keys: Iterable[str] | None = None,
        types: Iterable[str] | None = None,
    ) -> None:
        self._state = TailState(stream, after, keys, types, engine.settings.read_limit)
        self._engine = engine
        self._poll_interval = engine.settings.poll_interval
        self._next_poll = 0.0
        listener = engine.listener
        self._inbox = listener.register(stream)
        self._closed = False
        self._unregister = weakref.finalize(self, listener.unregister, self._inbox)

    @property
    def cursor(self) -> Cursor:
        """Where the tail stands: the last position given or passed over, per partition."""
        return self._state.cursor

    def close(self) -> None:
        """Stop the tail (an iteration in another thread ends)."""
        self._closed = True
        self._inbox.close()
        self._unregister()

    def __enter__(self) -> Tail:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Item]:
        return self

    def __next__(self) -> Item:
        event = self.next_event()
        if event is None:
            raise StopIteration
        return event

    def next_event(self, timeout: float | None = None) -> Item | None:
        """The next event; None when `timeout` seconds passed first, or the tail closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        state = self._state
        while not self._closed and not self._inbox.closed:
            event = state.next_event()
            if event is not None:
                return event
            heads, resync = self._inbox.take()
            state.learn(heads)
            if resync or time.monotonic() >= self._next_poll:
                state.look_at_heads = True
            if state.has_work():
                self._pull()
                continue
            remaining = _remaining(deadline)
            if remaining is not None and remaining <= 0:
                return None
            wait = self._next_poll - time.monotonic()
            self._inbox.wait(wait if remaining is None else min(wait, remaining))
        return None

    def _pull(self) -> None:
        state, sql = self._state, self._engine.sql
        with self._engine.connection() as conn:
            if state.look_at_heads:
                self._next_poll = time.monotonic() + self._poll_interval
                state.learn_all(sql.run(conn, state.heads_query()))
            for partition in state.behind():
                if state.full():
                    break
                state.read(partition, sql.run(conn, state.read_query(partition)))


class AsyncTail:
    """`Tail` for asyncio: `async for event in async_engine.tail(...)`."""

    def __init__(
        self,
        engine: AsyncSource,
        stream: str,
        after: After = None,
        *,
        keys: Iterable[str] | None = None,
        types: Iterable[str] | None = None,
    ) -> None:
        self._state = TailState(stream, after, keys, types, engine.settings.read_limit)
        self._engine = engine
        self._listener = engine.listener
        self._poll_interval = engine.settings.poll_interval
        self._next_poll = 0.0
        self._closed = False
        self._inbox: TaskInbox | None = None  # registered on first use, in its event loop
        self._unregister: weakref.finalize[Any, Any] | None = None

    @property
    def cursor(self) -> Cursor:
        """Where the tail stands: the last position given or passed over, per partition."""
        return self._state.cursor

    def close(self) -> None:
        """Stop the tail (an iteration waiting in another task ends)."""
        self._closed = True
        if self._inbox is not None:
            self._inbox.close()
        if self._unregister is not None:
            self._unregister()

    async def __aenter__(self) -> AsyncTail:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __aiter__(self) -> AsyncIterator[Item]:
        return self

    async def __anext__(self) -> Item:
        event = await self.next_event()
        if event is None:
            raise StopAsyncIteration
        return event

    async def next_event(self, timeout: float | None = None) -> Item | None:
        """The next event; None when `timeout` seconds passed first, or the tail closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        state = self._state
        if self._inbox is None:
            self._inbox = self._listener.register(state.stream)
            self._unregister = weakref.finalize(self, self._listener.unregister, self._inbox)
            if self._closed:
                self.close()
        while not self._closed and not self._inbox.closed:
            event = state.next_event()
            if event is not None:
                return event
            heads, resync = self._inbox.take()
            state.learn(heads)
            if resync or time.monotonic() >= self._next_poll:
                state.look_at_heads = True
            if state.has_work():
                await self._pull()
                continue
            remaining = _remaining(deadline)
            if remaining is not None and remaining <= 0:
                return None
            wait = self._next_poll - time.monotonic()
            await self._inbox.wait(wait if remaining is None else min(wait, remaining))
        return None

    async def _pull(self) -> None:
        state, sql = self._state, self._engine.sql
        async with self._engine.connection() as conn:
            if state.look_at_heads:
                self._next_poll = time.monotonic() + self._poll_interval
                state.learn_all(await sql.run_async(conn, state.heads_query()))
            for partition in state.behind():
                if state.full():
                    break
                state.read(partition, await sql.run_async(conn, state.read_query(partition)))
