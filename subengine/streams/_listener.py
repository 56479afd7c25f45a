"""One LISTEN connection per engine, shared by all its tails (DESIGN.md, "push only wakes").

`append_events` notifies the schema's channel once per partition it appended to, with the
partition's new head. The listener hands each notification to the inboxes of the tails of
that stream; a tail then reads after its cursor. A notification carries no event: a lost
one costs latency, never an event (invariant 5), because every (re)connection of the
listener tells every inbox to look at all heads again (the seed's "one last pull"), and
tails poll besides.

The gateway's API keys are cached by every gateway process; a change of a key notifies
the same channel (`KEYS_CHANGED`), and a `Changes` registered with the listener counts
those notifications and the listener's (re)connections and losses, so that a cache is
trusted only while notifications arrive and nothing changed since it was read. A change
of the webhooks to deliver notifies it too (`WEBHOOKS_CHANGED`): a `Changes` of those
wakes each gateway process's webhook deliveries, which otherwise only poll slowly.

`Listener` runs in a thread, `AsyncListener` in an asyncio task; they share the inboxes'
bookkeeping. Either runs while at least one tail (or `Changes`) is registered and
reconnects after any error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from subengine.db._connection import SessionNeeded, one_line
from subengine.db._sql import SQL
from subengine.model._errors import DatabaseUnavailable
from subengine.streams._streams import listen

log = logging.getLogger("subengine")

# How often a listener, between notifications, looks whether any tail still needs it.
_CHECK_SECONDS = 0.25
# The wait before the first reconnection after an error; doubled up to the longest.
_FIRST_RECONNECT_SECONDS = 0.1
_LONGEST_RECONNECT_SECONDS = 5.0
# The payload of the notification a change of the gateway's API keys sends (sql/queries.sql).
KEYS_CHANGED = "gateway_keys"
# The payload of the notification a change of the webhooks to deliver, or of when their
# supervisor must next look, sends (sql/webhooks.sql).
WEBHOOKS_CHANGED = "gateway_webhooks"


class Changes:
    """What a watcher of one kind of change (`about`: API keys or webhooks) knows of the
    listener: `version` moves whenever what it read may have gone stale (a change of that
    kind was notified, the listener connected, or it lost its connection), and `listening`
    says whether notifications arrive now. A cache trusts an answer only while listening,
    and only at the version it read it at. `wake`, if given, is called at every move (from
    the listener's thread or event loop: it must be thread-safe and quick)."""

    def __init__(self, about: str = KEYS_CHANGED, wake: Callable[[], None] | None = None) -> None:
        self.about = about
        self.version = 0
        self.listening = False
        self._wake = wake

    def _moved(self, listening: bool | None = None) -> None:
        if listening is not None:
            self.listening = listening
        self.version += 1
        if self._wake is not None:
            self._wake()


class Inbox:
    """What a tail learnt since it last looked: new heads of its stream's partitions, and
    whether to look at every head again (`resync`: the listener (re)connected, or a
    notification could not be read)."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self._heads: dict[int, int] = {}
        self._resync = False
        self._closed = False

    def _offer(self, partition: int, head: int) -> None:
        if head > self._heads.get(partition, 0):
            self._heads[partition] = head

    def _take(self) -> tuple[dict[int, int], bool]:
        heads, resync = self._heads, self._resync
        self._heads, self._resync = {}, False
        return heads, resync

    def _ready(self) -> bool:
        return bool(self._heads) or self._resync or self._closed

    @property
    def closed(self) -> bool:
        """True once the listener stopped for good (its engine closed)."""
        return self._closed

    def offer(self, partition: int, head: int) -> None:
        raise NotImplementedError

    def resync(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class ThreadInbox(Inbox):
    """An inbox a thread waits on."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._condition = threading.Condition()

    def offer(self, partition: int, head: int) -> None:
        with self._condition:
            self._offer(partition, head)
            self._condition.notify_all()

    def resync(self) -> None:
        with self._condition:
            self._resync = True
            self._condition.notify_all()

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    def take(self) -> tuple[dict[int, int], bool]:
        """The heads offered and the resync flag since the last take, clearing both."""
        with self._condition:
            return self._take()

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for something to take (or a close)."""
        with self._condition:
            return self._condition.wait_for(self._ready, timeout)


class TaskInbox(Inbox):
    """An inbox a coroutine waits on; offered to from its event loop only. With `ready`,
    the inbox calls it instead, soon (in the loop's next round) after something arrives:
    one call for every notification that arrived meanwhile, and no task of its own."""

    def __init__(self, stream: str, ready: Callable[[], None] | None = None) -> None:
        super().__init__(stream)
        self._event = asyncio.Event()
        self._ready_call = ready
        self._call_due = False

    def _signal(self) -> None:
        self._event.set()
        if self._ready_call is not None and not self._call_due:
            self._call_due = True
            asyncio.get_running_loop().call_soon(self._call)

    def _call(self) -> None:
        self._call_due = False
        assert self._ready_call is not None
        self._ready_call()

    def offer(self, partition: int, head: int) -> None:
        self._offer(partition, head)
        self._signal()

    def resync(self) -> None:
        self._resync = True
        self._signal()

    def close(self) -> None:
        self._closed = True
        self._signal()

    def take(self) -> tuple[dict[int, int], bool]:
        taken = self._take()
        if not self._closed:
            self._event.clear()
        return taken

    async def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for something to take (or a close)."""
        if self._ready():
            return True
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            return False
        return True


class _Inboxes:
    """The inboxes of the registered tails, by stream."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_stream: dict[str, set[Inbox]] = {}
        self._changes: set[Changes] = set()
        self._closed = False
        # how often the listener connected and began to LISTEN (for the metrics)
        self.connects = 0

    def _add(self, inbox: Inbox) -> None:
        # under the lock
        if self._closed:
            raise DatabaseUnavailable("the engine of this tail is closed")
        self._by_stream.setdefault(inbox.stream, set()).add(inbox)

    def _close_inboxes(self) -> None:
        """Refuse new tails and end every registered one (the listener then stops)."""
        with self._lock:
            self._closed = True
            inboxes = [inbox for found in self._by_stream.values() for inbox in found]
            self._by_stream.clear()
            changes, self._changes = list(self._changes), set()
        for inbox in inboxes:
            inbox.close()
        for change in changes:
            change._moved(listening=False)

    def _add_changes(self, about: str, wake: Callable[[], None] | None) -> Changes:
        # under the lock
        if self._closed:
            raise DatabaseUnavailable("the engine of this listener is closed")
        changes = Changes(about, wake)
        self._changes.add(changes)
        return changes

    def unwatch_changes(self, changes: Changes) -> None:
        """Stop counting for `changes` (the listener stops once nothing else needs it)."""
        with self._lock:
            self._changes.discard(changes)
        changes._moved(listening=False)

    def _wanted(self) -> bool:
        # under the lock
        return bool(self._by_stream or self._changes)

    def _listening(self, listening: bool) -> None:
        """The listener connected (and listens) or lost its connection: every cached
        answer may be stale."""
        with self._lock:
            changes = list(self._changes)
        for change in changes:
            change._moved(listening)

    def unregister(self, inbox: Inbox) -> None:
        """Stop delivering to `inbox` (the listener stops once no inbox is left)."""
        with self._lock:
            inboxes = self._by_stream.get(inbox.stream)
            if inboxes is not None:
                inboxes.discard(inbox)
                if not inboxes:
                    del self._by_stream[inbox.stream]

    def _all(self) -> list[Inbox]:
        with self._lock:
            return [inbox for inboxes in self._by_stream.values() for inbox in inboxes]

    def resync_all(self) -> None:
        for inbox in self._all():
            inbox.resync()

    def deliver(self, payload: str) -> None:
        """Hand a notification's new head to the inboxes of its stream."""
        if payload in (KEYS_CHANGED, WEBHOOKS_CHANGED):
            with self._lock:
                changes = [change for change in self._changes if change.about == payload]
            for change in changes:
                change._moved()
            return
        try:
            notice = json.loads(payload)
            stream, partition, head = notice["stream"], notice["partition"], notice["head"]
            if not (isinstance(partition, int) and isinstance(head, int)):
                raise TypeError("partition and head must be integers")
        except (ValueError, TypeError, KeyError):
            # not ours to read: whatever it meant, every tail looks at every head again
            log.warning("subengine: a notification that is not an append's: %.200r", payload)
            self.resync_all()
            return
        with self._lock:
            inboxes = list(self._by_stream.get(stream, ()))
        for inbox in inboxes:
            inbox.offer(partition, head)


def _failed(error: Exception, delay: float) -> None:
    log.warning(
        "subengine: the tails' listening connection failed (%s); reconnecting in %g s",
        one_line(str(error)),
        delay,
        exc_info=not isinstance(error, psycopg.OperationalError),
    )


_no_push_said = threading.Event()


def _no_push(error: SessionNeeded) -> None:
    """Say once per process that no notification will come: the connection LISTEN needs
    goes through a pooler and no direct one is set (docs/pooler.md)."""
    if not _no_push_said.is_set():
        _no_push_said.set()
        log.warning(
            "subengine: %s. Until then tails and the gateway get no notifications: they "
            "find new events by polling (SUBENGINE_POLL_INTERVAL), and API keys are read "
            "for every request",
            error,
        )


class Listener(_Inboxes):
    """The LISTEN connection of a sync engine's tails, in a daemon thread."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], sql: SQL) -> None:
        super().__init__()
        self._connect = connect
        self._sql = sql
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()  # cuts a wait before reconnecting short

    def register(self, stream: str) -> ThreadInbox:
        """A new inbox for a tail of `stream`; starts the listener if it is not running."""
        inbox = ThreadInbox(stream)
        with self._lock:
            self._add(inbox)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="subengine-tail-listener", daemon=True
                )
                self._thread.start()
        return inbox

    def _needed(self) -> bool:
        with self._lock:
            if not self._wanted():
                self._thread = None  # under the lock: a new registration starts a new thread
                return False
            return True

    def close(self) -> None:
        """End every tail, refuse new ones, and stop listening."""
        self._close_inboxes()
        self._stopped.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=4 * _CHECK_SECONDS)

    def _run(self) -> None:
        delay = _FIRST_RECONNECT_SECONDS
        while self._needed():
            try:
                with self._connect() as conn:
                    self._sql.run(conn, listen())
                    self.connects += 1
                    delay = _FIRST_RECONNECT_SECONDS
                    # anything committed while no connection listened: pull again
                    self.resync_all()
                    self._listening(True)
                    while self._needed():
                        for notification in conn.notifies(timeout=_CHECK_SECONDS):
                            self.deliver(notification.payload)
            except SessionNeeded as error:  # a pooler between us and PostgreSQL
                self._listening(False)
                _no_push(error)
                while self._needed() and not self._stopped.wait(_LONGEST_RECONNECT_SECONDS):
                    pass
                return
            except Exception as error:
                self._listening(False)
                _failed(error, delay)
                self._stopped.wait(delay)
                delay = min(2 * delay, _LONGEST_RECONNECT_SECONDS)
            else:
                return


class AsyncListener(_Inboxes):
    """The LISTEN connection of an `AsyncEngine`'s tails, in an asyncio task."""

    def __init__(
        self, connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]], sql: SQL
    ) -> None:
        super().__init__()
        self._connect = connect
        self._sql = sql
        self._task: asyncio.Task[None] | None = None

    def register(self, stream: str, ready: Callable[[], None] | None = None) -> TaskInbox:
        """A new inbox for a tail of `stream` (calling `ready` when something arrives, if
        given: see `TaskInbox`); starts the listener if it is not running. Call it from
        the event loop the tail runs in."""
        inbox = TaskInbox(stream, ready)
        with self._lock:
            self._add(inbox)
            self._start()
        return inbox

    def watch_changes(
        self, about: str = KEYS_CHANGED, wake: Callable[[], None] | None = None
    ) -> Changes:
        """A count of the changes of one kind (`about`: the gateway's API keys, or
        `WEBHOOKS_CHANGED`) and of this listener's connection, kept from now until
        `unwatch_changes`, calling `wake` at each; starts the listener if it is not
        running. Call it from the event loop the listener runs in."""
        with self._lock:
            changes = self._add_changes(about, wake)
            self._start()
        return changes

    def _start(self) -> None:
        # under the lock
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="subengine-tail-listener"
            )

    def _needed(self) -> bool:
        with self._lock:
            if not self._wanted():
                self._task = None
                return False
            return True

    async def close(self) -> None:
        """End every tail, refuse new ones, and stop listening now."""
        self._close_inboxes()
        with self._lock:
            task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the close itself was cancelled, not only the listener

    async def _run(self) -> None:
        delay = _FIRST_RECONNECT_SECONDS
        while self._needed():
            try:
                async with await self._connect() as conn:
                    await self._sql.run_async(conn, listen())
                    self.connects += 1
                    delay = _FIRST_RECONNECT_SECONDS
                    self.resync_all()
                    self._listening(True)
                    while self._needed():
                        async for notification in conn.notifies(timeout=_CHECK_SECONDS):
                            self.deliver(notification.payload)
            except SessionNeeded as error:  # a pooler between us and PostgreSQL
                self._listening(False)
                _no_push(error)
                while self._needed():
                    await asyncio.sleep(_LONGEST_RECONNECT_SECONDS)
                return
            except Exception as error:
                self._listening(False)
                _failed(error, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, _LONGEST_RECONNECT_SECONDS)
            else:
                return
