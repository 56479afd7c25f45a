"""What a worker counts, and how it reports it: Prometheus metrics and progress lines.

Every worker has a registry of its own (never prometheus_client's global one), so workers
sharing a process keep separate counts. Lag is not read when Prometheus scrapes: the
worker's progress loop (`follow_progress`) reads it with one query (`read_lag`) at start
and then at most once per `progress_interval`, and both the lag gauges and the progress
lines show that reading. One query serves both, its rate does not depend on how many
scrapers call or how often, and a scrape never waits on the database.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from subengine.engine._engine import Engine
from subengine.model._errors import ConfigurationError
from subengine.subscriptions._inspection import PartitionLag
from subengine.subscriptions._inspection import read_lag as read_lag  # looked up here
from subengine.subscriptions._parking import parked_counts

log = logging.getLogger("subengine.worker")

ALL_INTERFACES = "0.0.0.0"
_BATCH_SIZE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000)
_BATCH_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _LagCollector(Collector):
    """Exports the latest lag reading as it is, with the parked keys read with it;
    nothing before the first one."""

    def __init__(self) -> None:
        self._latest: tuple[list[PartitionLag], float, Mapping[str, tuple[int, int]]] | None
        self._latest = None

    def update(
        self, reading: list[PartitionLag], at: float, parked: Mapping[str, tuple[int, int]]
    ) -> None:
        self._latest = (reading, at, parked)  # replaced whole: a scrape sees one reading

    def collect(self) -> Iterator[Metric]:
        if self._latest is None:
            return
        reading, at, parked = self._latest
        lag = GaugeMetricFamily(
            "subengine_lag_events",
            "Events of the partition after the subscription's position (head - position), "
            "as of the last reading. One connected worker of a subscription exports it, so "
            "sum() over workers counts each partition once.",
            labels=["subscription", "partition"],
        )
        for row in reading:
            if row.reported:
                lag.add_metric([row.subscription, str(row.partition)], row.lag)
        yield lag
        yield GaugeMetricFamily(
            "subengine_lag_read_timestamp_seconds",
            "Unix time of the last lag reading (taken every SUBENGINE_PROGRESS_INTERVAL).",
            value=at,
        )
        keys = GaugeMetricFamily(
            "subengine_parked_keys",
            "Keys the subscription has parked now (policy park), as of the last lag "
            "reading; exported by the worker that exports its lag.",
            labels=["subscription"],
        )
        events = GaugeMetricFamily(
            "subengine_parked_events",
            "Events waiting under the subscription's parked keys, as of the last lag "
            "reading; exported by the worker that exports its lag.",
            labels=["subscription"],
        )
        for name in sorted({row.subscription for row in reading if row.reported}):
            parked_keys, parked_events = parked.get(name, (0, 0))
            keys.add_metric([name], parked_keys)
            events.add_metric([name], parked_events)
        yield keys
        yield events


class WorkerMetrics:
    """The counters of one worker, in a registry of its own; `serve` publishes them."""

    def __init__(self, subscriptions: Sequence[str]) -> None:
        self.registry = CollectorRegistry()
        per_subscription = ["subscription"]
        self._events = Counter(
            "subengine_events_processed",
            "Events whose batch committed (handled, or skipped for want of a handler).",
            per_subscription,
            registry=self.registry,
        )
        self._batch_seconds = Histogram(
            "subengine_batch_duration_seconds",
            "Seconds per committed batch: read, handlers, position update and commit.",
            per_subscription,
            buckets=_BATCH_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self._batch_events = Histogram(
            "subengine_batch_size_events",
            "Events per committed batch.",
            per_subscription,
            buckets=_BATCH_SIZE_BUCKETS,
            registry=self.registry,
        )
        self._failures = Counter(
            "subengine_batch_failures",
            "Batches that failed (a handler raised): a batch of several events, whose "
            "events are then handled one by one, and every attempt of the failing event.",
            per_subscription,
            registry=self.registry,
        )
        self._dead_letters = Counter(
            "subengine_dead_letters",
            "Events sent to the dead letters (policy dead_letter).",
            per_subscription,
            registry=self.registry,
        )
        self._keys_parked = Counter(
            "subengine_keys_parked",
            "Keys parked (policy park): an event failed its last attempt, and it and every "
            "later event of its key are set aside.",
            per_subscription,
            registry=self.registry,
        )
        self._events_parked = Counter(
            "subengine_events_parked",
            "Events of parked keys that batches set aside instead of handling them (policy "
            "park; the failing event of each parking is counted in subengine_keys_parked).",
            per_subscription,
            registry=self.registry,
        )
        self._database_errors = Counter(
            "subengine_database_errors",
            "Batches that met a database error (a timeout, a cancelled query, a lost "
            "connection) or an unexpected one: retried after a backoff, never counted as "
            "an attempt of their events.",
            per_subscription,
            registry=self.registry,
        )
        self._gaps = Counter(
            "subengine_gaps",
            "Gaps passed: positions retention removed before the subscription handled them, "
            "by what happened (skipped: policy skip; handled: a gap handler ran).",
            [*per_subscription, "action"],
            registry=self.registry,
        )
        self._gap_events = Counter(
            "subengine_gap_events",
            "Events in the gaps passed: removed by retention before the subscription handled them.",
            per_subscription,
            registry=self.registry,
        )
        self._pruned = Counter(
            "subengine_retention_removed_events",
            "Events this worker's pruning runs removed (retention policies).",
            registry=self.registry,
        )
        self._listener_failures = Counter(
            "subengine_listener_failures",
            "Times the listening connection failed and was opened again.",
            registry=self.registry,
        )
        self._notifications = Counter(
            "subengine_notifications_received",
            "Notifications of appends to the worker's streams.",
            registry=self.registry,
        )
        self._wakeups = Counter(
            "subengine_wakeups",
            "Idle slots woken to look for work, by cause: a notification, or the poll timer.",
            ["cause"],
            registry=self.registry,
        )
        self._looks = Counter(
            "subengine_looks_for_work",
            "Looks for work, by whether the slot took a partition (true) or found none free.",
            ["found_work"],
            registry=self.registry,
        )
        self._lag = _LagCollector()
        self.registry.register(self._lag)
        for name in subscriptions:  # every series exists from the start, at 0
            for metric in (
                self._events,
                self._batch_seconds,
                self._batch_events,
                self._failures,
                self._dead_letters,
                self._keys_parked,
                self._events_parked,
                self._database_errors,
                self._gap_events,
            ):
                metric.labels(name)
            for action in ("skipped", "handled"):
                self._gaps.labels(name, action)
        for cause in ("notification", "timer"):
            self._wakeups.labels(cause)
        for found in ("true", "false"):
            self._looks.labels(found)
        self._done_lock = threading.Lock()
        self._done = dict.fromkeys(subscriptions, 0)
        self._server: Any = None

    # what the worker reports

    def batch_committed(
        self, subscription: str, events: int, seconds: float, parked: int = 0
    ) -> None:
        """A batch committed: `events` handled (or skipped for want of a handler), and
        `parked` set aside for their parked keys; the position passed both."""
        self._events.labels(subscription).inc(events)
        self._batch_seconds.labels(subscription).observe(seconds)
        self._batch_events.labels(subscription).observe(events + parked)
        if parked:
            self._events_parked.labels(subscription).inc(parked)
        with self._done_lock:
            self._done[subscription] += events + parked

    def batch_failed(self, subscription: str, dead_lettered: bool) -> None:
        self._failures.labels(subscription).inc()
        if dead_lettered:
            self._dead_letters.labels(subscription).inc()

    def key_parked(self, subscription: str) -> None:
        self._keys_parked.labels(subscription).inc()

    def gap_passed(self, subscription: str, action: str, events: int) -> None:
        self._gaps.labels(subscription, action).inc()
        self._gap_events.labels(subscription).inc(events)

    def pruned(self, events: int) -> None:
        self._pruned.inc(events)

    def database_error(self, subscription: str) -> None:
        self._database_errors.labels(subscription).inc()

    def listener_failed(self) -> None:
        self._listener_failures.inc()

    def notification_received(self) -> None:
        self._notifications.inc()

    def woke(self, by_notification: bool) -> None:
        self._wakeups.labels("notification" if by_notification else "timer").inc()

    def looked_for_work(self, found: bool) -> None:
        self._looks.labels("true" if found else "false").inc()

    def lag_read(
        self,
        reading: list[PartitionLag],
        at: float,
        parked: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """A lag reading taken at `at`, with the parked keys and events per subscription
        read with it (subscriptions with none left out)."""
        self._lag.update(reading, at, parked or {})

    def done(self) -> dict[str, int]:
        """Events committed so far, per subscription (for the progress lines)."""
        with self._done_lock:
            return dict(self._done)

    # publishing

    @property
    def serving(self) -> bool:
        return self._server is not None

    def serve(self, port: int, address: str | None = None) -> None:
        """Serve the metrics over HTTP at /metrics (any path, in fact) until `close`, on
        `address` (default: every interface)."""
        from prometheus_client import start_http_server

        address = address or ALL_INTERFACES
        try:
            self._server, _thread = start_http_server(port, address, registry=self.registry)
        except OSError as error:
            raise ConfigurationError(
                f"cannot serve metrics on port {port} of address {address!r}: "
                f"{error.strerror or error}; choose another --metrics-port or --metrics-address"
            ) from None

    @property
    def port(self) -> int | None:
        """The port served on (useful with port 0), or None."""
        return None if self._server is None else int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@dataclass(frozen=True, slots=True)
class ProgressLine:
    """One subscription's progress since the previous report."""

    subscription: str
    events: int  # committed by this worker since the previous report
    seconds: float
    remaining: int  # over the partitions that can move (not stopped or paused)
    eta_seconds: float | None  # at the rate the remaining events shrank; None if they did not
    first: bool  # no earlier reading to compare with

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0

    def message(self) -> str:
        if self.first and self.events == 0:
            return f"subscription {self.subscription}: {self.remaining:,} events to catch up"
        done = (
            f"subscription {self.subscription}: {self.events:,} events in "
            f"{self.seconds:.1f} s ({self.rate:,.0f}/s)"
        )
        if self.remaining == 0:
            return f"{done}, caught up"
        if self.eta_seconds is not None:
            eta = f"ETA {_duration(self.eta_seconds)}"
        else:
            eta = "ETA unknown" if self.first else "not shrinking"
        return f"{done}, {self.remaining:,} remaining, {eta}"

    def fields(self) -> dict[str, Any]:
        """The line's numbers, for structured logs."""
        return {
            "subscription": self.subscription,
            "events": self.events,
            "seconds": round(self.seconds, 3),
            "rate": round(self.rate, 1),
            "remaining": self.remaining,
            "eta_seconds": None if self.eta_seconds is None else round(self.eta_seconds, 1),
        }


