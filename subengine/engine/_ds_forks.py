"""Forks of Durable Streams streams (docs/durable-streams.md, "Forks"): where a fork
starts in its source, what it inherits, its content type and expiry, and whether a PUT
asks for the fork that exists.

A fork point is a position of the source: the fork inherits the source's messages up
to it and numbers its own on from it. `Stream-Fork-Sub-Offset` moves it past its anchor
(the `Stream-Fork-Offset`): by that many messages in a JSON stream, into the next
message by that many bytes in a byte stream (the fork then keeps only those bytes of
that message: a cut, never a copy).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from subengine.outside import _durable_stream_forks as forks
from subengine.outside._durable_streams import CatalogStream, Inherited, media_type


@dataclass(frozen=True, slots=True)
class ForkOf:
    """What a PUT asks of its source: Stream-Forked-From (the source's path),
    Stream-Fork-Offset (as (epoch, position), and as given; None: the source's tail)
    and Stream-Fork-Sub-Offset."""

    path: str
    offset: tuple[int, int] | None = None
    offset_text: str | None = None
    sub_offset: int = 0


@dataclass(frozen=True, slots=True)
class ForkPlan:
    """A fork to create: its fork point and inherited ranges, the offset it was asked
    at (the source's tail when none was), its content type and expiry."""

    fork_point: int
    ranges: tuple[Inherited, ...]
    fork_offset: str
    content_type: str
    ttl_seconds: int | None
    expires_at: datetime | None


class ForkRefused(Exception):
    """A fork the source does not allow: `outcome` is `source_missing`, `source_deleted`
    (deleted softly), `content_type` (not the source's) or `bad_offset`."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


# runs a query on the connection of the transaction at hand
Run = Callable[[Any], Awaitable[Any]]


def fork_expiry(
    source: CatalogStream, ttl_seconds: int | None, expires_at: datetime | None
) -> tuple[int | None, datetime | None]:
    """A fork's TTL or Expires-At (PROTOCOL.md 4.2): its own when it asks for one, else
    its source's (its TTL counts down on its own from then on)."""
    if ttl_seconds is None and expires_at is None:
        return source.ttl_seconds, source.expires_at
    return ttl_seconds, expires_at


async def plan_fork(
    run: Run,
    source: CatalogStream,
    fork: ForkOf,
    content_type: str | None,
    ttl_seconds: int | None,
    expires_at: datetime | None,
) -> ForkPlan:
    """Where a fork of `source` starts and what it inherits; raises ForkRefused."""
    if source.deleted:
        raise ForkRefused("source_deleted", f"the stream at {source.path!r} is deleted")
    if content_type is not None and media_type(content_type) != media_type(source.content_type):
        raise ForkRefused(
            "content_type", f"a fork's Content-Type is its source's: {source.content_type}"
        )
    if fork.offset is None:
        anchor = source.tail
    else:
        kind = source.check_offset(*fork.offset)
        if kind != "ok":
            raise ForkRefused(
                "bad_offset",
                "Stream-Fork-Offset is not an offset of the source up to its tail: "
                "use one it returned",
            )
        anchor = fork.offset[1]
    fork_point, cut = await _fork_point(run, source, anchor, fork.sub_offset)
    ttl, expires = fork_expiry(source, ttl_seconds, expires_at)
    return ForkPlan(
        fork_point,
        source.inherit(fork_point, cut),
        fork.offset_text if fork.offset_text is not None else source.offset_at(anchor),
        content_type or source.content_type,
        ttl,
        expires,
    )


async def _fork_point(
    run: Run, source: CatalogStream, anchor: int, sub_offset: int
) -> tuple[int, int | None]:
    """The fork point and the cut of its message (None: whole) of a sub-offset past
    `anchor` (PROTOCOL.md 4.2: messages of a JSON stream, bytes of a byte stream)."""
    if sub_offset == 0:
        return anchor, None
    if source.json:
        if anchor + sub_offset > source.tail:
            raise ForkRefused(
                "bad_offset",
                f"Stream-Fork-Sub-Offset {sub_offset} is past the source's last message",
            )
        return anchor + sub_offset, None
    position = anchor + 1
    size = None
    if position <= source.tail:
        holder, shown = source.holder(position)
        size = await run(forks.message_size(holder, position))
        if size is not None and shown is not None:
            size = min(size, shown)
    if size is None:
        raise ForkRefused(
            "bad_offset", "Stream-Fork-Sub-Offset names bytes of a message the source lacks"
        )
    if sub_offset > size:
        raise ForkRefused(
            "bad_offset",
            f"Stream-Fork-Sub-Offset {sub_offset} is past the next message ({size} bytes)",
        )
    return position, None if sub_offset == size else sub_offset


def same_fork(
    found: CatalogStream,
    fork: ForkOf,
    content_type: str | None,
    expiry: tuple[int | None, datetime | None],
    closed: bool,
) -> bool:
    """Whether a fork PUT asks for the stream that exists (PROTOCOL.md 4.2, "Idempotent
    fork creation"): the same source, offset (when given), sub-offset, content type
    (when given), expiry (its own, or what it inherits: `expiry`) and closed state."""
    return (
        found.source is not None
        and found.forked_from == fork.path
        and (fork.offset_text is None or fork.offset_text == found.fork_offset)
        and fork.sub_offset == found.fork_sub_offset
        and (content_type is None or media_type(content_type) == media_type(found.content_type))
        and (found.ttl_seconds, found.expires_at) == expiry
        and found.closed == closed
    )
