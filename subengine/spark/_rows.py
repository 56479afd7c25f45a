"""Spark rows to appended events, exactly once however often a task runs.

A Spark task can run more than once for the same data: a failed task is retried, a
speculative copy runs beside a slow one, a micro-batch is replayed after a restart. Each
run appends its rows in one transaction, and each row without an `id` column value gets a
deterministic id, a UUID (version 5) of

    the write's identity, the Spark partition, the row's content, and how many
    identical rows came before it in the task.

The identity is the streaming query's id (kept in its checkpoint) and the micro-batch
id, or for a batch write the `writeId` option (else a random id drawn once per write, on
the driver). Neither the Spark partition's contents nor a batch's are ordered the same
way on every run (rows come out of shuffles in any order), but they hold the same rows,
so content-derived ids are the same on every run; the idempotent append stores an id
already in the stream only once (DESIGN.md, Append flow).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import pyarrow as pa

from subengine._append import append_prepared, prepare
from subengine._errors import InvalidEvent, InvalidInput
from subengine._events import NewEvent
from subengine._settings import Settings

# uuid5 namespace of event ids the Spark writer derives (a fixed random UUID).
SPARK_ID_NAMESPACE = uuid.UUID("0b7e4c1e-5d0a-4f57-9a65-3f2b1c8e6d42")
REQUIRED_COLUMNS = ("key", "type", "data")
OPTIONAL_COLUMNS = ("id", "metadata", "occurred_at", "expected_version")
# Events per append_events call; a task's calls share one transaction.
APPEND_CHUNK = 5_000


@dataclass(frozen=True, slots=True)
class WriteCounts:
    """What one task appended: events stored now, and ones a former run had stored."""

    stored: int
    duplicates: int


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


def derived_id(
    identity: str, stream: str, spark_partition: int, content: str, seen: int
) -> uuid.UUID:
    """The id of the `seen`-th row (from 0) of this content in a task of a write."""
    return uuid.uuid5(
        SPARK_ID_NAMESPACE, f"{identity}\n{stream}\n{spark_partition}\n{seen}\n{content}"
    )


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


class TaskAppender:
    """Appends the rows of one Spark task in one transaction on `conn`."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        settings: Settings,
        stream: str,
        identity: str,
        spark_partition: int,
    ) -> None:
        self.conn = conn
        self.settings = settings
        self.stream = stream
        self.identity = identity
        self.spark_partition = spark_partition
        self.seen: Counter[str] = Counter()
        self.expected: dict[str, int] = {}
        self.keys_appended: set[str] = set()
        self.stored = 0
        self.duplicates = 0

    def _where(self, row_number: int, key: object) -> str:
        return f"row {row_number} of Spark partition {self.spark_partition} (key {key!r})"

    def write(self, batches: Iterable[pa.RecordBatch], *, whole_task: bool) -> WriteCounts:
        """Validate and append every row; raises InvalidInput naming a bad row.

        With `whole_task` (the rows carry expected_version) every row is read before the
        first append, so that each key's expected version is known where its first event
        goes; otherwise rows go to the database in chunks as they come.
        """
        pending: list[tuple[int, NewEvent]] = []
        for number, row in enumerate(_rows(batches)):
            try:
                event, expected = _event(row)
            except InvalidInput as error:
                raise InvalidInput(f"{self._where(number, row.get('key'))}: {error}") from None
            if expected is not None:
                known = self.expected.setdefault(event.key, expected)
                if known != expected:
                    raise InvalidInput(
                        f"{self._where(number, event.key)}: rows of one key in one task must "
                        f"agree on expected_version, and this one says {expected} where an "
                        f"earlier one says {known} (it is the key's version before the task's "
                        "append)"
                    )
            pending.append((number, event))
            if not whole_task and len(pending) == APPEND_CHUNK:
                self._append(pending)
                pending = []
        for start in range(0, len(pending), APPEND_CHUNK):
            self._append(pending[start : start + APPEND_CHUNK])
        return WriteCounts(self.stored, self.duplicates)

    def _append(self, numbered: list[tuple[int, NewEvent]]) -> None:
        events = [event for _, event in numbered]
        new_keys = {e.key for e in events} - self.keys_appended
        # Each key's expected version is checked where its first event is appended.
        expected = {k: v for k, v in self.expected.items() if k in new_keys} or None
        try:
            params = prepare(self.stream, events, expected, self.settings)
        except InvalidEvent as error:
            number = numbered[error.index][0]
            raise InvalidInput(
                f"{self._where(number, events[error.index].key)}: {error.reason}"
            ) from None
        for i, event in enumerate(events):
            if event.id is None:
                content = _content(params, i)
                params["ids"][i] = derived_id(
                    self.identity, self.stream, self.spark_partition, content, self.seen[content]
                )
                self.seen[content] += 1
        appended = append_prepared(self.conn, params, self.settings)
        self.keys_appended |= new_keys
        duplicates = sum(1 for a in appended if a.duplicate)
        self.duplicates += duplicates
        self.stored += len(appended) - duplicates
