"""The hub of a gateway process: one LISTEN connection, wake-ups per partition, shared reads.

Push only wakes (DESIGN.md, the gateway's first principle). A notification says that a
partition's head moved; the hub wakes only the watchers of that (stream, partition), and
each then reads after its own cursor. Reads go through `read`, which runs one query per
(stream, partition, position) however many watchers stand there, and encodes each event
once for all of them. An event stream that waits with nothing else to do is not woken
for a read from where it stands: the hub hands it the read, and it sends its frames
(`Watcher.direct`). A head poll of every watched stream, every `poll_interval` seconds
and whenever the listener (re)connects, is the safety net for lost notifications.

What the hub knows of a stream (its epoch and heads) outlives the stream's last watcher
by `FEED_LINGER_SECONDS`: a long-poll client comes back right after each answer, and its
next long-poll then starts from known heads, with no head poll and no second page read
for the first one's sake.

A watcher holds no events: only which partitions changed since it last looked. A slow
client therefore never makes the hub queue anything for it; it reads more at once when
it gets round to it (coalescing).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson

from subengine.engine._async_engine import AsyncEngine
from subengine.model._errors import DatabaseUnavailable
from subengine.model._event_fields import ALL_FIELDS
from subengine.model._events import Tombstone
from subengine.streams._listener import TaskInbox
from subengine.streams._read import RawEvent

log = logging.getLogger("subengine.gateway")

# How many events one shared read of a partition returns at most.
READ_LIMIT = 200
# How many finished shared reads are kept for watchers that arrive a little later, and
# for how long.
_CACHED_READS = 512
_CACHED_SECONDS = 2.0
# How long the hub keeps following a stream after its last watcher left (longer than a
# long-poll client takes to send its next request).
FEED_LINGER_SECONDS = 5.0


def event_json(event: RawEvent, fields: frozenset[str] = ALL_FIELDS) -> str:
    """An event as the gateway sends it (docs/gateway.md, "Reading events"), with
    `fields` alone (`subengine.model._event_fields`), its data and metadata spliced in
    as the JSON text PostgreSQL gave. (Catch-up pages have the same text made by
    PostgreSQL: `subengine.streams._read.read_page_json`.)"""
    # a test per field: a table of writers per field took a quarter longer (live frames)
    parts = [f'"stream":{_text(event.stream)}'] if "stream" in fields else []
    parts.append(f'"partition":{event.partition},"position":{event.position}')
    if "id" in fields:
        parts.append(f'"id":"{event.id}"')
    if "key" in fields:
        parts.append(f'"key":{_text(event.key)}')
    if "key_version" in fields:
        parts.append(f'"key_version":{event.key_version}')
    if "type" in fields:
        parts.append(f'"type":{_text(event.type)}')
    if "metadata" in fields:
        parts.append(f'"metadata":{event.metadata}')
    if "occurred_at" in fields:
        parts.append(f'"occurred_at":"{event.occurred_at.isoformat()}"')
    if "recorded_at" in fields:
        parts.append(f'"recorded_at":"{event.recorded_at.isoformat()}"')
    if "data" in fields:
        parts.append(f'"data":{event.data}')
    return "{" + ",".join(parts) + "}"


def tombstone_body(tombstone: Tombstone) -> dict[str, Any]:
    return {
        "stream": tombstone.stream,
        "partition": tombstone.partition,
        "gap_from": tombstone.gap_from,
        "gap_to": tombstone.gap_to,
        "floor": tombstone.floor,
        "reason": tombstone.reason,
        "head": tombstone.head,
        "cursor_below_floor": tombstone.cursor_below_floor,
    }


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _text(text: str) -> str:
    """A JSON string, as `dumps` writes it (no escapes but the ones JSON requires), about
    ten times as fast: an event's stream, key and type."""
    return orjson.dumps(text).decode()


