"""Webhook deliveries (DESIGN.md, "The gateway", push; docs/webhooks.md).

Each gateway process runs one `Deliveries`: a supervisor thread and, while some webhook
is active or failing, an engine `Worker` whose subscriptions are the webhooks' engine
subscriptions (at_least_once). So the delivery workers of every gateway process compete
through the engine's own partition locks, one batch in flight per partition (order kept),
and a killed process loses nothing: its batches' positions did not move, and another
process sends them again under the same webhook-id.

The supervisor, about every second: ends webhooks whose lease ran out (`expired`, their
positions deleted) or that failed longer than the failure timeout (`failed`); sends the
consent challenge of pending ones (a refusal deletes the webhook); and restarts the
worker when the set of webhooks to deliver changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import psycopg
from standardwebhooks import Webhook as Signer

from subengine.engine._engine import Engine
from subengine.gateway._callbacks import (
    CallbackClient,
    CallbackRefused,
    CallbackResponse,
    CallbackUnreachable,
)
from subengine.gateway._hub import tombstone_body
from subengine.model._errors import RetryLater, SubengineError
from subengine.model._events import Event, Tombstone
from subengine.model._gateway_cursor import GatewayCursor, StreamPosition
from subengine.outside import _webhooks
from subengine.outside._webhooks import (
    Deliverable,
    DeliveryContext,
    WebhookNotFound,
    WebhookStream,
)
from subengine.worker._worker import Worker

log = logging.getLogger("subengine.gateway.webhooks")

USER_AGENT = "subengine-webhooks/1"


@dataclass(frozen=True)
class DeliveryConfig:
    """How a gateway process delivers webhooks (docs/webhooks.md, "Configuration")."""

    # delivery slots of this process: batches in flight at once
    concurrency: int = 4
    # seconds a webhook may fail (deliveries or its challenge) before it is `failed`
    failure_timeout: float = 3600.0
    # the first retry waits about this long, doubled per failed attempt up to the longest
    # (each delay drawn at random between half and all of it); a Retry-After is honoured
    # up to `longest_retry_after`
    first_retry: float = 1.0
    longest_retry: float = 300.0
    longest_retry_after: float = 3600.0
    # seconds between the supervisor's rounds
    tick: float = 1.0
    # seconds an expired webhook stays shown before its row is removed
    keep_expired: float = 86_400.0


def message_id(
    serial: int, stream: str, partition: int, generation: int, after: int, through: int
) -> str:
    """The webhook-id of a batch: the same for every attempt to send it, wherever it is
    sent from. Its bounds are stored when the engine first reads it (at_least_once), so
    a batch sent again, after a failure or a crash, covers the same positions."""
    text = f"{serial}/{stream}/{partition}/{generation}/{after}/{through}"
    return "msg_" + hashlib.sha256(text.encode()).hexdigest()[:32]


def signed_headers(message: str, body: str, keys: Sequence[str]) -> dict[str, str]:
    """Standard Webhooks headers for `body`, signed with every key (during a rotation a
    receiver may know only one of them)."""
    now = datetime.now(UTC)
    signatures = " ".join(Signer(key).sign(message, now, body) for key in keys)
    return {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": message,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signatures,
    }


def event_body(event: Event, include_data: bool) -> dict[str, Any]:
    """An event as the gateway's pull API shows it."""
    body: dict[str, Any] = {
        "id": str(event.id),
        "stream": event.stream,
        "partition": event.partition,
        "position": event.position,
        "type": event.type,
        "key": event.key,
        "key_version": event.key_version,
        "occurred_at": event.occurred_at.isoformat(),
        "recorded_at": event.recorded_at.isoformat(),
        "metadata": event.metadata,
    }
    if include_data:
        body["data"] = event.data
    return body


