"""The PySpark Python Data Source `subengine`: batch and streaming reads, and writes.

Where each part runs: `DataSource.schema`, the readers' planning methods (offsets,
`partitions`, `commit`) and the writers' `commit`/`abort` run on the driver; `read` and
`write` run in tasks on the executors. Both find the DSN in the environment variable the
`dsnEnv` option names; the driver checks it is set before any job starts.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    DataType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from subengine.db._sql import Db
from subengine.model._errors import ConfigurationError, InvalidInput, SubengineError
from subengine.model._events import PartitionState
from subengine.model._settings import Settings
from subengine.spark import _offsets, _options, _store
from subengine.spark._offsets import Positions
from subengine.spark._rows import (
    OPTIONAL_COLUMNS,
    QUERY_PREFIX,
    REQUIRED_COLUMNS,
    WRITE_PREFIX,
    TaskRows,
    WriteAttempt,
)
from subengine.streams import _staged_append
from subengine.streams._staged_append import StagedAttempt
from subengine.subscriptions._progress import subscription_positions

log = logging.getLogger("subengine.spark")

ON_DRIVER = "on the Spark driver"
ON_EXECUTOR = "on this Spark executor"

EVENT_SCHEMA = from_arrow_schema(_store.ARROW_SCHEMA)


@dataclass(frozen=True)
class EventRange(InputPartition):
    """Positions (after, upto] of one partition of the stream: one Spark task's read."""

    partition: int
    after: int
    upto: int


def _ranges(positions: Sequence[tuple[int, int, int]], rows_per_split: int) -> list[InputPartition]:
    """(partition, after, upto) ranges cut into tasks of at most `rows_per_split` events,
    in partition and position order."""
    ranges: list[InputPartition] = []
    for partition, after, upto in positions:
        for low in range(after, upto, rows_per_split):
            ranges.append(EventRange(partition, low, min(low + rows_per_split, upto)))
    return ranges


def _event_range(partition: InputPartition) -> EventRange:
    if not isinstance(partition, EventRange):
        raise TypeError(f"the subengine source reads EventRange partitions, not {partition!r}")
    return partition


def _check_read_schema(schema: StructType) -> None:
    if [f.name for f in schema.fields] != EVENT_SCHEMA.fieldNames() or any(
        type(f.dataType) is not type(e.dataType)
        for f, e in zip(schema.fields, EVENT_SCHEMA.fields, strict=True)
    ):
        raise InvalidInput(
            "the subengine data source reads events with its own schema; leave out .schema(...) "
            f"(its columns are {', '.join(EVENT_SCHEMA.fieldNames())})"
        )


class SubengineDataSource(DataSource):
    """Events of a subengine stream as a Spark DataFrame, and DataFrames as events.

    Register it with `subengine.spark.register(spark)`; docs/spark.md lists its options.
    """

    @classmethod
    def name(cls) -> str:
        return "subengine"

    def schema(self) -> StructType:
        # Called by load(), on the driver: check everything a read needs before any job.
        options = _options.read_options(self.options, "read")
        _check_source(options)
        return EVENT_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        _check_read_schema(schema)
        options = _options.read_options(self.options, "batch read")
        return BatchReader(options)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        _check_read_schema(schema)
        options = _options.read_options(self.options, "stream read")
        return StreamReader(options)

    def writer(self, schema: StructType, overwrite: bool) -> BatchWriter:
        options, partitions = _prepare_write(self.options, schema, overwrite)
        write_id = f"{WRITE_PREFIX}{options.write_id or uuid.uuid4()}"
        return BatchWriter(options.target, partitions, write_id)

    def streamWriter(self, schema: StructType, overwrite: bool) -> StreamWriter:
        options, partitions = _prepare_write(self.options, schema, overwrite)
        if options.write_id is not None:
            raise InvalidInput(
                "option writeId is for batch writes; a streaming write derives its event ids "
                "from the query's id and the micro-batch id"
            )
        return StreamWriter(options.target, partitions)


def _check_source(options: _options.ReadOptions) -> None:
    """Connect from the driver and check the stream, the partitions, the starting
    positions and the subscription exist and fit."""
    target = options.target
    with _store.connect(target.dsn(ON_DRIVER), target.schema) as db:
        bounds = _store.partition_bounds(db, target.stream)
        chosen = _store.chosen(bounds, target.stream, options.partitions)
        _starting_positions(db, options, bounds, chosen)
        if options.subscription is not None:
            subscription_positions(db, options.subscription, target.stream)


