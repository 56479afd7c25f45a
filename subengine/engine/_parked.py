"""The engine's methods for parked keys (policy `on_error="park"`, docs/parking.md): list
them, show their events, retry and discard them. `Engine` inherits them; each runs one
function of `subscriptions/_parking`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import psycopg

from subengine.db._sql import SQL, Db
from subengine.model._declarations import Subscription
from subengine.model._records import ParkedEvent, ParkedKey
from subengine.subscriptions import _parking
from subengine.subscriptions._parking import ParkedKeyRetry


class ParkedKeys:
    """Parked keys, for `Engine`, which supplies `sql`, `connect()`, `connection()` and
    `db()`."""

    sql: SQL

    def connect(self, *, autocommit: bool = False) -> psycopg.Connection[Any]:
        raise NotImplementedError

    def connection(
        self, *, autocommit: bool = False
    ) -> AbstractContextManager[psycopg.Connection[Any]]:
        raise NotImplementedError

    def db(self) -> AbstractContextManager[Db]:
        raise NotImplementedError

    def _handlers_db(
        self, subscription: Subscription, autocommit: bool = False
    ) -> AbstractContextManager[Db]:
        raise NotImplementedError

    def parked_keys(
        self, name: str | None = None, key: str | None = None, everything: bool = False
    ) -> list[ParkedKey]:
        """Keys parked now (of subscription `name`, of `key`), oldest first; with
        `everything`, those retried, discarded or superseded by a reset too."""
        query = _parking.parked_keys(name, key, everything)
        with self.connection() as conn:
            return self.sql.run(conn, query)

    def parked_events(self, name: str, key: str) -> list[ParkedEvent]:
        """The events parked under subscription `name`'s key `key` (its open parking,
        else its latest), in position order, each with what became of it."""
        with self.db() as db:
            return _parking.parked_events(db, name, key)

    def retry_parked_key(self, subscription: Subscription, key: str) -> ParkedKeyRetry:
        """Replay the events parked under `key` through `subscription`'s handlers, in
        position order, each exactly once (a transaction per batch_size events, fenced
        like a batch); when none is left, the key is clear and workers handle its later
        events. What it did: how many events it replayed, the handlers' error if they
        failed again (recorded; the key stays parked), or that a reset released the key
        meanwhile."""
        with self._handlers_db(subscription, autocommit=True) as db:  # a transaction per step
            return _parking.retry_parked_key(db, subscription, key)

    def discard_parked_key(self, name: str, key: str) -> int:
        """Release subscription `name`'s parked key `key` without handling its events
        (they stay listed, discarded); later events of the key are handled. The number
        of events discarded."""
        with self.db() as db:
            return _parking.discard_parked_key(db, name, key)
