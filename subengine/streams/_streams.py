"""Streams and their partitions: creating them and looking at their heads and floors."""

from __future__ import annotations

from subengine.db._sql import Query, Result, nothing
from subengine.model._declarations import Retention
from subengine.model._errors import StreamBeingDeleted, StreamExists, StreamNotFound
from subengine.model._events import PartitionState, Stream
from subengine.model._names import validate_partition_count, validate_stream_name
from subengine.streams._retention import retention_json


def create_stream(
    stream: str, partitions: int, retention: Retention | None = None
) -> Query[Stream | None]:
    """Create a stream with a fixed number of partitions and a retention policy (None:
    keep every event); None when the name is taken."""
    validate_stream_name(stream)
    validate_partition_count(partitions)
    params = {"stream": stream, "partitions": partitions, "retention": retention_json(retention)}

    def read(result: Result) -> Stream | None:
        return Stream(*result.rows[0]) if result.rows else None

    return Query("create_stream", params, read)


def name_taken(stream: str) -> Query[StreamExists | StreamBeingDeleted]:
    """Why `create_stream` found the name taken: a stream of it exists, or one is being
    deleted (or was deleted just now: then creating it again succeeds)."""

    def read(result: Result) -> StreamExists | StreamBeingDeleted:
        if not result.rows or result.rows[0][1]:
            return StreamBeingDeleted(stream)
        return StreamExists(stream, result.rows[0][0])

    return Query("stream_name_taken", {"stream": stream}, read)


def get_stream(stream: str) -> Query[Stream]:
    """One stream by name; StreamNotFound when there is none."""
    validate_stream_name(stream)

    def read(result: Result) -> Stream:
        if not result.rows:
            raise StreamNotFound(stream)
        return Stream(*result.rows[0])

    return Query("get_stream", {"stream": stream}, read)


def list_streams() -> Query[list[Stream]]:
    """Every stream, by name."""
    return Query("list_streams", {}, lambda result: [Stream(*row) for row in result.rows])


def partition_states(stream: str) -> Query[list[PartitionState]]:
    """Head, head time and floor of every partition of a stream."""
    validate_stream_name(stream)

    def read(result: Result) -> list[PartitionState]:
        if not result.rows:
            raise StreamNotFound(stream)
        return [PartitionState(*row) for row in result.rows]

    return Query("partitions", {"stream": stream}, read)


def heads(stream: str) -> Query[dict[int, int]]:
    """The head position of every partition of a stream."""
    query = partition_states(stream)
    return Query(
        query.name,
        query.params,
        lambda result: {state.partition: state.head for state in query.read(result)},
    )


def listen() -> Query[None]:
    """Start receiving the notifications of appends to the schema's streams (on an
    autocommit connection); see sql/listen.sql for the payload."""
    return Query("listen", {}, nothing)
