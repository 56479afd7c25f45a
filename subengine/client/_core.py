"""The reader's core, without I/O: what to ask the gateway next, what its answers mean,
which items are new, the cursor after each item, and when to back off or fall back to
long-poll. `Reader` and `AsyncReader` only move bytes (as psycopg's pool keeps its
logic in a base that its sync and async halves share).

The algorithm is seed 001's durable subscription: pull pages until up to date, then
follow live (SSE) from the same cursor; the gateway catches an event stream up itself,
so the client only drops positions it has already delivered (a per-partition
high-water mark, per stream epoch).
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal
from urllib.parse import quote

from subengine.client._errors import GatewayError
from subengine.client._items import (
    Event,
    Item,
    Reset,
    event_from_json,
    reset_from_json,
    tombstone_from_json,
)
from subengine.model._errors import InvalidInput
from subengine.model._event_fields import read_fields
from subengine.model._events import Tombstone
from subengine.model._gateway_cursor import GatewayCursor, InvalidCursor, StreamPosition
from subengine.model._json import loads

CURSOR_HEADER = "Subengine-Cursor"
# close codes after which the reader resumes by cursor (docs/gateway.md, "Server-sent events")
RESUMABLE = frozenset({"rotate", "shutdown", "slow"})
# the frame that ends a stream: `close`; older gateways named it `error` (docs/gateway.md)
CLOSE_FRAMES = frozenset({"close", "error"})
# events per page while a reader catches up: pages of the gateway's default 100 made a
# catch-up of small events take twice as long; 1,000 is the most any gateway takes
PAGE_LIMIT = 1000
# statuses worth asking again (after Retry-After, when given)
RETRYABLE_STATUSES = frozenset({408, 425, 429})

Mode = Literal["pages", "sse", "long-poll"]


@dataclass(frozen=True)
class Reconnect:
    """How a reader reconnects, and when it gives up on SSE for a while.

    Backoff: after the n-th failure in a row (from 0) the reader waits a random time
    between half and all of `min(max_delay, delay * 2**n)` seconds (jitter, so that
    many readers of a restarted gateway do not return at once), or the gateway's
    Retry-After if that is longer. A success starts the count again.

    Fallback: an SSE connection is *short* when it was answered 200 but ended, for any
    reason other than the gateway's `rotate`, less than `short_connection` seconds after
    it opened, without delivering an item (event, tombstone or reset). After
    `short_connections` short connections in a row (something between the reader and
    the gateway cuts event streams), the reader long-polls instead for
    `long_poll_period` seconds, then tries SSE again.
    """

    delay: float = 0.25
    max_delay: float = 30.0
    short_connection: float = 5.0
    short_connections: int = 3
    long_poll_period: float = 300.0

    def __post_init__(self) -> None:
        if self.delay <= 0 or self.max_delay < self.delay:
            raise ValueError("Reconnect needs 0 < delay <= max_delay")
        if self.short_connections < 1:
            raise ValueError("Reconnect.short_connections must be at least 1")

    def backoff(self, failures: int) -> float:
        """Seconds to wait after `failures` failures in a row (1: the first)."""
        bound = min(self.max_delay, self.delay * 2 ** min(failures - 1, 62))
        return random.uniform(bound / 2, bound)


@dataclass(frozen=True, slots=True)
class Selection:
    """What a reader reads of one stream: its keys and types (empty: all), whether
    events carry their data, and the fields they carry (None: all; docs/gateway.md)."""

    keys: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    include_data: bool = True
    fields: tuple[str, ...] | None = None

    def params(self) -> list[tuple[str, str]]:
        params = [("key", key) for key in self.keys] + [("type", t) for t in self.types]
        if self.fields is not None:
            params.append(("fields", ",".join(self.fields)))
        elif not self.include_data:
            params.append(("include_data", "false"))
        return params


def selection_of(
    keys: Iterable[str],
    types: Iterable[str],
    include_data: bool,
    fields: Iterable[str] | None = None,
) -> Selection:
    """A Selection from a reader's arguments (a lone string is one key, type or field),
    its fields checked as the gateway checks them."""
    if fields is not None:
        fields = (fields,) if isinstance(fields, str) else tuple(fields)
        # raises InvalidInput naming an unknown field, or include_data=False beside fields
        read_fields(fields, None if include_data else False)
    return Selection(
        (keys,) if isinstance(keys, str) else tuple(keys),
        (types,) if isinstance(types, str) else tuple(types),
        include_data,
        fields,
    )


@dataclass(frozen=True, slots=True)
class Call:
    """One request to make: the path, its query, its headers, and how long a read of
    its answer may stay silent."""

    mode: Mode
    path: str
    params: tuple[tuple[str, str], ...]
    headers: dict[str, str]
    read_timeout: float
    # a watch to create first (POST /v1/watch with this body)
    create: dict[str, Any] | None = None


class Resume(Exception):
    """The gateway ended an event stream in a way that resuming by cursor cures."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Unavailable(Exception):
    """The gateway (or something before it) answered with a status worth retrying."""

    def __init__(self, status: int, retry_after: float | None) -> None:
        super().__init__(f"the gateway answered {status}")
        self.status = status
        self.retry_after = retry_after


