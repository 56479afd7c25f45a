"""Scheduling: what each of a worker's slots does next. A slot looks for partitions with
work, oldest next event first, takes the first one whose lock it gets, takes its turn
there, and goes on with the oldest of the partitions it found, switching locks, or waits
when there is nothing to do (DESIGN.md invariant 7)."""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from dataclasses import dataclass
from datetime import datetime

import psycopg

from subengine.db._locks import lock_key
from subengine.db._sql import Db
from subengine.subscriptions._work import find_work
from subengine.worker._held import Held
from subengine.worker._state import PARTITION_LOCKS, RECONNECT_DELAY_SECONDS, WorkerState
from subengine.worker._turn import Turns

log = logging.getLogger("subengine.worker")

# Candidates fetched per look for work: enough that busy partitions locked by other
# workers do not hide the free ones.
CANDIDATES_PER_SLOT = 4


@dataclass(frozen=True, slots=True)
class Candidate:
    """A (subscription, partition) with work, and the time of its next event (a look
    finds only rows that know it)."""

    key: tuple[str, int]
    next_time: datetime


class Slots:
    """The slots of one worker: each runs `run` in a thread of its own."""

    def __init__(self, state: WorkerState, turns: Turns) -> None:
        self._state = state
        self._turns = turns
        self._subscriptions = state.subscriptions
        self._schema = state.engine.schema
        self._board = state.board
        self._wakeup = state.wakeup
        self._backoff = state.backoff
        self._metrics = state.metrics
        self._look_limit = state.look_limit
        # every slot's lock: a notified partition whose lock one slot holds is its to take
        self._held: list[Held] = []

    def run(self, stop: threading.Event) -> None:
        """One slot, in a thread of its own, until `stop`: a connection for its batches
        and a lock connection, each made again when lost."""
        outage_since: float | None = None
        state = self._state
        held = Held(
            lambda: state.connect_own(PARTITION_LOCKS),
            state.engine.sql,
            state.lock_provider,
            session_settings=state.sessions,
        )
        self._held.append(held)
        try:
            while not stop.is_set():
                try:
                    with self._state.connect() as conn:
                        outage_since = None
                        self._work(Db(conn, self._state.engine.sql), held, stop)
                # (a lock provider's own errors arrive as psycopg's too)
                except psycopg.OperationalError as error:
                    if stop.is_set():  # nothing is tried again: the batch rolled back
                        log.warning(
                            "database connection lost while the worker stops: %s; not "
                            "reconnecting (what of a batch in progress had not committed "
                            "rolled back, for the next worker)",
                            error,
                            extra=self._state.fields(),
                        )
                        return
                    outage_since = outage_since or time.monotonic()
                    if self._state.gave_up(outage_since, error, stop):
                        return
                    log.warning(
                        "database connection lost: %s; reconnecting",
                        error,
                        extra=self._state.fields(),
                    )
                    stop.wait(RECONNECT_DELAY_SECONDS)
                except Exception as error:  # looking for work failed: not one partition's
                    log.exception("worker slot failed; stopping the worker")
                    self._state.fatal = error
                    stop.set()
                    return
                finally:
                    held.release()
        finally:
            held.close()

    def _work(self, db: Db, held: Held, stop: threading.Event) -> None:
        """Look for work and handle the partition whose next event is oldest, one batch at
        a time (invariant 7). After each batch the slot goes on with the oldest of the
        partitions the look found, its own included; it looks again when the poller woke
        it or has suspects, after a poll interval, or when the partitions found run out.
        It waits for the poller when nothing can be taken, and after draining a partition
        when nothing new can have come (still holding that partition's lock: the next
        event there needs no lock statement). Before it waits, a slot that passed over
        partitions because another slot held them tries those again: the holder may
        have moved on, and left them with work that no other slot knows of.
        """
        while not stop.is_set():
            seen, looks = self._wakeup.count(), self._wakeup.looks()
            queue = self._look(held)
            # a full look may have left out partitions with work: look again when the
            # ones it found are used up
            cut_off = len(queue) == self._look_limit
            looked_at = time.monotonic()
            passed: list[Candidate] = []  # left because another slot held them
            chosen = self._choose(queue, held, passed)
            self._metrics.looked_for_work(chosen is not None)
            if chosen is None:
                self._idle(db, held, stop, seen, looks)
                continue
            while chosen is not None and not stop.is_set():
                name, partition = chosen
                next_time, drained, moved = self._turns.take(
                    db, self._subscriptions[name], partition, stop
                )
                if moved:  # a batch carried them: the look's times for them are old
                    queue[:] = [c for c in queue if c.key not in moved]
                held.has_work = next_time is not None
                if next_time is None and not drained:
                    held.release()  # halted: nothing for this slot to keep
                if (
                    (cut_off and not queue)
                    or self._wakeup.count() != seen
                    or self._board.pending_for(self._others(held))
                    or time.monotonic() - looked_at >= self._state.settings.poll_interval
                ):
                    break  # look again
                if next_time is None:
                    if queue:  # on to the next partition the look found
                        chosen = self._choose(queue, held, passed)
                        continue
                    if drained and passed:  # those the look found that others held
                        queue.extend(passed)
                        passed.clear()
                        chosen = self._choose(queue, held, passed, keep=True)
                        if chosen is not None:
                            continue
                    if drained:
                        self._idle(db, held, stop, seen, looks)
                    break  # look again
                if queue and queue[0].next_time < next_time:
                    # an older event waits elsewhere: go there, and come back in its turn
                    bisect.insort(queue, Candidate(chosen, next_time), key=lambda c: c.next_time)
                    chosen = self._choose(queue, held, passed)

    def _idle(self, db: Db, held: Held, stop: threading.Event, seen: int, looks: int) -> None:
        """Nothing to do: wait for news after `seen`, take what notifications bring, then
        look again (work no append announces, a retry come due say, is older than the
        appends: invariant 7). A notification that brings this slot nothing (another
        slot took its partitions) leaves it waiting without a statement, unless a
        wake-up since `looks` asked every slot to look."""
        while not stop.is_set():
            if not self._wait(held, seen):
                return  # a backoff ended
            seen = self._wakeup.count()
            if not self._take_notified(db, held, stop) or self._wakeup.looks() != looks:
                return

    def _take_notified(self, db: Db, held: Held, stop: threading.Event) -> bool:
        """After a wait with nothing to do: when what woke the slot is a few partitions
        that grew (a notification), handle them before looking, one batch each (first
        the one whose lock it holds; none another slot holds). The slot knew of no other
        work, and the events that woke it are the newest there are, so taking them
        first passes no older event (invariant 7); it saves a look before the handler
        runs. Every partition it does not drain (it cannot lock it, it waits out an
        error or a retry, it is stopped or paused, or the slot stops) goes back to the
        board for the look, which comes next and marks its row: a row the fast path
        leaves must not stay unmarked, or no look would find its events. Whether the
        board had nothing for it: nothing taken, and nothing only a look takes."""
        others = self._others(held)
        pairs = self._board.take_few(CANDIDATES_PER_SLOT, held.key, others)
        if not pairs:
            return not self._board.pending_for(others)
        for n, key in enumerate(pairs):
            drained = False
            try:
                if key[0] in self._state.left:
                    drained = True  # not this worker's any more: no look is to mark it
                    continue
                if stop.is_set() or self._backoff.waiting(key):
                    continue
                if key != held.key and not held.try_lock(key, lock_key(self._schema, *key)):
                    continue
                next_time, drained, _ = self._turns.take(
                    db, self._subscriptions[key[0]], key[1], stop
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
        return False

    def _others(self, held: Held) -> set[tuple[str, int]]:
        """The partitions whose locks the worker's other slots hold, but this slot's own
        (which two slots may both hold with the `rows` provider)."""
        keys = {other.key for other in self._held if other is not held and other.key is not None}
        keys.discard(held.key)
        return keys

    def _wait(self, held: Held, seen: int) -> bool:
        """Wait until the poller (or a slot) has news after `seen`, unless the board
        has suspects for this slot already, or a partition's backoff ends first (False)."""
        if self._board.pending_for(self._others(held)):
            return True
        timeout = self._backoff.next_retry_in()
        return self._wakeup.wait(seen, None if math.isinf(timeout) else timeout)

    def _look(self, held: Held) -> list[Candidate]:
        """The partitions with work, oldest next event first (at most a few per slot),
        after marking the board's suspects (but those another slot holds the lock of);
        the ones a batch held go back to the board."""
        serving = self._state.serving()
        pairs, whole = self._board.take(self._others(held))
        try:
            look = held.run(lambda db: find_work(db, serving, pairs, whole, self._look_limit))
        except BaseException:
            self._board.put_back(pairs, whole)
            raise
        self._board.defer(look.deferred)
        return [Candidate(key, next_time) for key, next_time in look.work]

    def _choose(
        self,
        queue: list[Candidate],
        held: Held,
        passed: list[Candidate],
        keep: bool = False,
    ) -> tuple[str, int] | None:
        """Take candidates off the front of `queue` until one is the held partition or can
        be locked, skipping partitions that wait out a database error; the ones others
        hold leave the queue for `passed`. Else the held partition if it still has work
        and the look was cut short (older ones are all held by others); else None, with
        nothing held unless `keep`."""
        cut_off = len(queue) == self._look_limit
        while queue:
            candidate = queue.pop(0)
            if self._backoff.waiting(candidate.key):
                continue
            if candidate.key == held.key:
                return held.key
            if held.try_lock(candidate.key, lock_key(self._schema, *candidate.key)):
                return candidate.key
            passed.append(candidate)
        if (
            held.key is not None
            and held.has_work
            and cut_off
            and not self._backoff.waiting(held.key)
        ):
            return held.key
        if not keep:
            held.release()
        return None
