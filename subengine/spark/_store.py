"""The Spark data source's database work for reads: partition heads, ranges of events as
Arrow batches, and a subscription moved forward (writes: `streams/_staged_append`).

Reads come out of PostgreSQL through `COPY ... TO STDOUT (FORMAT binary)`, the server's
cheapest way out (nothing to escape, times as plain integers), and are decoded into Arrow
arrays a column at a time (`_binary_copy`) as they arrive, a batch every BATCH_BYTES;
building Python objects per row would cost more than everything else together. Every
range read runs in one REPEATABLE READ transaction that first checks, in the same
snapshot, that the partition still stores the range, so a read returns exactly the
events of its positions; where retention removed some, it fails naming them or, with the
option failOnDataLoss false, skips them with a warning naming them.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing, contextmanager
from datetime import datetime

import psycopg
import pyarrow as pa

from subengine.db import _connection
from subengine.db._sql import SQL, Db
from subengine.model._errors import InvalidInput, PartitionNotFound, SubengineError
from subengine.model._events import PartitionState, Tombstone
from subengine.model._settings import Settings
from subengine.spark._binary_copy import TIMESTAMP, Decoder, Kind
from subengine.spark._offsets import Positions
from subengine.streams._range_copy import copy_range
from subengine.streams._streams import partition_states
from subengine.subscriptions._progress import advance_positions

log = logging.getLogger("subengine.spark")

# The columns of every row the source produces, in order (the Spark schema derives from it).
ARROW_SCHEMA = pa.schema(
    [
        pa.field(name, kind, nullable=False)
        for name, kind in (
            ("stream", pa.string()),
            ("partition", pa.int32()),
            ("position", pa.int64()),
            ("id", pa.string()),
            ("key", pa.string()),
            ("key_version", pa.int64()),
            ("type", pa.string()),
            ("data", pa.string()),
            ("metadata", pa.string()),
            ("occurred_at", TIMESTAMP),
            ("recorded_at", TIMESTAMP),
        )
    ]
)
# What spark_read_range sends: everything but the constant stream and partition.
# The fixed-width columns come first: they lie at the same place in every row.
_COPIED = (
    ("position", Kind.INT8),
    ("key_version", Kind.INT8),
    ("occurred_at", Kind.TIMESTAMPTZ),
    ("recorded_at", Kind.TIMESTAMPTZ),
    ("id", Kind.UUID),
    ("key", Kind.TEXT),
    ("type", Kind.TEXT),
    ("data", Kind.JSONB),
    ("metadata", Kind.JSONB),
)
_COPIED_ORDER = [name for name, _ in _COPIED]
# About this much COPY data makes one Arrow batch (the row that reaches it ends the batch):
# bounds a read's memory, whatever the size of its range or of its events.
BATCH_BYTES = 8 << 20


class RetentionGap(SubengineError, LookupError):
    """A read needs positions that retention has removed, and its option failOnDataLoss is
    true (the default), so it fails rather than skip them (DESIGN.md invariant 6). `gap`
    names exactly the positions of the read that are gone."""

    def __init__(self, gap: Tombstone) -> None:
        super().__init__(
            f"retention removed {_span(gap)} of partition {gap.partition} of stream "
            f"{gap.stream!r}, which this read needs (the partition keeps positions from "
            f"{gap.floor} on). To skip them and read on from position {gap.floor}, set the "
            "option failOnDataLoss to false"
        )
        self.gap = gap
        self.stream = gap.stream
        self.partition = gap.partition


def _span(gap: Tombstone) -> str:
    if gap.gap_from == gap.gap_to:
        return f"position {gap.gap_from}"
    return f"positions {gap.gap_from} to {gap.gap_to}"


@contextmanager
def connect(dsn: str, schema: str) -> Iterator[Db]:
    """A new connection with the queries of `schema`, in a transaction that commits when
    the block ends; the data source opens one per task or driver call."""
    with _connection.connect(
        dsn, Settings.from_env().connect_timeout, application_name="subengine-spark"
    ) as conn:
        yield Db(conn, SQL(schema))


def partition_bounds(db: Db, stream: str) -> dict[int, PartitionState]:
    """Head and floor of every partition of `stream`; StreamNotFound if there is none."""
    return {state.partition: state for state in db.run(partition_states(stream))}


def chosen(
    bounds: dict[int, PartitionState], stream: str, wanted: Sequence[int] | None
) -> tuple[int, ...]:
    """The partitions a read covers: all, or the `wanted` ones, which must exist."""
    if wanted is None:
        return tuple(sorted(bounds))
    for partition in wanted:
        if partition not in bounds:
            raise PartitionNotFound(stream, partition, len(bounds))
    return tuple(wanted)


def read_start(
    stream: str, bounds: PartitionState, after: int, upto: int, fail_on_data_loss: bool
) -> int:
    """Where a read of positions (after, upto] of the partition starts: after `after`, or,
    when retention removed some of them, after the gap, which fails the read with
    RetentionGap if `fail_on_data_loss` and is logged as skipped otherwise."""
    if upto > bounds.head:
        raise InvalidInput(
            f"positions up to {upto} of partition {bounds.partition} of stream {stream!r} "
            f"were asked for, but its head is {bounds.head}: is the checkpoint or the "
            "startingPositions option from another database or stream?"
        )
    if upto <= after or after + 1 >= bounds.floor:
        return after
    gap = Tombstone(stream, bounds.partition, after + 1, min(upto, bounds.floor - 1), bounds.floor)
    if fail_on_data_loss:
        raise RetentionGap(gap)
    log.warning(
        "skipped %s of partition %d of stream %s: retention removed them (the partition "
        "keeps positions from %d on) and the read's option failOnDataLoss is false",
        _span(gap),
        gap.partition,
        gap.stream,
        gap.floor,
        extra={
            "stream": gap.stream,
            "partition": gap.partition,
            "from_position": gap.gap_from,
            "to_position": gap.gap_to,
            "floor": gap.floor,
        },
    )
    return gap.gap_to


def read_range(
    dsn: str,
    schema: str,
    stream: str,
    partition: int,
    after: int,
    upto: int,
    fail_on_data_loss: bool,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Generator[pa.RecordBatch, None, None]:
    """The events of positions (after, upto] of one partition, in position order, as
    Arrow batches of ARROW_SCHEMA. The same range always gives the same rows, unless
    retention removed some of them: then see `read_start`. The floor is checked in the
    snapshot the events are read in, so the check is exact however it moves meanwhile."""
    with connect(dsn, schema) as db:
        db.conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        db.conn.read_only = True
        bounds = partition_bounds(db, stream).get(partition)
        if bounds is None:
            raise PartitionNotFound(stream, partition, 0)
        start = read_start(stream, bounds, after, upto, fail_on_data_loss)
        if start >= upto:
            return
        # Dense positions under a checked floor: a range without a time window holds every
        # position, so each batch must continue the last.
        dense = since is None and until is None
        decoder = Decoder(_COPIED)
        following = start + 1
        copy = copy_range(db, stream, partition, start, upto, since, until, BATCH_BYTES)
        with closing(copy):
            for run in copy:
                batch = _batch(decoder.decode(run.data, run.sizes), stream, partition)
                if batch.num_rows == 0:
                    continue
                if dense:
                    _check_dense(stream, partition, batch.column("position"), following)
                following += batch.num_rows
                yield batch
        decoder.finish()
        if dense and following != upto + 1:
            raise SubengineError(
                f"positions ({start}, {upto}] of partition {partition} of stream {stream!r} "
                f"hold {following - start - 1} events, not {upto - start}: positions must be "
                "dense"
            )


def _check_dense(stream: str, partition: int, positions: pa.Array, following: int) -> None:
    """Positions come unique and in order: dense from `following` on if the last is
    as many past the first as there are rows."""
    first, last = positions[0].as_py(), positions[-1].as_py()
    if first != following or last != following + len(positions) - 1:
        raise SubengineError(
            f"partition {partition} of stream {stream!r} gave positions {first} to {last} "
            f"where {following} to {following + len(positions) - 1} should be: positions "
            "must be dense"
        )


def _batch(columns: list[pa.Array], stream: str, partition: int) -> pa.RecordBatch:
    rows = len(columns[0])
    arrays = {
        "stream": pa.repeat(pa.scalar(stream, pa.string()), rows),
        "partition": pa.repeat(pa.scalar(partition, pa.int32()), rows),
        **dict(zip(_COPIED_ORDER, columns, strict=True)),
    }
    return pa.RecordBatch.from_arrays(
        [arrays[name] for name in ARROW_SCHEMA.names], schema=ARROW_SCHEMA
    )


# subscriptions


def advance_subscription(dsn: str, schema: str, name: str, positions: Positions) -> None:
    """Move subscription `name` forward to `positions` (never back)."""
    with connect(dsn, schema) as db:
        db.run(advance_positions(name, positions))
