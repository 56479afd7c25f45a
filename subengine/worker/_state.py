"""What the threads of one worker share: its engine and subscriptions, the board and the
wake-up, the backoff, the metrics, the subscriptions it left, and the error that ends it."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg

from subengine.db._connection import SessionNeeded
from subengine.engine._engine import Engine
from subengine.model._declarations import Subscription
from subengine.model._errors import ConfigurationError, DatabaseUnavailable
from subengine.worker._board import Board, Wakeup
from subengine.worker._held import Backoff
from subengine.worker._metrics import WorkerMetrics

log = logging.getLogger("subengine.worker")

RECONNECT_DELAY_SECONDS = 1.0

# What needs a session of its own on a worker's connections (docs/pooler.md).
PARTITION_LOCKS = "a worker's partition locks"
POLLER_SESSION = "a worker's poller (LISTEN, and its session settings)"


class WorkerState:
    """One worker's shared state. The slots and the poller read it; what they change is
    `left` (a slot), `fatal` (whoever gives up on the database) and `stopping`."""

    def __init__(
        self,
        engine: Engine,
        subscriptions: Sequence[Subscription],
        *,
        listen: bool,
        look_limit: int,
        serves_metrics: bool,
    ) -> None:
        self.engine = engine
        self.settings = engine.settings
        self.subscriptions = {s.name: s for s in subscriptions}
        self.listen = listen
        self.lock_provider = engine.settings.lock_provider
        # whether its own connections may keep session state: see check_sessions
        self.sessions = True
        self.look_limit = look_limit
        self.serves_metrics = serves_metrics
        self.id = uuid.uuid4()
        # every connection of the worker carries it: the status views find the worker's
        # connections, and the holder of each partition lock, by it
        self.application_name = f"subengine worker {self.id}"
        self.board = Board(subscriptions)
        self.wakeup = Wakeup()
        self.backoff = Backoff(self.settings)
        self.metrics = WorkerMetrics(list(self.subscriptions))
        # subscriptions deleted while the worker runs: it leaves them alone
        self.left: set[str] = set()
        # set by a slot or the poller that gave up on the database; run() raises it
        self.fatal: Exception | None = None
        self.stopping = False

    def connect(
        self, autocommit: bool = False, session: str | None = None
    ) -> psycopg.Connection[Any]:
        """A new connection of the worker's own, named after it (`session`: what needs a
        session of its own on it, see `Engine.connect`)."""
        return self.engine.connect(
            application_name=self.application_name, autocommit=autocommit, session=session
        )

    def check_sessions(self) -> None:
        """Find out, before the slots start, whether the worker's own connections can
        have sessions of their own (directly, or through SUBENGINE_DIRECT_DSN). When they
        go through a transaction-mode pooler instead, the worker takes no advisory lock
        (the `rows` provider), polls instead of listening, sets nothing on its sessions
        and leaves pruning to others: all of which would stay behind in a server session
        other clients use. It says so once (docs/pooler.md)."""
        try:
            self.connect(autocommit=True, session=PARTITION_LOCKS).close()
        except SessionNeeded:
            self.sessions = False
            self.lock_provider = "rows"
            self.listen = False
            self._refuse_unlocked()
            log.warning(
                "worker %s: its connections go through a connection pooler and no direct "
                "one is set (SUBENGINE_DIRECT_DSN, itself not pooled): it takes no partition "
                "locks (a batch waits on its partition's row instead, and the status views "
                "show no holder), polls every %g s instead of listening "
                "(SUBENGINE_POLL_INTERVAL), and does not prune (docs/pooler.md)",
                self.id,
                self.settings.poll_interval,
                extra=self.fields(),
            )
        else:
            self._refuse_unlocked()

    def _refuse_unlocked(self) -> None:
        """Without partition locks (the `rows` provider) only a transactional batch keeps
        its partition to itself, by its row lock: an at_least_once batch runs its
        handlers after its first transaction committed, so a second slot could run the
        same batch meanwhile. Such subscriptions are refused (ConfigurationError)."""
        if self.lock_provider != "rows":
            return
        for subscription in self.subscriptions.values():
            if subscription.ack == "at_least_once":
                raise ConfigurationError(
                    f"subscription {subscription.name!r} acknowledges at least once, which "
                    "needs partition locks (its handlers run outside the batch's "
                    "transaction), and this worker has none (lock provider rows): set "
                    "SUBENGINE_DIRECT_DSN behind a pooler, or another SUBENGINE_LOCK_PROVIDER"
                )

    def connect_own(self, what: str) -> psycopg.Connection[Any]:
        """A connection for `what`, which wants a session of its own (an autocommit
        connection through SUBENGINE_DIRECT_DSN when set); a pooled one when the worker
        found it has no sessions (`check_sessions`)."""
        return self.connect(autocommit=True, session=what if self.sessions else None)

    def serving(self) -> list[str]:
        """The subscriptions the worker runs, but those it left."""
        return [name for name in self.subscriptions if name not in self.left]

    def registration(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "names": list(self.subscriptions),
            "serves_metrics": self.serves_metrics,
        }

    def gave_up(self, outage_since: float, error: Exception, stop: threading.Event) -> bool:
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

    def fields(self, **fields: Any) -> dict[str, Any]:
        """Structured log fields (`extra=`): the worker's id and the given ones."""
        return {"worker_id": str(self.id), **fields}
