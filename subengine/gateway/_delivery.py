"""Webhook deliveries (DESIGN.md, "The gateway", push; docs/webhooks.md).

Each gateway process runs one `Deliveries`: a supervisor thread and, while some webhook
is active or failing, an engine `Worker` whose subscriptions are the webhooks' engine
subscriptions (at_least_once). So the delivery workers of every gateway process compete
through the engine's own partition locks, one batch in flight per partition (order kept),
and a killed process loses nothing: its batches' positions did not move, and another
process sends them again under the same webhook-id. Its slots take a plain batch in two
statements, its events' JSON made by PostgreSQL and spliced into the body as bytes
(`_delivery_turns`); the engine's batch, whose handlers are here too, takes the rest.

The supervisor's rounds end webhooks whose lease ran out (`expired`, their positions
deleted) or that failed longer than the failure timeout (`failed`); send the consent
challenge of pending ones (a refusal deletes the webhook); record successes; and restart
the worker when the set of webhooks to deliver changed. A round runs only when something
can have changed: this process woke it, another one notified a change of the webhooks
(the listener's `WEBHOOKS_CHANGED`), a deadline the last round read comes due, or a
delivery succeeded or failed (within a tick). Besides, a slow safety poll covers a lost
notification; while the listener does not listen, rounds run every tick, as they must.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson
import psycopg

from subengine.engine._engine import Engine
from subengine.gateway._callbacks import (
    CallbackClient,
    CallbackRefused,
    CallbackResponse,
    CallbackUnreachable,
)
from subengine.gateway._delivery_bodies import (
    batch_body,
    batch_cursor,
    event_body,
    message_id,
    signed_headers,
    trace_headers,
)
from subengine.gateway._delivery_turns import DeliveryWorker, Route
from subengine.gateway._hub import tombstone_body
from subengine.model._errors import ConfigurationError, RetryLater, SubengineError
from subengine.model._events import Event, Tombstone
from subengine.outside import _webhooks
from subengine.outside._webhook_batches import ClaimedBatch
from subengine.outside._webhooks import (
    Deliverable,
    DeliveryContext,
    WebhookNotFound,
    WebhookStream,
)
from subengine.streams._listener import Changes

log = logging.getLogger("subengine.gateway.webhooks")

# Seconds after a deadline the round comes: PostgreSQL's clock has passed it by then.
_DEADLINE_SLACK_SECONDS = 0.05
# While a stop waits for the batches in flight, how often it makes sure PostgreSQL still
# answers (and how long it gives it): once it does not, nothing in flight can commit, and
# the stop waits no longer.
_STOP_CHECK_SECONDS = 1.0


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
    # seconds between the supervisor's rounds while notifications do not arrive (or
    # deliveries succeed or fail, which are recorded once a round)
    tick: float = 1.0
    # seconds between the supervisor's rounds while nothing happens and the listener
    # listens: only a lost notification needs them (each notification or reconnection of
    # the listener runs a round at once), so the longest wait that still bounds the delay
    # of a webhook made by another process when a notification is lost
    safety_poll: float = 60.0
    # seconds an expired webhook stays shown before its row is removed
    keep_expired: float = 86_400.0


class _Failed(Exception):
    """A delivery or challenge that did not succeed: the one-line reason, and the
    receiver's Retry-After when it sent one."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class _Cancelled(Exception):
    """The receiver answered 410 Gone: it wants nothing more under this id."""


