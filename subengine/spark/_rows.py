"""Spark rows to staged events: what a write task sends to the staging table.

A write task does not append: it checks its rows as `append` checks events and stages
them under an attempt id of its own (see `streams/_staged_append`). The driver's commit
appends the rows of the attempts Spark committed, and gives each row without an `id` a
deterministic one: a UUID of

    the write's identity and stream and the row's content (the row's `content`, a UUID
    (version 5) computed here), and the row's number among the identical rows of the
    whole write (its `occurrence`, counted here within the task and completed in SQL
    across the tasks at commit).

The identity is the streaming query's id (kept in its checkpoint) and the micro-batch id,
or for a batch write the `writeId` option (else a random id drawn once per write, on the
driver). Nothing in an id depends on which task held the row or in which order, so a
write run again with the same rows, however Spark distributes them, derives the same ids,
and the idempotent append stores an id already in the stream only once.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa

from subengine.model._errors import InvalidEvent, InvalidInput
from subengine.model._events import NewEvent, partition_for
from subengine.model._settings import Settings
from subengine.streams._append import prepare

# uuid5 namespace of the content UUIDs the Spark writer derives (a fixed random UUID).
SPARK_ID_NAMESPACE = uuid.UUID("0b7e4c1e-5d0a-4f57-9a65-3f2b1c8e6d42")
REQUIRED_COLUMNS = ("key", "type", "data")
OPTIONAL_COLUMNS = ("id", "metadata", "occurred_at", "expected_version")
# Rows checked together by one `prepare` call: bounds a task's memory.
CHECK_CHUNK = 5_000

# How a staged row's write_id begins: a batch write's, or a streaming query's.
WRITE_PREFIX = "write:"
QUERY_PREFIX = "query:"

# A staged row, in the column order of the spark_stage query.
StagedRow = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class WriteAttempt:
    """Which write and which task attempt a task's rows belong to."""

    write_id: str
    batch: int
    attempt: uuid.UUID
    spark_partition: int

    @property
    def identity(self) -> str:
        """What the content UUIDs of the write derive from: the write, and the micro-batch
        of a streaming one."""
        if self.write_id.startswith(QUERY_PREFIX):
            return f"{self.write_id}:batch:{self.batch}"
        return self.write_id


@dataclass(slots=True)
class StagingSummary:
    """What a task staged: its rows, the stream partitions they go to, and whether any
    row has an expected version."""

    rows: int = 0
    partitions: set[int] = field(default_factory=set)
    expects_versions: bool = False


def _json_value(value: Any, column: str) -> Any:
    """A JSON column's value: JSON text is parsed; a struct arrives as a dict and a map as
    a list of (key, value) pairs."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as error:
            raise InvalidInput(f"{column} is not valid JSON text ({error})") from None
    if isinstance(value, list) and all(
        isinstance(item, tuple) and len(item) == 2 for item in value
    ):
        return dict(value)
    return value


def _event(row: dict[str, Any]) -> tuple[NewEvent, int | None]:
    event_id = row.get("id")
    if event_id is not None:
        try:
            event_id = uuid.UUID(str(event_id))
        except ValueError:
            raise InvalidInput(f"id {event_id!r} is not a UUID") from None
    metadata = row.get("metadata")
    event = NewEvent(
        key=row["key"],
        type=row["type"],
        data=_json_value(row["data"], "data"),
        metadata=None if metadata is None else _json_value(metadata, "metadata"),
        id=event_id,
        occurred_at=row.get("occurred_at"),
    )
    return event, row.get("expected_version")


def _rows(batches: Iterable[pa.RecordBatch]) -> Iterator[dict[str, Any]]:
    for batch in batches:
        yield from batch.to_pylist()


def content_id(identity: str, stream: str, content: str) -> uuid.UUID:
    """The UUID of a row's content in a write: identical rows of a write share it."""
    return uuid.uuid5(SPARK_ID_NAMESPACE, f"{identity}\n{stream}\n{content}")


def _content(params: dict[str, Any], i: int) -> str:
    occurred = params["occurred_at"][i]
    return json.dumps(
        [
            params["keys"][i],
            params["types"][i],
            params["data"][i],
            params["metadata"][i],
            occurred.isoformat() if isinstance(occurred, datetime) else None,
        ],
        ensure_ascii=False,
    )


class TaskRows:
    """The rows of one Spark task attempt, checked and turned into staged rows."""

    def __init__(
        self, settings: Settings, stream: str, partitions: int, attempt: WriteAttempt
    ) -> None:
        self.settings = settings
        self.stream = stream
        self.partitions = partitions
        self.attempt = attempt
        self.identity = attempt.identity
        self.seen: Counter[uuid.UUID] = Counter()
        self.expected: dict[str, int] = {}
        self.summary = StagingSummary()

    def _where(self, row_number: int, key: object) -> str:
        return f"row {row_number} of Spark partition {self.attempt.spark_partition} (key {key!r})"

    def staged(self, batches: Iterable[pa.RecordBatch]) -> Iterator[StagedRow]:
        """Every row as a staged row, in the task's order; raises InvalidInput naming the
        first bad row. `summary` counts what was produced."""
        pending: list[tuple[int, NewEvent, int | None]] = []
        for number, row in enumerate(_rows(batches)):
            try:
                event, expected = _event(row)
            except InvalidInput as error:
                raise InvalidInput(f"{self._where(number, row.get('key'))}: {error}") from None
            if expected is not None:
                known = self.expected.setdefault(event.key, expected)
                if known != expected:
                    raise InvalidInput(
                        f"{self._where(number, event.key)}: rows of one key in one write must "
                        f"agree on expected_version, and this one says {expected} where an "
                        f"earlier one says {known} (it is the key's version before the write)"
                    )
            pending.append((number, event, expected))
            if len(pending) == CHECK_CHUNK:
                yield from self._chunk(pending)
                pending = []
        yield from self._chunk(pending)

    def _chunk(self, numbered: list[tuple[int, NewEvent, int | None]]) -> Iterator[StagedRow]:
        if not numbered:
            return
        events = [event for _, event, _ in numbered]
        try:
            params = prepare(self.stream, events, None, self.settings)
        except InvalidEvent as error:
            number = numbered[error.index][0]
            raise InvalidInput(
                f"{self._where(number, events[error.index].key)}: {error.reason}"
            ) from None
        attempt = self.attempt
        for i, (number, event, expected) in enumerate(numbered):
            content = content_id(self.identity, self.stream, _content(params, i))
            occurrence = 0
            if event.id is None:
                occurrence = self.seen[content]
                self.seen[content] += 1
            self.summary.rows += 1
            self.summary.partitions.add(partition_for(event.key, self.partitions))
            if expected is not None:
                self.summary.expects_versions = True
            yield (
                attempt.write_id,
                attempt.batch,
                attempt.attempt,
                number + 1,
                attempt.spark_partition,
                content,
                occurrence,
                event.id,
                event.key,
                event.type,
                params["data"][i],
                params["metadata"][i],
                event.occurred_at,
                expected,
            )
