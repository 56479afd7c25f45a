"""Where a worker finds work, and what its own connections ask: the look for partitions
with work, oldest next event first (invariant 7), the poll, the heads of its streams, the
partition locks, and the settings of the connections that run them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from subengine.db._sql import Db, Query, Result, first_row
from subengine.streams._streams import listen


@dataclass(frozen=True, slots=True)
class Look:
    """What a look for work found: up to `limit` partitions with work, oldest next event
    first, and the suspects it could not settle because a batch held their rows."""

    work: list[tuple[tuple[str, int], datetime]]
    deferred: list[tuple[str, int]]


def look_for_work(
    serving: Sequence[str],
    suspects: Sequence[tuple[str, int]],
    whole: Sequence[str],
    limit: int,
) -> Query[Look]:
    """The look of the `look_for_work` query: the partitions with work of the `serving`
    subscriptions, after giving a next event's time to the `suspects` (pairs) and to
    every partition of the `whole` subscriptions that have events after their position
    but none yet (DESIGN.md invariant 7)."""

    def read(result: Result) -> Look:
        work, deferred = [], []
        for name, partition, next_time, later in result.rows:
            if later:
                deferred.append((str(name), int(partition)))
            else:
                work.append(((str(name), int(partition)), next_time))
        return Look(work, deferred)

    return Query(
        "look_for_work",
        {
            "serving": list(serving),
            "names": [name for name, _ in suspects],
            "partitions": [partition for _, partition in suspects],
            "whole": list(whole),
            "limit": limit,
        },
        read,
    )


def find_work(
    db: Db,
    serving: Sequence[str],
    suspects: Sequence[tuple[str, int]],
    whole: Sequence[str],
    limit: int,
) -> Look:
    """Run the look (`look_for_work`) on a worker's connection."""
    return db.run(look_for_work(serving, suspects, whole, limit))


def poll_for_work(
    db: Db,
    registration: dict[str, Any],
    serving: Sequence[str],
    streams: Sequence[str],
    beat: bool,
) -> tuple[dict[str, int], bool]:
    """A worker's poll: the sum of the heads of each of `streams`, and whether any
    partition of the `serving` subscriptions has work it could take; with `beat`, also
    the heartbeat of the worker `registration` describes (id, host, pid, names,
    serves_metrics), which registers it again if it was pruned."""
    return db.run(
        Query(
            "poll_for_work",
            {**registration, "serving": list(serving), "streams": list(streams), "beat": beat},
            lambda result: (
                {stream: int(total) for stream, total in result.rows[0][0].items()},
                bool(result.rows[0][1]),
            ),
        )
    )


def stream_heads(db: Db, streams: Sequence[str]) -> list[tuple[str, int, int]]:
    """The head of every partition of some streams, as (stream, partition, head)."""
    return db.run(
        Query(
            "stream_heads",
            {"streams": list(streams)},
            lambda result: [(str(s), int(p), int(h)) for s, p, h in result.rows],
        )
    )


def prepare_worker_connection(db: Db) -> None:
    """Set up a worker's own connection (a slot's lock connection, the poller's) for the
    statements it runs: see the `worker_connection_settings` query."""
    db.run(Query("worker_connection_settings", {}, first_row))


def listen_for_appends(db: Db) -> None:
    """Start receiving the notifications of appends on this autocommit connection."""
    db.run(listen())
