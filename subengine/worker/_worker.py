"""The worker: competing consumers of subscriptions (DESIGN.md, Consume flow).

Each of `concurrency` slots loops: look for partitions with work, oldest next event
first; take the first one whose advisory lock it gets (on a lock connection of the slot's
own, which also runs the look); handle one batch; go on with the oldest of the partitions
it found, switching locks, and look again when something new may have come; wait when
there is nothing to do. One poller per worker process tells the slots when to look: it
listens for notifications, which say which partition grew, and once per poll interval
compares the heads it knows with the database's and asks whether any partition has work
(its only statement when the worker is idle, and the heartbeat too). Locks only keep
workers from wasting effort on one partition: correctness comes from the position row
lock and compare-and-set in every batch (invariants 3 and 5).

The look costs what the work costs, not what the (subscription, partition) pairs do: a
position row whose partition has events after it carries the next event's time
(`next_time`, kept by every statement that moves a position, and indexed), except when
the events came after the row's last write; those appends are the partitions the poller
learned about, the suspects, which the next look checks and marks.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import psycopg
import sqlalchemy.exc

from subengine.db._locks import lock_key, lock_partition, unlock_partition
from subengine.db._sql import SQL, Db, Query, first_row
from subengine.engine._engine import Engine
from subengine.model._declarations import Subscription
from subengine.model._errors import (
    DatabaseUnavailable,
    Fenced,
    PositionsMissing,
    RetryLater,
    SubscriptionNotFound,
)
from subengine.model._events import Tombstone
from subengine.model._settings import Settings
from subengine.streams._retention import PartitionCut
from subengine.streams._streams import listen
from subengine.subscriptions import _inspection
from subengine.subscriptions._subscriptions import (
    BatchFailed,
    BatchOutcome,
    Failure,
    ensure_subscription,
    error_text,
    handle_batch,
    look_for_work,
    postpone_batch,
    record_failure,
)
from subengine.worker import _metrics

log = logging.getLogger("subengine.worker")

T = TypeVar("T")

# Candidates fetched per look for work: enough that busy partitions locked by other
# workers do not hide the free ones.
_CANDIDATES_PER_SLOT = 4
# Partitions of the same subscription a transactional batch may carry besides the chosen
# one (up to the batch size in events): with many partitions of few events each, a
# transaction per partition would cost more than the events.
_COMPANIONS = 8
_RECONNECT_DELAY_SECONDS = 1.0
# How often the poller, between notifications, checks whether the worker is stopping.
_LISTEN_CHECK_SECONDS = 0.25


class _Board:
    """What the poller knows of where work may have come: the head of every partition of
    the streams the worker reads, and the suspects, the (subscription, partition) pairs
    whose partition grew since a look last checked them (or whole subscriptions, after a
    (re)connection, when anything may have happened). Shared by the poller, which adds
    suspects, and the slots, whose looks take them."""

    def __init__(self, subscriptions: Sequence[Subscription]) -> None:
        self._lock = threading.Lock()
        self._names: dict[str, list[str]] = {}
        for subscription in subscriptions:
            self._names.setdefault(subscription.stream, []).append(subscription.name)
        self._heads: dict[tuple[str, int], int] = {}
        self._pairs: set[tuple[str, int]] = set()
        self._whole: set[str] = set()
        # suspects whose rows a batch held when a look came: for the look after a batch
        # ends or after the next poll, not the very next one (which would only spin)
        self._deferred: set[tuple[str, int]] = set()
        # heads that grew so far, and when each partition's head last grew (that count)
        self._news = 0
        self._grown: dict[tuple[str, int], int] = {}

    @property
    def streams(self) -> list[str]:
        return sorted(self._names)

    def grew(self, stream: str, partition: int, head: int) -> bool:
        """A partition's head is at least `head` (a notification): whether that is news,
        in which case its pairs are suspects."""
        with self._lock:
            return self._grew(stream, partition, head)

    def _grew(self, stream: str, partition: int, head: int) -> bool:
        names = self._names.get(stream)
        known = self._heads.get((stream, partition), 0)
        if names is None or head <= known:
            return False
        self._heads[stream, partition] = head
        self._news += 1
        self._grown[stream, partition] = self._news
        self._pairs.update((name, partition) for name in names)
        return True

    def news(self) -> int:
        """How many heads grew so far: for `grew_since`."""
        with self._lock:
            return self._news

    def grew_since(self, name: str, stream: str, partitions: Sequence[int], news: int) -> bool:
        """Partitions of subscription `name` a batch moved (or tried to): those whose head
        grew since `news` (a `news()` from before the batch) become suspects again;
        whether any did. The batch stored their next_time (NULL when drained) from a
        snapshot that may predate those appends, and a look that took them as suspects
        before its commit saw their rows as they were (a next_time, so nothing to mark)
        and dropped them: with no later append, no look would ever find their events."""
        with self._lock:
            again = [
                (name, partition)
                for partition in partitions
                if self._grown.get((stream, partition), 0) > news
            ]
            self._pairs.update(again)
            return bool(again)

    def heads_read(self, heads: list[tuple[str, int, int]], everything: bool) -> bool:
        """Every head of some streams, read from the database: the partitions that grew
        become suspects (all pairs when `everything`: nothing is known); whether any did."""
        with self._lock:
            grown = [self._grew(stream, partition, head) for stream, partition, head in heads]
            if everything:
                for names in self._names.values():
                    self._whole.update(names)
            return any(grown) or everything

    def differs(self, totals: dict[str, int]) -> list[str]:
        """The streams whose sum of heads in the database is not the one known: some
        of their partitions grew without a notification (yet)."""
        with self._lock:
            known = dict.fromkeys(self._names, 0)
            for (stream, _), head in self._heads.items():
                known[stream] += head
            return [s for s in self._names if totals.get(s, 0) != known[s]]

    def take(self) -> tuple[list[tuple[str, int]], list[str]]:
        """The suspects, for a look, which is now responsible for them."""
        with self._lock:
            pairs, whole = sorted(self._pairs), sorted(self._whole)
            self._pairs.clear()
            self._whole.clear()
            return pairs, whole

    def take_few(self, limit: int) -> list[tuple[str, int]]:
        """Up to `limit` suspects, for a slot that takes them without a look, when the
        suspects are only pairs (a notification's, not a reconnection's); the others
        stay for the other slots and the looks."""
        with self._lock:
            if self._whole or not self._pairs:
                return []
            pairs = sorted(self._pairs)[:limit]
            self._pairs.difference_update(pairs)
            return pairs

    def put_back(self, pairs: Sequence[tuple[str, int]], whole: Sequence[str] = ()) -> None:
        """Suspects a failed look took, for the next one."""
        if pairs or whole:
            with self._lock:
                self._pairs.update(pairs)
                self._whole.update(whole)

    def defer(self, pairs: Sequence[tuple[str, int]]) -> None:
        """Suspects a batch held when a look came."""
        if pairs:
            with self._lock:
                self._deferred.update(pairs)

    def retry_deferred(self) -> bool:
        """Make the deferred suspects suspects again (a batch ended, or a poll came);
        whether there were any."""
        with self._lock:
            if not self._deferred:
                return False
            self._pairs.update(self._deferred)
            self._deferred.clear()
            return True

    def pending(self) -> bool:
        with self._lock:
            return bool(self._pairs or self._whole)


class _Wakeup:
    """A counter of notifications that idle slots wait on; no wake-up is lost between
    a slot's look for work and its wait, because it waits only if the count is unchanged."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._count = 0

    def count(self) -> int:
        with self._condition:
            return self._count

    def notify(self) -> None:
        with self._condition:
            self._count += 1
            self._condition.notify_all()

    def wait(self, seen: int, timeout: float | None) -> bool:
        """Wait for a notification after `seen` (at most `timeout` seconds, None: no
        limit); False when the timeout came first."""
        with self._condition:
            if self._count == seen:
                self._condition.wait(timeout)
            return self._count != seen


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A (subscription, partition) with work, and the time of its next event (a look
    finds only rows that know it)."""

    key: tuple[str, int]
    next_time: datetime


class _Held:
    """A slot's partition lock: the one it holds between batches (and whether that
    partition had work left after the last one), on a lock connection of the slot's own.

    Invariant 7 makes a slot switch partitions after a batch whenever an older event
    waits elsewhere, so a switch must be cheap: one statement takes the new lock and
    releases the old one. The connection is in autocommit mode, so it never sits idle in
    a transaction; its locks are session locks, gone if it ends.
    """

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], sql: SQL) -> None:
        self._connect = connect
        self._sql = sql
        self._conn: psycopg.Connection[Any] | None = None
        self.key: tuple[str, int] | None = None
        self.has_work = False
        self._lock_key: int | None = None

    def run(self, query: Callable[[], Query[T]]) -> T:
        """Run a statement on the lock connection. A connection the server ended took
        the held lock with it (another worker may hold it now): it is forgotten, and the
        statement is made again and runs once more on a new connection."""
        for attempt in (1, 2):
            if self._conn is None or self._conn.closed:
                self.close()
                self._conn = self._connect()
                self._sql.run(self._conn, Query("worker_connection_settings", {}, first_row))
            try:
                return self._sql.run(self._conn, query())
            except psycopg.OperationalError:
                self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def try_lock(self, key: tuple[str, int], lock_key: int) -> bool:
        """Take the lock of `key` (keyed `lock_key`) and hold it instead of the one held."""
        if not self.run(lambda: lock_partition(lock_key, self._lock_key)):
            return False
        self.key, self._lock_key, self.has_work = key, lock_key, True
        return True

    def release(self) -> None:
        if self._lock_key is None:
            return
        lock_key = self._lock_key
        self._forget()
        try:
            if self._conn is not None:
                self._sql.run(self._conn, unlock_partition(lock_key))
        except psycopg.Error as error:  # the connection is gone, and the lock with it
            log.info("a partition lock's connection was gone (%s); so is the lock", error)
            self.close()

    def close(self) -> None:
        """Forget the lock and close the connection (which ends its locks)."""
        self._forget()
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    def _forget(self) -> None:
        self.key, self._lock_key = None, None


class _Backoff:
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


class _ConnectionLost(psycopg.OperationalError):
    """A slot's connection broke during a batch; the slot reconnects."""


