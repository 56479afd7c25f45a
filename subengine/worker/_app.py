"""The registry users decorate: an `App` holds subscriptions, a subscription its handlers.

    app = subengine.App()
    billing = app.subscription("billing", stream="orders", start="beginning")

    @billing.handler("OrderPlaced")
    def placed(event, conn): ...

The declarations themselves (`Subscription`, `Start`, handlers) live in `_declarations`;
the App collects them and runs a worker for them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from subengine.model._declarations import Ack, OnError, Start, Subscription
from subengine.model._errors import InvalidInput

if TYPE_CHECKING:
    from subengine.engine._engine import Engine

__all__ = ["App", "Start", "Subscription"]


class App:
    """The subscriptions of an application, as the worker finds them (`--app MODULE:ATTR`)."""

    def __init__(self) -> None:
        self.subscriptions: dict[str, Subscription] = {}

    def run_worker(
        self,
        engine: Engine,
        subscriptions: Sequence[str] | None = None,
        *,
        concurrency: int = 1,
        stop: threading.Event | None = None,
        listen: bool = True,
        metrics_port: int | None = None,
        metrics_address: str | None = None,
    ) -> None:
        """Run a worker for some (default: all) of the app's subscriptions until `stop`.

        Blocks; run it in a thread to embed it. The current batches finish and every lock
        is released before it returns. With `metrics_port`, the worker serves Prometheus
        metrics over HTTP on that port of `metrics_address` (every interface by default)
        while it runs.
        """
        from subengine.worker._worker import Worker

        names = list(self.subscriptions) if subscriptions is None else list(subscriptions)
        unknown = [name for name in names if name not in self.subscriptions]
        if unknown or not names:
            raise InvalidInput(
                f"the app declares no subscription {', '.join(map(repr, unknown))}"
                if unknown
                else "the app declares no subscription"
            )
        worker = Worker(
            engine,
            [self.subscriptions[n] for n in names],
            concurrency=concurrency,
            listen=listen,
            metrics_port=metrics_port,
            metrics_address=metrics_address,
        )
        worker.run(stop or threading.Event())

    def subscription(
        self,
        name: str,
        *,
        stream: str,
        start: Start = "beginning",
        batch_size: int = 100,
        ack: Ack = "transactional",
        on_error: OnError = "stop",
        max_attempts: int = 5,
        on_gap: Literal["stop", "skip"] = "stop",
    ) -> Subscription:
        """Declare a subscription; register its handlers on the returned object."""
        if name in self.subscriptions:
            raise InvalidInput(f"the app declares subscription {name!r} twice")
        subscription = Subscription(
            name, stream, start, batch_size, ack, on_error, max_attempts, on_gap=on_gap
        )
        self.subscriptions[name] = subscription
        return subscription
