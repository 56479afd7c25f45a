"""The worker: competing consumers of subscriptions (DESIGN.md, Consume flow).

Each of `concurrency` slots loops: find partitions with work, oldest next event first;
take the first one whose advisory lock it gets (on a lock connection of the slot's own);
handle one batch; go on with the oldest of the partitions it found, switching locks, and
look again after a notification or a poll interval; wait when there is nothing to do. A
listener thread turns notifications into wake-ups and reconnects when its connection
drops. Locks only keep workers from wasting effort on one partition: correctness comes
from the position row lock and compare-and-set in every batch (invariants 3 and 5).
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
from typing import Any

import psycopg
import sqlalchemy.exc

from subengine import _metrics, _operations
from subengine._declarations import Subscription
from subengine._engine import Engine
from subengine._errors import DatabaseUnavailable, Fenced, PositionsMissing, SubscriptionNotFound
from subengine._locks import lock_key, lock_partition, ping, unlock_partition
from subengine._settings import Settings
from subengine._sql import SQL, Db
from subengine._streams import listen
from subengine._subscriptions import (
    BatchFailed,
    BatchOutcome,
    Failure,
    ensure_subscription,
    error_text,
    handle_batch,
    partitions_with_work,
    record_failure,
)

log = logging.getLogger("subengine.worker")

# Candidates fetched per look for work: enough that busy partitions locked by other
# workers do not hide the free ones.
_CANDIDATES_PER_SLOT = 4
_RECONNECT_DELAY_SECONDS = 1.0
# How often the listener, between notifications, checks whether the worker is stopping.
_LISTEN_CHECK_SECONDS = 0.25


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

    def wait(self, seen: int, timeout: float) -> bool:
        """Wait for a notification after `seen`; False when the timeout came first."""
        with self._condition:
            if self._count == seen:
                self._condition.wait(timeout)
            return self._count != seen


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A (subscription, partition) with work, and the time of its next event."""

    key: tuple[str, int]
    next_time: datetime | None

    def order(self) -> tuple[bool, datetime | None]:
        """Oldest first, unknown times last (as the look orders them)."""
        return (self.next_time is None, self.next_time)


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

    def try_lock(self, key: tuple[str, int], lock_key: int) -> bool:
        """Take the lock of `key` (keyed `lock_key`) and hold it instead of the one held."""
        for attempt in (1, 2):
            if self._conn is None or self._conn.closed:
                self.close()
                self._conn = self._connect()
            try:
                taken = self._sql.run(self._conn, lock_partition(lock_key, self._lock_key))
                break
            except psycopg.OperationalError:
                # the connection ended, and the held lock with it: once more on a new one
                self.close()
                if attempt == 2:
                    raise
        if not taken:
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

    def alive(self) -> bool:
        """Whether the lock's connection still answers: a connection the server ended
        took the lock with it, and another worker may hold it now."""
        try:
            if self._conn is not None:
                self._sql.run(self._conn, ping())
                return True
        except psycopg.Error:
            self.close()
        return False

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
        self.metrics = _metrics.WorkerMetrics(list(self.subscriptions))
        self.metrics_port = metrics_port
        self.metrics_address = metrics_address
        # every connection of the worker carries it: the status views find the worker's
        # connections, and the holder of each partition lock, by it
        self.application_name = f"subengine worker {self.id}"
        self._backoff = _Backoff(self.settings)
        # subscriptions deleted while the worker runs: it leaves them alone
        self._left: set[str] = set()
        # set by a slot that gave up on the database; run() raises it
        self.fatal: Exception | None = None

    # the run

    def run(self, stop: threading.Event) -> None:
        """Work until `stop` is set; the current batches finish and every lock is released."""
        with self.engine.db() as db:
            for subscription in self.subscriptions.values():
                ensure_subscription(db, subscription)
            pruned = db.run(_operations.prune_workers())
            db.run(_operations.register_worker(self._registration()))
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
            threading.Thread(target=self._heartbeat, args=(stop,), daemon=True),
            threading.Thread(target=self._wake_on_stop, args=(stop,), daemon=True),
            threading.Thread(target=self._progress, args=(stop,), daemon=True),
        ]
        if self.listen:
            threads.append(threading.Thread(target=self._listen, args=(stop,), daemon=True))
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
                self.engine.sql.run(conn, _operations.unregister_worker(self.id))
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
                    now = time.monotonic()
                    outage_since = now if outage_since is None else outage_since
                    if now - outage_since >= self.settings.outage_timeout:
                        self.fatal = DatabaseUnavailable(
                            f"the database was unreachable for "
                            f"{self.settings.outage_timeout:g} s (SUBENGINE_OUTAGE_TIMEOUT): "
                            f"{str(error).strip()}"
                        )
                        stop.set()
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
        partitions the look found, its own included; it looks again after a notification,
        after a poll interval, or when those run out. It waits when nothing can be taken.
        """
        while not stop.is_set():
            seen = self.wakeup.count()
            queue = self._candidates(db)
            # a full look may have left out partitions with work: look again when the
            # ones it found are used up
            cut_off = len(queue) == self.concurrency * _CANDIDATES_PER_SLOT
            looked_at = time.monotonic()
            if held.key is not None and not held.alive():
                held.release()
            chosen = self._choose(queue, held)
            self.metrics.looked_for_work(chosen is not None)
            if chosen is None:
                wait = min(self.settings.poll_interval, self._backoff.next_retry_in())
                notified = self.wakeup.wait(seen, wait)
                self.metrics.woke(by_notification=notified)
                continue
            while chosen is not None and not stop.is_set():
                name, partition = chosen
                next_time = self._take_turn(db, self.subscriptions[name], partition, stop)
                held.has_work = next_time is not None
                if (
                    next_time is None
                    or (cut_off and not queue)
                    or self.wakeup.count() != seen
                    or time.monotonic() - looked_at >= self.settings.poll_interval
                ):
                    break  # look again
                if queue and queue[0].next_time is not None and queue[0].next_time < next_time:
                    # an older event waits elsewhere: go there, and come back in its turn
                    bisect.insort(queue, _Candidate(chosen, next_time), key=_Candidate.order)
                    chosen = self._choose(queue, held)

    def _candidates(self, db: Db) -> list[_Candidate]:
        """The partitions with work, oldest next event first (at most a few per slot)."""
        names = [name for name in self.subscriptions if name not in self._left]
        rows = db.run(partitions_with_work(names, self.concurrency * _CANDIDATES_PER_SLOT))
        db.conn.commit()
        return [_Candidate((name, partition), next_time) for name, partition, next_time in rows]

    def _choose(self, queue: list[_Candidate], held: _Held) -> tuple[str, int] | None:
        """Take candidates off the front of `queue` until one is the held partition or can
        be locked, skipping partitions that wait out a database error (the ones others
        hold leave the queue: their holders serve them). Else the held partition if it
        still has work and the look was cut short (older ones are all held by others);
        else None, with nothing held."""
        cut_off = len(queue) == self.concurrency * _CANDIDATES_PER_SLOT
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
    ) -> datetime | None:
        """Handle one batch of a partition; the time of its next event, or None when it
        has no more work for now.

        When a batch of several events fails, its events are handled again at once, one
        per batch, within this turn: those before the failing one commit, and the failing
        one meets the retry delay and the error policy alone. Any other error is kept to
        this partition: it is logged and the partition is tried again after a backoff,
        without counting an attempt; only a lost connection leaves the turn.
        """
        key = (subscription.name, partition)
        split: BatchFailed | None = None  # a failed batch of several events, handled singly
        while not stop.is_set():
            started = time.monotonic()
            try:
                outcome = self._batch(db, subscription, partition, 1 if split else None)
            except Exception as error:
                if db.conn.broken or db.conn.closed:
                    raise _ConnectionLost(f"the worker's connection broke: {error}") from error
                self._database_trouble(subscription, partition, error)
                return None
            self._backoff.succeeded(key)
            if outcome is None:
                return None
            if isinstance(outcome, BatchFailed):
                split = outcome
                continue
            if outcome.handled > 0:
                self._batch_committed(subscription, outcome, time.monotonic() - started)
            # one at a time only through the failed batch's events: a reset that moved
            # the position elsewhere meanwhile ends it
            if split is not None and split.position < outcome.position < split.last_position:
                continue
            return outcome.next_time
        return None

    def _batch(
        self,
        db: Db,
        subscription: Subscription,
        partition: int,
        size: int | None,
    ) -> BatchOutcome | BatchFailed | None:
        """One batch: its outcome; a failed batch of several events (to split); None when
        the partition has nothing to do now (stopped, failed, fenced or missing events)."""
        try:
            return handle_batch(db, subscription, partition, size)
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
            if failed.events > 1:
                self._batch_split(subscription, partition, failed)
                return failed
            failure = record_failure(db, subscription, partition, failed, self.settings)
            self._batch_failed(subscription, partition, failure, failed.error)
            return None

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

    def _batch_split(self, subscription: Subscription, partition: int, failed: BatchFailed) -> None:
        self.metrics.batch_failed(subscription.name, False)
        log.warning(
            "subscription %s partition %s: a batch of %s events failed (%s: %s); handling "
            "them one at a time to find the failing one",
            subscription.name,
            partition,
            failed.events,
            type(failed.error).__name__,
            failed.error,
            extra=self._fields(
                subscription=subscription.name,
                partition=partition,
                events=failed.events,
                to_position=failed.last_position,
                error=f"{type(failed.error).__name__}: {failed.error}",
            ),
        )

    def _batch_committed(
        self, subscription: Subscription, outcome: BatchOutcome, seconds: float
    ) -> None:
        self.metrics.batch_committed(subscription.name, outcome.handled, seconds)
        if log.isEnabledFor(logging.DEBUG):
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

    def _listen(self, stop: threading.Event) -> None:
        """Turn notifications into wake-ups. Whatever goes wrong (a lost connection, a
        payload that breaks the parser, a bug) is logged and counted, and the listener
        connects again: push only saves time, so it must never stop for good."""
        while not stop.is_set():
            try:
                with self.engine.connect(
                    application_name=self.application_name, autocommit=True
                ) as conn:
                    self.engine.sql.run(conn, listen())
                    self.wakeup.notify()  # whatever came while we were not listening
                    while not stop.is_set():
                        for notification in conn.notifies(timeout=_LISTEN_CHECK_SECONDS):
                            if self._wanted(notification.payload):
                                self.metrics.notification_received()
                                self.wakeup.notify()
            except Exception as error:
                self.metrics.listener_failed()
                log.warning(
                    "the listening connection failed (%s); reconnecting in %g s",
                    error_text(error),
                    _RECONNECT_DELAY_SECONDS,
                    exc_info=not isinstance(error, psycopg.OperationalError),
                    extra=self._fields(error=error_text(error)),
                )
                stop.wait(_RECONNECT_DELAY_SECONDS)

    def _wake_on_stop(self, stop: threading.Event) -> None:
        stop.wait()
        self.wakeup.notify()  # idle slots wait on the wake-up, not on `stop`

    def _wanted(self, payload: str) -> bool:
        try:
            return json.loads(payload).get("stream") in self.streams
        except (ValueError, AttributeError):
            return True

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.settings.heartbeat_interval):
            try:
                with self.engine.connection() as conn:
                    if stop.is_set():  # never register again once the worker is stopping
                        return
                    self.engine.sql.run(conn, _operations.heartbeat(self._registration()))
            except Exception as error:  # the heartbeat is for inspection only: never fatal
                log.warning("heartbeat failed: %s", error, extra=self._fields())

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

    def _fields(self, **fields: Any) -> dict[str, Any]:
        """Structured log fields (`extra=`): the worker's id and the given ones."""
        return {"worker_id": str(self.id), **fields}