@dataclass(eq=False)
class SharedRead:
    """One read of a partition after a position, shared by every watcher standing there:
    its items, the epoch of the stream they are of (read with them, in one snapshot),
    the head known when it was asked for, and each event's JSON, made once.

    A stream deleted and created again has a new epoch and sends no notification (the
    hub learns of it only at its next head poll): a reader whose cursor is of another
    epoch than the read's must not take its items, but read the stream anew."""

    stream: str
    partition: int
    after: int
    head: int
    epoch: int = 0
    items: list[RawEvent | Tombstone] = field(default_factory=list)
    finished: float = 0.0
    _encoded: dict[tuple[int, frozenset[str]], str] = field(default_factory=dict)
    # the frames readers made of it, by where they stood (see Reader.live_frames), and
    # the position of the partition after them; None: made once, not kept
    frames: dict[Hashable, tuple[list[Any], int] | None] = field(default_factory=dict)
    frames_kept: int = 0  # of `frames`, those not None

    def reaches(self, head: int) -> bool:
        """Whether this read still answers a reader at `after`: it was full, or it got
        to `head`."""
        if len(self.items) >= READ_LIMIT:
            return True
        return bool(self.items) and self.items[-1].position >= head

    def encoded(self, index: int, fields: frozenset[str]) -> str:
        key = (index, fields)
        text = self._encoded.get(key)
        if text is None:
            item = self.items[index]
            assert isinstance(item, RawEvent)
            text = self._encoded[key] = event_json(item, fields)
        return text


