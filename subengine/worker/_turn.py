"""A turn: one batch of a partition (perhaps carrying other partitions of its
subscription), handled again in parts when it fails, until the partition has no more work
for now, is drained, halted or fenced; the failures met go to the error policy."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime

import psycopg

from subengine.db._sql import Db
from subengine.model._declarations import Subscription
from subengine.model._errors import Fenced, PositionsMissing, RetryLater, SubscriptionNotFound
from subengine.subscriptions._batches import BatchOutcome, handle_batch
from subengine.subscriptions._failures import BatchFailed, postpone_batch, record_failure
from subengine.worker._reporting import Reporter
from subengine.worker._state import WorkerState

# A transactional batch whose chosen partition has no more events for now also carries
# other partitions of its subscription, oldest next event first, each with at most the
# batch size of events, up to this many batch sizes in the transaction (and as many
# partitions as that leaves room for): with many partitions of few events each (1,024
# partitions, a sparse backlog), a transaction per batch size of events still cost more
# than the events (bench/scale.py).
CARRIED_BATCHES = 4

# What a turn ends with: the time of the partition's next event (None: no more work for
# now), whether it was drained, and the other partitions the batch moved.
TurnEnd = tuple[datetime | None, bool, set[tuple[str, int]]]


class ConnectionLost(psycopg.OperationalError):
    """A slot's connection broke during a batch; the slot reconnects."""


class Turns:
    """The turns of one worker's slots (see `take`)."""

    def __init__(
        self,
        state: WorkerState,
        report: Reporter,
        async_db: Callable[[], Db] | None = None,
    ) -> None:
        self._state = state
        # the slot's Db on the event loop, for subscriptions with async handlers
        self._async_db = async_db
        self._board = state.board
        self._backoff = state.backoff
        self._report = report

    def take(
        self,
        db: Db,
        subscription: Subscription,
        partition: int,
        stop: threading.Event,
        companions: bool = True,
    ) -> TurnEnd:
        """`_turn`, after which the partitions it moved whose heads grew meanwhile are
        suspects again (see `Board.grew_since`), for the look that comes next. A
        subscription with async handlers has its batches on the slot's AsyncConnection."""
        if subscription.is_async and self._async_db is not None:
            db = self._async_db()
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
    ) -> TurnEnd:
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
        leaves the turn. Once the worker stops nothing is tried again: a failed try is
        the end of the turn, and the log says what of the partition did not commit.
        """
        key = (subscription.name, partition)
        split: BatchFailed | None = None  # a failed batch of several events, handled singly
        failed: Exception | None = None  # what the last try met, to try again in parts
        while not stop.is_set():
            started = time.monotonic()
            alone = split is not None or not companions
            try:
                outcomes = self._batch(db, subscription, partition, 1 if split else None, alone)
            except Exception as error:
                if db.conn.broken or db.conn.closed:
                    raise ConnectionLost(f"the worker's connection broke: {error}") from error
                if stop.is_set():  # stopping: no backoff, no retry; it rolled back
                    self._report.left_at_stop(subscription, partition, error)
                    return None, False, set()
                if not alone:  # perhaps another partition's trouble: try this one alone
                    companions = False
                    failed = error
                    continue
                delay = self._backoff.failed(key)
                self._report.database_trouble(subscription, partition, error, delay)
                return None, False, set()
            self._backoff.succeeded(key)
            if outcomes is None:
                return None, False, set()
            if isinstance(outcomes, BatchFailed):
                failed = outcomes.error
                if outcomes.shared:
                    companions = False
                    if outcomes.partition != partition:
                        # pin the failure on the companion's event now, not at every
                        # batch that would take it along
                        self.take(db, subscription, outcomes.partition, stop, False)
                else:
                    split = outcomes
                continue
            outcome = outcomes[0]
            if outcome.gap is not None:
                self._report.gap_passed(subscription, outcome.gap)
            if any(o.handled or o.parked for o in outcomes):
                self._report.batch_committed(subscription, outcomes, time.monotonic() - started)
                self._board.retry_deferred()  # this batch may have held one of them
            # one at a time only through the failed batch's events: a reset that moved
            # the position elsewhere meanwhile ends it
            if split is not None and split.position < outcome.position < split.last_position:
                continue
            moved = {(subscription.name, o.partition) for o in outcomes[1:]}
            return outcome.next_time, outcome.next_time is None, moved
        if failed is not None:  # the worker stopped before the try again
            self._report.left_at_stop(subscription, partition, failed)
        return None, False, set()

    def _batch(
        self,
        db: Db,
        subscription: Subscription,
        partition: int,
        size: int | None,
        alone: bool,
    ) -> list[BatchOutcome] | BatchFailed | None:
        """One batch (with companions unless `alone`): the outcome of each partition it
        moved, the chosen one first; a failed batch of several events or partitions (to
        handle again in parts); None when the partition has nothing to do now (stopped,
        failed, fenced or missing events)."""
        carried = CARRIED_BATCHES * subscription.batch_size
        try:
            return handle_batch(db, subscription, partition, size, 0 if alone else carried, carried)
        except Fenced as fenced:
            self._report.fenced(subscription, fenced)
            return None
        except SubscriptionNotFound as gone:
            # deleted while the worker runs (`subscription delete --force`), and perhaps
            # declared anew by another app: this worker's declaration is no longer it
            if subscription.name not in self._state.left:
                self._state.left.add(subscription.name)
                self._report.left(subscription, partition, gone)
            return None
        except PositionsMissing as missing:
            self._report.missing(subscription, partition, missing)
            return None
        except BatchFailed as failed:
            if db.conn.broken or db.conn.closed:  # the handlers met the connection's end
                raise
            if isinstance(failed.error, RetryLater):  # the whole batch, later: no split
                recorded = postpone_batch(db, subscription, failed)
                self._report.postponed(subscription, failed, recorded)
                return None
            if failed.shared or failed.events > 1:
                self._report.batch_split(subscription, failed)
                return failed
            failure = record_failure(
                db,
                subscription,
                partition,
                failed,
                self._state.settings.retry_delay,
                self._state.settings.retry_delay_max,
            )
            self._report.batch_failed(subscription, partition, failure, failed.error)
            return None