class Worker:
    """Runs the handlers of some subscriptions until `stop` is set."""

    def __init__(
        self,
        engine: Engine,
        subscriptions: Sequence[Subscription],
        concurrency: int = 1,
        listen: bool = True,
        metrics_port: int | None = None,
        metrics_address: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.engine = engine
        self.settings = engine.settings
        self.schema = engine.schema
        self.subscriptions = {s.name: s for s in subscriptions}
        self.streams = {s.stream for s in subscriptions}
        self.concurrency = concurrency
        self.listen = listen
        self.id = uuid.uuid4()
        self.wakeup = _Wakeup()
        self._board = _Board(subscriptions)
        self._look_limit = concurrency * _CANDIDATES_PER_SLOT
        self.metrics = _metrics.WorkerMetrics(list(self.subscriptions))
        self.metrics_port = metrics_port
        self.metrics_address = metrics_address
        # every connection of the worker carries it: the status views find the worker's
        # connections, and the holder of each partition lock, by it
        self.application_name = f"subengine worker {self.id}"
        self._backoff = _Backoff(self.settings)
        # subscriptions deleted while the worker runs: it leaves them alone
        self._left: set[str] = set()
        # set by a slot or the poller that gave up on the database; run() raises it
        self.fatal: Exception | None = None
        self._stopping = False

    # the run

    def run(self, stop: threading.Event) -> None:
        """Work until `stop` is set; the current batches finish and every lock is released."""
        with self.engine.db() as db:
            for subscription in self.subscriptions.values():
                ensure_subscription(db, subscription)
            pruned = db.run(_inspection.prune_workers())
            db.run(_inspection.register_worker(self._registration()))
        if pruned:
            log.info(
                "removed the registrations of %s workers that are gone (pids %s)",
                len(pruned),
                ", ".join(str(row.pid) for row in pruned),
                extra=self._fields(),
            )
        if self.metrics_port is not None:
            try:
                self.metrics.serve(self.metrics_port, self.metrics_address)
            except Exception:
                self._unregister()
                raise
        log.info(
            "worker %s (pid %s) started: subscriptions %s, concurrency %s%s",
            self.id,
            os.getpid(),
            ", ".join(f"{s.name} ({s.stream})" for s in self.subscriptions.values()),
            self.concurrency,
            "" if self.metrics.port is None else f", metrics on port {self.metrics.port}",
            extra=self._fields(
                subscriptions=list(self.subscriptions),
                concurrency=self.concurrency,
                pid=os.getpid(),
                metrics_port=self.metrics.port,
            ),
        )
        threads = [
            threading.Thread(target=self._poll, args=(stop,), daemon=True, name="poller"),
            threading.Thread(target=self._wake_on_stop, args=(stop,), daemon=True),
            threading.Thread(target=self._progress, args=(stop,), daemon=True),
        ]
        if self.settings.retention_interval:
            threads.append(
                threading.Thread(target=self._prune, args=(stop,), daemon=True, name="pruner")
            )
        slots = [
            threading.Thread(target=self._slot, args=(stop,), name=f"slot-{n}")
            for n in range(self.concurrency)
        ]
        for thread in threads + slots:
            thread.start()
        try:
            for slot in slots:
                slot.join()
        finally:
            stop.set()
            self.wakeup.notify()
            for slot in slots:
                slot.join()
            for thread in threads:  # each notices `stop` soon, unless a connect hangs
                thread.join(timeout=_RECONNECT_DELAY_SECONDS)
            self._unregister()
            self.metrics.close()
        if self.fatal is not None:
            raise self.fatal

    def _registration(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "names": list(self.subscriptions),
            "serves_metrics": self.metrics_port is not None,
        }

    def _unregister(self) -> None:
        try:
            with self.engine.connect(application_name=self.application_name) as conn:
                self.engine.sql.run(conn, _inspection.unregister_worker(self.id))
        except psycopg.OperationalError as error:  # the row is for inspection only
            log.warning("could not unregister the worker: %s", error, extra=self._fields())

    # one slot

    def _slot(self, stop: threading.Event) -> None:
        outage_since: float | None = None
        held = _Held(
            lambda: self.engine.connect(application_name=self.application_name, autocommit=True),
            self.engine.sql,
        )
        try:
            while not stop.is_set():
                try:
                    with self.engine.connect(application_name=self.application_name) as conn:
                        outage_since = None
                        self._work(Db(conn, self.engine.sql), held, stop)
                except (psycopg.OperationalError, sqlalchemy.exc.OperationalError) as error:
                    outage_since = outage_since or time.monotonic()
                    if self._gave_up(outage_since, error, stop):
                        return
                    log.warning(
                        "database connection lost: %s; reconnecting", error, extra=self._fields()
                    )
                    stop.wait(_RECONNECT_DELAY_SECONDS)
                except Exception as error:  # looking for work failed: not one partition's
                    log.exception("worker slot failed; stopping the worker")
                    self.fatal = error
                    stop.set()
                    return
                finally:
                    held.release()
        finally:
            held.close()

    def _work(self, db: Db, held: _Held, stop: threading.Event) -> None:
        """Look for work and handle the partition whose next event is oldest, one batch at
        a time (invariant 7). After each batch the slot goes on with the oldest of the
        partitions the look found, its own included; it looks again when the poller woke
        it or has suspects, after a poll interval, or when the partitions found run out.
        It waits for the poller when nothing can be taken, and after draining a partition
        when nothing new can have come (still holding that partition's lock: the next
        event there needs no lock statement).
        """
        while not stop.is_set():
            seen = self.wakeup.count()
            queue = self._look(held)
            # a full look may have left out partitions with work: look again when the
            # ones it found are used up
            cut_off = len(queue) == self._look_limit
            looked_at = time.monotonic()
            chosen = self._choose(queue, held)
            self.metrics.looked_for_work(chosen is not None)
            if chosen is None:
                self._idle(db, held, stop, seen)
                continue
            while chosen is not None and not stop.is_set():
                name, partition = chosen
                next_time, drained, moved = self._take_turn(
                    db, self.subscriptions[name], partition, stop
                )
                if moved:  # a batch carried them: the look's times for them are old
                    queue[:] = [c for c in queue if c.key not in moved]
                held.has_work = next_time is not None
                if next_time is None and not drained:
                    held.release()  # halted: nothing for this slot to keep
                if (
                    (cut_off and not queue)
                    or self.wakeup.count() != seen
                    or self._board.pending()
                    or time.monotonic() - looked_at >= self.settings.poll_interval
                ):
                    break  # look again
                if next_time is None:
                    if queue:  # on to the next partition the look found
                        chosen = self._choose(queue, held)
                        continue
                    if drained:
                        self._idle(db, held, stop, seen)
                    break  # look again
                if queue and queue[0].next_time < next_time:
                    # an older event waits elsewhere: go there, and come back in its turn
                    bisect.insort(queue, _Candidate(chosen, next_time), key=lambda c: c.next_time)
                    chosen = self._choose(queue, held)

    def _idle(self, db: Db, held: _Held, stop: threading.Event, seen: int) -> None:
        """Nothing to do: wait for news after `seen`, then take what a notification
        brought, if that is all there is."""
        self._wait(seen)
        self._take_notified(db, held, stop)

    def _take_notified(self, db: Db, held: _Held, stop: threading.Event) -> None:
        """After a wait with nothing to do: when what woke the slot is a few partitions
        that grew (a notification), handle them before looking, one batch each. The slot
        knew of no other work, and the events that woke it are the newest there are, so
        taking them first passes no older event (invariant 7); it saves a look before
        the handler runs. Every partition it does not drain (it cannot lock it, it waits
        out an error or a retry, it is stopped or paused, or the slot stops) goes back
        to the board for the look, which comes next and marks its row: a row the fast
        path leaves must not stay unmarked, or no look would find its events."""
        pairs = self._board.take_few(_CANDIDATES_PER_SLOT)
        for n, key in enumerate(pairs):
            drained = False
            try:
                if stop.is_set() or key[0] in self._left or self._backoff.waiting(key):
                    continue
                if key != held.key and not held.try_lock(key, lock_key(self.schema, *key)):
                    continue
                next_time, drained, _ = self._take_turn(
                    db, self.subscriptions[key[0]], key[1], stop
                )
                held.has_work = next_time is not None
                if next_time is None and not drained:
                    held.release()  # halted: nothing for this slot to keep
            except BaseException:
                self._board.put_back(pairs[n:])
                raise
            finally:
                if not drained:
                    self._board.put_back([key])

    def _wait(self, seen: int) -> None:
        """Wait until the poller (or a slot) has news after `seen`, unless the board
        has suspects already, or a partition's backoff ends first."""
        if self._board.pending():
            return
        timeout = self._backoff.next_retry_in()
        self.wakeup.wait(seen, None if math.isinf(timeout) else timeout)

    def _look(self, held: _Held) -> list[_Candidate]:
        """The partitions with work, oldest next event first (at most a few per slot),
        after marking the board's suspects; the ones a batch held go back to the board."""
        serving = [name for name in self.subscriptions if name not in self._left]
        pairs, whole = self._board.take()
        try:
            look = held.run(lambda: look_for_work(serving, pairs, whole, self._look_limit))
        except BaseException:
            self._board.put_back(pairs, whole)
            raise
        self._board.defer(look.deferred)
        return [_Candidate(key, next_time) for key, next_time in look.work]

    def _choose(self, queue: list[_Candidate], held: _Held) -> tuple[str, int] | None:
        """Take candidates off the front of `queue` until one is the held partition or can
        be locked, skipping partitions that wait out a database error (the ones others
        hold leave the queue: their holders serve them). Else the held partition if it
        still has work and the look was cut short (older ones are all held by others);
        else None, with nothing held."""
        cut_off = len(queue) == self._look_limit
        while queue:
            candidate = queue.pop(0)
            if self._backoff.waiting(candidate.key):
                continue
            if candidate.key == held.key:
                return held.key
            if held.try_lock(candidate.key, lock_key(self.schema, *candidate.key)):
                return candidate.key
        if (
            held.key is not None
            and held.has_work
            and cut_off
            and not self._backoff.waiting(held.key)
        ):
            return held.key
        held.release()
        return None

    def _take_turn(
        self,
        db: Db,
        subscription: Subscription,
        partition: int,
        stop: threading.Event,
        companions: bool = True,
    ) -> tuple[datetime | None, bool, set[tuple[str, int]]]:
        """`_turn`, after which the partitions it moved whose heads grew meanwhile are
        suspects again (see `_Board.grew_since`), for the look that comes next."""
        news = self._board.news()
        moved: set[tuple[str, int]] = set()
        try:
            turn = self._turn(db, subscription, partition, stop, companions)
            moved = turn[2]
            return turn
        finally:
            self._board.grew_since(
                subscription.name,
                subscription.stream,
                [partition, *(p for _, p in moved)],
                news,
            )

    def _turn(
        self,
        db: Db,
        subscription: Subscription,
        partition: int,
        stop: threading.Event,
        companions: bool = True,
    ) -> tuple[datetime | None, bool, set[tuple[str, int]]]:
        """Handle one batch of a partition (which may carry other partitions of the
        subscription, see `lock_batch`): the time of the partition's next event, or None
        when it has no more work for now; whether the partition was drained (rather than
        halted, fenced or failed); and the other partitions the batch moved.

        When a batch of several events fails, its events are handled again at once, one
        per batch, within this turn: those before the failing one commit, and the failing
        one meets the retry delay and the error policy alone. A batch of several
        partitions that fails is handled again partition by partition, each one alone.
        Any other error is kept to this partition: it is logged and the partition is
        tried again after a backoff, without counting an attempt; only a lost connection
        leaves the turn.
        """
        key = (subscription.name, partition)
        split: BatchFailed | None = None  # a failed batch of several events, handled singly
        while not stop.is_set():
            started = time.monotonic()
            alone = split is not None or not companions
            try:
                outcomes = self._batch(
                    db, subscription, partition, 1 if split else None,
                    0 if alone else _COMPANIONS,
                )  # fmt: skip
            except Exception as error:
                if db.conn.broken or db.conn.closed:
                    raise _ConnectionLost(f"the worker's connection broke: {error}") from error
                if not alone:  # perhaps another partition's trouble: try this one alone
                    companions = False
                    continue
                self._database_trouble(subscription, partition, error)
                return None, False, set()
            self._backoff.succeeded(key)
            if outcomes is None:
                return None, False, set()
            if isinstance(outcomes, BatchFailed):
                if outcomes.shared:
                    companions = False
                    if outcomes.partition != partition:
                        # pin the failure on the companion's event now, not at every
                        # batch that would take it along
                        self._take_turn(db, subscription, outcomes.partition, stop, False)
                else:
                    split = outcomes
                continue
            outcome = outcomes[0]
            if outcome.gap is not None:
                self._gap_passed(subscription, outcome.gap)
            if any(o.handled for o in outcomes):
                self._batch_committed(subscription, outcomes, time.monotonic() - started)
                self._board.retry_deferred()  # this batch may have held one of them
            # one at a time only through the failed batch's events: a reset that moved
            # the position elsewhere meanwhile ends it
            if split is not None and split.position < outcome.position < split.last_position:
                continue
            moved = {(subscription.name, o.partition) for o in outcomes[1:]}
            return outcome.next_time, outcome.next_time is None, moved
        return None, False, set()

    def _batch(
        self,
        db: Db,
        subscription: Subscription,
        partition: int,
        size: int | None,
        companions: int,
    ) -> list[BatchOutcome] | BatchFailed | None:
        """One batch: the outcome of each partition it moved, the chosen one first; a
        failed batch of several events or partitions (to handle again in parts); None
        when the partition has nothing to do now (stopped, failed, fenced or missing
        events)."""
        try:
            return handle_batch(db, subscription, partition, size, companions)
        except Fenced as fenced:
            log.info("%s", fenced, extra=self._fields(subscription=subscription.name))
            return None
        except SubscriptionNotFound as gone:
            # deleted while the worker runs (`subscription delete --force`), and perhaps
            # declared anew by another app: this worker's declaration is no longer it
            if subscription.name not in self._left:
                self._left.add(subscription.name)
                log.warning(
                    "%s; this worker leaves it alone until restarted",
                    gone,
                    extra=self._fields(subscription=subscription.name, partition=partition),
                )
            return None
        except PositionsMissing as missing:
            self.metrics.batch_failed(subscription.name, False)
            log.error(
                "%s",
                missing,
                extra=self._fields(
                    subscription=subscription.name,
                    partition=partition,
                    from_position=missing.first,
                    to_position=missing.last,
                ),
            )
            return None
        except BatchFailed as failed:
            if db.conn.broken or db.conn.closed:  # the handlers met the connection's end
                raise
            if isinstance(failed.error, RetryLater):  # the whole batch, later: no split
                self._postponed(db, subscription, failed)
                return None
            if failed.shared or failed.events > 1:
                self._batch_split(subscription, failed)
                return failed
            failure = record_failure(db, subscription, partition, failed, self.settings)
            self._batch_failed(subscription, partition, failure, failed.error)
            return None

    def _gap_passed(self, subscription: Subscription, gap: Tombstone) -> None:
        action = "handled" if subscription.gap is not None else "skipped"
        self.metrics.gap_passed(subscription.name, action, gap.gap_to - gap.gap_from + 1)
        log.warning(
            "subscription %s: %s; %s (recorded in the gaps table)",
            subscription.name,
            gap,
            "its gap handler ran" if action == "handled" else "skipped (on_gap='skip')",
            extra=self._fields(
                subscription=subscription.name,
                partition=gap.partition,
                from_position=gap.gap_from,
                to_position=gap.gap_to,
            ),
        )

    def _database_trouble(
        self, subscription: Subscription, partition: int, error: Exception
    ) -> None:
        delay = self._backoff.failed((subscription.name, partition))
        self.metrics.database_error(subscription.name)
        log.warning(
            "subscription %s partition %s: %s: %s; trying again in %.1f s (no attempt of "
            "its events is counted)",
            subscription.name,
            partition,
            "database error" if isinstance(error, psycopg.Error) else "unexpected error",
            error_text(error),
            delay,
            exc_info=not isinstance(error, psycopg.Error),
            extra=self._fields(
                subscription=subscription.name,
                partition=partition,
                error=error_text(error),
                retry_in=round(delay, 3),
            ),
        )

    def _postponed(self, db: Db, subscription: Subscription, failed: BatchFailed) -> None:
        recorded = postpone_batch(db, subscription, failed)
        self.metrics.batch_failed(subscription.name, False)
        seconds = failed.error.seconds if isinstance(failed.error, RetryLater) else 0.0
        log.warning(
            "subscription %s partition %s: %s; the batch is handled again in %.1f s%s",
            subscription.name,
            failed.partition,
            failed.error,
            seconds,
            "" if recorded else " (the position moved meanwhile: not recorded)",
            extra=self._fields(
                subscription=subscription.name,
                partition=failed.partition,
                retry_in=round(seconds, 3),
                error=error_text(failed.error),
            ),
        )

    def _batch_split(self, subscription: Subscription, failed: BatchFailed) -> None:
        self.metrics.batch_failed(subscription.name, False)
        log.warning(
            "subscription %s partition %s: a batch of %s failed (%s: %s); handling %s",
            subscription.name,
            failed.partition,
            "several partitions" if failed.shared else f"{failed.events} events",
            type(failed.error).__name__,
            failed.error,
            "its partitions one at a time" if failed.shared
            else "them one at a time to find the failing one",
            extra=self._fields(
                subscription=subscription.name,
                partition=failed.partition,
                events=failed.events,
                to_position=failed.last_position,
                error=f"{type(failed.error).__name__}: {failed.error}",
            ),
        )  # fmt: skip

    def _batch_committed(
        self, subscription: Subscription, outcomes: Sequence[BatchOutcome], seconds: float
    ) -> None:
        self.metrics.batch_committed(
            subscription.name, sum(outcome.handled for outcome in outcomes), seconds
        )
        if not log.isEnabledFor(logging.DEBUG):
            return
        for outcome in outcomes:
            # positions are dense: the batch held the `handled` positions up to the new one
            first = outcome.position - outcome.handled + 1
            log.debug(
                "subscription %s partition %s: positions %s to %s in %.3f s",
                subscription.name,
                outcome.partition,
                first,
                outcome.position,
                seconds,
                extra=self._fields(
                    subscription=subscription.name,
                    partition=outcome.partition,
                    from_position=first,
                    to_position=outcome.position,
                    events=outcome.handled,
                    seconds=round(seconds, 6),
                ),
            )

    def _batch_failed(
        self, subscription: Subscription, partition: int, failure: Failure, error: Exception
    ) -> None:
        dead_lettered = failure.action == "dead_lettered"
        self.metrics.batch_failed(subscription.name, dead_lettered)
        fields = self._fields(
            subscription=subscription.name,
            partition=partition,
            attempts=failure.attempts,
            max_attempts=subscription.max_attempts,
            error=error_text(error),
        )
        where = f"subscription {subscription.name} partition {partition}"
        if failure.action == "fenced":
            log.info(
                "%s: a batch failed (%s), but the position moved meanwhile (a reset or "
                "another worker): nothing was recorded",
                where,
                error_text(error),
                extra=fields,
            )
            return
        log.warning(
            "%s: batch failed (attempt %s of %s): %s",
            where,
            failure.attempts,
            subscription.max_attempts,
            error_text(error),
            extra=fields,
        )
        outcomes = {
            "dead_lettered": "the failing event went to the dead letters; the partition goes on",
            "stopped": "the partition is stopped at the failing event (on_error='stop')",
            "missing": "the failing event is no longer stored, so it cannot be dead-lettered: "
            "the partition is stopped before it",
        }
        if failure.action in outcomes:
            log.error("%s: %s", where, outcomes[failure.action], extra=fields)

    # around the slots

    def _poll(self, stop: threading.Event) -> None:
        """The worker's poller, on a connection of its own: it turns notifications into
        suspects and wake-ups, and polls once per poll interval (which is also the
        heartbeat when one is due). On every (re)connection it reads the heads and makes
        every partition a suspect: anything may have come meanwhile. Whatever goes wrong
        is logged and counted, and it connects again: push only saves time, so it must
        never stop for good; a database unreachable for the outage timeout ends the
        worker (its slots, idle, would not notice)."""
        outage_since: float | None = None
        while not stop.is_set():
            try:
                with self.engine.connect(
                    application_name=self.application_name, autocommit=True
                ) as conn:
                    self.engine.sql.run(conn, Query("worker_connection_settings", {}, first_row))
                    # every partition is a suspect for the first look, which comes after
                    # the LISTEN: nothing appended before or after it goes unseen
                    heads = self.engine.sql.run(conn, _stream_heads(self._board.streams))
                    self._board.heads_read(heads, everything=True)
                    if self.listen:
                        self.engine.sql.run(conn, listen())
                    outage_since = None
                    self.wakeup.notify()
                    self._polling(conn, stop)
            except Exception as error:
                if isinstance(error, psycopg.OperationalError):
                    outage_since = outage_since or time.monotonic()
                    if self._gave_up(outage_since, error, stop):
                        return
                self.metrics.listener_failed()
                log.warning(
                    "the poller's connection failed (%s); reconnecting in %g s",
                    error_text(error),
                    _RECONNECT_DELAY_SECONDS,
                    exc_info=not isinstance(error, psycopg.OperationalError),
                    extra=self._fields(error=error_text(error)),
                )
                stop.wait(_RECONNECT_DELAY_SECONDS)

    def _polling(self, conn: psycopg.Connection[Any], stop: threading.Event) -> None:
        settings = self.settings
        next_poll = time.monotonic() + settings.poll_interval
        next_beat = time.monotonic() + settings.heartbeat_interval
        while not stop.is_set():
            now = time.monotonic()
            if now >= min(next_poll, next_beat):
                beat = now >= next_beat
                self._poll_once(conn, beat)
                next_poll = now + settings.poll_interval
                if beat:
                    next_beat = now + settings.heartbeat_interval
                continue
            wait = min(min(next_poll, next_beat) - now, _LISTEN_CHECK_SECONDS)
            if not self.listen:
                stop.wait(wait)
                continue
            for notification in conn.notifies(timeout=wait):
                grown = self._grown(notification.payload)
                if grown is not None and self._board.grew(*grown):
                    self.metrics.notification_received()
                    self.metrics.woke(by_notification=True)
                    self.wakeup.notify()

    def _poll_once(self, conn: psycopg.Connection[Any], beat: bool) -> None:
        """One poll: the heads' sums and whether any partition has work (and the
        heartbeat with `beat`); the slots are woken if something may be waiting."""
        registration = self._registration()
        totals, has_work = self.engine.sql.run(
            conn,
            Query(
                "poll_for_work",
                {
                    **registration,
                    "serving": [n for n in self.subscriptions if n not in self._left],
                    "streams": self._board.streams,
                    # never register again once the worker is stopping
                    "beat": beat and not self._stopping,
                },
                lambda result: (result.rows[0][0], bool(result.rows[0][1])),
            ),
        )
        self.metrics.woke(by_notification=False)
        differs = self._board.differs({stream: int(total) for stream, total in totals.items()})
        grown = differs and self._board.heads_read(
            self.engine.sql.run(conn, _stream_heads(differs)), everything=False
        )
        if self._board.retry_deferred() or has_work or grown or self._board.pending():
            self.wakeup.notify()

    def _gave_up(self, outage_since: float, error: Exception, stop: threading.Event) -> bool:
        """Whether the database has been unreachable since `outage_since` for the outage
        timeout: then the worker stops, and run() raises the error."""
        if time.monotonic() - outage_since < self.settings.outage_timeout:
            return False
        self.fatal = DatabaseUnavailable(
            f"the database was unreachable for {self.settings.outage_timeout:g} s "
            f"(SUBENGINE_OUTAGE_TIMEOUT): {str(error).strip()}"
        )
        stop.set()
        return True

    def _wake_on_stop(self, stop: threading.Event) -> None:
        stop.wait()
        self._stopping = True
        self.wakeup.notify()  # idle slots wait on the wake-up, not on `stop`

    @staticmethod
    def _grown(payload: str) -> tuple[str, int, int] | None:
        """The (stream, partition, head) a notification names; None (after a warning)
        for a payload that does not parse: then only the polls see that append."""
        try:
            notice = json.loads(payload)
            return str(notice["stream"]), int(notice["partition"]), int(notice["head"])
        except (ValueError, TypeError, KeyError, RecursionError) as error:
            log.warning("a notification that does not parse (%s): %r", error, payload[:200])
            return None

    def _progress(self, stop: threading.Event) -> None:
        """Read the lag at start and then every progress_interval, for the lag gauges and
        the progress lines; skip the query when nothing can have changed (see Progress)."""
        names = list(self.subscriptions)
        progress = _metrics.Progress(names, time.monotonic())
        while True:
            done = self.metrics.done()
            if not progress.wants_reading(done, self.metrics.serving):
                progress.skip(time.monotonic())
            else:
                try:
                    with self.engine.connection() as conn:
                        reading = self.engine.sql.run(conn, _metrics.read_lag(names, self.id))
                except Exception as error:  # progress is for people: never fatal
                    log.warning("could not read the lag: %s", error, extra=self._fields())
                else:
                    self.metrics.lag_read(reading, time.time())
                    for line in progress.report(time.monotonic(), done, reading):
                        log.info("%s", line.message(), extra=self._fields(**line.fields()))
            if stop.wait(self.settings.progress_interval):
                return

    def _prune(self, stop: threading.Event) -> None:
        """Apply the streams' retention policies every retention_interval, the first time
        one interval after start (DESIGN.md, "Retention and gaps"); one worker of the
        database at a time does (an advisory lock), and a stop ends a run between two of
        its batches."""

        def progress(cut: PartitionCut, removed: int) -> None:
            if stop.is_set():
                raise _Stopping

        while not stop.wait(self.settings.retention_interval):
            try:
                run = self.engine.run_retention(progress=progress)
            except _Stopping:
                return
            except Exception as error:  # retention waits for the next run: never fatal
                log.warning("pruning failed: %s", error_text(error), extra=self._fields())
                continue
            self.metrics.pruned(run.removed)
            if run.removed:
                log.info(
                    "retention removed %s event(s) from %s partition(s)",
                    run.removed,
                    len(run.partitions),
                    extra=self._fields(events=run.removed, partitions=len(run.partitions)),
                )

    def _fields(self, **fields: Any) -> dict[str, Any]:
        """Structured log fields (`extra=`): the worker's id and the given ones."""
        return {"worker_id": str(self.id), **fields}


class _Stopping(Exception):
    """The worker stops: a pruning run ends between two batches."""


def _stream_heads(streams: Sequence[str]) -> Query[list[tuple[str, int, int]]]:
    """The head of every partition of some streams."""
    return Query(
        "stream_heads",
        {"streams": list(streams)},
        lambda result: [(str(s), int(p), int(h)) for s, p, h in result.rows],
    )
