"""Engine streams as Durable Streams, read only (docs/durable-streams.md, "Engine
streams"): each partition of a stream of the engine is the Durable Streams stream
`/__subengine/streams/{stream}/{partition}`, of type application/json, each message the
whole event as the gateway's own protocol shows it. Its offsets are the stream's epoch
and the event's position; its tail is the partition's head; it is never closed. An
append, create or delete there is 405.
"""

from __future__ import annotations

from typing import Any

from subengine.engine._async_engine import AsyncEngine
from subengine.gateway._ds_http import FLOOR, GAP_FROM, GAP_TO, DsError, offset
from subengine.gateway._hub import event_json
from subengine.model._errors import StreamNotFound
from subengine.model._events import Tombstone
from subengine.model._names import STREAM_NAME
from subengine.outside._durable_streams import CatalogStream

# The path of the views; the protocol leaves `__ds` to itself, and this one to us.
VIEWS = "/__subengine/streams/"
# Events read at most per page of a view (a page is also bounded by bytes).
_VIEW_ROWS = 200


def view_of(path: str) -> tuple[str, int] | None:
    """The (engine stream, partition) a path names, None when it names no view; a
    malformed view path is 404."""
    if not path.startswith(VIEWS):
        return None
    stream, _, partition = path[len(VIEWS) :].partition("/")
    if (
        STREAM_NAME.fullmatch(stream) is None
        or not (partition.isascii() and partition.isdecimal())
        or len(partition) > 4
    ):
        raise DsError(404, f"no stream here: a view is {VIEWS}<stream>/<partition>")
    return stream, int(partition)


async def view_stream(engine: AsyncEngine, path: str, stream: str, partition: int) -> CatalogStream:
    """The view of one partition of `stream`, as a catalog stream; 404 when there is no
    such stream or partition."""
    try:
        found = await engine.stream(stream)
        states = await engine.partitions(stream)
    except StreamNotFound:
        raise DsError(404, f"no engine stream {stream!r}") from None
    if partition >= len(states):
        raise DsError(404, f"stream {stream!r} has {len(states)} partitions")
    state = states[partition]
    return CatalogStream(
        path=path,
        stream=stream,
        content_type="application/json",
        ttl_seconds=None,
        expires_at=None,
        deadline=None,
        tail=state.head,
        closed=False,
        closed_by=None,
        last_seq=None,
        epoch=found.epoch,
        floor=state.floor,
        expired=False,
        partition=partition,
        view=True,
    )


async def read_view(
    engine: AsyncEngine, found: CatalogStream, after: int, max_bytes: int
) -> list[tuple[int, str]]:
    """The events of the view after `after`, up to its tail, as JSON text: as many as
    fit in `max_bytes`, at least one. Retention having removed the next ones is 410, and
    so is a stream deleted and created again since `found` was looked up: its events
    are not of the stream the offsets name (they carry `found.epoch`)."""
    try:
        epoch, items = await engine.read_json(found.stream, found.partition, after, _VIEW_ROWS)
    except StreamNotFound:
        raise DsError(404, f"the engine stream {found.stream!r} was deleted") from None
    if epoch != found.epoch:
        raise DsError(
            410, f"the engine stream {found.stream!r} was deleted and created again: read anew"
        )
    messages: list[tuple[int, str]] = []
    size = 0
    for item in items:
        if isinstance(item, Tombstone):
            if messages:
                break
            headers = {
                FLOOR: offset(found.epoch, item.floor - 1),
                GAP_FROM: str(item.gap_from),
                GAP_TO: str(item.gap_to),
            }
            raise DsError(410, "retention removed the events after this offset", headers)
        if item.position > found.tail or (messages and size >= max_bytes):
            break
        text = event_json(item)
        messages.append((item.position, text))
        size += len(text)
    return messages


def read_only(method: str) -> Any:
    return DsError(
        405,
        f"{method} is not allowed: an engine stream is read only here; append with the "
        "gateway's own protocol or the engine",
        {"Allow": "GET, HEAD, OPTIONS"},
    )
