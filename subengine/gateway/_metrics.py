"""What a gateway process counts, served at `/metrics` in Prometheus' text format.

Every gateway application has a registry of its own (never prometheus_client's global
one), so two gateways mounted in one process keep separate counts. What the gateway
counts anyway (open connections, the hub's reads and watchers, LISTEN resyncs) is read
when scraped, not copied; a scrape never touches the database.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from subengine.gateway._connections import KINDS, LIMITS, Connections
from subengine.outside._webhooks import STATES, Webhook

if TYPE_CHECKING:
    from subengine.gateway._delivery import Deliveries
    from subengine.gateway._hub import Hub

# The SSE frames a gateway sends (a heartbeat is a comment line).
FRAME_TYPES = ("events", "tombstone", "reset", "caught-up", "close", "heartbeat")
_LAG_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000, 10_000, 100_000)


class _StateCollector(Collector):
    """The gateway's own counts, read at scrape time."""

    def __init__(
        self, connections: Connections, hub: Hub, listen_connects: Callable[[], int]
    ) -> None:
        self._connections = connections
        self._hub = hub
        self._listen_connects = listen_connects

    def collect(self) -> Iterator[Metric]:
        open_now = GaugeMetricFamily(
            "subengine_gateway_connections",
            "Requests being served, by kind: pull (a page), long_poll, sse (an event "
            "stream of one stream) and watch (an event stream of a watch).",
            labels=["kind"],
        )
        for kind in KINDS:
            open_now.add_metric([kind], self._connections.by_kind[kind])
        yield open_now
        rejected = CounterMetricFamily(
            "subengine_gateway_rejected",
            "Requests answered 429, by the limit they met: too_many_connections (open "
            "long-polls and event streams of one key) or too_many_event_streams (of the "
            "process).",
            labels=["limit"],
        )
        for code in LIMITS:
            rejected.add_metric([code], self._connections.rejected[code])
        yield rejected
        yield CounterMetricFamily(
            "subengine_gateway_hub_reads",
            "Reads of a partition the hub ran for live clients: one per (stream, "
            "partition, position) however many clients stand there.",
            value=self._hub.reads,
        )
        yield CounterMetricFamily(
            "subengine_gateway_page_reads",
            "Pages of a stream read by cursor: pulls, catch-up, and a long-poll's first "
            "read (a long-poll woken by an append reads through the hub).",
            value=self._hub.pages,
        )
        yield GaugeMetricFamily(
            "subengine_gateway_watchers",
            "Long-polls and event streams the hub wakes (one per stream each follows).",
            value=self._hub.watched(),
        )
        yield CounterMetricFamily(
            "subengine_gateway_listen_connects",
            "Resyncs of the hub after the LISTEN connection (re)connected: one per "
            "followed stream per connect. A rise while nothing restarted means the "
            "connection to PostgreSQL was lost.",
            value=self._listen_connects(),
        )


class _WebhookCollector(Collector):
    """Each webhook's state, failed attempts, last success and lag, as the deliveries'
    last round read them, and what the deliveries of this process did since it started."""

    def __init__(self) -> None:
        self.seen: list[Webhook] = []
        self.deliveries: Deliveries | None = None

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "subengine_webhook_state",
            "1 for the state each webhook subscription is in (pending, active, failing, "
            "failed, expired).",
            labels=["webhook", "state"],
        )
        lag = GaugeMetricFamily(
            "subengine_webhook_lag_events",
            "Events of a webhook's streams not yet delivered to it.",
            labels=["webhook"],
        )
        attempts = GaugeMetricFamily(
            "subengine_webhook_failed_attempts",
            "Failed deliveries (or challenges) of a webhook since its last success.",
            labels=["webhook"],
        )
        success = GaugeMetricFamily(
            "subengine_webhook_last_success_timestamp_seconds",
            "When a delivery to the webhook last succeeded (Unix time; absent: never).",
            labels=["webhook"],
        )
        for hook in self.seen:
            for name in STATES:
                state.add_metric([hook.id, name], 1.0 if hook.state == name else 0.0)
            lag.add_metric([hook.id], hook.lag)
            attempts.add_metric([hook.id], hook.attempts)
            if hook.last_success_at is not None:
                success.add_metric([hook.id], hook.last_success_at.timestamp())
        yield from (state, lag, attempts, success)
        if self.deliveries is None:
            return
        results = CounterMetricFamily(
            "subengine_webhook_deliveries",
            "POSTs of batches to callbacks by this process, by result: delivered, failed "
            "(retried later) or cancelled (410 Gone).",
            labels=["result"],
        )
        for result in ("delivered", "failed", "cancelled"):
            results.add_metric([result], self.deliveries.results.get(result, 0))
        yield results
        yield CounterMetricFamily(
            "subengine_webhook_events_delivered",
            "Events delivered to callbacks by this process.",
            value=self.deliveries.events_delivered,
        )
        yield CounterMetricFamily(
            "subengine_webhook_rounds",
            "Rounds of this process's webhook supervisor (a few statements each): when "
            "woken by a change, at a deadline, while deliveries succeed or fail, and "
            "otherwise once a safety poll.",
            value=self.deliveries.rounds,
        )


