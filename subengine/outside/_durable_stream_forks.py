"""Forks of Durable Streams streams (docs/durable-streams.md, "Forks"): the catalog rows
and inherited ranges of a fork, the reads that stitch them, and deleting softly.

A fork is a new engine stream whose events are numbered on from the fork point (its
partition starts with that head), and a list of ranges it inherits: positions of other
engine streams (its source's, and what its source inherits), none of them copied. A
read walks the ranges and then the fork's own events in position order. A fork point
inside a byte message keeps the first bytes of that message: the range's `cut`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from subengine.db._sql import Query, Result, first_row, nothing
from subengine.outside._durable_streams import CatalogStream, Inherited


def insert_fork(
    path: str,
    stream: str,
    content_type: str,
    ttl_seconds: int | None,
    expires_at: datetime | None,
    source: CatalogStream,
    fork_offset: str,
    fork_sub_offset: int,
    fork_point: int,
) -> Query[bool]:
    """Add a fork of `source` to the catalog; False when the path is taken."""
    params = {
        "path": path,
        "stream": stream,
        "content_type": content_type,
        "ttl_seconds": ttl_seconds,
        "expires_at": expires_at,
        "source": source.stream,
        "forked_from": source.path,
        "fork_offset": fork_offset,
        "fork_sub_offset": fork_sub_offset,
        "fork_point": fork_point,
    }
    return Query("ds_insert_fork", params, lambda result: bool(result.rows))


def insert_inherited(stream: str, ranges: Sequence[Inherited]) -> Query[None]:
    params = {
        "stream": stream,
        "sources": [part.stream for part in ranges],
        "afters": [part.after for part in ranges],
        "uptos": [part.upto for part in ranges],
        "cuts": [part.cut for part in ranges],
    }
    return Query("ds_insert_inherited", params, nothing)


def number_from(stream: str, fork_point: int) -> Query[None]:
    """Number a new engine stream's events on from `fork_point`."""
    return Query("ds_number_from", {"stream": stream, "fork_point": fork_point}, nothing)


def pin_sources(streams: Sequence[str]) -> Query[None]:
    """Make retention of `streams` wait for this transaction (see the query)."""
    return Query("ds_pin_sources", {"streams": sorted(set(streams))}, nothing)


def message_size(stream: str, position: int) -> Query[int | None]:
    """The bytes of the byte message at `position` of an engine stream (None: none)."""

    def read(result: Result) -> int | None:
        row = first_row(result)
        return None if row is None else int(row[0])

    return Query("ds_message_size", {"stream": stream, "position": position}, read)


def forks_of(stream: str) -> Query[int]:
    """How many forks read engine stream `stream` as their source."""
    return Query("ds_forks_of", {"stream": stream}, lambda result: int(result.rows[0][0]))


def soft_delete(path: str, stream: str) -> Query[None]:
    return Query("ds_soft_delete", {"path": path, "stream": stream}, nothing)


def lock_source(stream: str) -> Query[bool]:
    """Lock the catalog row of engine stream `stream`; False when there is none."""
    return Query("ds_lock_source", {"stream": stream}, lambda result: bool(result.rows))


def release_source(stream: str) -> Query[str | None]:
    """Remove engine stream `stream`'s row when it is deleted softly and no fork reads
    it any more; None when it stays (or is gone), else that row's own source ("" for
    none)."""

    def read(result: Result) -> str | None:
        row = first_row(result)
        if row is None:
            return None
        return "" if row[1] is None else str(row[1])

    return Query("ds_release_source", {"stream": stream}, read)


def _messages(result: Result) -> list[tuple[int, Any]]:
    return [(row[0], row[1]) for row in result.rows]


def read_stitched(
    found: CatalogStream, after: int, max_bytes: int, limit: int
) -> Query[list[tuple[int, Any]]]:
    """The messages of fork `found` after `after`, up to its tail, from what it inherits
    and then its own: (position, bytes) or (position, JSON text), as many as fit in
    `max_bytes`, at least one."""
    ranges = found.ranges(after)
    params: dict[str, Any] = {
        "streams": [part.stream for part in ranges],
        "afters": [part.after for part in ranges],
        "uptos": [part.upto for part in ranges],
        "after": after,
        "max_bytes": max_bytes,
        "limit": limit,
    }
    if found.json:
        return Query("ds_read_json_stitched", params, _messages)
    params["cuts"] = [part.cut for part in ranges]
    return Query("ds_read_bytes_stitched", params, _messages)
