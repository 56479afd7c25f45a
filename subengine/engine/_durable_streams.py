"""The gateway's Durable Streams storage (docs/durable-streams.md): create, append, close,
read and delete a Durable Streams stream, each in one PostgreSQL transaction of the
`AsyncEngine`, and the sweeper's work (expired streams, deleted streams' engine streams).

An append locks the stream's catalog row, checks it (closed, content type, producer,
Stream-Seq), appends the messages as engine events through `append_events`, stores a byte
stream's bytes beside them, and records the new tail, Stream-Seq, closed state and
producer state, all in one transaction: a producer's state commits with its data or not
at all, and survives restarts and any number of gateway processes. An append of JSON
messages with nothing else to check (no Stream-Seq, producer or close) is that
transaction in one statement, when the stream takes it as it is (`_append_plain`).

A fork (`engine/_ds_forks.py`) is created like a stream, with the ranges it inherits;
a stream that forks read is deleted softly (its row and engine stream stay, the path
answers 410) until the last of them is gone, and then goes with it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import psycopg

from subengine.engine._async_engine import AsyncEngine
from subengine.engine._ds_forks import ForkOf, ForkRefused, fork_expiry, plan_fork, same_fork
from subengine.model._errors import InvalidInput, StreamNotFound
from subengine.model._events import NewEvent
from subengine.model._json import fast_loads
from subengine.outside import _durable_stream_forks as forks
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
from subengine.streams._append_json import append_json, json_events, prepare_json
from subengine.streams._streams import create_stream

log = logging.getLogger("subengine.gateway")

# Rows read at most per page of a stream (a page is also bounded by bytes): the byte
# bound decides for messages over about 200 bytes. The statement reads this many rows
# to find the cut, so a larger bound costs small messages more than it saves: a catch-up
# of 50,000 messages of 220 bytes in 1,000-row pages ran at 0.64x the reference
# server's speed (50 requests), at 0.79x with 5,000 rows, and at 0.63x with 10,000
# (bench/door.py, subengine DS).
PAGE_ROWS = 5000
# Byte messages a deleted stream loses per transaction.
_DELETE_BATCH = 5000


class BadMessage(InvalidInput):
    """A body that is no message of its stream (invalid JSON, an empty JSON array)."""


@dataclass(frozen=True, slots=True)
class Created:
    """What a PUT did: `created`, `exists` (the same configuration: 200), `conflict`
    (another one: 409), `deleted` (a stream deleted softly holds the path: 409) or a
    fork's refusal (`ForkRefused.outcome`, with `detail`); the stream as it is now
    (None: refused)."""

    outcome: str
    stream: CatalogStream | None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Appended:
    """What a POST did. `outcome`: `appended`, `closed_only` (a close without data, or of
    a stream already closed), `duplicate` (a producer's retry, or the retry of the request
    that closed it), `closed` (409: the stream is closed), `content_type` (409), `seq`
    (409: Stream-Seq not above the last), `deleted` (410: deleted softly), or the
    producer's refusal (`stale_epoch`, `bad_epoch_seq`, `gap`). `tail` is the stream's
    tail after it; `producer` what the producer check said."""

    outcome: str
    stream: CatalogStream
    tail: int
    closed: bool
    producer: ProducerCheck | None = None


@dataclass(frozen=True, slots=True)
class NewStream:
    """A PUT's configuration: content type (None: a fork's, its source's), TTL or
    Expires-At, closed, its body, and the source it forks."""

    content_type: str | None
    ttl_seconds: int | None
    expires_at: datetime | None
    closed: bool
    body: bytes = b""
    fork: ForkOf | None = None
    json: bool = field(init=False)

    def __post_init__(self) -> None:
        kind = catalog.media_type(self.content_type or "")
        object.__setattr__(self, "json", kind == "application/json")


def json_messages(body: bytes, *, allow_empty: bool) -> list[Any]:
    """The messages of a JSON body: the elements of a top-level array (one level is
    flattened), or the value itself. Raises BadMessage."""
    try:
        value = fast_loads(body)
    except ValueError:  # perhaps decoded otherwise, or refused, by json.loads: it decides
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
        removed, or deleted softly when forks read it). `touch` resets a TTL stream's
        countdown (reads do). A stream deleted softly comes back `deleted`."""
        async with self.engine.connection(autocommit=True) as conn:  # one statement
            found: CatalogStream | None = await self._run(
                conn, catalog.get_stream(path, touch=touch)
            )
        if found is not None and found.expired:
            if await self._expire(found.path, found.stream):
                return replace(found, deleted=True, expired=False)
            return None
        return found

    async def _expire(self, path: str, stream: str) -> bool:
        """Remove the expired stream at `path` (if it is still engine stream `stream`);
        whether it is deleted softly now."""
        async with self.engine.connection() as conn:
            found = await self._run(conn, catalog.lock_stream(path))
            if found is None or found.stream != stream:
                return False
            if found.deleted or not found.expired:
                return bool(found.deleted)
            return await self._remove(conn, found)

    async def _remove(self, conn: psycopg.AsyncConnection[Any], found: CatalogStream) -> bool:
        """Delete `found` (its row locked): softly when forks read it (True), else at
        once, and then each source up its chain that was deleted softly and that no
        fork reads any more."""
        if await self._run(conn, forks.forks_of(found.stream)):
            await self._run(conn, forks.soft_delete(found.path, found.stream))
            return True
        await self._run(conn, catalog.delete_stream(found.path, found.stream))
        source = found.source
        while source:
            # the lock first, then a statement of its own: it sees every fork that a
            # transaction holding the lock before deleted (so the last one always frees it)
            await self._run(conn, forks.lock_source(source))
            source = await self._run(conn, forks.release_source(source))
        return False

    async def read(self, found: CatalogStream, after: int) -> list[tuple[int, Any]]:
        """The messages of `found` after position `after`, up to its tail: (position,
        bytes) for a byte stream, (position, JSON text) for a JSON one; a page bounded
        by bytes, at least one message when there is any."""
        if after >= found.tail:
            return []
        if found.inherited:
            query: Any = forks.read_stitched(found, after, self.max_page_bytes, PAGE_ROWS)
        elif found.json:
            query = catalog.read_json(
                found.stream, after, found.tail, self.max_page_bytes, PAGE_ROWS
            )
        else:
            query = catalog.read_bytes(
                found.stream, after, found.tail, self.max_page_bytes, PAGE_ROWS
            )
        async with self.engine.connection(autocommit=True) as conn:  # one statement
            rows: list[tuple[int, Any]] = await self._run(conn, query)
        return rows

    async def stream_and_read(
        self, path: str, known: CatalogStream, after: int
    ) -> tuple[CatalogStream | None, list[tuple[int, Any]] | None]:
        """`stream(path)` and `read` of what it finds after position `after`, in one
        statement for `known` a JSON stream of the catalog that is no fork (a live reader
        woken by an append); messages None for another kind, which `read` reads. No
        message when the path is now another stream than `known`."""
        if known.inherited or not known.json:
            return await self.stream(path), None
        query = catalog.get_stream_and_json(
            path, known.stream, after, self.max_page_bytes, PAGE_ROWS
        )
        async with self.engine.connection(autocommit=True) as conn:  # one statement
            found, messages = await self._run(conn, query)
        if found is not None and found.expired:
            if await self._expire(found.path, found.stream):
                return replace(found, deleted=True, expired=False), []
            return None, []
        return found, messages

    # writing

    async def create(self, path: str, new: NewStream) -> Created:
        """Create the stream at `path` as `new` says (a fork of `new.fork`, if it names
        one), with its body as first messages (and closed, if asked), unless one exists
        (`exists` or `conflict`, or `deleted`: deleted softly)."""
        for _ in range(3):  # a PUT of the same path at the same time: look again
            async with self.engine.connection() as conn:
                found = await self._run(conn, catalog.lock_stream(path))
                if found is not None and found.expired:
                    deleted = await self._remove(conn, found)
                    found = replace(found, deleted=True) if deleted else None
                if found is not None:
                    return await self._existing(conn, found, new)
                try:
                    created = await self._create(conn, path, new)
                except ForkRefused as refused:
                    await conn.rollback()
                    return Created(refused.outcome, None, refused.message)
                if created is None:
                    await conn.rollback()
                    continue
            return Created("created", created)
        raise InvalidInput(f"the stream {path!r} is being created and deleted at once; retry")

    async def _existing(
        self, conn: psycopg.AsyncConnection[Any], found: CatalogStream, new: NewStream
    ) -> Created:
        """What a PUT at a path that holds `found` gets: `exists` when it asks for that
        very stream (its configuration, or the same fork), else `conflict`."""
        if found.deleted:
            return Created("deleted", found)
        if new.fork is None:
            same = (
                found.source is None
                and catalog.media_type(found.content_type)
                == catalog.media_type(new.content_type or "")
                and found.ttl_seconds == new.ttl_seconds
                and found.expires_at == new.expires_at
                and found.closed == new.closed
            )
        else:
            expiry = (new.ttl_seconds, new.expires_at)
            source = await self._run(conn, catalog.get_stream(new.fork.path, touch=False))
            if source is not None:
                expiry = fork_expiry(source, new.ttl_seconds, new.expires_at)
            same = same_fork(found, new.fork, new.content_type, expiry, new.closed)
        return Created("exists" if same else "conflict", found)

    async def _create(
        self, conn: psycopg.AsyncConnection[Any], path: str, new: NewStream
    ) -> CatalogStream | None:
        """Create the stream (or fork) at `path`, free in this transaction; None when
        another PUT took the path meanwhile. Raises ForkRefused and BadMessage."""
        name = catalog.engine_name(path)
        if new.fork is None:
            messages = _messages(new.body, new.json, allow_empty=True)
            await self._run(conn, create_stream(name, 1))
            inserted = await self._run(
                conn,
                catalog.insert_stream(
                    path, name, new.content_type or "", new.ttl_seconds, new.expires_at
                ),
            )
            base = 0
        else:
            fork = new.fork
            source = await self._run(conn, catalog.lock_stream(fork.path))
            if source is not None and source.expired:
                deleted = await self._remove(conn, source)
                source = replace(source, deleted=True) if deleted else None
            if source is None:
                raise ForkRefused("source_missing", f"no stream at {fork.path!r} to fork")
            plan = await plan_fork(
                lambda query: self._run(conn, query),
                source,
                fork,
                new.content_type,
                new.ttl_seconds,
                new.expires_at,
            )
            new = replace(new, content_type=plan.content_type)
            messages = _messages(new.body, new.json, allow_empty=True)
            # retention of what the fork inherits waits for this transaction from here
            await self._run(conn, forks.pin_sources([part.stream for part in plan.ranges]))
            await self._run(conn, create_stream(name, 1))
            await self._run(conn, forks.number_from(name, plan.fork_point))
            inserted = await self._run(
                conn,
                forks.insert_fork(
                    path,
                    name,
                    plan.content_type,
                    plan.ttl_seconds,
                    plan.expires_at,
                    source,
                    plan.fork_offset,
                    fork.sub_offset,
                    plan.fork_point,
                ),
            )
            if inserted and plan.ranges:
                await self._run(conn, forks.insert_inherited(name, plan.ranges))
            base = plan.fork_point
        if not inserted:
            return None
        tail = await self._append(conn, name, new.json, messages, new.closed, base)
        await self._run(conn, catalog.appended(path, tail, None, new.closed, None))
        created: CatalogStream = await self._run(conn, catalog.get_stream(path, touch=False))
        return created

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
        if not close and seq is None and producer is None:
            plain = await self._append_plain(path, content_type, body)
            if plain is not None:
                return plain
        async with self.engine.connection() as conn:
            found: CatalogStream | None = await self._run(conn, catalog.lock_stream(path))
            if found is not None and found.expired:
                deleted = await self._remove(conn, found)
                await conn.commit()
                found = replace(found, deleted=True) if deleted else None
            if found is None:
                raise StreamNotFound(path)
            if found.deleted:
                return Appended("deleted", found, found.tail, found.closed)
            outcome = await self._append_checked(
                conn, found, content_type, body, close=close, seq=seq, producer=producer
            )
            if outcome.outcome not in ("appended", "closed_only"):
                await conn.rollback()
            return outcome

    async def _append_plain(
        self, path: str, content_type: str | None, body: bytes
    ) -> Appended | None:
        """An append of JSON messages alone, in one statement (`catalog.append_plain`),
        or None when nothing was written: then the general path below checks, refuses or
        appends. Both append the same events and answer the same; the general path
        takes five round trips (BEGIN, the lock, the append, the catalog, COMMIT), which
        were 0.6 to 0.8 ms of a Durable Streams append at 100/s (issue 26)."""
        if content_type is None or catalog.media_type(content_type) != "application/json":
            return None
        try:
            messages = json_messages(body, allow_empty=False)
        except BadMessage:
            return None  # the general path names it, after what it checks first
        events = json_events(
            [{"key": MESSAGE_KEY, "type": MESSAGE_TYPE, "data": m} for m in messages],
            self.engine.settings,
        )
        if events is None:
            return None
        async with self.engine.connection(autocommit=True) as conn:  # one statement
            found, positions = await self._run(conn, catalog.append_plain(path, events))
        if found is None or not positions:
            return None
        return Appended("appended", found, positions[-1], False)

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
        events: list[dict[str, Any]] = [
            {"key": MESSAGE_KEY, "type": MESSAGE_TYPE, "data": m if is_json else {"bytes": len(m)}}
            for m in messages
        ]
        if close:
            events.append({"key": MESSAGE_KEY, "type": CLOSED_TYPE, "data": {}})
        if not events:
            return tail
        # as the gateway's own appends: the messages go to PostgreSQL as one JSON array,
        # without an event object or a JSON text of their own each (issue 26: 2.4 ms of
        # the gateway's CPU per 500 messages, against 4.6 through NewEvent and prepare);
        # what prepare_json does not vouch for takes that general path, as before
        params = prepare_json(stream, events, None, self.engine.settings)
        if params is not None:
            stored = await self._run(conn, append_json(params))
        else:
            general = [NewEvent(e["key"], e["type"], e["data"]) for e in events]
            stored = await self._run(
                conn, append_events(prepare(stream, general, None, self.engine.settings))
            )
        positions = [a.position for a in stored[: len(messages)]]
        if messages and not is_json:
            await self._run(conn, catalog.insert_bytes(stream, positions, messages))
        return positions[-1] if positions else tail

    async def delete(self, path: str) -> str:
        """Remove the stream at `path` (softly while forks read it): `deleted`,
        `missing`, `gone` (deleted softly already) or `subscribed` (an engine
        subscription consumes it: delete that first)."""
        async with self.engine.connection() as conn:
            found = await self._run(conn, catalog.lock_stream(path))
            if found is None:
                return "missing"
            if found.deleted:
                return "gone"
            if found.expired:
                await self._remove(conn, found)
                return "missing"
            if await self._run(conn, catalog.subscriptions_of(found.stream)):
                return "subscribed"
            await self._remove(conn, found)
        return "deleted"

    # the sweeper

    async def sweep(self, limit: int = 100) -> int:
        """Remove the expired streams from the catalog, the byte messages retention left
        below their floors and the engine streams of deleted streams; how many engine
        streams went."""
        async with self.engine.connection() as conn:
            expired = await self._run(conn, catalog.expired_streams(limit))
        for path, stream in expired:
            await self._expire(path, stream)
        while True:  # bytes whose events retention removed
            async with self.engine.connection() as conn:
                if not await self._run(conn, catalog.prune_bytes(_DELETE_BATCH)):
                    break
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