def refusal(status: int, body: bytes) -> GatewayError:
    """The GatewayError of an answer with this status and body: the gateway's own code and
    message (docs/gateway.md, "Conventions"), or the status and the body when it has none."""
    try:
        error = json.loads(body)["error"]
        return GatewayError(status, str(error["code"]), str(error["message"]))
    except (ValueError, KeyError, TypeError):
        return GatewayError(status, f"http_{status}", body.decode(errors="replace"))


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # an HTTP date: the backoff will do
    return seconds if 0 <= seconds <= 3600 else None


@dataclass
class _Marks:
    """The last position delivered of each partition of one stream epoch."""

    epoch: int
    positions: list[int] = field(default_factory=list)

    def position(self, partition: int) -> int:
        return self.positions[partition] if partition < len(self.positions) else 0

    def raise_to(self, positions: Sequence[int]) -> None:
        if len(positions) > len(self.positions):
            self.positions.extend([0] * (len(positions) - len(self.positions)))
        for partition, position in enumerate(positions):
            if position > self.positions[partition]:
                self.positions[partition] = position


def _bounds(item: Item) -> tuple[str, int, int, int] | None:
    """(stream, partition, first position, last position) of an event or tombstone."""
    if isinstance(item, Event):
        return item.stream, item.partition, item.position, item.position
    if isinstance(item, Tombstone):
        return item.stream, item.partition, item.gap_from, item.gap_to
    return None


