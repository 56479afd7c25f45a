"""Appending staged rows: the database work of Spark writes, whose tasks stage rows and
whose driver's commit appends them.

Spark runs a write as tasks, and a task may run more than once: retried after a failure,
copied by speculation, or run again after the stage before it was recomputed, in which
case a round-robin or otherwise non-deterministic repartition can hand it other rows than
its first attempt had. So a task never appends. Each attempt stages its rows in the
UNLOGGED table `spark_staged_events` under an attempt id of its own and reports it in its
commit message; Spark hands the driver's `commit` the messages of exactly the attempts it
committed, one per Spark partition, and the commit appends their rows in one transaction
(`commit_staged`). Staged rows of other attempts are never appended; the commit and the
abort delete every staged row of the write (`discard_staged`).

The rows never pass through the driver: the commit moves them inside PostgreSQL, with
`append_events`, one chunk of an attempt's rows per call.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from subengine.db._sql import Db, Query, Row, first_row, nothing
from subengine.model._errors import InvalidInput, SubengineError, WrongExpectedVersion
from subengine.streams._append import subengine_errors

# Rows per append_events call of a commit; the calls share the commit's transaction.
APPEND_CHUNK = 5_000


class StagedRowsLost(SubengineError):
    """Rows a committed task attempt staged are gone: the write cannot commit."""


@dataclass(frozen=True, slots=True)
class StagedAttempt:
    """What one committed task attempt staged: the rows of its Spark partition, the
    stream partitions they go to, and whether any row has an expected version."""

    attempt: uuid.UUID
    spark_partition: int
    rows: int
    partitions: tuple[int, ...]
    expects_versions: bool


@dataclass(frozen=True, slots=True)
class CommitCounts:
    """What a commit appended: events stored now, and rows whose id was stored already."""

    stored: int
    duplicates: int


def stage(db: Db, rows: Iterable[Sequence[Any]]) -> None:
    """Stage `rows` (in the column order of the spark_stage query) with one COPY, in the
    connection's transaction."""
    db.sql.copy_in(db.conn, "spark_stage", rows)


def commit_staged(
    db: Db,
    stream: str,
    write_id: str,
    batch: int,
    attempts: Sequence[StagedAttempt],
) -> CommitCounts:
    """Append the rows of `attempts` to `stream`, in one transaction on `conn`.

    Attempts go in the order of their Spark partitions, each attempt's rows in the order
    its task received them. Raises StagedRowsLost when an attempt's rows are not all
    staged, WrongExpectedVersion or InvalidInput for a failed expected_version check; then
    nothing is appended.
    """
    key = {"write_id": write_id, "batch": batch, "attempts": [a.attempt for a in attempts]}
    ordered = sorted(attempts, key=lambda a: a.spark_partition)
    stored = duplicates = 0
    with db.transaction(), subengine_errors(stream):
        staged: Sequence[Row] = db.run(Query("spark_staged_counts", key))
        counts: dict[uuid.UUID, int] = {attempt: count for attempt, count in staged}
        lost = [a for a in attempts if counts.get(a.attempt, 0) != a.rows]
        if lost:
            raise StagedRowsLost(
                f"the rows {len(lost)} task(s) of this write staged for stream {stream!r} are "
                "gone (PostgreSQL empties its UNLOGGED staging table when it restarts after a "
                "crash); nothing of the write was appended: run it again"
            )
        partitions = sorted({p for a in attempts for p in a.partitions})
        db.run(
            Query("spark_lock_partitions", {"stream": stream, "partitions": partitions}, nothing)
        )
        setting = db.run(Query("spark_plan_by_hashing", {}, first_row))
        db.run(Query("spark_number_shared_rows", key, nothing))
        if setting is not None:
            db.run(Query("spark_plan_restore", {"setting": setting[0]}, nothing))
        if any(a.expects_versions for a in attempts):
            _check_expected_versions(db, stream, key)
        for attempt in ordered:
            for after in range(0, attempt.rows, APPEND_CHUNK):
                params = {
                    "stream": stream,
                    "write_id": write_id,
                    "batch": batch,
                    "attempt": attempt.attempt,
                    "after": after,
                    "upto": after + APPEND_CHUNK,
                }
                row = db.run(Query("spark_append_staged", params, first_row))
                if row is not None:
                    stored += row[0]
                    duplicates += row[1]
    return CommitCounts(stored, duplicates)


def _check_expected_versions(db: Db, stream: str, key: dict[str, Any]) -> None:
    found = db.run(Query("spark_expected_versions", {**key, "stream": stream}, first_row))
    if found is None:
        return
    name, low, high, actual = found
    if low != high:
        raise InvalidInput(
            f"rows of key {name!r} in this write say expected_version {low} and {high}; rows "
            "of one key must agree on it (it is the key's version before the write)"
        )
    raise WrongExpectedVersion(stream, name, low, actual)


def discard_staged(write_id: str, batch: int) -> Query[None]:
    """Delete the staged rows of a write (of a streaming query: up to micro-batch
    `batch`), of every attempt, in the connection's transaction."""
    return Query("spark_discard_staged", {"write_id": write_id, "batch": batch}, nothing)
