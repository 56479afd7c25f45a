"""`Subscriber`: the receiving end of the gateway's webhook subscriptions (issue 15),
built as seed 000's P3Sub subscriber.

Pushes only save time. The subscriber accepts a pushed batch when it starts right after
what it has already accepted of that partition; when pushes stop, or skip ahead, it
pulls by cursor. When a pull finds events the pushes missed, it subscribes again under a
new id from its cursor (replacing the old subscription) and refuses the old id. Its
only state is the cursor, which the application stores with its own changes.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Literal

import httpx

from subengine.client._asgi import Receive, Scope, Send, serve_deliveries
from subengine.client._core import Selection, StreamOptions, selection_of
from subengine.client._deliveries import (
    Batch,
    RememberedIds,
    Signatures,
    batch_of,
    last_position,
    trimmed,
)
from subengine.client._errors import GatewayError
from subengine.client._items import Item, Reset, reset_from_json
from subengine.client._subscriber_gateway import SubscriberGateway, page_batches
from subengine.model._gateway_cursor import GatewayCursor, StreamPosition
from subengine.model._json import loads
from subengine.model._secrets import new_secret, validate_secret

log = logging.getLogger("subengine.client")

# what a background step may fail with; it is logged and tried again later
_FAILURES = (GatewayError, httpx.HTTPError, ValueError, KeyError, TypeError)


def _new_subscription_id() -> str:
    return f"sub-{secrets.token_hex(12)}"


class Subscriber:
    """Every event of `streams` after a cursor, exactly once and in order per
    partition, pushed by the gateway to `callback` and pulled when pushes fail.

    `streams` names the streams, or maps each to a `StreamOptions` whose `keys` and
    `types` filter it (where to start is this subscriber's `cursor`, `since` or `start`,
    and `include_data` is the subscriber's). `cursor` is the one a subscriber stored
    before; without one it starts right after `since` (a time, aware datetime or RFC
    3339 text: P3Sub's T0, such as the time of the resource it read or of the last
    event it has; events recorded at that very time are not delivered), or else at
    `start`: "now" (the heads when it starts) or "beginning". `secret` ("whsec_" and
    base64) signs the deliveries; a random one when None. `pull_after` is the seconds
    without an accepted push after which it pulls; `tolerance` how far a delivery's
    timestamp may be from now. Once
    `max_queued` items wait in the queue, deliveries are answered 503, so the gateway
    retries them later (batches taken meanwhile may add up to `max_events` each beyond
    it). `api_key`, `timeout` and `client` are as for `Reader`.

    Serve it as an ASGI app at `callback` (it is one), or call `receive` from any web
    framework. Take items with `get` or by iterating; after each, `cursor` is where the
    application stands: store it in the same transaction as what the item changed.
    """

    def __init__(
        self,
        gateway_url: str,
        callback: str,
        streams: Mapping[str, StreamOptions] | Sequence[str],
        *,
        cursor: str | None = None,
        start: Literal["now", "beginning"] = "now",
        since: str | datetime | None = None,
        secret: str | None = None,
        include_data: bool = True,
        max_events: int = 100,
        lease_seconds: int = 86_400,
        pull_after: float = 30.0,
        tolerance: timedelta = timedelta(minutes=5),
        max_queued: int = 10_000,
        api_key: str | None = None,
        timeout: float = 30.0,
        client: httpx.Client | None = None,
    ) -> None:
        if isinstance(streams, str):
            streams = [streams]
        if not streams:
            raise ValueError("a subscriber needs at least one stream")
        if start not in ("now", "beginning"):
            raise ValueError('start must be "now" or "beginning"')
        if isinstance(since, datetime):
            if since.tzinfo is None:
                raise ValueError("since needs a time zone (an aware datetime)")
            since = since.isoformat()
        if pull_after <= 0 or max_queued < 1:
            raise ValueError("pull_after must be positive and max_queued at least 1")
        self._selections: dict[str, Selection] = {}
        for name in streams:
            options = streams[name] if isinstance(streams, Mapping) else StreamOptions()
            if options.after is not None or options.since is not None:
                raise ValueError(
                    f"stream {name!r}: a subscriber starts from its cursor or start, "
                    "not from StreamOptions.after or since"
                )
            if options.fields is not None:
                raise ValueError(
                    f"stream {name!r}: a webhook's events carry every field but what "
                    "include_data leaves out, not StreamOptions.fields"
                )
            self._selections[name] = selection_of(options.keys, options.types, include_data)
        self._callback = callback
        self._start = start
        self._since = since
        # the gateway's own rules: a secret it would refuse is refused here, at once
        self._secret = new_secret() if secret is None else validate_secret(secret)
        self._signatures = Signatures(self._secret, tolerance.total_seconds())
        self._include_data = include_data
        self._max_events = max_events
        self._lease_seconds = lease_seconds
        self._pull_after = pull_after
        self._max_queued = max_queued
        self._gateway = SubscriberGateway(gateway_url, api_key, timeout, client)

        # Guards everything below; `get` waits on it for items.
        self._lock = threading.Condition()
        # One pull at a time: a second would read what the first is accepting.
        self._pull_lock = threading.Lock()
        # what the queue has accepted: each stream's epoch and per-partition positions
        self._epochs: dict[str, int] = {}
        self._positions: dict[str, list[int]] = {}
        self._queue: deque[tuple[Item, str]] = deque()
        self._taken = cursor
        self._subscription = _new_subscription_id()
        self._definition: dict[str, Any] = {}
        # whether the gateway has taken the current subscription (its PUT succeeded)
        self._subscribed = False
        self._put_due = 0.0
        self._last_accepted = time.monotonic()
        # whether this subscriber refused a push of its own accord (503) since the last
        # it accepted: then a pull that finds events says nothing of the pushes
        self._refused = False
        self._resubscriptions = 0
        # the last webhook-ids taken
        self._seen = RememberedIds()
        self._started = self._closed = False
        self._stopped = threading.Event()
        self._timer: threading.Thread | None = None

    # the application's side

    @property
    def cursor(self) -> str | None:
        """The cursor after the last item taken from the queue (before any: where the
        subscriber started; None before `start` when it was given no cursor)."""
        with self._lock:
            return self._taken

    @property
    def subscription_id(self) -> str:
        """The id of the current subscription; deliveries under any other are refused."""
        with self._lock:
            return self._subscription

    @property
    def resubscriptions(self) -> int:
        """How often the subscriber replaced its subscription after finding missed events."""
        with self._lock:
            return self._resubscriptions

    def start(self) -> None:
        """Subscribe (PUT /v1/webhooks/{id}) from the cursor, and start the timer.

        Raises GatewayError when the gateway answers with an error, httpx.HTTPError
        when it cannot be reached."""
        with self._lock:
            if self._started or self._closed:
                raise RuntimeError("a subscriber starts once")
        known = GatewayCursor.decode(self._taken).streams if self._taken is not None else {}
        starts = {name: known.get(name) or self._start_of(name) for name in self._selections}
        with self._lock:
            for name, at in starts.items():
                self._epochs[name] = at.epoch
                self._positions[name] = list(at.positions)
            self._taken = self._encode()
            self._definition = self._body(replaces=None)
            self._last_accepted = time.monotonic()
            # from here on, deliveries of the subscription are taken (its challenge may
            # come before the PUT is answered)
            self._started = True
        self._put()
        self._timer = threading.Thread(target=self._run_timer, name="subscriber-timer", daemon=True)
        self._timer.start()

    def get(self, timeout: float | None = None) -> Item | None:
        """The next item of the queue, waiting up to `timeout` seconds (None: until one
        comes); None when none came, or the subscriber is closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._queue:
                if self._closed:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._lock.wait(remaining)
            item, self._taken = self._queue.popleft()
            return item

    def __iter__(self) -> Iterator[Item]:
        """The items of the queue as they come, until the subscriber is closed."""
        while (item := self.get()) is not None:
            yield item

    def close(self) -> None:
        """Cancel the subscription (DELETE), stop the timer and end any `get`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            subscription, started = self._subscription, self._started
            self._lock.notify_all()
        self._stopped.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join()
        if started:
            try:
                self._gateway.cancel(subscription)
            except _FAILURES as error:
                log.warning("cancelling webhook subscription %s failed: %r", subscription, error)
        self._gateway.close()

    def __enter__(self) -> Subscriber:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # the gateway's side

    def receive(self, body: bytes, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """Answer one delivery: its raw body and headers in, (status, response body) out.

        401: the signature or its timestamp does not check out. 410: a subscription
        that is not the current one (the gateway then deletes it). A challenge of the
        current subscription is answered with its text. A batch is accepted when it
        follows what the queue holds of its partition (after a pull, when it starts
        beyond it); 200 also answers one already accepted. 503: not now (the queue is
        full, or a pull failed), the gateway retries. 400: a body it cannot read."""
        try:
            message = loads(body)
        except ValueError:
            message = None
        named = message.get("subscription") if isinstance(message, dict) else None
        with self._lock:
            current = self._subscription if self._started and not self._closed else None
        lowered = {name.lower(): value for name, value in headers.items()}
        if not self._signatures.verified(body, lowered):
            # An unknown subscription is one this subscriber left (before a restart,
            # with another secret): 410 has the gateway delete it.
            gone = isinstance(named, str) and named != current
            return (410 if gone else 401), b""
        if not isinstance(message, dict) or not isinstance(named, str):
            return 400, b""
        if named != current:
            return 410, b""
        if message.get("type") == "challenge":
            challenge = message.get("challenge")
            if not isinstance(challenge, str):
                return 400, b""
            return 200, json.dumps({"challenge": challenge}).encode()
        if message.get("type") != "events":
            return 400, b""
        return self._deliver(lowered["webhook-id"], message, named), b""

    def _deliver(self, webhook_id: str, message: Mapping[str, Any], subscription: str) -> int:
        try:
            batch = batch_of(message)
            if batch.stream not in self._selections:
                raise ValueError(f"stream {batch.stream!r} is not subscribed to")
        except (KeyError, TypeError, ValueError) as error:
            log.warning("a delivery of %s is malformed: %r", subscription, error)
            return 400
        with self._lock:
            if webhook_id in self._seen:
                return 200
            if len(self._queue) >= self._max_queued:
                self._refused = True
                return 503
        accepted = self._offer(batch)
        if accepted is None:
            try:
                self._catch_up(batch, subscription)
            except _FAILURES as error:
                log.warning("pulling %s after a delivery failed: %r", batch.stream, error)
                with self._lock:
                    self._refused = True
                return 503
            accepted = self._offer(batch)
            if accepted is None:
                return 503
        with self._lock:
            self._seen.add(webhook_id)
            if accepted:
                self._last_accepted = time.monotonic()
                self._refused = False
        return 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app: POSTs to it are deliveries (see `receive`)."""
        await serve_deliveries(scope, receive, send, self.receive)

    # the queue

    def _offer(self, batch: Batch) -> list[Item] | None:
        """Accept what `batch` adds to the queue, if it follows what the queue holds of
        its partition: the items accepted (none: it was all there already), or None
        when it starts beyond (or is of another epoch of the stream)."""
        with self._lock:
            if self._epochs.get(batch.stream) != batch.epoch:
                return None
            positions = self._positions[batch.stream]
            if batch.partition >= len(positions):
                positions.extend([0] * (batch.partition + 1 - len(positions)))
            at = positions[batch.partition]
            if batch.through <= at:
                return []
            if batch.after > at:
                return None
            # A batch that overlaps what is accepted adds its part beyond.
            fresh = [trimmed(item, at) for item in batch.items if last_position(item) > at]
            for index, item in enumerate(fresh):
                # the last item carries the batch's end: positions it passed over
                last = index == len(fresh) - 1
                positions[batch.partition] = batch.through if last else last_position(item)
                self._queue.append((item, self._encode()))
            positions[batch.partition] = batch.through
            self._lock.notify_all()
            return [*fresh]

    def _reset(self, reset: Reset) -> bool:
        """Queue a reset the queue has not seen: the stream starts again from its new
        epoch's beginning."""
        with self._lock:
            if self._epochs.get(reset.stream) == reset.epoch:
                return False
            self._epochs[reset.stream] = reset.epoch
            self._positions[reset.stream] = []
            self._queue.append((reset, self._encode()))
            self._lock.notify_all()
            return True

    def _encode(self) -> str:
        return GatewayCursor(
            {
                name: StreamPosition(self._epochs[name], tuple(self._positions[name]))
                for name in self._selections
            }
        ).encode()

    # pulling

    def _catch_up(self, batch: Batch, subscription: str) -> None:
        """Pull the stream of a batch that starts beyond the queue, up to its start;
        resubscribe when the pull found items the pushes skipped."""
        until = (batch.partition, batch.epoch, batch.after)
        found = self._pull([batch.stream], until)
        skipped = [
            item
            for item in found
            if isinstance(item, Reset)
            or (item.partition == batch.partition and last_position(item) <= batch.after)
        ]
        if skipped:
            self._resubscribe(subscription)

    def _pull(
        self, streams: Sequence[str], until: tuple[int, int, int] | None = None
    ) -> list[Item]:
        """Pull each stream by the queue's cursor until up to date (or, with `until`
        (partition, epoch, position), until that partition reaches that position), or
        until the queue is full; the items accepted."""
        found: list[Item] = []
        with self._pull_lock:
            for name in streams:
                # a pull this one waited for may have gone as far already
                while not self._stopped.is_set() and not self._reached(name, until):
                    with self._lock:
                        if len(self._queue) >= self._max_queued:
                            break
                        sent = StreamPosition(self._epochs[name], tuple(self._positions[name]))
                    params = [
                        ("after", GatewayCursor({name: sent}).encode()),
                        ("limit", str(self._max_events)),
                        *self._selections[name].params(),
                    ]
                    page = self._gateway.events(name, params)
                    found += self._accept_page(name, sent, page)
                    moved = page["cursor"] != params[0][1]
                    if page["up_to_date"] or not moved:
                        break
        return found

    def _reached(self, name: str, until: tuple[int, int, int] | None) -> bool:
        if until is None:
            return False
        partition, epoch, position = until
        with self._lock:
            positions = self._positions[name]
            return self._epochs[name] == epoch and (
                partition < len(positions) and positions[partition] >= position
            )

    def _accept_page(self, name: str, sent: StreamPosition, page: Mapping[str, Any]) -> list[Item]:
        """Offer a page pulled from `sent` to the queue, one batch per partition."""
        ends = GatewayCursor.decode(page["cursor"]).streams[name]
        found: list[Item] = []
        for body in page["resets"]:
            reset = reset_from_json(body)
            if self._reset(reset):
                found.append(reset)
        for batch in page_batches(name, sent, ends, page):
            found += self._offer(batch) or []
        return found

    # the subscription

    def _start_of(self, name: str) -> StreamPosition:
        if self._since is not None:
            return self._gateway.position_since(name, self._since)
        described = self._gateway.stream(name)
        if self._start == "now":
            return GatewayCursor.decode(described["cursor"]).streams[name]
        return StreamPosition(int(described["epoch"]))

    def _body(self, replaces: str | None) -> dict[str, Any]:
        """The subscription's definition, from the queue's cursor (under the lock)."""
        streams: dict[str, dict[str, list[str]]] = {}
        for name, selection in self._selections.items():
            streams[name] = {}
            if selection.keys:
                streams[name]["key"] = list(selection.keys)
            if selection.types:
                streams[name]["type"] = list(selection.types)
        body: dict[str, Any] = {
            "callback": self._callback,
            "streams": streams,
            "start": {"after": self._encode()},
            "include_data": self._include_data,
            "max_events": self._max_events,
            "lease_seconds": self._lease_seconds,
            "secret": self._secret,
        }
        if replaces is not None:
            body["replaces"] = replaces
        return body

    def _put(self) -> None:
        """PUT the current subscription: it creates it, or renews its lease."""
        with self._lock:
            subscription, body = self._subscription, self._definition
            self._put_due = time.monotonic() + self._pull_after  # again then if it fails
        self._gateway.subscribe(subscription, body)  # a `replaces` that is gone is no error
        with self._lock:
            if self._subscription == subscription:
                self._subscribed = True
                # a renewal must not name the webhook it replaced: that one is gone
                self._definition.pop("replaces", None)
                self._put_due = time.monotonic() + self._lease_seconds / 2

    def _resubscribe(self, failed: str) -> None:
        """Replace the subscription `failed` by a new one from the queue's cursor (unless
        another thread did already); deliveries under `failed` are refused from now."""
        with self._lock:
            if self._closed or self._subscription != failed:
                return
            self._subscription = _new_subscription_id()
            self._subscribed = False
            self._resubscriptions += 1
            self._definition = self._body(replaces=failed)
            log.info("webhook subscription %s missed events; now %s", failed, self._subscription)
        try:
            self._put()
        except _FAILURES as error:
            log.warning("subscribing again failed (%r); the timer tries again", error)

    def _run_timer(self) -> None:
        while not self._stopped.wait(self._until_due()):
            now = time.monotonic()
            with self._lock:
                put_due = now >= self._put_due
                pull_due = now >= self._last_accepted + self._pull_after
                subscription, subscribed = self._subscription, self._subscribed
            if put_due:
                try:
                    self._put()
                except _FAILURES as error:
                    log.warning("subscribing %s failed: %r", subscription, error)
            if pull_due:
                self._pull_on_time(subscription, subscribed)

    def _until_due(self) -> float:
        with self._lock:
            due = min(self._put_due, self._last_accepted + self._pull_after)
        return max(0.0, due - time.monotonic())

    def _pull_on_time(self, subscription: str, subscribed: bool) -> None:
        """No push was accepted for `pull_after` seconds: pull, and when that finds
        events, the subscription failed (P3Sub): subscribe again."""
        try:
            found = self._pull(list(self._selections))
        except _FAILURES as error:
            log.warning("pulling after %.1fs without pushes failed: %r", self._pull_after, error)
            found = []
        with self._lock:
            self._last_accepted = time.monotonic()
            refused, self._refused = self._refused, False
        # what it found may be what this subscriber refused (a full queue): the pushes
        # did not fail then, and are retried
        if found and subscribed and not refused:
            self._resubscribe(subscription)
