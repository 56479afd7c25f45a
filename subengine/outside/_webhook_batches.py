"""A webhook batch in two statements (docs/webhooks.md, "Deliveries"): one claims it (its
bounds stored, its events' JSON made by PostgreSQL, what the delivery needs), the other
moves the position once the callback took it, without waiting for the disk.

The engine's at_least_once batch does the same work in about eight round trips (a
transaction to read it and store its bounds, one to read the webhook, one to move the
position) and decodes every event to encode it again. Here each statement is a
transaction of its own (the connection in autocommit), and the events are passed through
as stored. Only plain batches go this way: a claim that finds anything else (a gap,
missing events, a failure being retried, a halted partition, a webhook not delivered)
writes nothing and says so, and the engine's batch takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from subengine.db._sql import Query, Result, first_row


@dataclass(frozen=True, slots=True)
class ClaimedBatch:
    """A plain batch whose bounds are stored: the positions after `position` through
    `through`, its wanted events' JSON joined with commas (None: the filters left none
    out of `wanted` = 0), and what its delivery needs."""

    position: int
    generation: int  # of the position row: what moving it compares
    through: int
    events: str | None
    wanted: int
    next_time: datetime | None  # of the event after the batch, when it was read
    callback: str
    secrets: tuple[str, ...]  # the current secret, then the one a rotation replaced
    state: str  # of the webhook: active or failing
    subscription_generation: int  # named in the delivery and its webhook-id
    epoch: int
    positions: tuple[int, ...]  # of every partition, for the cursor


def claim_batch(
    webhook_id: str,
    name: str,
    stream: str,
    partition: int,
    size: int,
    types: tuple[str, ...] | None,
    keys: tuple[str, ...] | None,
) -> Query[ClaimedBatch | None]:
    """Claim the next batch of `partition` for the webhook's engine subscription `name`:
    None when it is not a plain batch (nothing was written: the engine's batch handles
    it), or the subscription or the webhook is gone."""

    def read(result: Result) -> ClaimedBatch | None:
        row = first_row(result)
        if row is None or not row[0]:
            return None
        (_, position, generation, take, events, wanted, next_time, callback, secret,
         previous, state, subscription_generation, epoch, positions, _) = row  # fmt: skip
        return ClaimedBatch(
            position,
            generation,
            position + take,
            events,
            wanted,
            next_time,
            callback,
            (secret,) if previous is None else (secret, previous),
            state,
            subscription_generation,
            epoch,
            tuple(positions),
        )

    params = {
        "id": webhook_id,
        "name": name,
        "stream": stream,
        "partition": partition,
        "size": size,
        "types": None if types is None else list(types),
        "keys": None if keys is None else list(keys),
    }
    return Query("claim_webhook_batch", params, read)


def commit_batch(
    name: str, stream: str, partition: int, batch: ClaimedBatch
) -> Query[tuple[bool, datetime | None]]:
    """Move the position past a delivered batch, compared and set as every batch's is
    (DESIGN.md invariant 3): whether it moved (not: a reset or another process moved it
    meanwhile, and nothing was written), and the time of the partition's next event.
    The commit does not wait for the disk: a crash of PostgreSQL may send the last
    batches again, each the same batch (see commit_webhook_batch)."""

    def read(result: Result) -> tuple[bool, datetime | None]:
        row = first_row(result)
        return (False, None) if row is None else (True, row[1])

    params = {
        "name": name,
        "stream": stream,
        "partition": partition,
        "old": batch.position,
        "new": batch.through,
        "generation": batch.generation,
        "next_time": batch.next_time,
    }
    return Query("commit_webhook_batch", params, read)