class ReadCore:
    """One reader's state: its cursor, its marks, and its connection history."""

    def __init__(
        self,
        stream: str,
        selection: Selection,
        *,
        after: str | None,
        since: str | datetime | None,
        api_key: str | None,
        heartbeat: float,
        page_limit: int | None,
        long_poll_wait: float,
        timeout: float,
        reconnect: Reconnect,
    ) -> None:
        if after is not None and since is not None:
            raise ValueError("give either after or since, not both")
        if not 1 <= heartbeat <= 60:
            raise ValueError("heartbeat must be from 1 to 60 seconds")
        self.stream = stream
        self.selection = selection
        self.api_key = api_key
        self.heartbeat = heartbeat
        self.page_limit = page_limit
        self.long_poll_wait = long_poll_wait
        self.timeout = timeout
        self.reconnect = reconnect
        if isinstance(since, datetime):
            if since.tzinfo is None:
                raise ValueError("since needs a time zone (an aware datetime)")
            since = since.isoformat()
        self._start = [("since", since)] if since is not None else [("after", after or "beginning")]
        # the cursor the next request resumes from
        self.cursor: str | None = None
        self.marks: dict[str, _Marks] = {}
        if after is not None and after.startswith("c1."):
            self.cursor = after
            try:
                known = GatewayCursor.decode(after)
            except InvalidCursor:
                pass  # the gateway says what is wrong with it
            else:
                for name, at in known.streams.items():
                    self.marks[name] = _Marks(at.epoch, list(at.positions))
        # the cursor after the last item handed to the caller (None: before the gateway
        # answered, when the reader started without a cursor)
        self.delivered = self.cursor
        self.up_to_date = False
        self.failures = 0
        self.short_in_a_row = 0
        self.long_poll_until = float("-inf")
        # names this reader's long-polls: a retry answers the one it replaces at once
        # (docs/gateway.md, "Long-poll")
        self.session = uuid.uuid4().hex

    # what to ask

    def mode(self, now: float) -> Mode:
        if not self.up_to_date:
            return "pages"
        return "long-poll" if now < self.long_poll_until else "sse"

    def next_call(self, now: float) -> Call:
        mode = self.mode(now)
        start = [("after", self.cursor)] if self.cursor is not None else self._start
        params = start + self.selection.params()
        headers = {"Accept": "application/json"}
        read_timeout = self.timeout
        if mode == "sse":
            params += [("live", "sse"), ("heartbeat", f"{self.heartbeat:g}")]
            headers = {"Accept": "text/event-stream"}
            if self.cursor is not None:
                headers["Last-Event-ID"] = self.cursor
            # the watchdog: twice the heartbeat of silence means the connection is dead
            read_timeout = 2 * self.heartbeat
        else:
            if self.page_limit is not None:
                params.append(("limit", str(self.page_limit)))
            if mode == "long-poll":
                params += [("live", "long-poll"), ("wait", f"{self.long_poll_wait:g}")]
                params.append(("session", self.session))
                read_timeout = self.long_poll_wait + self.timeout
        path = f"/v1/streams/{quote(self.stream, safe='')}/events"
        return Call(mode, path, tuple(params), self._authorized(headers), read_timeout)

    def _authorized(self, headers: dict[str, str]) -> dict[str, str]:
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def created(self, body: Mapping[str, Any]) -> None:
        raise TypeError("only a watch is created")

    # what answers mean

    def check(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """Raise for an answer that is not a success: Unavailable when asking again later
        may succeed (5xx, 429, ...), GatewayError when it would not (other 4xx)."""
        if status < 400:
            return
        if status >= 500 or status in RETRYABLE_STATUSES:
            raise Unavailable(status, _retry_after(headers.get("retry-after")))
        raise self.refused(status, body)

    def refused(self, status: int, body: bytes) -> GatewayError:
        """The error of a 4xx answer that asking again would not change."""
        return refusal(status, body)

    def page(self, body: Mapping[str, Any]) -> list[tuple[Item, str]]:
        """The new items of a page (or long-poll answer), each with the cursor after it."""
        items: list[Item] = [reset_from_json(reset) for reset in body["resets"]]
        items += [tombstone_from_json(tombstone) for tombstone in body["tombstones"]]
        items += [event_from_json(event, self.stream) for event in body["events"]]
        delivered = self._batch(str(body["cursor"]), items)
        if body["up_to_date"]:
            self.up_to_date = True
        return delivered

    def no_news(self, cursor: str | None) -> None:
        """A long-poll ended empty (204): its cursor, if it sent one, is the new one."""
        if cursor:
            self._batch(cursor, [])

    def frame(self, kind: str, data: str, frame_id: str | None) -> list[tuple[Item, str]]:
        """The new items of one SSE frame, each with the cursor after it. A `close`
        frame raises Resume when the reader resumes from it, GatewayError otherwise."""
        if kind in CLOSE_FRAMES:
            error = json.loads(data)
            code, message = str(error.get("code")), str(error.get("message"))
            if code in RESUMABLE:
                raise Resume(code, message)
            raise GatewayError(None, code, message)
        if frame_id is None:
            return []  # a frame this client does not know, without a cursor
        body = loads(data)
        items: list[Item] = []
        if kind == "events":
            stream = body["stream"]
            items = [event_from_json(event, stream) for event in body["events"]]
        elif kind == "tombstone":
            items = [tombstone_from_json(body)]
        elif kind == "reset":
            items = [reset_from_json(body)]
        elif kind == "caught-up":
            self.up_to_date = True
        return self._batch(frame_id, items)

    def _batch(self, cursor_text: str, items: list[Item]) -> list[tuple[Item, str]]:
        """Of `items` (answered together with the cursor `cursor_text`), those not yet
        delivered, each with the cursor after it; moves the marks and the cursor."""
        cursor = GatewayCursor.decode(cursor_text)
        fresh = self._new(cursor, items)
        self.cursor = cursor_text
        if not fresh:
            self.delivered = cursor_text
        for name, at in cursor.streams.items():
            self.marks[name].raise_to(at.positions)
        return _cursors_after_each(cursor, cursor_text, fresh)

    def _new(self, cursor: GatewayCursor, items: list[Item]) -> list[Item]:
        # A stream's marks hold for one epoch: a batch of another epoch (after a reset,
        # or the first batch of a reader that started without a cursor) starts afresh.
        epochs_before = {name: marks.epoch for name, marks in self.marks.items()}
        for name, at in cursor.streams.items():
            if epochs_before.get(name) != at.epoch:
                self.marks[name] = _Marks(at.epoch)
        fresh: list[Item] = []
        for item in items:
            if isinstance(item, Reset):
                if epochs_before.get(item.stream) != item.epoch:
                    fresh.append(item)
                continue
            bounds = _bounds(item)
            if bounds is None:
                continue
            name, partition, _, last = bounds
            marks = self.marks.get(name)
            if marks is None or last > marks.position(partition):
                fresh.append(item)
        return fresh

    # connections

    def succeeded(self) -> None:
        self.failures = 0

    def failed(self, retry_after: float | None = None) -> float:
        """Seconds to wait before the next request, after a failure."""
        self.failures += 1
        delay = self.reconnect.backoff(self.failures)
        return max(delay, retry_after or 0.0)

    def sse_ended(self, lived: float, delivered: bool, rotated: bool, now: float) -> None:
        """Count an SSE connection that was answered 200 and has ended."""
        if rotated or delivered or lived >= self.reconnect.short_connection:
            self.short_in_a_row = 0
            self.failures = 0
            return
        self.short_in_a_row += 1
        if self.short_in_a_row >= self.reconnect.short_connections:
            self.short_in_a_row = 0
            self.long_poll_until = now + self.reconnect.long_poll_period


def _cursors_after_each(
    cursor: GatewayCursor, cursor_text: str, items: list[Item]
) -> list[tuple[Item, str]]:
    """Each item with the cursor after it. After the last, the batch's own cursor; before
    that, a partition with items still to come stands just before the first of them
    (the positions between were passed over by a filter, or are the gap a tombstone
    reports), so that a reader resuming from any of these cursors neither skips nor
    repeats an item."""
    if not items:
        return []
    epochs = {name: at.epoch for name, at in cursor.streams.items()}
    positions = {name: list(at.positions) for name, at in cursor.streams.items()}
    lowered: set[tuple[str, int]] = set()
    for item in items:
        bounds = _bounds(item)
        if bounds is None:
            continue
        name, partition, first, _ = bounds
        if (name, partition) in lowered or name not in positions:
            continue
        lowered.add((name, partition))
        marks = positions[name]
        if partition >= len(marks):
            marks.extend([0] * (partition + 1 - len(marks)))
        marks[partition] = first - 1
    delivered: list[tuple[Item, str]] = []
    for item in items[:-1]:
        bounds = _bounds(item)
        if bounds is not None and bounds[0] in positions:
            name, partition, _, last = bounds
            positions[name][partition] = max(positions[name][partition], last)
        text = GatewayCursor(
            {name: StreamPosition(epochs[name], tuple(marks)) for name, marks in positions.items()}
        ).encode()
        delivered.append((item, text))
    delivered.append((items[-1], cursor_text))
    return delivered


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """What a watch reads of one of its streams: where it starts (`after`: a cursor of
    this stream, "beginning" or "now"; or `since`: a time), its filters and the fields
    its events carry (None: all)."""

    after: str | None = None
    since: str | datetime | None = None
    keys: tuple[str, ...] | list[str] = ()
    types: tuple[str, ...] | list[str] = ()
    include_data: bool = True
    fields: tuple[str, ...] | list[str] | None = None

    def __post_init__(self) -> None:
        if self.fields is not None:
            if isinstance(self.fields, str):
                raise InvalidInput("StreamOptions.fields must be a list of field names")
            read_fields(self.fields, None if self.include_data else False)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = (
            {"include_data": self.include_data}
            if self.fields is None
            else {"fields": list(self.fields)}
        )
        if self.since is not None:
            body["since"] = (
                self.since.isoformat() if isinstance(self.since, datetime) else self.since
            )
        elif self.after is not None:
            body["after"] = self.after
        if self.keys:
            body["key"] = list(self.keys)
        if self.types:
            body["type"] = list(self.types)
        return body


class WatchCore(ReadCore):
    """A reader's state for a watch of several streams: it creates the watch (POST
    /v1/watch), then follows its event stream, which catches up by itself; a watch
    that expired or is unknown is created again from the cursor."""

    def __init__(
        self,
        streams: Mapping[str, StreamOptions],
        *,
        after: str | None,
        api_key: str | None,
        heartbeat: float,
        timeout: float,
        reconnect: Reconnect,
    ) -> None:
        if not streams:
            raise ValueError("a watch needs at least one stream")
        super().__init__(
            "",
            Selection(),
            after=after,
            since=None,
            api_key=api_key,
            heartbeat=heartbeat,
            page_limit=None,
            long_poll_wait=0.0,
            timeout=timeout,
            reconnect=reconnect,
        )
        self.streams = dict(streams)
        self.wid: str | None = None

    def mode(self, now: float) -> Mode:
        return "sse"

    def next_call(self, now: float) -> Call:
        if self.wid is None:
            headers = self._authorized({"Accept": "application/json"})
            return Call("sse", "/v1/watch", (), headers, self.timeout, self._body())
        headers = {"Accept": "text/event-stream"}
        if self.cursor is not None:
            headers["Last-Event-ID"] = self.cursor
        path = f"/v1/watch/{quote(self.wid, safe='')}"
        return Call("sse", path, (), self._authorized(headers), 2 * self.heartbeat)

    def _body(self) -> dict[str, Any]:
        streams = {name: options.body() for name, options in self.streams.items()}
        if self.cursor is not None:
            # again from where the reader stands: each stream from its part of the cursor
            known = GatewayCursor.decode(self.cursor).streams
            for name, body in streams.items():
                body.pop("since", None)
                if name in known:
                    body["after"] = GatewayCursor({name: known[name]}).encode()
        return {"streams": streams, "heartbeat": self.heartbeat}

    def created(self, body: Mapping[str, Any]) -> None:
        """The gateway created the watch: its id, and its cursor if the reader had none."""
        self.wid = str(body["wid"])
        if self.cursor is None:
            self._batch(str(body["cursor"]), [])

    def check(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        if status in (404, 410) and self.wid is not None:
            refusal = self.refused(status, body)
            if refusal.code in ("watch_not_found", "watch_expired"):
                self.wid = None  # create it again, from the cursor
                raise Unavailable(status, None)
        super().check(status, headers, body)


@dataclass(frozen=True, slots=True)
class SseFrame:
    """One server-sent event: its name, its data and its id (None: it had none). A
    comment (the gateway's heartbeat) is a frame named ':'."""

    kind: str
    data: str
    id: str | None


class SseParser:
    """Server-sent events from the lines of a response (the WHATWG parsing rules this
    gateway needs: `event`, `data`, `id`, comments; `retry` is left to Reconnect)."""

    def __init__(self) -> None:
        self._kind = "message"
        self._data: list[str] = []
        self._id: str | None = None

    def feed(self, line: str) -> SseFrame | None:
        """The frame `line` completes, if any."""
        if line == "":
            frame = None
            if self._data:
                frame = SseFrame(self._kind, "\n".join(self._data), self._id)
            self._kind, self._data, self._id = "message", [], None
            return frame
        if line.startswith(":"):
            return SseFrame(":", line[1:].strip(), None)
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._kind = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self._id = value
        return None
