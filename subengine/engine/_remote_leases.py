"""The engine's methods for remote workers' leases (docs/remote-workers.md): claim, ack,
extend, release, nack, and the remote error policy. `Engine` inherits them; each runs one
function of `outside/_remote_leases` in a transaction of its own.
"""

from __future__ import annotations

import uuid
from contextlib import AbstractContextManager
from datetime import datetime

from subengine.db._sql import Db
from subengine.model._settings import Settings
from subengine.outside import _remote_leases
from subengine.outside._remote_leases import (
    DEFAULT_LEASE_SECONDS,
    Lease,
    LiveLease,
    RemoteSubscription,
)
from subengine.subscriptions._failures import Failure


class RemoteLeases:
    """Leases of remote workers, for `Engine`, which supplies `schema`, `settings` and
    `db()`."""

    schema: str
    settings: Settings

    def db(self) -> AbstractContextManager[Db]:
        raise NotImplementedError

    def claim_lease(
        self,
        subscription: str,
        worker: str,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        max_events: int | None = None,
    ) -> Lease | None:
        """Lease the partition of `subscription` whose next event is oldest among those no
        worker (local or remote) holds, with its next batch; None when none is free."""
        with self.db() as db:
            return _remote_leases.claim(
                db, self.schema, subscription, worker, lease_seconds, max_events
            )

    def ack_lease(self, subscription: str, lease_id: uuid.UUID, position: int | None = None) -> int:
        """Acknowledge a lease's batch up to `position` (default: all of it) and end the
        lease; the new position. LeaseConflict (nothing changed) when it is stale."""
        with self.db() as db:
            return _remote_leases.ack(db, subscription, lease_id, position)

    def extend_lease(
        self, subscription: str, lease_id: uuid.UUID, lease_seconds: float
    ) -> datetime:
        """Move a live lease's deadline to `lease_seconds` from now; the new deadline."""
        with self.db() as db:
            return _remote_leases.extend(db, subscription, lease_id, lease_seconds)

    def release_lease(self, subscription: str, lease_id: uuid.UUID) -> None:
        """End a live lease without acknowledging anything; its partition is free at once."""
        with self.db() as db:
            _remote_leases.release(db, subscription, lease_id)

    def nack_lease(
        self,
        subscription: str,
        lease_id: uuid.UUID,
        error: str,
        position: int | None = None,
        retry_after: float | None = None,
    ) -> Failure:
        """Event `position` of a lease (default: its first) failed with `error`: the
        events before it are acknowledged and the failure counts toward the remote error
        policy. What the policy did."""
        with self.db() as db:
            return _remote_leases.nack(
                db, subscription, lease_id, self.settings, error, position, retry_after
            )

    def set_remote_policy(
        self,
        subscription: str,
        on_error: str = "stop",
        max_attempts: int = 5,
        batch_size: int = 100,
    ) -> None:
        """Store the error policy (stop, dead_letter or park after `max_attempts`) and the
        batch size that remote workers of `subscription` follow."""
        with self.db() as db:
            _remote_leases.set_remote_policy(db, subscription, on_error, max_attempts, batch_size)

    def remote_subscription(self, subscription: str) -> RemoteSubscription:
        """`subscription`'s stream and remote policy; SubscriptionNotFound without one."""
        with self.db() as db:
            return _remote_leases.remote_subscription(db, subscription)

    def remote_leases(self, subscription: str) -> list[LiveLease]:
        """The live leases of `subscription` (who holds which partition until when)."""
        with self.db() as db:
            return _remote_leases.live_leases(db, subscription)