class _Failed(Exception):
    """A delivery or challenge that did not succeed: the one-line reason, and the
    receiver's Retry-After when it sent one."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class _Cancelled(Exception):
    """The receiver answered 410 Gone: it wants nothing more under this id."""


def _outcome(response: CallbackResponse) -> None:
    if 200 <= response.status < 300:
        return
    if response.status == 410:
        raise _Cancelled
    raise _Failed(f"the callback answered {response.status}", response.retry_after())


class Deliveries:
    """The webhook delivery of one gateway process (its `client` is the caller's to
    close)."""

    def __init__(
        self,
        engine: Engine,
        client: CallbackClient,
        config: DeliveryConfig,
        on_round: Callable[[list[_webhooks.Webhook]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.client = client
        self.config = config
        self._on_round = on_round
        self._stop = threading.Event()
        self._woken = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker_stop = threading.Event()
        self._worker_thread: threading.Thread | None = None
        self._plan: list[Deliverable] = []
        # counts for /metrics: results of deliveries, events delivered
        self.results: dict[str, int] = {}
        self.events_delivered = 0
        self._count_lock = threading.Lock()
        # events delivered per webhook since they were last recorded: recorded once per
        # round, not per batch (each record is a write of the webhook's one row)
        self._succeeded: dict[str, int] = {}

    # running

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._supervise, name="webhook-deliveries", daemon=True
        )
        self._thread.start()

    def wake(self) -> None:
        """Look for work now (a webhook was created or changed in this process)."""
        self._woken.set()

    def stop(self) -> None:
        """Stop delivering: the batches in flight finish (or time out) first."""
        self._stop.set()
        self._woken.set()
        if self._thread is not None:
            self._thread.join()
        self._stop_worker()
        try:
            self._record_successes()
        except (psycopg.Error, SubengineError) as error:
            log.warning("webhook deliveries: the last successes were not recorded: %s", error)

    def _supervise(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except (psycopg.Error, SubengineError) as error:
                log.warning("webhook deliveries: %s; trying again", error)
            except Exception:
                log.exception("webhook deliveries: unexpected error; trying again")
            self._woken.wait(self.config.tick)
            self._woken.clear()

    def _round(self) -> None:
        self._record_successes()
        with self.engine.db() as db:
            for webhook_id, state in _webhooks.end_lapsed(db, self.config.failure_timeout):
                log.warning(
                    "webhook %s is now %s (%s)",
                    webhook_id,
                    state,
                    "its lease ran out" if state == "expired" else "failing too long",
                )
            db.run(_webhooks.forget_expired(self.config.keep_expired))
            challenges = db.run(_webhooks.claim_challenges(8, self.config.longest_retry))
        for challenge in challenges:
            if self._stop.is_set():
                break
            self._challenge(challenge)
        with self.engine.db() as db:
            plan = db.run(_webhooks.deliverable())
            shown = _webhooks.webhooks(db) if self._on_round is not None else []
        if self._on_round is not None:
            self._on_round(shown)
        if plan != self._plan:
            self._restart_worker(plan)

    def _restart_worker(self, plan: list[Deliverable]) -> None:
        self._stop_worker()
        self._plan = plan
        subscriptions = [
            subscription
            for hook in plan
            for index, stream in enumerate(hook.streams)
            for subscription in [self._declaration(hook, index, stream)]
        ]
        if not subscriptions:
            return
        worker = Worker(self.engine, subscriptions, concurrency=self.config.concurrency)
        stop = self._worker_stop = threading.Event()

        def run() -> None:
            try:
                worker.run(stop)
            except Exception:
                log.exception("the webhook delivery worker stopped")
                self._plan = []  # started again at the next round

        self._worker_thread = threading.Thread(target=run, name="webhook-worker", daemon=True)
        self._worker_thread.start()

    def _stop_worker(self) -> None:
        if self._worker_thread is not None:
            self._worker_stop.set()
            self._worker_thread.join()
        self._worker_thread = None
        self._plan = []

    def _declaration(self, hook: Deliverable, index: int, stream: WebhookStream) -> Any:
        declared = _webhooks.engine_subscription(
            hook.serial, index, stream, hook.max_events, hook.starts[index]
        )
        name = declared.name

        def deliver(events: Sequence[Event], conn: Any) -> None:
            self._deliver(hook, name, stream, events)

        def deliver_gap(gap: Tombstone, conn: Any) -> None:
            self._deliver_gap(hook, name, gap)

        return replace(declared, batch=deliver, gap=deliver_gap, on_gap="handler")

    # one batch

    def _context(self, hook: Deliverable, name: str) -> DeliveryContext | None:
        with self.engine.db() as db:
            context = db.run(_webhooks.delivery_context(hook.id, name))
        if context is not None and context.state not in ("active", "failing"):
            raise RetryLater(self.config.tick * 2, f"webhook {hook.id} is {context.state}")
        return context

    def _deliver(
        self, hook: Deliverable, name: str, stream: WebhookStream, events: Sequence[Event]
    ) -> None:
        context = self._context(hook, name)
        if context is None:
            return  # deleted: the position is gone too, so nothing commits
        # sent even when the filters leave no event: after/through stay a chain, so the
        # subscriber need not pull to learn that nothing was missed
        wanted = [event for event in events if stream.wants(event)]
        first, last = events[0], events[-1]
        body = self._body(
            hook, context, first.stream, first.partition, first.position - 1, last.position
        )
        body["events"] = [event_body(event, context.include_data) for event in wanted]
        self._send(hook, context, body, len(wanted))

    def _deliver_gap(self, hook: Deliverable, name: str, gap: Tombstone) -> None:
        context = self._context(hook, name)
        if context is None:
            return
        body = self._body(hook, context, gap.stream, gap.partition, gap.gap_from - 1, gap.gap_to)
        body["tombstones"] = [tombstone_body(gap)]
        self._send(hook, context, body, 0)

    def _body(
        self,
        hook: Deliverable,
        context: DeliveryContext,
        stream: str,
        partition: int,
        after: int,
        through: int,
    ) -> dict[str, Any]:
        positions = list(context.positions)
        if partition < len(positions):
            positions[partition] = through
        cursor = GatewayCursor({stream: StreamPosition(context.epoch, tuple(positions))})
        return {
            "type": "events",
            "subscription": hook.id,
            "generation": context.generation,
            "stream": stream,
            "partition": partition,
            "after": after,
            "through": through,
            "events": [],
            "tombstones": [],
            "cursor": cursor.encode(),
        }

    def _send(
        self, hook: Deliverable, context: DeliveryContext, body: dict[str, Any], events: int
    ) -> None:
        text = json.dumps(body, separators=(",", ":"))
        message = message_id(
            hook.serial,
            body["stream"],
            body["partition"],
            context.generation,
            body["after"],
            body["through"],
        )
        headers = signed_headers(message, text, context.secrets)
        try:
            _outcome(self.client.post(context.callback, text.encode(), headers))
        except _Cancelled:
            self._count("cancelled")
            log.warning("webhook %s: the callback answered 410 Gone; deleting it", hook.id)
            try:
                self.engine.delete_webhook(hook.id)
            except WebhookNotFound:
                pass
            return
        except (_Failed, CallbackRefused, CallbackUnreachable) as error:
            self._count("failed")
            retry_after = getattr(error, "retry_after", None)
            self._record_successes()  # first: a later record must not hide this failure
            with self.engine.db() as db:
                attempts = db.run(_webhooks.delivery_failed(hook.id, str(error)))
            delay = self._delay(attempts or 1, retry_after)
            raise RetryLater(delay, f"webhook {hook.id}: {error}") from None
        self._count("delivered", events)
        with self._count_lock:
            self._succeeded[hook.id] = self._succeeded.get(hook.id, 0) + events
        if context.state != "active":
            self._record_successes()  # failing no more: say so now, not at the next round

    def _record_successes(self) -> None:
        """Record the deliveries that succeeded since the last record: each webhook's
        last success, delivered count, and state active."""
        with self._count_lock:
            succeeded, self._succeeded = self._succeeded, {}
        if not succeeded:
            return
        try:
            with self.engine.db() as db, db.transaction():
                for webhook_id, events in sorted(succeeded.items()):
                    db.run(_webhooks.delivery_succeeded(webhook_id, events))
        except Exception:
            with self._count_lock:  # kept for the next try
                for webhook_id, events in succeeded.items():
                    self._succeeded[webhook_id] = self._succeeded.get(webhook_id, 0) + events
            raise

    def _delay(self, attempts: int, retry_after: float | None) -> float:
        """Exponential backoff with jitter; at least the receiver's Retry-After."""
        longest = self.config.longest_retry
        delay: float = min(longest, self.config.first_retry * 2.0 ** min(attempts - 1, 30))
        delay *= random.uniform(0.5, 1.0)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.config.longest_retry_after))
        return delay

    def _count(self, result: str, events: int = 0) -> None:
        with self._count_lock:
            self.results[result] = self.results.get(result, 0) + 1
            self.events_delivered += events

    # consent

    def _challenge(self, challenge: _webhooks.Challenge) -> None:
        token = secrets.token_urlsafe(24)
        body = json.dumps(
            {
                "type": "challenge",
                "subscription": challenge.id,
                "challenge": token,
                "lease_seconds": challenge.lease_seconds,
            },
            separators=(",", ":"),
        )
        message = "msg_challenge_" + secrets.token_hex(12)
        headers = signed_headers(message, body, (challenge.secret,))
        try:
            response = self.client.post(challenge.callback, body.encode(), headers)
            if response.status >= 500 or response.status == 429:
                raise _Failed(f"the callback answered {response.status}", response.retry_after())
            if 200 <= response.status < 300 and _echoed(response.body) == token:
                with self.engine.db() as db:
                    db.run(_webhooks.challenge_passed(challenge.id))
                log.info("webhook %s: the callback accepted the subscription", challenge.id)
                self.wake()
                return
        except (_Failed, CallbackRefused, CallbackUnreachable) as error:
            delay = self._delay(challenge.attempts + 1, getattr(error, "retry_after", None))
            with self.engine.db() as db:
                db.run(_webhooks.challenge_failed(challenge.id, str(error), delay))
            log.warning(
                "webhook %s: the challenge was not answered (%s); asking again in %.1f s",
                challenge.id,
                error,
                delay,
            )
            return
        log.warning(
            "webhook %s: the callback refused the subscription (status %s); deleting it",
            challenge.id,
            response.status,
        )
        try:
            self.engine.delete_webhook(challenge.id)
        except WebhookNotFound:
            pass


def _echoed(body: bytes) -> str | None:
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    echoed = answer.get("challenge") if isinstance(answer, dict) else None
    return echoed if isinstance(echoed, str) else None
