"""Retention: setting a stream's policy and pruning what it no longer keeps.

Pruning (DESIGN.md, "Retention and gaps") removes the oldest events of a partition and
raises its floor in the same statement, `batch` positions at a time, each batch its own
transaction: the partition's row is locked only by each batch's last step, so an append
to that partition waits at most for that. Deletes follow the primary key from the floor
up, so each batch reads one index range. One pruner runs at a time per schema (a
session advisory lock held for the run); a second one finds it taken and does nothing.
Every reader below the new floor then gets a tombstone for exactly what went.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from psycopg.types.json import Jsonb

from subengine.db._sql import Db, Query, Result, first_row, nothing
from subengine.model._declarations import Retention
from subengine.model._errors import InvalidInput, StreamNotFound
from subengine.model._events import Stream
from subengine.model._names import validate_stream_name, validate_whole_number

# measured with bench/retention.py: the appends beside the pruner lose least with it
DEFAULT_PRUNE_BATCH = 1_000
MAX_PRUNE_BATCH = 100_000


def retention_json(retention: Retention | None) -> Jsonb | None:
    """A policy as the streams table stores it."""
    if retention is None:
        return None
    if not isinstance(retention, Retention):
        raise InvalidInput(
            f"retention must be a subengine.Retention or None, not {type(retention).__name__}"
        )
    return Jsonb(retention.to_json())


def set_retention(stream: str, retention: Retention | None) -> Query[Stream]:
    """Change a stream's policy (None: keep every event from now on); it applies from
    the next pruning run."""
    validate_stream_name(stream)

    def read(result: Result) -> Stream:
        if not result.rows:
            raise StreamNotFound(stream)
        return Stream(*result.rows[0])

    return Query("set_retention", {"stream": stream, "retention": retention_json(retention)}, read)


@dataclass(frozen=True, slots=True)
class PartitionCut:
    """What retention wants of one partition now: positions `floor` to `cut - 1` go."""

    stream: str
    partition: int
    floor: int
    head: int
    cut: int
    keep: bool = False  # keep_unprocessed: each batch checks the subscriptions again
    hard: int | None = None  # then the hard limits' cut
    # positions below `aged` the age limits want gone, below `capped` the count limits
    aged: int = 0
    capped: int = 0

    @property
    def removable(self) -> int:
        return self.cut - self.floor


@dataclass(frozen=True, slots=True)
class PrunedPartition:
    """What a pruning run removed from one partition: positions `first` to `last`
    (`removed` events; fewer than the span only if some were missing already)."""

    stream: str
    partition: int
    first: int
    last: int
    removed: int


@dataclass(frozen=True, slots=True)
class RetentionRun:
    """A pruning run: what it removed, partition by partition, or (`dry_run`) what it
    would remove now. `locked`: another pruner held the lock, so this one did nothing."""

    partitions: list[PrunedPartition]
    dry_run: bool = False
    locked: bool = False

    @property
    def removed(self) -> int:
        return sum(part.removed for part in self.partitions)


def retention_plan(stream: str | None = None) -> Query[list[PartitionCut]]:
    """Every partition of the streams with a policy (or of `stream`) and its cut."""
    if stream is not None:
        validate_stream_name(stream)
    return Query(
        "retention_plan",
        {"stream": stream},
        lambda result: [PartitionCut(*row) for row in result.rows],
    )


def _prune_range(cut: PartitionCut, start: int, end: int) -> Query[tuple[int, int] | None]:
    params = {
        "stream": cut.stream,
        "partition": cut.partition,
        "from": start,
        "to": end,
        "keep": cut.keep,
        "hard": cut.hard,
        "aged": cut.aged,
        "capped": cut.capped,
    }

    def read(result: Result) -> tuple[int, int] | None:
        return (int(result.rows[0][0]), int(result.rows[0][1])) if result.rows else None

    return Query("prune_range", params, read)


# progress(partition's cut, events removed so far in it)
Progress = Callable[[PartitionCut, int], None]


def run_retention(
    db: Db,
    schema: str,
    stream: str | None = None,
    *,
    batch: int = DEFAULT_PRUNE_BATCH,
    dry_run: bool = False,
    plan: Callable[[Sequence[PartitionCut]], None] | None = None,
    progress: Progress | None = None,
) -> RetentionRun:
    """Prune every stream with a policy, or one stream, on an autocommit connection of
    its own (its commits do not wait for the disk: see the query pruner_settings).

    `plan` hears the partitions with something to remove before the run starts;
    `progress` hears each batch. With `dry_run` nothing is removed: the run reports what
    it would remove now. A stream without a policy keeps everything (for `stream`, that
    is an error, so a typo does not pass for "nothing to do").
    """
    validate_whole_number(batch, "the prune batch", 1, MAX_PRUNE_BATCH)
    if stream is not None:
        row = db.run(Query("get_stream", {"stream": validate_stream_name(stream)}, first_row))
        if row is None:
            raise StreamNotFound(stream)
        if row[4] is None:
            raise InvalidInput(f"stream {stream!r} has no retention policy: it keeps every event")
    lock = {"schema": schema}
    db.run(Query("pruner_settings", {}, nothing))
    if not dry_run and not db.run(
        Query("retention_lock", lock, lambda result: bool(result.rows[0][0]))
    ):
        return RetentionRun([], locked=True)
    try:
        cuts = [cut for cut in db.run(retention_plan(stream)) if cut.removable > 0]
        if plan is not None:
            plan(cuts)
        if dry_run:
            return RetentionRun(
                [
                    PrunedPartition(c.stream, c.partition, c.floor, c.cut - 1, c.removable)
                    for c in cuts
                ],
                dry_run=True,
            )
        pruned = [_prune(db, cut, batch, progress) for cut in cuts]
        return RetentionRun([part for part in pruned if part.last >= part.first])
    finally:
        # a broken connection took its session lock with it; unlocking would only hide
        # what broke it
        if not dry_run and not db.conn.broken:
            db.run(Query("retention_unlock", lock, lambda result: None))


def _prune(db: Db, cut: PartitionCut, batch: int, progress: Progress | None) -> PrunedPartition:
    removed, start, floor = 0, cut.floor, cut.floor
    while start < cut.cut:
        end = min(start + batch, cut.cut)
        pruned = db.run(_prune_range(cut, start, end))
        if pruned is None:  # the stream is being deleted
            break
        count, floor = pruned
        removed += count
        if progress is not None:
            progress(cut, removed)
        if floor < end:  # a subscription it keeps events for stands below the cut now
            break
        start = floor
    return PrunedPartition(cut.stream, cut.partition, cut.floor, floor - 1, removed)
