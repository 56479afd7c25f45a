"""The gateway's event-stream response (SSE) of one stream or of a watch: catch up by pages,
then follow the hub's wake-ups, with heartbeats, until the client, the server or time ends it."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from starlette.types import Receive, Send

from subengine.gateway._auth import Principal
from subengine.gateway._connections import Slot
from subengine.gateway._http import NO_STORE
from subengine.gateway._hub import SharedRead, Watcher, dumps
from subengine.gateway._reading import Reader, Selection
from subengine.gateway._sse import Blocked, EventStream, Gone, HeldOpen, frame_text
from subengine.gateway._state import Gateway
from subengine.model._errors import DatabaseUnavailable, StreamNotFound, SubengineError
from subengine.model._gateway_cursor import InvalidCursor, StreamPosition

log = logging.getLogger("subengine.gateway")

# How often (at most; and at every heartbeat) an open event stream checks that its key
# still may read its streams.
KEY_CHECK_SECONDS = 10.0
# An event stream whose read failed (PostgreSQL out of reach) tries again after this
# long, doubled up to the longest.
_FIRST_RETRY_SECONDS = 0.1
_LONGEST_RETRY_SECONDS = 5.0
# A partition whose read found less than its known head is read again after this long,
# doubled up to the longest.
_FIRST_STALL_SECONDS = 0.005
_LONGEST_STALL_SECONDS = 0.5


@contextmanager
def released_on_error(slot: Slot) -> Iterator[None]:
    """Give `slot` back if what follows fails before a response takes it over."""
    try:
        yield
    except BaseException:
        slot.release()
        raise


async def open_event_stream(
    gateway: Gateway,
    selections: dict[str, Selection],
    start: dict[str, StreamPosition],
    heartbeat: float,
    principal: Principal,
    slot: Slot,
) -> EventStreamResponse:
    """The event stream of `selections`, which holds `slot` until it ends."""
    watcher = await gateway.watcher(selections, shared_reads=True)
    return EventStreamResponse(gateway, selections, start, heartbeat, watcher, principal, slot)


class EventStreamResponse(HeldOpen):
    """An SSE response of one stream or a watch: catch up by pages, say `caught-up`,
    then follow the hub's wake-ups, with heartbeats, until the client leaves, the
    stream's lifetime ends, or the server shuts down."""

    def __init__(
        self,
        gateway: Gateway,
        selections: dict[str, Selection],
        start: dict[str, StreamPosition],
        heartbeat: float,
        watcher: Watcher,
        principal: Principal,
        slot: Slot,
    ) -> None:
        self.principal = principal
        self.gateway = gateway
        self.selections = selections
        self.start = start
        self.heartbeat = heartbeat
        self.watcher = watcher
        self.slot = slot  # released when the response ends, however it ends

    async def serve(self, receive: Receive, send: Send) -> None:
        gateway, config = self.gateway, self.gateway.config
        watcher = self.watcher
        stream = EventStream(receive, send, watcher.event, config.write_timeout)
        reader = Reader(gateway.hub, self.selections, self.start)
        lifetime = config.stream_lifetime * random.uniform(0.9, 1.1)
        ends = time.monotonic() + lifetime
        gateway.open_streams.add(stream)
        gateway.watch_writes()
        try:
            if gateway.closing.is_set():
                stream.close()
            gateway.hub.add(watcher)
            await stream.start(
                [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", NO_STORE.encode()),
                    (b"x-accel-buffering", b"no"),
                ]
            )
            await self._write(stream, None, "retry: 1000\n\n")
            await self._run(stream, reader, watcher, ends)
        except Gone:
            pass
        except Blocked:
            # the socket takes nothing: a last word if it can, then close
            try:
                await asyncio.wait_for(
                    send(
                        {
                            "type": "http.response.body",
                            "body": close_frame("slow", "the client reads too slowly").encode(),
                            "more_body": True,
                        }
                    ),
                    0.1,
                )
            except Exception:
                pass
        finally:
            gateway.open_streams.discard(stream)
            self.slot.release()
            gateway.hub.remove(watcher)
            await stream.end()

    async def _write(self, stream: EventStream, frame_type: str | None, text: str | bytes) -> None:
        sent_before = stream.bytes_sent
        await stream.write(text)
        self.gateway.metrics.sent(self.slot.kind, frame_type, stream.bytes_sent - sent_before)

    async def _send_frames(self, stream: EventStream, reader: Reader) -> None:
        """Send the frames the reader made."""
        for frame in reader.take_frames():
            await self._write(stream, frame.kind, frame.wire)

    async def _catch_up(self, stream: EventStream, reader: Reader) -> None:
        limit = self.gateway.config.max_page_limit
        pending = set(self.selections)
        while pending:
            for name in sorted(pending):
                if await reader.catch_up_frames(name, limit):
                    pending.discard(name)
                await self._send_frames(stream, reader)

    def _direct(self, stream: EventStream, reader: Reader, shared: SharedRead) -> bool:
        """Send the frames of the hub's shared read, from outside the stream's task, which
        waits with nothing else to do (`Watcher.direct`). False: it is woken instead, to
        read for itself (the read is not from where it stands, or more may follow) or to
        finish a send that could not be made at once."""
        if stream.closing or stream.gone or not reader.fits(shared):
            return False
        metrics = self.gateway.metrics  # counted once the fan-out is done
        lag = max(self.gateway.hub.head(shared.stream, shared.partition) - shared.after, 0)
        more, _ = reader.shared_frames(shared)
        sent = True
        for frame in reader.take_frames():
            sent = stream.write_now(frame.wire) and sent
            metrics.sent_soon(self.slot.kind, frame.kind, len(frame.wire))
        if sent and not more:
            metrics.lag_soon(lag)  # else the woken task counts its wake-up
            return True
        return False

    async def _run(
        self, stream: EventStream, reader: Reader, watcher: Watcher, ends: float
    ) -> None:
        caught_up = False
        checked = time.monotonic()
        # when to see whether a heartbeat is due: a frame sent meanwhile puts it off then
        look_at = stream.sent_at + self.heartbeat
        # spread over time, so that streams opened together do not check together
        check_every = min(KEY_CHECK_SECONDS, self.heartbeat) * random.uniform(0.8, 1.2)
        pending: set[tuple[str, int]] = set()
        # partitions whose head is known to be ahead of what a read found (a replica
        # that has yet to replay it): read again after `stall`, doubled up to the longest
        stalled: set[tuple[str, int]] = set()
        stall = _FIRST_STALL_SECONDS
        delay = _FIRST_RETRY_SECONDS
        direct = partial(self._direct, stream, reader) if self.sends_from_outside else None
        watcher.wake_all()  # the first round catches up
        while True:
            changed, resync = watcher.take()
            if stream.pending:  # what the hub's fan-out could not send at once, first
                await stream.flush()
            try:
                if resync:
                    pending.clear()
                    await self._catch_up(stream, reader)
                    if not caught_up:
                        caught_up = True
                        await self._write(
                            stream,
                            "caught-up",
                            frame_text("caught-up", "{}", reader.cursor.encode()),
                        )
                behind = reader.behind(changed)
                if behind:
                    self.gateway.metrics.watcher_lag.observe(reader.lag(behind))
                pending |= behind
                while pending and not stream.closing:
                    name, partition = pending.pop()
                    more, moved = await reader.live_frames(name, partition)
                    if more:
                        (pending if moved else stalled).add((name, partition))
                    await self._send_frames(stream, reader)
                now = time.monotonic()
                if now >= checked + check_every:
                    checked = now
                    if not await self._still_allowed():
                        await stream.write(
                            close_frame("forbidden", "the API key was revoked or lost its rights")
                        )
                        return
                delay = _FIRST_RETRY_SECONDS
            except StreamNotFound as error:
                await self._write(stream, CLOSE, close_frame("stream_not_found", str(error)))
                return
            except DatabaseUnavailable as error:
                # the stream stays open: look at everything again once PostgreSQL answers
                log.warning("gateway read failed, retrying in %.1fs: %s", delay, error)
                watcher.take()
                await stream.wait(delay)  # woken early by the client leaving or a shutdown
                watcher.wake_all()
                delay = min(2 * delay, _LONGEST_RETRY_SECONDS)
                if not stream.closing:
                    continue
            except SubengineError as error:  # after the above: a cursor that no longer fits, say
                code = "bad_cursor" if isinstance(error, InvalidCursor) else "bad_request"
                await self._write(stream, CLOSE, close_frame(code, str(error)))
                return
            now = time.monotonic()
            if stream.closing:
                await self._write(
                    stream, CLOSE, close_frame("shutdown", "the server is shutting down")
                )
                return
            if now >= ends:
                await self._write(
                    stream,
                    CLOSE,
                    close_frame("rotate", "the stream's lifetime ended: resume by cursor"),
                )
                return
            if now >= look_at:
                if now >= stream.sent_at + self.heartbeat:
                    await self._write(stream, "heartbeat", ": hb\n\n")
                    look_at = now + self.heartbeat
                    continue
                look_at = stream.sent_at + self.heartbeat
            if stalled:
                await stream.wait(min(look_at, ends, now + stall) - now)
                pending |= stalled
                stalled.clear()
                stall = min(2 * stall, _LONGEST_STALL_SECONDS)
                continue
            stall = _FIRST_STALL_SECONDS
            # nothing else to do: the hub may send the frames of its reads meanwhile; the
            # task wakes for what it must do itself (a heartbeat, the key's check, the end)
            watcher.direct = direct
            try:
                await stream.wait_until(min(look_at, checked + check_every, ends))
            finally:
                watcher.direct = None

    async def _still_allowed(self) -> bool:
        key = self.principal.key
        if key is None:
            return not await self.gateway.auth.required()
        current = await self.gateway.auth.key_by_id(key.id)
        return current is not None and all(current.allows(name, "read") for name in self.selections)


# The last frame of an event stream, saying why it ends. Never `error`: EventSource gives
# its own connection failures that name, so a frame of it would land in their listener.
CLOSE = "close"


def close_frame(code: str, message: str) -> str:
    return frame_text(CLOSE, dumps({"code": code, "message": message}), None)