class Wake:
    """A flag one coroutine waits on: `asyncio.Event` for a single waiter, without its
    bookkeeping (a wake-up per watcher per notification is the gateway's hot path)."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def is_set(self) -> bool:
        return self._set

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> None:
        if self._set:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class Watcher:
    """One client's wake-ups: the (stream, partition) pairs whose head moved since it last
    looked, and whether to look at everything again (a resync or an epoch change)."""

    def __init__(
        self,
        partitions: dict[str, frozenset[int] | None],
        shared_reads: bool = False,
        page_reads: bool = False,
    ) -> None:
        # per stream, the partitions it reads (None: all)
        self.partitions = partitions
        # whether it reads each partition that moved on its own, through the hub's
        # shared reads (an event stream: `Reader.live_frames`): the hub then wakes it (or
        # hands it the read, see `direct`) once its read of the partition is done. Others
        # are woken at once: a long-poll, which answers with what every partition woken
        # together holds (an append to several partitions wakes it once, not once per
        # partition's read), and the readers that read otherwise (Durable Streams, a
        # remote worker's claim).
        self.shared_reads = shared_reads
        # a long-poll's: woken at once, it then reads what moved through the hub's shared
        # reads too, so the hub starts the read of a moved partition as it wakes it
        self.page_reads = page_reads
        self.changed: set[tuple[str, int]] = set()
        self.resync = False
        self.event = Wake()
        # set by an event stream while its task waits with nothing else to do: it takes
        # the frames of a shared read it fits from the hub itself, without being woken
        # (False: wake it instead, to read for itself)
        self.direct: Callable[[SharedRead], bool] | None = None

    def wants(self, stream: str, partition: int) -> bool:
        wanted = self.partitions.get(stream)
        return wanted is None or partition in wanted

    def wake(self, stream: str, partition: int) -> None:
        self.changed.add((stream, partition))
        self.event.set()

    def wake_all(self) -> None:
        self.resync = True
        self.event.set()

    def take(self) -> tuple[set[tuple[str, int]], bool]:
        changed, resync = self.changed, self.resync
        self.changed, self.resync = set(), False
        self.event.clear()
        return changed, resync


def _wake(
    watchers: list[Watcher], stream: str, partition: int, read: asyncio.Future[SharedRead]
) -> None:
    """Wake the watchers of a partition that moved, once the read for them is done; a
    watcher that waits with nothing else to do is handed the read instead, and sends its
    frames from here (one after the other, without a switch to each one's task)."""
    shared = None
    if not read.cancelled() and read.exception() is None:
        shared = read.result()
    # else: each watcher's own read raises the failure again, or reads anew
    for watcher in watchers:
        direct = watcher.direct
        if shared is not None and direct is not None and not watcher.event.is_set():
            try:
                if direct(shared):
                    continue
            except Exception:  # its task meets what is wrong; the others are served
                log.exception("gateway: handing a read to an event stream failed")
        watcher.wake(stream, partition)


def _looked_at(read: asyncio.Future[SharedRead]) -> None:
    """Mark a failure of a read as seen (whoever asks for the read meets it again)."""
    if not read.cancelled():
        read.exception()


@dataclass(eq=False)
class _Feed:
    """What the hub knows of one watched stream."""

    stream: str
    inbox: TaskInbox = field(init=False)  # set once registered: it calls back the hub
    watchers: set[Watcher] = field(default_factory=set)
    epoch: int | None = None
    heads: list[int] = field(default_factory=list)
    # the timer that stops following the stream, while it has no watcher
    drop: asyncio.TimerHandle | None = None


class Hub:
    """Wake-ups and shared reads for every watcher of a gateway process.

    `listen_engine` owns the LISTEN connection (notifications exist on the primary only);
    `read_engine` serves the reads (the primary, or a streaming replica).
    """

    def __init__(
        self,
        listen_engine: AsyncEngine,
        read_engine: AsyncEngine,
        poll_interval: float,
        linger: float = FEED_LINGER_SECONDS,
    ) -> None:
        self.listen_engine = listen_engine
        self.read_engine = read_engine
        self.poll_interval = poll_interval
        self.linger = linger
        self._feeds: dict[str, _Feed] = {}
        self._reads: OrderedDict[tuple[str, int, int], asyncio.Future[SharedRead]] = OrderedDict()
        self._poller: asyncio.Task[None] | None = None
        self._poll_now = asyncio.Event()
        self._closed = False
        self.reads = 0  # queries run by `read` (for the metrics and the benchmark)
        self.pages = 0  # pages read by cursor through it (`Reader.page`, the metrics)

    # watchers

    def add(self, watcher: Watcher) -> None:
        """Wake `watcher` from now on when a partition it reads moves."""
        if self._closed:
            raise DatabaseUnavailable("the gateway is shutting down")
        for stream in watcher.partitions:
            feed = self._feeds.get(stream)
            if feed is None:
                feed = _Feed(stream)
                feed.inbox = self.listen_engine.listener.register(
                    stream, partial(self._follow, feed)
                )
                self._feeds[stream] = feed  # once registered: a failure leaves nothing
            elif feed.drop is not None:
                feed.drop.cancel()
                feed.drop = None
            feed.watchers.add(watcher)
            if feed.epoch is None:
                self._poll_now.set()
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(
                self._poll(), name="subengine-gateway-head-poll"
            )

    def remove(self, watcher: Watcher) -> None:
        """Stop waking `watcher`. A stream left without watchers is still followed for
        `linger` seconds, for the next one."""
        for stream in watcher.partitions:
            feed = self._feeds.get(stream)
            if feed is None:
                continue
            feed.watchers.discard(watcher)
            if not feed.watchers and feed.drop is None:
                feed.drop = asyncio.get_running_loop().call_later(self.linger, self._drop, feed)

    def _drop(self, feed: _Feed) -> None:
        """Stop following a stream that has had no watcher for `linger` seconds."""
        feed.drop = None
        if feed.watchers or self._feeds.get(feed.stream) is not feed:
            return
        del self._feeds[feed.stream]
        self.listen_engine.listener.unregister(feed.inbox)

    def head(self, stream: str, partition: int) -> int:
        """The highest head of the partition the hub has heard of (0: none yet)."""
        feed = self._feeds.get(stream)
        if feed is None or partition >= len(feed.heads):
            return 0
        return feed.heads[partition]

    def known(self, stream: str) -> tuple[int, list[int]] | None:
        """The epoch and the heads of every partition of `stream`, as the hub knows them
        while it follows it; None before its first head poll, or once it stopped."""
        feed = self._feeds.get(stream)
        if feed is None or feed.epoch is None or not feed.heads:
            return None
        return feed.epoch, feed.heads

    def watched(self) -> int:
        return sum(len(feed.watchers) for feed in self._feeds.values())

    def _follow(self, feed: _Feed) -> None:
        """Hand the notifications of one stream to the watchers of their partitions: its
        inbox calls this, in the event loop, soon after they arrive (no task between)."""
        if self._feeds.get(feed.stream) is not feed:
            return  # no longer followed
        heads, resync = feed.inbox.take()
        if feed.inbox.closed:
            for watcher in list(feed.watchers):
                watcher.wake_all()
            return
        if resync:
            self._wake_poller()
        for partition, head in heads.items():
            self._learn(feed, partition, head)

    def _learn(self, feed: _Feed, partition: int, head: int) -> None:
        if partition >= len(feed.heads):
            feed.heads.extend([0] * (partition + 1 - len(feed.heads)))
        previous = feed.heads[partition]
        if head <= previous:
            return
        feed.heads[partition] = head
        stream = feed.stream
        readers: list[Watcher] = []
        paging = False  # a long-poll woken here reads from the previous head soon
        for watcher in feed.watchers:
            if watcher.wants(stream, partition):
                if watcher.shared_reads and feed.epoch is not None:
                    readers.append(watcher)
                else:  # it reads otherwise, or before the first head poll: at once
                    watcher.wake(stream, partition)
                    paging = paging or watcher.page_reads
        if feed.epoch is None or not (readers or paging):
            return
        # Every caught-up reader stands at the previous head and reads from there: the
        # read starts now, and once it is done each waiting reader is handed it (no
        # switch to its task) and the others are woken to find it made (one switch per
        # append, not two: wake, then wait for the read). A reader elsewhere reads for
        # itself, as before; a failed read wakes them all the same.
        future = self._shared(stream, partition, previous, time.monotonic())
        if not readers:  # the long-polls take it up, woken already
            future.add_done_callback(_looked_at)  # a failure is theirs to meet
            return
        if future.done():
            _wake(readers, stream, partition, future)
        else:
            future.add_done_callback(partial(_wake, readers, stream, partition))

    def _wake_poller(self) -> None:
        self._poll_now.set()

    async def _poll(self) -> None:
        """The safety net: read the heads (and epochs) of every watched stream."""
        while not self._closed:
            streams = list(self._feeds)
            if streams:
                try:
                    found = await self.read_engine.epochs_and_heads(streams)
                except Exception as error:  # the next poll tries again
                    log.warning("gateway head poll failed: %s", error)
                    found = None
                if found is not None:
                    self._learn_all(streams, found)
            self._poll_now.clear()
            try:
                await asyncio.wait_for(self._poll_now.wait(), self.poll_interval)
            except TimeoutError:
                pass

    def _learn_all(
        self, streams: list[str], found: dict[str, tuple[int, list[int] | None]]
    ) -> None:
        for stream in streams:
            feed = self._feeds.get(stream)
            if feed is None:
                continue
            epoch, heads = found.get(stream, (None, None))
            if epoch != feed.epoch or heads is None:
                # first seen, created anew, deleted or being deleted: every watcher looks
                # again
                for watcher in feed.watchers:
                    watcher.wake_all()
                feed.epoch = epoch
                feed.heads = list(heads or [])
                continue
            for partition, head in enumerate(heads):
                self._learn(feed, partition, head)

    # shared reads

    async def read(self, stream: str, partition: int, after: int) -> SharedRead:
        """The events of a partition after `after` (up to READ_LIMIT), read once for every
        watcher that asks for the same (stream, partition, position) meanwhile."""
        future = self._shared(stream, partition, after, time.monotonic())
        if future.done():
            return future.result()
        return await asyncio.shield(future)

    def _shared(
        self, stream: str, partition: int, after: int, now: float
    ) -> asyncio.Future[SharedRead]:
        """The read of `read`: one made or under way that still serves, else a new one."""
        key = (stream, partition, after)
        future = self._reads.get(key)
        if future is not None and future.done():
            # a finished read serves later watchers while it is fresh and still reaches
            # the head known now (or was full); otherwise it is read again
            if (
                not future.cancelled()
                and future.exception() is None
                and now - future.result().finished < _CACHED_SECONDS
                and future.result().reaches(self.head(stream, partition))
            ):
                return future
            del self._reads[key]
            future = None
        if future is None:
            # the read is the hub's own task: a watcher that leaves (its task cancelled)
            # while others wait on it cancels nothing of theirs
            future = asyncio.ensure_future(self._read(stream, partition, after))
            self.reads += 1
            self._reads[key] = future
            self._evict(now)
        return future

    async def _read(self, stream: str, partition: int, after: int) -> SharedRead:
        shared = SharedRead(stream, partition, after, self.head(stream, partition))
        try:
            shared.epoch, shared.items = await self.read_engine.read_json(
                stream, partition, after, READ_LIMIT
            )
        except BaseException:
            key = (stream, partition, after)
            if self._reads.get(key) is asyncio.current_task():
                del self._reads[key]  # a failed read is not kept for others
            raise
        shared.finished = time.monotonic()
        return shared

    def _evict(self, now: float) -> None:
        """Drop the finished reads that are too old to serve, and the oldest beyond
        _CACHED_READS (their events are held only while a watcher uses them)."""
        while self._reads:
            oldest_key, oldest = next(iter(self._reads.items()))
            if not oldest.done():
                break
            stale = oldest.cancelled() or oldest.exception() is not None
            if (
                not stale
                and now - oldest.result().finished < _CACHED_SECONDS
                and len(self._reads) <= _CACHED_READS
            ):
                break
            del self._reads[oldest_key]

    async def close(self) -> None:
        """Stop polling and following; every watcher is woken to notice."""
        self._closed = True
        for feed in list(self._feeds.values()):
            if feed.drop is not None:
                feed.drop.cancel()
            for watcher in list(feed.watchers):
                watcher.wake_all()
            self.listen_engine.listener.unregister(feed.inbox)
        self._feeds.clear()
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