class GatewayMetrics:
    """The registry of one gateway application and the series it updates as it serves."""

    def __init__(
        self, connections: Connections, hub: Hub, listen_connects: Callable[[], int]
    ) -> None:
        self.registry = CollectorRegistry()
        self.frames_sent = Counter(
            "subengine_gateway_frames_sent",
            "SSE frames sent, by type (heartbeat: a comment line).",
            ["type"],
            registry=self.registry,
        )
        # the series of each label, looked up once: `labels()` takes a lock and checks
        # its arguments, and every frame to every watcher counts in two series
        self._frames_sent = {t: self.frames_sent.labels(t) for t in FRAME_TYPES}
        self.bytes_sent = Counter(
            "subengine_gateway_bytes_sent",
            "Bytes of event pages and event streams sent, by kind of connection.",
            ["kind"],
            registry=self.registry,
        )
        self._bytes_sent = {kind: self.bytes_sent.labels(kind) for kind in KINDS}
        self.pages_read_ahead = Counter(
            "subengine_gateway_pages_read_ahead",
            "Catch-up pages read ahead (both APIs), while the reader took in the page before, "
            "by outcome: used by the next request, unused (dropped unasked, or its request "
            "gave up), at_end (it reached the end of the stream: the request reads afresh) "
            "or failed (its read failed: the request reads afresh).",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ("used", "unused", "at_end", "failed"):
            self.pages_read_ahead.labels(outcome)
        self.long_polls_waiting = Gauge(
            "subengine_gateway_long_polls_waiting",
            "Long-polls up to date and waiting for an append (or their timeout).",
            registry=self.registry,
        )
        self.long_polls_superseded = Counter(
            "subengine_gateway_long_polls_superseded",
            "Long-polls answered early (204) because a newer long-poll of the same session "
            "arrived.",
            registry=self.registry,
        )
        self.watcher_lag = Histogram(
            "subengine_gateway_watcher_lag_events",
            "When an event stream wakes, or the hub sends it a frame: the events between "
            "its cursor and the heads the hub knows, in the partitions that moved.",
            buckets=_LAG_BUCKETS,
            registry=self.registry,
        )
        # what `sent_soon` and `lag_soon` are to count
        self._sent_soon: dict[tuple[str, str], tuple[int, int]] = {}
        self._lags_soon: list[int] = []
        self._counting_due = False
        self.registry.register(_StateCollector(connections, hub, listen_connects))
        self._webhooks = _WebhookCollector()
        self.registry.register(self._webhooks)

    def webhooks_seen(self, webhooks: list[Webhook]) -> None:
        """The webhooks as the deliveries' last round read them."""
        self._webhooks.seen = webhooks

    def watch_deliveries(self, deliveries: Deliveries) -> None:
        self._webhooks.deliveries = deliveries

    def sent(self, kind: str, frame_type: str | None, size: int, frames: int = 1) -> None:
        """`size` bytes sent on a connection of `kind`; `frames` frames of `frame_type`,
        if any."""
        if frame_type is not None:
            series = self._frames_sent.get(frame_type)
            (series or self.frames_sent.labels(frame_type)).inc(frames)
        (self._bytes_sent.get(kind) or self.bytes_sent.labels(kind)).inc(size)

    def sent_soon(self, kind: str, frame_type: str, size: int) -> None:
        """`sent` of one frame, counted in the event loop's next round with the others
        sent meanwhile: the hub's fan-out of a frame to many streams counts once, after."""
        key = (kind, frame_type)
        frames, total = self._sent_soon.get(key, (0, 0))
        self._sent_soon[key] = (frames + 1, total + size)
        self._count_soon()

    def lag_soon(self, events: int) -> None:
        """An observation of `watcher_lag`, made in the event loop's next round."""
        self._lags_soon.append(events)
        self._count_soon()

    def _count_soon(self) -> None:
        if not self._counting_due:
            self._counting_due = True
            asyncio.get_running_loop().call_soon(self._count)

    def _count(self) -> None:
        self._counting_due = False
        sent, self._sent_soon = self._sent_soon, {}
        lags, self._lags_soon = self._lags_soon, []
        for (kind, frame_type), (frames, size) in sent.items():
            self.sent(kind, frame_type, size, frames)
        for events in lags:
            self.watcher_lag.observe(events)
