"""The gateway's Durable Streams storage (docs/durable-streams.md): create, append, close,
read and delete a Durable Streams stream, each in one PostgreSQL transaction of the
`AsyncEngine`, and the sweeper's work (expired streams, deleted streams' engine streams).

An append locks the stream's catalog row, checks it (closed, content type, producer,
Stream-Seq), appends the messages as engine events through `append_events`, stores a byte
stream's bytes beside them, and records the new tail, Stream-Seq, closed state and
producer state, all in one transaction: a producer's state commits with its data or not
at all, and survives restarts and any number of gateway processes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from subengine.engine._async_engine import AsyncEngine
from subengine.model._errors import InvalidInput, StreamNotFound
from subengine.model._events import NewEvent
from subengine.outside import _durable_streams as catalog
from subengine.outside._durable_streams import (
    CLOSED_TYPE,
    MESSAGE_KEY,
    MESSAGE_TYPE,
    CatalogStream,
    Producer,
    ProducerCheck,
)
from subengine.streams._append import append_events, prepare
from subengine.streams._streams import create_stream

log = logging.getLogger("subengine.gateway")

# Rows read at most per page of a stream (a page is also bounded by bytes).
PAGE_ROWS = 1000
# Byte messages a deleted stream loses per transaction.
_DELETE_BATCH = 5000


class BadMessage(InvalidInput):
    """A body that is no message of its stream (invalid JSON, an empty JSON array)."""


@dataclass(frozen=True, slots=True)
class Created:
    """What a PUT did: `created`, `exists` (the same configuration: 200) or `conflict`
    (another one: 409); the stream as it is now."""

    outcome: str
    stream: CatalogStream


@dataclass(frozen=True, slots=True)
class Appended:
    """What a POST did. `outcome`: `appended`, `closed_only` (a close without data, or of
    a stream already closed), `duplicate` (a producer's retry, or the retry of the request
    that closed it), `closed` (409: the stream is closed), `content_type` (409), `seq`
    (409: Stream-Seq not above the last), or the producer's refusal (`stale_epoch`,
    `bad_epoch_seq`, `gap`). `tail` is the stream's tail after it; `producer` what the
    producer check said."""

    outcome: str
    stream: CatalogStream
    tail: int
    closed: bool
    producer: ProducerCheck | None = None


@dataclass(frozen=True, slots=True)
class NewStream:
    """A PUT's configuration: content type, TTL or Expires-At, closed, and its body."""

    content_type: str
    ttl_seconds: int | None
    expires_at: datetime | None
    closed: bool
    body: bytes = b""
    json: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "json", catalog.media_type(self.content_type) == "application/json"
        )


