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

Here the worker starts and stops its threads; its parts are the slots (`_scheduling`),
a batch's turn (`_turn`), the locks and backoff (`_held`), the board (`_board`), the
poller (`_poller`), what it reports (`_reporting`) and its metrics (`_metrics`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import psycopg

from subengine.db._loop import EventLoopThread
from subengine.db._sql import Db
from subengine.engine._engine import Engine
from subengine.model._declarations import Subscription
from subengine.streams._retention import PartitionCut
from subengine.subscriptions._failures import error_text
from subengine.subscriptions._inspection import register_worker, unregister_worker
from subengine.subscriptions._subscriptions import ensure_subscription
from subengine.worker._async import LoopConnections
from subengine.worker._metrics import follow_progress
from subengine.worker._poller import Poller
from subengine.worker._reporting import Reporter
from subengine.worker._scheduling import CANDIDATES_PER_SLOT, Slots
from subengine.worker._state import RECONNECT_DELAY_SECONDS, WorkerState
from subengine.worker._turn import Turns

log = logging.getLogger("subengine.worker")


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
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """`loop`: where the handlers of async subscriptions are awaited (it must keep
        running until `run` returns); by default the worker runs one in a thread."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        state = WorkerState(
            engine,
            subscriptions,
            listen=listen,
            look_limit=concurrency * CANDIDATES_PER_SLOT,
            serves_metrics=metrics_port is not None,
        )
        self._state = state
        self.engine = engine
        self.settings = engine.settings
        self.subscriptions = state.subscriptions
        self.streams = {s.stream for s in subscriptions}
        self.concurrency = concurrency
        self.id = state.id
        self.metrics = state.metrics
        self.metrics_port = metrics_port
        self.metrics_address = metrics_address
        self._board = state.board
        self._look_limit = state.look_limit
        self._poller = Poller(state)
        self._loop = loop
        self._loop_connections: LoopConnections | None = None
        turns = Turns(state, Reporter(state), self._async_db)
        self._slots = Slots(state, turns)

    # the run

    def run(self, stop: threading.Event) -> None:
        """Work until `stop` is set; the current batches finish and every lock is released."""
        with self.engine.db() as db:  # (waits for a server that is starting)
            for subscription in self.subscriptions.values():
                ensure_subscription(db, subscription)
            self._state.check_sessions()  # before it registers: it may refuse to start
            pruned = register_worker(db, self._registration())
        if pruned:
            log.info(
                "removed the registrations of %s workers that are gone (pids %s)",
                len(pruned),
                ", ".join(str(row.pid) for row in pruned),
                extra=self._state.fields(),
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
            extra=self._state.fields(
                subscriptions=list(self.subscriptions),
                concurrency=self.concurrency,
                pid=os.getpid(),
                metrics_port=self.metrics.port,
            ),
        )
        threads = [
            threading.Thread(target=self._poller.run, args=(stop,), daemon=True, name="poller"),
            threading.Thread(target=self._wake_on_stop, args=(stop,), daemon=True),
            threading.Thread(
                target=follow_progress,
                args=(self.engine, self.metrics, list(self.subscriptions), self.id, stop),
                daemon=True,
            ),
        ]
        if self.settings.retention_interval and self._state.sessions:
            threads.append(
                threading.Thread(target=self._prune, args=(stop,), daemon=True, name="pruner")
            )
        slots = [
            threading.Thread(target=self._slots.run, args=(stop,), name=f"slot-{n}")
            for n in range(self.concurrency)
        ]
        own_loop = self._start_loop()
        for thread in threads + slots:
            thread.start()
        try:
            for slot in slots:
                slot.join()
        finally:
            stop.set()
            self._state.wakeup.notify()
            for slot in slots:
                slot.join()
            for thread in threads:  # each notices `stop` soon, unless a connect hangs
                thread.join(timeout=RECONNECT_DELAY_SECONDS)
            self._stop_loop(own_loop)
            self._unregister()
            self.metrics.close()
        if self._state.fatal is not None:
            raise self._state.fatal

    # async handlers

    def _start_loop(self) -> EventLoopThread | None:
        """The event loop for the async subscriptions' batches, when the worker has some:
        the one it was given, else one of its own (returned, to stop at the end)."""
        if not any(s.is_async for s in self.subscriptions.values()):
            return None
        own: EventLoopThread | None = None
        loop = self._loop
        if loop is None:
            own = EventLoopThread()
            loop = own.loop
        self._loop_connections = LoopConnections(self._state, loop)
        return own

    def _async_db(self) -> Db:
        if self._loop_connections is None:
            raise RuntimeError("the worker's event loop is not running")
        return self._loop_connections.db()

    def _stop_loop(self, own: EventLoopThread | None) -> None:
        if self._loop_connections is not None:
            self._loop_connections.close()
        if own is not None:
            own.close(RECONNECT_DELAY_SECONDS)

    def _registration(self) -> dict[str, Any]:
        return self._state.registration()

    def _unregister(self) -> None:
        try:
            with self._state.connect() as conn:
                unregister_worker(Db(conn, self.engine.sql), self.id)
        except psycopg.OperationalError as error:  # the row is for inspection only
            log.warning("could not unregister the worker: %s", error, extra=self._state.fields())

    # around the slots

    def _wake_on_stop(self, stop: threading.Event) -> None:
        stop.wait()
        self._state.stopping = True
        self._state.wakeup.notify()  # idle slots wait on the wake-up, not on `stop`

    def _prune(self, stop: threading.Event) -> None:
        """Apply the streams' retention policies every retention_interval, the first time
        one interval after start (DESIGN.md, "Retention and gaps"); one worker of the
        database at a time does (an advisory lock), and a stop ends a run between two of
        its batches. Each batch commits on its own, so a run that a stop or an error ends
        still says what its batches removed."""
        # each partition's events removed so far by the run: progress hears every batch
        removed: dict[tuple[str, int], int] = {}

        def progress(cut: PartitionCut, count: int) -> None:
            removed[(cut.stream, cut.partition)] = count
            if stop.is_set():
                raise _Stopping

        while not stop.wait(self.settings.retention_interval):
            removed.clear()
            try:
                self.engine.run_retention(progress=progress)
            except _Stopping:
                self._pruned(removed, "stopped")
                return
            except Exception as error:  # retention waits for the next run: never fatal
                log.warning("pruning failed: %s", error_text(error), extra=self._state.fields())
                self._pruned(removed, "failed")
                continue
            self._pruned(removed, "finished")

    def _pruned(self, removed: dict[tuple[str, int], int], ended: str) -> None:
        """Count and log what a run removed; `ended`: finished, stopped or failed."""
        events = sum(removed.values())
        partitions = sum(1 for count in removed.values() if count)
        self.metrics.pruned(events)
        if events:
            log.info(
                "retention removed %s event(s) from %s partition(s)%s",
                events,
                partitions,
                _RUN_ENDED[ended],
                extra=self._state.fields(events=events, partitions=partitions, ended=ended),
            )


# how a pruning run's log line ends, by how the run ended
_RUN_ENDED = {
    "finished": "",
    "stopped": " before the worker stopped",
    "failed": " before the run failed",
}


class _Stopping(Exception):
    """The worker stops: a pruning run ends between two batches."""
