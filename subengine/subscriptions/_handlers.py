"""Calling a subscription's handlers on the connection of a `Db`: plain handlers with its
psycopg `Connection`, async handlers awaited on the event loop of a `LoopDb` with its
`AsyncConnection`. Every place that runs handlers (a batch, a gap, a dead letter's or a
parked key's retry) goes through here, so each works the same for both kinds."""

from __future__ import annotations

from collections.abc import Sequence

from subengine.db._loop import LoopDb
from subengine.db._sql import Db
from subengine.model._declarations import Subscription
from subengine.model._errors import InvalidInput
from subengine.model._events import Event, Tombstone


def run_handlers(
    db: Db, subscription: Subscription, events: Sequence[Event], in_transaction: bool
) -> None:
    """The subscription's handlers for `events`, given the connection when
    `in_transaction` (transactional subscriptions), else None."""
    if not subscription.is_async:
        subscription.handle(events, db.conn if in_transaction else None)
        return
    loop_db = _loop_db(db, subscription)
    loop_db.wait(subscription.handle_async(events, loop_db.async_conn if in_transaction else None))


def run_gap_handler(db: Db, subscription: Subscription, gap: Tombstone) -> None:
    """The subscription's gap handler, in the batch's transaction."""
    if not subscription.is_async:
        subscription.handle_gap(gap, db.conn)
        return
    loop_db = _loop_db(db, subscription)
    loop_db.wait(subscription.handle_gap_async(gap, loop_db.async_conn))


def _loop_db(db: Db, subscription: Subscription) -> LoopDb:
    if isinstance(db, LoopDb):
        return db
    raise InvalidInput(
        f"subscription {subscription.name!r} has async handlers, which only the worker can "
        "run (subengine worker, App.run_worker, AsyncWorker): this call runs handlers "
        "synchronously"
    )