def json_messages(body: bytes, *, allow_empty: bool) -> list[Any]:
    """The messages of a JSON body: the elements of a top-level array (one level is
    flattened), or the value itself. Raises BadMessage."""
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadMessage("the body is not valid JSON") from None
    if isinstance(value, list):
        if not value and not allow_empty:
            raise BadMessage("an empty JSON array appends nothing")
        return value
    return [value]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class DurableStreams:
    """Durable Streams streams stored through an `AsyncEngine`."""

    def __init__(self, engine: AsyncEngine, max_page_bytes: int) -> None:
        self.engine = engine
        self.sql = engine.sql
        self.max_page_bytes = max_page_bytes

    async def _run(self, conn: psycopg.AsyncConnection[Any], query: Any) -> Any:
        return await self.sql.run_async(conn, query)

    # looking

    async def stream(self, path: str, *, touch: bool = False) -> CatalogStream | None:
        """The stream at `path`, or None (none, or it has just expired: then it is
        removed). `touch` resets a TTL stream's countdown (reads do)."""
        async with self.engine.connection() as conn:
            found: CatalogStream | None = await self._run(
                conn, catalog.get_stream(path, touch=touch)
            )
        if found is not None and found.expired:
            await self._expire(found)
            return None
        return found

    async def _expire(self, found: CatalogStream) -> None:
        async with self.engine.connection() as conn:
            await self._run(conn, catalog.delete_stream(found.path, found.stream))

    async def read(self, found: CatalogStream, after: int) -> list[tuple[int, Any]]:
        """The messages of `found` after position `after`, up to its tail: (position,
        bytes) for a byte stream, (position, JSON text) for a JSON one; a page bounded
        by bytes, at least one message when there is any."""
        if after >= found.tail:
            return []
        if found.json:
            query: Any = catalog.read_json(
                found.stream, after, found.tail, self.max_page_bytes, PAGE_ROWS
            )
        else:
            query = catalog.read_bytes(
                found.stream, after, found.tail, self.max_page_bytes, PAGE_ROWS
            )
        async with self.engine.connection() as conn:
            rows: list[tuple[int, Any]] = await self._run(conn, query)
        return rows

    # writing

    async def create(self, path: str, new: NewStream) -> Created:
        """Create the stream at `path` as `new` says, with its body as first messages
        (and closed, if asked), unless one exists (`exists` or `conflict`)."""
        messages = _messages(new.body, new.json, allow_empty=True)
        for _ in range(3):  # a PUT of the same path at the same time: look again
            async with self.engine.connection() as conn:
                found = await self._run(conn, catalog.lock_stream(path))
                if found is not None and found.expired:
                    await self._run(conn, catalog.delete_stream(path, found.stream))
                    found = None
                if found is not None:
                    same = (
                        catalog.media_type(found.content_type)
                        == catalog.media_type(new.content_type)
                        and found.ttl_seconds == new.ttl_seconds
                        and found.expires_at == new.expires_at
                        and found.closed == new.closed
                    )
                    return Created("exists" if same else "conflict", found)
                name = catalog.engine_name(path)
                await self._run(conn, create_stream(name, 1))
                inserted = await self._run(
                    conn,
                    catalog.insert_stream(
                        path, name, new.content_type, new.ttl_seconds, new.expires_at
                    ),
                )
                if not inserted:
                    await conn.rollback()
                    continue
                tail = await self._append(conn, name, new.json, messages, new.closed)
                await self._run(conn, catalog.appended(path, tail, None, new.closed, None))
                created = await self._run(conn, catalog.get_stream(path, touch=False))
            return Created("created", created)
        raise InvalidInput(f"the stream {path!r} is being created and deleted at once; retry")

    async def append(
        self,
        path: str,
        content_type: str | None,
        body: bytes,
        *,
        close: bool,
        seq: str | None,
        producer: Producer | None,
    ) -> Appended:
        """Append `body` (its messages) to the stream at `path`, and close it when
        `close`; an empty body with `close` only closes it. Raises StreamNotFound and
        BadMessage; every other refusal is an `Appended` outcome."""
        async with self.engine.connection() as conn:
            found: CatalogStream | None = await self._run(conn, catalog.lock_stream(path))
            if found is None or found.expired:
                if found is not None:
                    await self._run(conn, catalog.delete_stream(path, found.stream))
                    await conn.commit()
                raise StreamNotFound(path)
            outcome = await self._append_checked(
                conn, found, content_type, body, close=close, seq=seq, producer=producer
            )
            if outcome.outcome not in ("appended", "closed_only"):
                await conn.rollback()
            return outcome

    async def _append_checked(
        self,
        conn: psycopg.AsyncConnection[Any],
        found: CatalogStream,
        content_type: str | None,
        body: bytes,
        *,
        close: bool,
        seq: str | None,
        producer: Producer | None,
    ) -> Appended:
        if found.closed:
            if producer is not None and found.closed_by == producer:
                again = ProducerCheck("duplicate", producer.epoch, producer.seq)
                return Appended("duplicate", found, found.tail, True, again)
            if close and not body:
                return Appended("closed_only", found, found.tail, True)
            return Appended("closed", found, found.tail, True)
        if body and content_type is not None:
            if catalog.media_type(content_type) != catalog.media_type(found.content_type):
                return Appended("content_type", found, found.tail, False)
        check: ProducerCheck | None = None
        if producer is not None:
            state = await self._run(conn, catalog.producer_state(found.stream, producer.id))
            check = catalog.check_producer(state, producer)
            if check.outcome != "accept":
                return Appended(check.outcome, found, found.tail, False, check)
        if seq is not None and found.last_seq is not None:
            if seq.encode() <= found.last_seq.encode():
                return Appended("seq", found, found.tail, False, check)
        messages = _messages(body, found.json, allow_empty=False) if body else []
        tail = await self._append(conn, found.stream, found.json, messages, close, found.tail)
        await self._run(conn, catalog.appended(found.path, tail, seq, close, producer))
        if producer is not None and check is not None:
            accepted = Producer(producer.id, check.epoch, check.seq)
            await self._run(conn, catalog.put_producer(found.stream, accepted))
        return Appended("appended" if messages else "closed_only", found, tail, close, check)

    async def _append(
        self,
        conn: psycopg.AsyncConnection[Any],
        stream: str,
        is_json: bool,
        messages: list[Any],
        close: bool,
        tail: int = 0,
    ) -> int:
        """Append `messages` (and the close marker) as events; the new tail (the
        position of the last message)."""
        events = [
            NewEvent(MESSAGE_KEY, MESSAGE_TYPE, m if is_json else {"bytes": len(m)})
            for m in messages
        ]
        if close:
            events.append(NewEvent(MESSAGE_KEY, CLOSED_TYPE, {}))
        if not events:
            return tail
        stored = await self._run(
            conn, append_events(prepare(stream, events, None, self.engine.settings))
        )
        positions = [a.position for a in stored[: len(messages)]]
        if messages and not is_json:
            await self._run(conn, catalog.insert_bytes(stream, positions, messages))
        return positions[-1] if positions else tail

    async def delete(self, path: str) -> str:
        """Remove the stream at `path`: `deleted`, `missing`, or `subscribed` (an engine
        subscription consumes it: delete that first)."""
        async with self.engine.connection() as conn:
            found = await self._run(conn, catalog.lock_stream(path))
            if found is None or found.expired:
                if found is not None:
                    await self._run(conn, catalog.delete_stream(path, found.stream))
                return "missing"
            if await self._run(conn, catalog.subscriptions_of(found.stream)):
                return "subscribed"
            await self._run(conn, catalog.delete_stream(path, found.stream))
        return "deleted"

    # the sweeper

    async def sweep(self, limit: int = 100) -> int:
        """Remove the expired streams from the catalog and delete the engine streams of
        deleted ones; how many engine streams went."""
        async with self.engine.connection() as conn:
            expired = await self._run(conn, catalog.expired_streams(limit))
        for path, stream in expired:
            async with self.engine.connection() as conn:
                await self._run(conn, catalog.delete_stream(path, stream))
        async with self.engine.connection() as conn:
            names: list[str] = await self._run(conn, catalog.garbage(limit))
        gone = 0
        for name in names:
            try:
                await self.engine.delete_stream(name)
            except StreamNotFound:
                pass
            except InvalidInput as error:  # a subscription of it was created meanwhile
                log.warning("durable streams: engine stream %s stays: %s", name, error)
                continue
            while True:
                async with self.engine.connection() as conn:
                    if not await self._run(conn, catalog.delete_bytes(name, _DELETE_BATCH)):
                        break
            async with self.engine.connection() as conn:
                await self._run(conn, catalog.forget_garbage(name))
            gone += 1
        return gone


def _messages(body: bytes, is_json: bool, *, allow_empty: bool) -> list[Any]:
    if not body:
        return []
    if is_json:
        return json_messages(body, allow_empty=allow_empty)
    return [body]