@dataclass(frozen=True, slots=True)
class _Target:
    """Where and how a batch is sent: the callback, the secrets that sign it, the
    subscription's generation (in the body and the webhook-id) and the webhook's state
    when the batch was read."""

    callback: str
    secrets: tuple[str, ...]
    generation: int
    state: str


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
        # a round now (a wake or a notified change), and a round at the next tick (a
        # delivery's success or failure to record, a worker to start again)
        self._woken = threading.Event()
        self._soon = threading.Event()
        self._changes: Changes | None = None
        # rounds run since the start (for tests and /metrics)
        self.rounds = 0
        self._thread: threading.Thread | None = None
        self._worker_stop = threading.Event()
        self._worker_thread: threading.Thread | None = None
        self._plan: list[Deliverable] = []
        self._refused = False  # whether the delivery worker was refused for good
        # counts for /metrics: results of deliveries, events delivered
        self.results: dict[str, int] = {}
        self.events_delivered = 0
        self._count_lock = threading.Lock()
        # events delivered per webhook since they were last recorded: recorded once per
        # round, not per batch (each record is a write of the webhook's one row)
        self._succeeded: dict[str, int] = {}

    # running

    def start(self, changes: Changes | None = None) -> None:
        """Start the supervisor. `changes` counts the notified changes of the webhooks
        (`WEBHOOKS_CHANGED`; its `wake` should be this `wake`): while it listens, rounds
        run when woken and at the safety poll; without it, every tick."""
        self._changes = changes
        self._thread = threading.Thread(
            target=self._supervise, name="webhook-deliveries", daemon=True
        )
        self._thread.start()

    def wake(self) -> None:
        """Look for work now: a webhook was created or changed in this process, or
        another one notified a change."""
        self._woken.set()

    def stop(self) -> None:
        """Stop delivering: the batches in flight finish (or time out) first, unless
        PostgreSQL stopped answering (then they cannot commit, and the stop returns within
        seconds, leaving the daemon threads that wait for it)."""
        self._stop.set()
        self._woken.set()
        self._worker_stop.set()
        if self._thread is not None and not self._ended(self._thread):
            return
        self._worker_stop.set()  # the supervisor may have started another one meanwhile
        if self._worker_thread is not None and not self._ended(self._worker_thread):
            return
        self._stop_worker()
        try:
            self._record_successes()
        except (psycopg.Error, SubengineError) as error:
            log.warning("webhook deliveries: the last successes were not recorded: %s", error)

    def _ended(self, thread: threading.Thread) -> bool:
        """Wait for `thread` to end while PostgreSQL answers; whether it ended."""
        while True:
            thread.join(_STOP_CHECK_SECONDS)
            if not thread.is_alive():
                return True
            if not self.engine.reachable(_STOP_CHECK_SECONDS):
                log.warning(
                    "webhook deliveries: PostgreSQL does not answer; stopping without "
                    "waiting for the batches in flight (they are sent again later)"
                )
                return False

    def _supervise(self) -> None:
        while not self._stop.is_set():
            # cleared before the round: a wake during it runs another
            self._woken.clear()
            self._soon.clear()
            wait = self.config.tick
            try:
                wait = self._round()
            except (psycopg.Error, SubengineError) as error:
                log.warning("webhook deliveries: %s; trying again", error)
            except Exception:
                log.exception("webhook deliveries: unexpected error; trying again")
            self._rest(wait)

    def _listening(self) -> bool:
        return self._changes is not None and self._changes.listening

    def _rest(self, wait: float) -> None:
        """Wait up to `wait` seconds for the next round: less when woken, and at the next
        tick when a round is wanted soon or the listener stopped listening."""
        deadline = time.monotonic() + wait
        while not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._woken.wait(min(remaining, self.config.tick)):
                return
            if self._soon.is_set() or not self._listening():
                return

    def _round(self) -> float:
        """One round; the seconds until the next one is due."""
        self.rounds += 1
        recorded = self._record_successes()
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
            due = db.run(
                _webhooks.next_deadline(self.config.failure_timeout, self.config.keep_expired)
            )
            shown = _webhooks.webhooks(db) if self._on_round is not None else []
        if self._on_round is not None:
            self._on_round(shown)
        if plan != self._plan:
            self._restart_worker(plan)
        wait = self.config.safety_poll if self._listening() else self.config.tick
        if recorded:
            # once more a tick later: the positions of the batches just recorded commit
            # after their POST, and the lag shown must follow them
            wait = self.config.tick
        if due is not None:
            wait = min(wait, max(due, 0.0) + _DEADLINE_SLACK_SECONDS)
        return wait

    def _restart_worker(self, plan: list[Deliverable]) -> None:
        self._stop_worker()
        self._plan = plan
        subscriptions = []
        routes: dict[str, Route] = {}
        for hook in plan:
            for index, stream in enumerate(hook.streams):
                declared = self._declaration(hook, index, stream)
                subscriptions.append(declared)
                routes[declared.name] = (hook, stream)
        if not subscriptions:
            return
        worker = DeliveryWorker(
            self.engine, subscriptions, routes, self._send_claimed, self.config.concurrency
        )
        stop = self._worker_stop = threading.Event()

        def run() -> None:
            try:
                worker.run(stop)
            except ConfigurationError as error:
                # what no round can change (a pooler and no direct connection: see
                # docs/pooler.md): said once, and the plan stays, so it is not retried
                if not self._refused:
                    self._refused = True
                    log.warning("webhook deliveries are off: %s", error)
            except Exception:
                log.exception("the webhook delivery worker stopped")
                self._plan = []  # started again at the next round
                self._soon.set()

        self._worker_thread = threading.Thread(target=run, name="webhook-worker", daemon=True)
        self._worker_thread.start()

    def _stop_worker(self) -> None:
        if self._worker_thread is not None:
            self._worker_stop.set()
            self._worker_thread.join()
        self._worker_thread = None
        self._plan = []

    def _declaration(self, hook: Deliverable, index: int, stream: WebhookStream) -> Any:
        """The engine subscription of a webhook's stream, whose handlers deliver what the
        delivery worker's short way leaves to the engine (see `_delivery_turns`)."""
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

    def _send_claimed(self, route: Route, partition: int, batch: ClaimedBatch) -> None:
        """Send a batch the delivery worker claimed (its events' JSON made by
        PostgreSQL)."""
        hook, stream = route
        cursor = batch_cursor(stream.stream, batch.epoch, batch.positions, partition, batch.through)
        body = batch_body(
            hook.id,
            batch.subscription_generation,
            stream.stream,
            partition,
            batch.position,
            batch.through,
            b"" if batch.events is None else batch.events.encode(),
            b"",
            cursor,
        )
        self._send(
            hook,
            _Target(batch.callback, batch.secrets, batch.subscription_generation, batch.state),
            stream.stream,
            partition,
            batch.position,
            batch.through,
            body,
            batch.wanted,
        )

    def _context(self, hook: Deliverable, name: str) -> DeliveryContext | None:
        with self.engine.db() as db:
            context = db.run(_webhooks.delivery_context(hook.id, name))
        if context is not None and context.state not in ("active", "failing"):
            raise RetryLater(self.config.tick * 2, f"webhook {hook.id} is {context.state}")
        return context

    def _deliver(
        self, hook: Deliverable, name: str, stream: WebhookStream, events: Sequence[Event]
    ) -> None:
        """Deliver a batch the engine read (see `_declaration`)."""
        context = self._context(hook, name)
        if context is None:
            return  # deleted: the position is gone too, so nothing commits
        # sent even when the filters leave no event: after/through stay a chain, so the
        # subscriber need not pull to learn that nothing was missed
        wanted = [event for event in events if stream.wants(event)]
        first, last = events[0], events[-1]
        encoded = ",".join(
            json.dumps(event_body(event, context.include_data), separators=(",", ":"))
            for event in wanted
        )
        self._send_read(
            hook, context, first.stream, first.partition, first.position - 1, last.position,
            encoded.encode(), b"", len(wanted),
        )  # fmt: skip

    def _deliver_gap(self, hook: Deliverable, name: str, gap: Tombstone) -> None:
        context = self._context(hook, name)
        if context is None:
            return
        self._send_read(
            hook, context, gap.stream, gap.partition, gap.gap_from - 1, gap.gap_to, b"",
            orjson.dumps(tombstone_body(gap)), 0,
        )  # fmt: skip

    def _send_read(
        self,
        hook: Deliverable,
        context: DeliveryContext,
        stream: str,
        partition: int,
        after: int,
        through: int,
        events: bytes,
        tombstones: bytes,
        count: int,
    ) -> None:
        cursor = batch_cursor(stream, context.epoch, context.positions, partition, through)
        generation = context.generation
        body = batch_body(
            hook.id, generation, stream, partition, after, through, events, tombstones, cursor
        )
        target = _Target(context.callback, context.secrets, generation, context.state)
        self._send(hook, target, stream, partition, after, through, body, count)

    def _send(
        self,
        hook: Deliverable,
        target: _Target,
        stream: str,
        partition: int,
        after: int,
        through: int,
        body: bytes,
        events: int,
    ) -> None:
        """POST a batch; return when the callback took it (or cancelled the webhook), or
        raise RetryLater."""
        message = message_id(hook.serial, stream, partition, target.generation, after, through)
        headers = signed_headers(message, body, target.secrets)
        headers.update(trace_headers(body))
        try:
            _outcome(self.client.post(target.callback, body, headers))
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
            self._soon.set()  # the next round reads when its failure timeout passes
            delay = self._delay(attempts or 1, retry_after)
            raise RetryLater(delay, f"webhook {hook.id}: {error}") from None
        self._count("delivered", events)
        with self._count_lock:
            self._succeeded[hook.id] = self._succeeded.get(hook.id, 0) + events
        self._soon.set()  # recorded at the next round
        if target.state != "active":
            self._record_successes()  # failing no more: say so now, not at the next round

    def _record_successes(self) -> bool:
        """Record the deliveries that succeeded since the last record: each webhook's
        last success, delivered count, and state active. Whether there were any."""
        with self._count_lock:
            succeeded, self._succeeded = self._succeeded, {}
        if not succeeded:
            return False
        try:
            with self.engine.db() as db, db.transaction():
                for webhook_id, events in sorted(succeeded.items()):
                    db.run(_webhooks.delivery_succeeded(webhook_id, events))
        except Exception:
            with self._count_lock:  # kept for the next try
                for webhook_id, events in succeeded.items():
                    self._succeeded[webhook_id] = self._succeeded.get(webhook_id, 0) + events
            raise
        return True

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
        ).encode()
        message = "msg_challenge_" + secrets.token_hex(12)
        headers = signed_headers(message, body, (challenge.secret,))
        try:
            response = self.client.post(challenge.callback, body, headers)
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
