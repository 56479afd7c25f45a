"""The delivery worker of a gateway process: an engine `Worker` (its looks, partition
locks, notifications, backoff and error policy) whose slots take a plain webhook batch in
two statements of their own instead of the engine's batch transaction.

A slot's turn on a partition: `claim_batch` locks the position row, stores the batch's
bounds and returns the batch with its events' JSON, as one autocommitted statement; the
batch is posted; `commit_batch` moves the position (compare-and-set) in another. A stored
end is durable before the POST (a retry after a crash of this process or of PostgreSQL is
the same batch, under the same webhook-id); the position's move is not waited for: a
crash of PostgreSQL may lose the last moves, and their batches are then sent again, each
the same batch (webhooks are at_least_once; the claim that stores the next end flushes
every move before it; docs/webhooks.md says what retention and a failover change). A
batch the claim finds not plain (a gap, missing events, a failure being retried, a halted
partition, a webhook not delivered) is the engine's turn, unchanged; so is a batch whose
delivery raised an unexpected error. Its slots lock partitions with the `builtin`
provider where the setting says `pals` (docs/pooler.md, "Lock providers").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import psycopg

from subengine.db._sql import Db
from subengine.engine._engine import Engine
from subengine.model._declarations import Subscription
from subengine.model._errors import Fenced, RetryLater
from subengine.outside._webhook_batches import ClaimedBatch, claim_batch, commit_batch
from subengine.outside._webhooks import Deliverable, WebhookStream
from subengine.subscriptions._batches import BatchOutcome
from subengine.subscriptions._failures import BatchFailed, postpone_batch
from subengine.worker._reporting import Reporter
from subengine.worker._scheduling import Slots
from subengine.worker._state import WorkerState
from subengine.worker._turn import ConnectionLost, TurnEnd, Turns
from subengine.worker._worker import Worker

log = logging.getLogger("subengine.gateway.webhooks")

# A webhook's stream behind an engine subscription: the webhook and that stream's filters.
Route = tuple[Deliverable, WebhookStream]
# Sends a claimed batch of a partition: returns when the callback took it (or cancelled
# the webhook), raises RetryLater when it is to be sent again later.
Send = Callable[[Route, int, ClaimedBatch], None]


class DeliveryWorker(Worker):
    """A `Worker` of webhook engine subscriptions whose slots take plain batches the
    short way (see the module's docstring)."""

    def __init__(
        self,
        engine: Engine,
        subscriptions: Sequence[Subscription],
        routes: dict[str, Route],
        send: Send,
        concurrency: int,
    ) -> None:
        super().__init__(engine, subscriptions, concurrency=concurrency)
        state = self._state
        if state.lock_provider == "pals":
            # the same lock keys, so pals workers and these slots still exclude each other,
            # in one statement per switch instead of two through SQLAlchemy: oldest-first
            # delivery switches partitions on about every other batch (issue 26: gateway
            # CPU per 100-event batch about 0.8 -> 0.6 ms, PostgreSQL's 0.7 -> 0.6 ms)
            state.lock_provider = "builtin"
        self._slots = Slots(state, _DeliveryTurns(state, Reporter(state), routes, send))


class _DeliveryTurns(Turns):
    def __init__(
        self, state: WorkerState, report: Reporter, routes: dict[str, Route], send: Send
    ) -> None:
        super().__init__(state, report)
        self._routes = routes
        self._send = send

    def take(
        self,
        db: Db,
        subscription: Subscription,
        partition: int,
        stop: threading.Event,
        companions: bool = True,
    ) -> TurnEnd:
        route = self._routes.get(subscription.name)
        # a webhook's engine subscription stops on an error; another policy (parking sets
        # events aside in the engine's batch) is the engine's batch's to follow
        if route is not None and subscription.on_error == "stop" and not stop.is_set():
            # as the engine's turn does: a partition whose head grew during the batch is
            # a suspect again for the next look (see `Board.grew_since`)
            news = self._board.news()
            try:
                end = self._plain(db, subscription, partition, route)
            except BaseException:
                self._board.grew_since(subscription.name, subscription.stream, [partition], news)
                raise
            if end is not None:
                self._board.grew_since(subscription.name, subscription.stream, [partition], news)
                return end
        return super().take(db, subscription, partition, stop, companions)

    def _plain(
        self, db: Db, subscription: Subscription, partition: int, route: Route
    ) -> TurnEnd | None:
        """One plain batch of the partition: how the turn ends, or None when the
        engine's turn is to take it (nothing was written, or the delivery raised an
        unexpected error)."""
        hook, stream = route
        key = (subscription.name, partition)
        conn = db.conn
        started = time.monotonic()
        autocommit = conn.autocommit
        try:
            conn.autocommit = True  # each statement commits on its own: no BEGIN, no COMMIT
            try:
                claimed = db.run(
                    claim_batch(
                        hook.id,
                        subscription.name,
                        subscription.stream,
                        partition,
                        subscription.batch_size,
                        stream.types,
                        stream.keys,
                    )
                )
                if claimed is None:
                    return None
                try:
                    self._send(route, partition, claimed)
                except RetryLater as error:
                    failed = BatchFailed(
                        error,
                        claimed.through - claimed.position,
                        claimed.through,
                        claimed.position,
                        claimed.generation,
                        partition,
                        False,
                    )
                    recorded = postpone_batch(db, subscription, failed)
                    self._report.postponed(subscription, failed, recorded)
                    self._backoff.succeeded(key)
                    return None, False, set()
                except (psycopg.Error, ConnectionLost):
                    raise
                except Exception:
                    log.exception(
                        "webhook %s: delivering positions %s to %s of partition %s failed; "
                        "handing the batch to the engine's error policy",
                        hook.id,
                        claimed.position + 1,
                        claimed.through,
                        partition,
                    )
                    return None
                moved, next_time = db.run(
                    commit_batch(subscription.name, subscription.stream, partition, claimed)
                )
            finally:
                if not (conn.closed or conn.broken):
                    conn.autocommit = autocommit
        except psycopg.Error as error:
            if conn.broken or conn.closed:
                raise ConnectionLost(f"the worker's connection broke: {error}") from error
            delay = self._backoff.failed(key)
            self._report.database_trouble(subscription, partition, error, delay)
            return None, False, set()
        self._backoff.succeeded(key)
        if not moved:
            self._report.fenced(
                subscription,
                Fenced(
                    f"the position of {subscription.name!r} in partition {partition} moved "
                    "during the batch; nothing of it was committed"
                ),
            )
            return None, False, set()
        outcome = BatchOutcome(partition, claimed.through - claimed.position, claimed.through,
                               next_time)  # fmt: skip
        self._report.batch_committed(subscription, [outcome], time.monotonic() - started)
        self._board.retry_deferred()
        return next_time, next_time is None, set()
