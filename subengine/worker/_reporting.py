"""How a worker reports what its batches did: the metrics it counts and the log lines
it writes for each outcome (committed, events of parked keys set aside, failed, split,
postponed, a gap passed, a database error, a fenced batch, a subscription gone, events
missing). No database work here."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import psycopg

from subengine.model._declarations import Subscription
from subengine.model._errors import Fenced, PositionsMissing, RetryLater, SubscriptionNotFound
from subengine.model._events import Tombstone
from subengine.subscriptions._batches import BatchOutcome
from subengine.subscriptions._failures import BatchFailed, Failure, error_text
from subengine.worker._state import WorkerState

log = logging.getLogger("subengine.worker")


class Reporter:
    """The outcomes of one worker's batches, counted in its metrics and logged with its
    structured fields."""

    def __init__(self, state: WorkerState) -> None:
        self._state = state
        self._metrics = state.metrics

    def gap_passed(self, subscription: Subscription, gap: Tombstone) -> None:
        action = "handled" if subscription.gap is not None else "skipped"
        self._metrics.gap_passed(subscription.name, action, gap.gap_to - gap.gap_from + 1)
        log.warning(
            "subscription %s: %s; %s (recorded in the gaps table)",
            subscription.name,
            gap,
            "its gap handler ran" if action == "handled" else "skipped (on_gap='skip')",
            extra=self._state.fields(
                subscription=subscription.name,
                partition=gap.partition,
                from_position=gap.gap_from,
                to_position=gap.gap_to,
            ),
        )

    def database_trouble(
        self, subscription: Subscription, partition: int, error: Exception, delay: float
    ) -> None:
        """A batch met a database error (or an unexpected one); its partition waits
        `delay` seconds."""
        self._metrics.database_error(subscription.name)
        log.warning(
            "subscription %s partition %s: %s: %s; trying again in %.1f s (no attempt of "
            "its events is counted)",
            subscription.name,
            partition,
            "database error" if isinstance(error, psycopg.Error) else "unexpected error",
            error_text(error),
            delay,
            exc_info=not isinstance(error, psycopg.Error),
            extra=self._state.fields(
                subscription=subscription.name,
                partition=partition,
                error=error_text(error),
                retry_in=round(delay, 3),
            ),
        )

    def left_at_stop(self, subscription: Subscription, partition: int, error: Exception) -> None:
        """The worker stops, and the partition's batch failed (or its events were being
        handled again in parts): what of it had not committed rolled back, and is left to
        the next worker, which starts from the partition's committed position."""
        log.warning(
            "subscription %s partition %s: the batch in progress failed (%s) while the "
            "worker stops: it is not tried again; what of it had not committed rolled "
            "back, for the next worker",
            subscription.name,
            partition,
            error_text(error),
            extra=self._state.fields(
                subscription=subscription.name, partition=partition, error=error_text(error)
            ),
        )

    def postponed(self, subscription: Subscription, failed: BatchFailed, recorded: bool) -> None:
        """A handler raised RetryLater; `recorded`: the delay was stored (the position
        had not moved)."""
        self._metrics.batch_failed(subscription.name, False)
        seconds = failed.error.seconds if isinstance(failed.error, RetryLater) else 0.0
        log.warning(
            "subscription %s partition %s: %s; the batch is handled again in %.1f s%s",
            subscription.name,
            failed.partition,
            failed.error,
            seconds,
            "" if recorded else " (the position moved meanwhile: not recorded)",
            extra=self._state.fields(
                subscription=subscription.name,
                partition=failed.partition,
                retry_in=round(seconds, 3),
                error=error_text(failed.error),
            ),
        )

    def batch_split(self, subscription: Subscription, failed: BatchFailed) -> None:
        self._metrics.batch_failed(subscription.name, False)
        log.warning(
            "subscription %s partition %s: a batch of %s failed (%s: %s); handling %s",
            subscription.name,
            failed.partition,
            "several partitions" if failed.shared else f"{failed.events} events",
            type(failed.error).__name__,
            failed.error,
            "its partitions one at a time" if failed.shared
            else "them one at a time to find the failing one",
            extra=self._state.fields(
                subscription=subscription.name,
                partition=failed.partition,
                events=failed.events,
                to_position=failed.last_position,
                error=f"{type(failed.error).__name__}: {failed.error}",
            ),
        )  # fmt: skip

    def batch_committed(
        self, subscription: Subscription, outcomes: Sequence[BatchOutcome], seconds: float
    ) -> None:
        parked = sum(outcome.parked for outcome in outcomes)
        self._metrics.batch_committed(
            subscription.name, sum(outcome.handled for outcome in outcomes), seconds, parked
        )
        if parked:
            log.info(
                "subscription %s: %s event(s) of parked keys set aside",
                subscription.name,
                parked,
                extra=self._state.fields(subscription=subscription.name, events=parked),
            )
        if not log.isEnabledFor(logging.DEBUG):
            return
        for outcome in outcomes:
            # positions are dense: the batch held the handled and parked positions up to
            # the new one
            first = outcome.position - outcome.handled - outcome.parked + 1
            log.debug(
                "subscription %s partition %s: positions %s to %s in %.3f s",
                subscription.name,
                outcome.partition,
                first,
                outcome.position,
                seconds,
                extra=self._state.fields(
                    subscription=subscription.name,
                    partition=outcome.partition,
                    from_position=first,
                    to_position=outcome.position,
                    events=outcome.handled,
                    seconds=round(seconds, 6),
                ),
            )

    def batch_failed(
        self, subscription: Subscription, partition: int, failure: Failure, error: Exception
    ) -> None:
        dead_lettered = failure.action == "dead_lettered"
        self._metrics.batch_failed(subscription.name, dead_lettered)
        if failure.action == "parked":
            self._metrics.key_parked(subscription.name)
        fields = self._state.fields(
            subscription=subscription.name,
            partition=partition,
            attempts=failure.attempts,
            max_attempts=subscription.max_attempts,
            error=error_text(error),
        )
        if failure.key is not None:
            fields["key"] = failure.key
        where = f"subscription {subscription.name} partition {partition}"
        if failure.action == "fenced":
            log.info(
                "%s: a batch failed (%s), but the position moved meanwhile (a reset or "
                "another worker): nothing was recorded",
                where,
                error_text(error),
                extra=fields,
            )
            return
        log.warning(
            "%s: batch failed (attempt %s of %s): %s",
            where,
            failure.attempts,
            subscription.max_attempts,
            error_text(error),
            extra=fields,
        )
        outcomes = {
            "dead_lettered": "the failing event went to the dead letters; the partition goes on",
            "parked": f"key {failure.key!r} is parked: the failing event and every later "
            "event of the key are set aside until `subengine parked retry` or `discard`; "
            "the partition's other keys go on",
            "stopped": "the partition is stopped at the failing event (on_error='stop')",
            "missing": "the failing event is no longer stored, so it cannot be dead-lettered: "
            "the partition is stopped before it",
        }
        if failure.action in outcomes:
            log.error("%s: %s", where, outcomes[failure.action], extra=fields)

    def fenced(self, subscription: Subscription, fenced: Fenced) -> None:
        log.info("%s", fenced, extra=self._state.fields(subscription=subscription.name))

    def left(self, subscription: Subscription, partition: int, gone: SubscriptionNotFound) -> None:
        """The worker leaves a subscription deleted while it runs."""
        log.warning(
            "%s; this worker leaves it alone until restarted",
            gone,
            extra=self._state.fields(subscription=subscription.name, partition=partition),
        )

    def missing(
        self, subscription: Subscription, partition: int, missing: PositionsMissing
    ) -> None:
        self._metrics.batch_failed(subscription.name, False)
        log.error(
            "%s",
            missing,
            extra=self._state.fields(
                subscription=subscription.name,
                partition=partition,
                from_position=missing.first,
                to_position=missing.last,
            ),
        )