class Progress:
    """Turns lag readings and a worker's counts into progress lines.

    A subscription gets a line when it did work since the previous report or has events
    remaining; otherwise it is quiet. `wants_reading` says whether a reading is worth its
    query: always while metrics are served (the lag gauges), otherwise only while
    something was remaining at the last reading or the worker did work since.
    """

    def __init__(self, subscriptions: Sequence[str], now: float) -> None:
        self._names = list(subscriptions)
        self._since = now
        self._done = dict.fromkeys(self._names, 0)
        self._remaining: dict[str, int] | None = None  # at the last reading

    def wants_reading(self, done: dict[str, int], serving_metrics: bool) -> bool:
        return (
            serving_metrics
            or self._remaining is None
            or any(self._remaining.values())
            or done != self._done
        )

    def skip(self, now: float) -> None:
        """No reading this time: nothing was remaining and nothing was done."""
        self._since = now

    def report(
        self, now: float, done: dict[str, int], reading: list[PartitionLag]
    ) -> list[ProgressLine]:
        first = self._remaining is None
        seconds = max(now - self._since, 0.0)
        remaining = dict.fromkeys(self._names, 0)
        for row in reading:
            if not row.halted and row.subscription in remaining:
                remaining[row.subscription] += row.lag
        lines = []
        for name in self._names:
            events = done.get(name, 0) - self._done.get(name, 0)
            if events == 0 and remaining[name] == 0:
                continue
            previous = None if self._remaining is None else self._remaining[name]
            eta = None
            if previous is not None and seconds > 0 and previous > remaining[name]:
                eta = remaining[name] / ((previous - remaining[name]) / seconds)
            lines.append(ProgressLine(name, events, seconds, remaining[name], eta, first))
        self._since, self._done, self._remaining = now, dict(done), remaining
        return lines


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def follow_progress(
    engine: Engine,
    metrics: WorkerMetrics,
    names: Sequence[str],
    worker_id: uuid.UUID,
    stop: threading.Event,
) -> None:
    """A worker's progress loop: read the lag at start and then every progress_interval,
    for the lag gauges and the progress lines; skip the query when nothing can have
    changed (see Progress)."""
    progress = Progress(names, time.monotonic())
    while True:
        done = metrics.done()
        if not progress.wants_reading(done, metrics.serving):
            progress.skip(time.monotonic())
        else:
            try:
                with engine.db() as db:
                    reading = read_lag(db, names, worker_id)
                    parked = parked_counts(db, names)
            except Exception as error:  # progress is for people: never fatal
                log.warning("could not read the lag: %s", error, extra=_fields(worker_id))
            else:
                metrics.lag_read(reading, time.time(), parked)
                for line in progress.report(time.monotonic(), done, reading):
                    log.info("%s", line.message(), extra=_fields(worker_id, **line.fields()))
        if stop.wait(engine.settings.progress_interval):
            return


def _fields(worker_id: uuid.UUID, **fields: Any) -> dict[str, Any]:
    return {"worker_id": str(worker_id), **fields}
