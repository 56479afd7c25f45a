"""Reading for one client: its selections, its cursor, and the frames it is sent.

The same bookkeeping serves a pull, a long-poll, an SSE stream and a watch: catch up
with pages read by cursor (`Reader.page`, one snapshot per page) until every stream is
up to date, then, for SSE, read only the partitions the hub says moved, through the
hub's shared reads. A position at or below the cursor is never sent (the cursor only
moves forward), and a read that starts below a partition's floor gets its tombstone
first, so nothing is skipped silently (DESIGN.md, the gateway's principles 1 and 3).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, NamedTuple

from subengine.gateway._hub import READ_LIMIT, Hub, SharedRead, dumps, tombstone_body
from subengine.gateway._sse import frame_text
from subengine.model._event_fields import ALL_FIELDS
from subengine.model._events import Tombstone, partition_for
from subengine.model._gateway_cursor import GatewayCursor, InvalidCursor, StreamPosition
from subengine.streams._read import EncodedPage, RawEvent


@dataclass(frozen=True, slots=True)
class Selection:
    """What a client reads of one stream: its keys and types (None: all) and the fields
    its events carry (`subengine.model._event_fields`)."""

    stream: str
    keys: frozenset[str] | None = None
    types: frozenset[str] | None = None
    fields: frozenset[str] = ALL_FIELDS

    def keeps(self, event: RawEvent) -> bool:
        return (self.keys is None or event.key in self.keys) and (
            self.types is None or event.type in self.types
        )

    def partitions(self, count: int | None) -> frozenset[int] | None:
        """The partitions its keys live in (None: every partition)."""
        if self.keys is None or count is None:
            return None
        return frozenset(partition_for(key, count) for key in self.keys)


# The most sets of frames a shared read keeps, each for the readers at one cursor.
_FRAMES_KEPT = 4

# The most bytes of event JSON a page holds (but for a single larger event): a page of
# large events stays a size a client and the gateway hold at once, whatever its `limit`.
PAGE_BYTES = 1 << 20


class Taken(NamedTuple):
    """A page taken by a reader: the kept events' JSON, the tombstones, whether the stream
    is now read up to its heads, the bytes of the events' JSON joined by commas, and
    whether the byte bound ended the page."""

    events: list[str]
    tombstones: list[dict[str, Any]]
    up_to_date: bool
    size: int
    full: bool


@dataclass(frozen=True, slots=True)
class Frame:
    """One SSE message: its event name, its JSON data, the whole cursor after it (None:
    a frame that carries no `id:`), and the message as sent."""

    kind: str
    data: str
    cursor: str | None
    wire: bytes

    @classmethod
    def of(cls, kind: str, data: str, cursor: str | None) -> Frame:
        return cls(kind, data, cursor, frame_text(kind, data, cursor).encode())


class Reset(Exception):
    """A stream of the cursor was deleted and created again (its epoch changed)."""


@dataclass
class Reader:
    """One client's selections and cursor over the hub."""

    hub: Hub
    selections: dict[str, Selection]
    start: dict[str, StreamPosition]
    frames_out: list[Frame] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.epochs = {stream: at.epoch for stream, at in self.start.items()}
        # per stream, the last position delivered of every partition (empty: the
        # beginning of every partition, until the first page says how many there are)
        self.marks = {stream: list(at.positions) for stream, at in self.start.items()}
        # the streams read once: the gaps of a stream's first page were there at connect
        self.read_once: set[str] = set()

    @property
    def cursor(self) -> GatewayCursor:
        return GatewayCursor(
            {
                stream: StreamPosition(self.epochs[stream], tuple(marks))
                for stream, marks in self.marks.items()
            }
        )

    def position(self, stream: str, partition: int) -> int:
        marks = self.marks[stream]
        return marks[partition] if partition < len(marks) else 0

    def _advance(self, stream: str, partition: int, position: int) -> None:
        marks = self.marks[stream]
        if position > marks[partition]:
            marks[partition] = position

    def _emit(self, kind: str, body: Any | str) -> None:
        data = body if isinstance(body, str) else dumps(body)
        self.frames_out.append(Frame.of(kind, data, self.cursor.encode()))

    def take_frames(self) -> list[Frame]:
        frames, self.frames_out = self.frames_out, []
        return frames

    # catching up by cursor

    def _reads(
        self, stream: str, limit: int, max_bytes: int, oversize: bool
    ) -> Callable[[Sequence[int]], Awaitable[EncodedPage]]:
        """The read of a page of `stream` after some positions, its events' JSON made by
        PostgreSQL."""
        selection = self.selections[stream]
        return partial(
            self.hub.read_engine.read_page_json,
            stream,
            limit=limit,
            keys=selection.keys,
            types=selection.types,
            fields=selection.fields,
            max_bytes=max_bytes,
            oversize=oversize,
        )

    async def _read_page(
        self,
        stream: str,
        limit: int,
        max_bytes: int,
        oversize: bool = True,
        ahead: EncodedPage | None = None,
    ) -> EncodedPage:
        """A page of `stream` after the cursor (`ahead`, when it was read from there in
        the cursor's epoch). A changed epoch emits a `reset` frame and reads the stream
        again from its beginning. The cursor then names every partition."""
        read = self._reads(stream, limit, max_bytes, oversize)
        if ahead is not None and ahead.epoch == self.epochs[stream]:
            page = ahead
        else:
            self.hub.pages += 1
            page = await read(self.marks[stream])
        if page.epoch != self.epochs[stream]:
            self._reset(stream, self.epochs[stream], page.epoch)
            page = await read(())
        elif not page.fits:
            raise InvalidCursor(
                f"the cursor has {len(self.marks[stream])} positions for stream {stream!r}, "
                f"which has {len(page.heads)} partitions"
            )
        if not self.marks[stream]:
            self.marks[stream] = [0] * len(page.heads)
        if stream not in self.read_once:
            self.read_once.add(stream)
            gaps = [replace(gap, cursor_below_floor=True) for gap in page.tombstones]
            page = replace(page, tombstones=gaps)
        return page

    def read_ahead(self, stream: str, limit: int) -> Callable[[], Awaitable[EncodedPage | None]]:
        """The read of the page of `stream` after the cursor as it stands, which a pull's
        next request will ask for (`page(..., ahead=)`): None when that page reaches the
        heads it finds, so that the request reads afresh and sees what was appended
        since, or when the stream was created again."""
        read = self._reads(stream, limit, PAGE_BYTES, True)
        marks, epoch = tuple(self.marks[stream]), self.epochs[stream]

        async def page() -> EncodedPage | None:
            self.hub.pages += 1
            found = await read(marks)
            if found.epoch != epoch or not found.fits:
                return None
            ends = list(marks)
            for tombstone in found.tombstones:
                ends[tombstone.partition] = tombstone.gap_to
            for partition, position, _ in found.events:
                ends[partition] = position
            if all(end >= head for end, head in zip(ends, found.heads, strict=True)):
                return None
            return found

        return page

    async def page(
        self,
        stream: str,
        limit: int,
        max_bytes: int = PAGE_BYTES,
        oversize: bool = True,
        ahead: EncodedPage | None = None,
    ) -> Taken:
        """One page of `stream` after the cursor (at most `limit` events and, but for a
        first event larger than it when `oversize`, `max_bytes` of their JSON; `ahead`,
        the page `read_ahead` read from the cursor with the same bounds, if any). Moves
        the cursor."""
        return self._take_page(await self._read_page(stream, limit, max_bytes, oversize, ahead))

    async def live_page(
        self,
        stream: str,
        partitions: Iterable[int],
        wanted: frozenset[int] | None,
        limit: int,
        max_bytes: int = PAGE_BYTES,
        oversize: bool = True,
    ) -> Taken:
        """What `page` would take once the stream was up to date and the hub said that
        `partitions` moved, read through the hub's shared reads: one read per partition
        and position however many readers wait there, instead of a page of the whole
        stream each (a long-poll woken by an append). The events of the partitions are
        taken oldest first, as a page takes them, within `limit` and `max_bytes`; the
        cursor moves over what is taken (and the events the filters pass over before
        it). Up to date means every partition of `wanted` (None: all) is at the head the
        hub knows: with `key=` filters the cursor of the other partitions stays where it
        was (a later page passes over their events). A read of a stream created again
        since the cursor's epoch (the read says its epoch) sends it to `page`, which
        emits the reset."""
        selection = self.selections[stream]
        reads = []
        for partition in sorted(set(partitions)):
            position = self.position(stream, partition)
            if self.hub.head(stream, partition) <= position:
                continue
            shared = await self.hub.read(stream, partition, position)
            if shared.epoch != self.epochs[stream]:
                # the stream was deleted and created again: a page says so (a reset)
                # and reads the new one from its beginning
                return await self.page(stream, limit, max_bytes, oversize)
            reads.append((partition, shared))
        tombstones: list[dict[str, Any]] = []
        merged: list[tuple[Any, int, int, SharedRead, int]] = []
        for partition, shared in reads:
            for index, item in enumerate(shared.items):
                if isinstance(item, Tombstone):
                    if index > 0:  # behind events that may not all be taken: read again
                        break
                    self._advance(stream, partition, item.gap_to)
                    tombstones.append(tombstone_body(item))
                else:
                    merged.append((item.recorded_at, partition, item.position, shared, index))
        merged.sort(key=lambda m: m[:3])
        events: list[str] = []
        size, full = 0, False
        for _, partition, position, shared, index in merged:
            item = shared.items[index]
            assert isinstance(item, RawEvent)
            if selection.keeps(item):
                if len(events) >= limit:
                    break
                text = shared.encoded(index, selection.fields)
                grown = size + len(text.encode()) + (1 if events else 0)
                if grown > max_bytes and (events or not oversize):
                    full = True
                    break
                events.append(text)
                size = grown
            self._advance(stream, partition, position)
        marks = self.marks[stream]
        up_to_date = all(
            self.hub.head(stream, partition) <= mark
            for partition, mark in enumerate(marks)
            if wanted is None or partition in wanted
        )
        return Taken(events, tombstones, up_to_date, size, full)

    def _reset(self, stream: str, previous: int, epoch: int) -> None:
        self.epochs[stream] = epoch
        self.marks[stream] = []
        self._emit(
            "reset",
            {
                "stream": stream,
                "previous_epoch": previous,
                "epoch": epoch,
                "reason": "the stream was deleted and created again",
            },
        )

    def _take_page(self, page: EncodedPage) -> Taken:
        stream = page.stream
        marks = self.marks[stream]
        tombstones = []
        for tombstone in page.tombstones:
            self._advance(stream, tombstone.partition, tombstone.gap_to)
            tombstones.append(tombstone_body(tombstone))
        events = []
        # a page's positions are after the cursor, and rise along each partition
        for partition, position, text in page.events:
            marks[partition] = position
            if text is not None:
                events.append(text)
        return Taken(events, tombstones, self._up_to_date(page), page.size, page.full)

    def _up_to_date(self, page: EncodedPage) -> bool:
        marks = self.marks[page.stream]
        return all(mark >= head for mark, head in zip(marks, page.heads, strict=True))

    async def catch_up_frames(self, stream: str, limit: int, max_bytes: int = PAGE_BYTES) -> bool:
        """Read one page of `stream` and emit it as frames (a tombstone frame per gap,
        an events frame per partition); whether the stream is up to date."""
        page = await self._read_page(stream, limit, max_bytes)
        for tombstone in page.tombstones:
            self._advance(stream, tombstone.partition, tombstone.gap_to)
            self._emit("tombstone", tombstone_body(tombstone))
        # per partition, in the order the page first reaches it: its first and last
        # positions and its kept events' JSON
        firsts: dict[int, int] = {}
        lasts: dict[int, int] = {}
        kept: dict[int, list[str]] = {}
        for partition, position, text in page.events:
            if partition not in firsts:
                firsts[partition] = position
                kept[partition] = []
            lasts[partition] = position
            if text is not None:
                kept[partition].append(text)
        for partition, first in firsts.items():
            last = lasts[partition]
            self._advance(stream, partition, last)
            if kept[partition]:
                self._emit_events(
                    stream, partition, first, last, page.heads[partition], kept[partition]
                )
        return self._up_to_date(page)

    def _emit_events(
        self, stream: str, partition: int, first: int, last: int, head: int, events: list[str]
    ) -> None:
        data = (
            f'{{"stream":{dumps(stream)},"partition":{partition},"first":{first},'
            f'"last":{last},"head":{max(head, last)},"events":[{",".join(events)}]}}'
        )
        self._emit("events", data)

    # live, through the hub

    def at_known_heads(self, stream: str) -> bool:
        """Whether the cursor stands at every head the hub knows of `stream`, in the
        epoch it follows: nothing to read until the hub hears of more. Any later append
        notifies a watcher added before this is asked."""
        known = self.hub.known(stream)
        if known is None:
            return False
        epoch, heads = known
        marks = self.marks[stream]
        return (
            epoch == self.epochs[stream]
            and len(marks) == len(heads)
            and all(mark >= head for mark, head in zip(marks, heads, strict=True))
        )

    def behind(self, changed: Iterable[tuple[str, int]]) -> set[tuple[str, int]]:
        """Of `changed`, the partitions whose head the hub knows is past the cursor."""
        return {
            (stream, partition)
            for stream, partition in changed
            if stream in self.marks
            and self.hub.head(stream, partition) > self.position(stream, partition)
        }

    def lag(self, partitions: Iterable[tuple[str, int]]) -> int:
        """Events between the cursor and the heads the hub knows, in `partitions`."""
        return sum(
            max(self.hub.head(stream, partition) - self.position(stream, partition), 0)
            for stream, partition in partitions
        )

    async def live_frames(self, stream: str, partition: int) -> tuple[bool, bool]:
        """Read one partition after the cursor through the hub's shared read and emit its
        frames. Returns whether more may follow (the read was full, or the hub knows of a
        later head) and whether the cursor moved (it does not while a replica has yet to
        replay what the primary notified)."""
        before = self.position(stream, partition)
        shared: SharedRead = await self.hub.read(stream, partition, before)
        if shared.epoch != self.epochs[stream]:
            # the stream was deleted and created again, which no notification says: a
            # page emits the reset and reads the new one from its beginning
            return not await self.catch_up_frames(stream, READ_LIMIT), True
        return self.shared_frames(shared)

    def fits(self, shared: SharedRead) -> bool:
        """Whether `shared` is a read from where the cursor stands, in the epoch it is of:
        `shared_frames` then emits its frames."""
        stream = shared.stream
        return (
            self.epochs.get(stream) == shared.epoch
            and self.position(stream, shared.partition) == shared.after
        )

    def shared_frames(self, shared: SharedRead) -> tuple[bool, bool]:
        """`live_frames` once the hub's read is done, if it `fits`."""
        stream, partition, before = shared.stream, shared.partition, shared.after
        head = max(shared.head, self.hub.head(stream, partition))
        # Every reader that stands where this one does (its whole cursor), with the same
        # selection, gets the same frames from this read: the second makes and keeps
        # them (the first only notes where it stood: readers whose cursors differ, with
        # key filters say, keep no frames), a few at most per read.
        state = (self.selections[stream], head, self._state())
        made = shared.frames.get(state)
        if made is None:
            count = len(self.frames_out)
            self._live_frames(stream, partition, shared, head)
            if state not in shared.frames:
                shared.frames[state] = None
            elif shared.frames_kept < _FRAMES_KEPT:
                shared.frames[state] = (self.frames_out[count:], self.position(stream, partition))
                shared.frames_kept += 1
        else:
            frames, position = made
            self.frames_out.extend(frames)
            self._advance(stream, partition, position)
        known = self.hub.head(stream, partition)
        after = self.position(stream, partition)
        return len(shared.items) >= READ_LIMIT or known > after, after > before

    def _state(self) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
        """The whole cursor, as a key."""
        if len(self.marks) == 1:  # most readers: one stream
            ((stream, marks),) = self.marks.items()
            return ((stream, self.epochs[stream], tuple(marks)),)
        return tuple(
            (stream, self.epochs[stream], tuple(marks)) for stream, marks in self.marks.items()
        )

    def _live_frames(self, stream: str, partition: int, shared: SharedRead, head: int) -> None:
        selection = self.selections[stream]
        kept: list[str] = []
        first = last = None
        for index, item in enumerate(shared.items):
            if isinstance(item, Tombstone):
                self._advance(stream, partition, item.gap_to)
                self._emit("tombstone", tombstone_body(item))
                continue
            if first is None:
                first = item.position
            last = item.position
            if selection.keeps(item):
                kept.append(shared.encoded(index, selection.fields))
        if last is not None:
            assert first is not None
            self._advance(stream, partition, last)
            if kept:
                self._emit_events(stream, partition, first, last, head, kept)