def _starting_positions(
    db: Db,
    options: _options.ReadOptions,
    bounds: dict[int, PartitionState],
    chosen: tuple[int, ...],
) -> Positions:
    """The positions a new streaming query starts after."""
    target = options.target
    starting = _options.parse_starting_positions(options.starting_positions)
    if starting == "earliest":
        return {p: bounds[p].floor - 1 for p in chosen}
    if starting == "latest":
        return {p: bounds[p].head for p in chosen}
    if isinstance(starting, str):
        name = starting.removeprefix(_options.SUBSCRIPTION_PREFIX)
        positions = subscription_positions(db, name, target.stream)
        return {p: positions.get(p, 0) for p in chosen}
    for partition, position in starting.items():
        if partition not in chosen:
            raise InvalidInput(
                f"startingPositions names partition {partition}, which this query does not "
                f"read (partitions {list(chosen)})"
            )
        if position > bounds[partition].head:
            raise InvalidInput(
                f"startingPositions gives partition {partition} the position {position}, past "
                f"its head {bounds[partition].head}"
            )
    return {p: starting.get(p, 0) for p in chosen}


class BatchReader(DataSourceReader):
    """Every stored event of the chosen partitions, up to the heads when the query is
    planned; one Spark partition per stream partition, split every `rowsPerSplit` events."""

    def __init__(self, options: _options.ReadOptions) -> None:
        self.options = options

    def partitions(self) -> list[InputPartition]:
        target = self.options.target
        with _store.connect(target.dsn(ON_DRIVER), target.schema) as db:
            bounds = _store.partition_bounds(db, target.stream)
        chosen = _store.chosen(bounds, target.stream, self.options.partitions)
        ranges = [(p, bounds[p].floor - 1, bounds[p].head) for p in chosen]
        return _ranges(ranges, self.options.rows_per_split) or [EventRange(chosen[0], 0, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        partition = _event_range(partition)
        target = self.options.target
        return _store.read_range(
            target.dsn(ON_EXECUTOR),
            target.schema,
            target.stream,
            partition.partition,
            partition.after,
            partition.upto,
            self.options.fail_on_data_loss,
            self.options.since,
            self.options.until,
        )


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """New events of the chosen partitions, micro-batch by micro-batch.

    An offset holds the last position read of every partition; a micro-batch reads the
    positions between two offsets, which are the same events however often it runs.
    """

    def __init__(self, options: _options.ReadOptions) -> None:
        if options.since is not None or options.until is not None:
            raise InvalidInput("options since and until are for batch reads, not streaming ones")
        self.options = options
        self.target = options.target
        # Set by prepareForTriggerAvailableNow: the heads the query must stop at.
        self.available_now: Positions | None = None

    def _bounds(self) -> tuple[dict[int, PartitionState], tuple[int, ...]]:
        with _store.connect(self.target.dsn(ON_DRIVER), self.target.schema) as db:
            bounds = _store.partition_bounds(db, self.target.stream)
        return bounds, _store.chosen(bounds, self.target.stream, self.options.partitions)

    def _heads(self) -> Positions:
        bounds, chosen = self._bounds()
        return {p: bounds[p].head for p in chosen}

    def initialOffset(self) -> dict[str, int]:
        with _store.connect(self.target.dsn(ON_DRIVER), self.target.schema) as db:
            bounds = _store.partition_bounds(db, self.target.stream)
            chosen = _store.chosen(bounds, self.target.stream, self.options.partitions)
            return _offsets.to_offset(_starting_positions(db, self.options, bounds, chosen))

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_records_per_trigger
        return ReadAllAvailable() if limit is None else ReadMaxRows(limit)

    def prepareForTriggerAvailableNow(self) -> None:
        bounds, chosen = self._bounds()
        self.available_now = {p: bounds[p].head for p in chosen}

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        bounds, chosen = self._bounds()
        heads = {p: bounds[p].head for p in chosen}
        begin = _offsets.from_offset(start, chosen)
        for partition, position in begin.items():
            if position > heads[partition]:
                raise InvalidInput(
                    f"the query has read partition {partition} of stream "
                    f"{self.target.stream!r} up to position {position}, past its head "
                    f"{heads[partition]}: is the checkpoint from another database?"
                )
        if self.available_now is not None:
            heads = {p: min(heads[p], self.available_now[p]) for p in heads}
        # The limit counts stored events only: a micro-batch that meets a gap covers all of
        # it, so that it fails naming the whole gap, or skips it at once.
        stored = {p: max(begin[p], min(bounds[p].floor - 1, heads[p])) for p in begin}
        if isinstance(limit, ReadMaxRows):
            return _offsets.to_offset(_offsets.admit(stored, heads, limit.max_rows))
        if isinstance(limit, ReadAllAvailable):
            return _offsets.to_offset({p: max(begin[p], heads[p]) for p in begin})
        raise InvalidInput(f"the subengine source cannot limit a micro-batch by {limit!r}")

    def reportLatestOffset(self) -> dict[str, int]:
        return _offsets.to_offset(self._heads())

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        bounds, chosen = self._bounds()
        begin = _offsets.from_offset(start, chosen)
        finish = _offsets.from_offset(end, chosen)
        # Checked here on the driver, and again by each task in the snapshot it reads in.
        fail = self.options.fail_on_data_loss
        starts = {
            p: _store.read_start(self.target.stream, bounds[p], begin[p], finish[p], fail)
            for p in chosen
        }
        ranges = [(p, starts[p], finish[p]) for p in chosen if finish[p] > starts[p]]
        return _ranges(ranges, self.options.rows_per_split)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        partition = _event_range(partition)
        return _store.read_range(
            self.target.dsn(ON_EXECUTOR),
            self.target.schema,
            self.target.stream,
            partition.partition,
            partition.after,
            partition.upto,
            self.options.fail_on_data_loss,
        )

    def commit(self, end: dict[str, Any]) -> None:
        # Spark's checkpoint is the source of truth; the subscription only mirrors it.
        if self.options.subscription is None:
            return
        positions = _offsets.from_offset(end, tuple(sorted(int(p) for p in end)))
        _store.advance_subscription(
            self.target.dsn(ON_DRIVER), self.target.schema, self.options.subscription, positions
        )


# writing

_JSON_TYPES = (StringType, StructType, MapType)
_COLUMN_TYPES: dict[str, tuple[type[DataType], ...]] = {
    "key": (StringType,),
    "type": (StringType,),
    "data": _JSON_TYPES,
    "metadata": _JSON_TYPES,
    "id": (StringType,),
    "occurred_at": (TimestampType, TimestampNTZType),
    "expected_version": (IntegerType, LongType),
}


def _prepare_write(
    options: Any, schema: StructType, overwrite: bool
) -> tuple[_options.WriteOptions, int]:
    """Check a write's options and columns, and that its stream exists, on the driver;
    returns the options and the stream's partition count."""
    if overwrite:
        raise InvalidInput("a subengine stream is append-only: write with mode('append')")
    parsed = _options.write_options(options)
    names = schema.fieldNames()
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise InvalidInput(
            f"the DataFrame to write lacks column(s) {', '.join(missing)}; it needs key, type "
            f"and data, and may have {', '.join(OPTIONAL_COLUMNS)}"
        )
    for field in schema.fields:
        allowed = _COLUMN_TYPES.get(field.name)
        if allowed is None:
            raise InvalidInput(
                f"the DataFrame to write has column {field.name!r}, which is not an event field: "
                f"select key, type, data and any of {', '.join(OPTIONAL_COLUMNS)}"
            )
        if not isinstance(field.dataType, allowed):
            raise InvalidInput(
                f"column {field.name!r} is of type {field.dataType.simpleString()}; it must be "
                + " or ".join(t.typeName() for t in allowed)
            )
        if isinstance(field.dataType, TimestampNTZType):
            raise InvalidInput(
                "column 'occurred_at' is a timestamp without a time zone; convert it to a "
                "timestamp (with the session's zone) so that the instant is unambiguous"
            )
    target = parsed.target
    with _store.connect(target.dsn(ON_DRIVER), target.schema) as db:
        bounds = _store.partition_bounds(db, target.stream)
    return parsed, len(bounds)


@dataclass
class WriteCommit(WriterCommitMessage):
    """One task attempt's result: the write, and what the attempt staged."""

    write_id: str
    batch: int
    staged: StagedAttempt


def _write_task(
    target: _options.Target,
    partitions: int,
    write_id: str,
    batch: int,
    batches: Iterator[pa.RecordBatch],
) -> WriteCommit:
    """Stage the task's rows in one transaction, under a new attempt id."""
    context = TaskContext.get()
    if context is None:
        raise ConfigurationError("the subengine writer runs only inside a Spark task")
    attempt = WriteAttempt(write_id, batch, uuid.uuid4(), context.partitionId())
    rows = TaskRows(Settings.from_env(schema=target.schema), target.stream, partitions, attempt)
    with _store.connect(target.dsn(ON_EXECUTOR), target.schema) as db:
        _staged_append.stage(db, rows.staged(batches))
    summary = rows.summary
    staged = StagedAttempt(
        attempt.attempt,
        attempt.spark_partition,
        summary.rows,
        tuple(sorted(summary.partitions)),
        summary.expects_versions,
    )
    return WriteCommit(write_id, batch, staged)


def _committed(
    messages: Sequence[WriterCommitMessage | None], write_id: str | None, batch: int
) -> tuple[str | None, list[StagedAttempt]]:
    """The write and the attempts of the messages of a commit, checked to be one attempt
    per Spark partition of one write."""
    commits = [m for m in messages if isinstance(m, WriteCommit)]
    writes = {m.write_id for m in commits} | ({write_id} if write_id is not None else set())
    if len(writes) > 1 or any(m.batch != batch for m in commits):
        raise SubengineError(
            f"a subengine write's commit received the messages of other writes ({sorted(writes)}"
            f", micro-batch {batch}); nothing was appended"
        )
    attempts = [m.staged for m in commits]
    if len({a.spark_partition for a in attempts}) != len(attempts):
        raise SubengineError(
            "a subengine write's commit received two attempts of one Spark partition; "
            "nothing was appended"
        )
    return (writes.pop() if writes else None), attempts


def _commit(
    target: _options.Target, write_id: str, batch: int, attempts: Sequence[StagedAttempt]
) -> _staged_append.CommitCounts:
    """Append the attempts' staged rows in one transaction, then delete the write's
    staged rows, those of failed attempts included."""
    with _store.connect(target.dsn(ON_DRIVER), target.schema) as db:
        counts = _staged_append.commit_staged(db, target.stream, write_id, batch, attempts)
        with db.transaction():
            db.run(_staged_append.discard_staged(write_id, batch))
    return counts


def _discard(target: _options.Target, write_id: str, batch: int) -> None:
    with _store.connect(target.dsn(ON_DRIVER), target.schema) as db, db.transaction():
        db.run(_staged_append.discard_staged(write_id, batch))


class BatchWriter(DataSourceArrowWriter):
    """Appends a DataFrame's rows, all or nothing: tasks stage their rows, and the
    driver's commit appends those of the attempts Spark committed in one transaction."""

    def __init__(self, target: _options.Target, partitions: int, write_id: str) -> None:
        self.target = target
        self.partitions = partitions
        self.write_id = write_id

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCommit:
        return _write_task(self.target, self.partitions, self.write_id, 0, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _, attempts = _committed(messages, self.write_id, 0)
        counts = _commit(self.target, self.write_id, 0, attempts)
        log.info(
            "appended %d events to stream %s (%d stored by an earlier run)",
            counts.stored,
            self.target.stream,
            counts.duplicates,
            extra={
                "stream": self.target.stream,
                "stored": counts.stored,
                "duplicates": counts.duplicates,
            },
        )

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        _discard(self.target, self.write_id, 0)
        log.warning(
            "a write to stream %s failed; none of its rows were appended",
            self.target.stream,
            extra={"stream": self.target.stream},
        )


class StreamWriter(DataSourceStreamArrowWriter):
    """Appends every micro-batch's rows, all or nothing, as BatchWriter does; a replayed
    micro-batch stores nothing twice."""

    def __init__(self, target: _options.Target, partitions: int) -> None:
        self.target = target
        self.partitions = partitions

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCommit:
        context = TaskContext.get()
        query_id = context.getLocalProperty("sql.streaming.queryId") if context else None
        batch_id = context.getLocalProperty("streaming.sql.batchId") if context else None
        if not query_id or batch_id is None:
            raise ConfigurationError(
                "the subengine stream writer found no streaming query id or micro-batch id "
                "in its task; it runs only in a Structured Streaming micro-batch query"
            )
        write_id = f"{QUERY_PREFIX}{query_id}"
        return _write_task(self.target, self.partitions, write_id, int(batch_id), iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        write_id, attempts = _committed(messages, None, batchId)
        if write_id is None:  # no task ran, so none staged anything
            return
        counts = _commit(self.target, write_id, batchId, attempts)
        log.info(
            "micro-batch %d appended %d events to stream %s (%d stored by an earlier run)",
            batchId,
            counts.stored,
            self.target.stream,
            counts.duplicates,
            extra={"stream": self.target.stream, "batch": batchId, "stored": counts.stored},
        )

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        write_id, _ = _committed(messages, None, batchId)
        if write_id is not None:
            _discard(self.target, write_id, batchId)
        log.warning(
            "micro-batch %d failed; none of its rows were appended to stream %s (the "
            "replayed micro-batch appends them)",
            batchId,
            self.target.stream,
            extra={"stream": self.target.stream, "batch": batchId},
        )
