"""Deleting a stream: its subscriptions, partitions, events and row, in short transactions.

Three steps, each safe to repeat, so that running the delete again finishes one that was
interrupted anywhere:
1. One short transaction locks the stream's row, checks its subscriptions (refused while
   there are any, unless forced: then they go, as `delete_subscription` deletes them)
   and deletes its partition rows. That waits for the appends in flight; from its commit
   every append fails (SE404, "being deleted") and no subscription of the stream can be
   stored, while the row keeps the name, so that it cannot be created again over old
   events.
2. The events go in batches, each its own transaction: no huge transaction, and appends
   to other streams never wait for more than a batch. Then the keys' last versions go,
   in batches too.
3. The row goes, only once nothing else of the stream is left. The name is free again;
   a stream created under it has a new epoch, by which a reader that kept the old one
   can tell (`Cursor` does not carry the epoch yet: the gateway's cursor will).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from subengine.db._sql import Db, Query, Result, first_row, nothing
from subengine.model._errors import InvalidInput, StreamNotFound, SubengineError
from subengine.model._events import Stream
from subengine.model._names import validate_stream_name, validate_whole_number
from subengine.subscriptions._subscriptions import delete_subscription

log = logging.getLogger("subengine")

DEFAULT_DELETE_BATCH = 5_000
MAX_DELETE_BATCH = 100_000


@dataclass(frozen=True, slots=True)
class DeletedStream:
    """What deleting a stream removed: the stream (name and epoch), its events and its
    subscriptions (each with its positions, dead letters and gaps). A delete that
    finishes an interrupted one counts only what it removed itself."""

    name: str
    epoch: int
    events: int
    subscriptions: tuple[str, ...]


def delete_stream(
    db: Db, name: str, *, force: bool = False, batch: int = DEFAULT_DELETE_BATCH
) -> DeletedStream:
    """Delete stream `name` and everything of it, on an autocommit connection.

    Refused (InvalidInput, nothing changed), forced or not, for the engine stream of a
    Durable Streams stream; and while subscriptions of the stream are stored, unless
    `force`, which deletes them too, even while connected workers run them (their
    batches then commit nothing, as after `delete_subscription(force=True)`). Events go
    `batch` at a time, each batch its own transaction. StreamNotFound when there is no
    such stream.
    """
    validate_stream_name(name)
    validate_whole_number(batch, "the delete batch", 1, MAX_DELETE_BATCH)
    with db.transaction():
        stream = db.run(_lock_stream(name))
        if stream is None:
            raise StreamNotFound(name)
        _refuse_durable_stream(db, name)
        subscriptions = _remove_subscriptions(db, name, force)
        db.run(Query("delete_partitions", {"stream": name}, nothing))
    events = sum(_delete_events(db, name, p, batch) for p in range(stream.partitions))
    _delete_keys(db, name, batch)
    with db.transaction():
        if db.run(_lock_stream(name)) is not None:  # else a delete run alongside finished
            subscriptions += _remove_subscriptions(db, name, force)
            if db.run(Query("delete_stream", {"stream": name}, first_row)) is None:
                raise SubengineError(
                    f"stream {name!r} still has events, keys or partitions after its delete; "
                    f"run `subengine stream delete {name}` again"
                )
    log.info(
        "deleted stream %s (epoch %s): %s events, subscriptions %s",
        name,
        stream.epoch,
        events,
        list(subscriptions),
        extra={"stream": name, "epoch": stream.epoch, "events": events},
    )
    return DeletedStream(name, stream.epoch, events, subscriptions)


def _lock_stream(name: str) -> Query[Stream | None]:
    def read(result: Result) -> Stream | None:
        return Stream(*result.rows[0]) if result.rows else None

    return Query("lock_stream_for_delete", {"stream": name}, read)


def _refuse_durable_stream(db: Db, name: str) -> None:
    """Refuse, forced or not, to delete the engine stream of a Durable Streams stream (or
    of a deleted one that forks still read): its catalog row would point at nothing."""
    row = db.run(Query("stream_durable_path", {"stream": name}, first_row))
    if row is not None:
        path = row[0]
        raise InvalidInput(
            f"stream {name!r} holds the Durable Streams stream {path!r}: delete that with "
            "DELETE on its URL, and the gateway deletes the engine stream once nothing reads it"
        )


def _remove_subscriptions(db: Db, name: str, force: bool) -> tuple[str, ...]:
    """Delete the subscriptions of stream `name` (with `force`), or refuse while it has any."""
    names = db.run(
        Query(
            "stream_subscriptions",
            {"stream": name},
            lambda result: tuple(str(row[0]) for row in result.rows),
        )
    )
    if names and not force:
        raise InvalidInput(
            f"stream {name!r} has subscriptions: {', '.join(names)}; delete them first "
            "(`subengine subscription delete NAME`), or delete the stream with them: "
            f"`subengine stream delete {name} --force` (force=True)"
        )
    for subscription in names:
        delete_subscription(db, subscription, force=True)
    return names


def _delete_events(db: Db, name: str, partition: int, batch: int) -> int:
    """Delete every event of one partition, `batch` per transaction; how many went."""
    removed, after = 0, 0
    while True:
        params = {"stream": name, "partition": partition, "after": after, "batch": batch}
        with db.transaction():
            count, after = db.run(
                Query("delete_events_batch", params, lambda result: tuple(result.rows[0]))
            )
        if count == 0:  # not `count < batch`: a delete run alongside may have taken some
            return removed
        removed += count


def _delete_keys(db: Db, name: str, batch: int) -> None:
    """Delete the key rows (last versions) of stream `name`, `batch` per transaction."""
    params = {"stream": name, "batch": batch}
    while True:
        with db.transaction():
            count = db.run(
                Query("delete_keys_batch", params, lambda result: int(result.rows[0][0]))
            )
        if count == 0:
            return
