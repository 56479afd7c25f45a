"""Key-scoped parking (policy `on_error="park"`, docs/parking.md): which events of a
batch a parked key sets aside, and what operators do with a parked key (look at it,
retry it, discard it).

Order per key (DESIGN.md invariant 9) rests on one rule: everything that parks a key,
sets an event aside, passes the position or releases a key holds the partition's position
row lock, so per partition these happen one after another. A batch sets aside the events
of the keys parked when it locked the rows, in the transaction that moves the position
past them; a retry replays a key's waiting events in position order, each step in one
transaction holding the row, and the key stays parked until the step that leaves none
waiting releases it; a reset releases the parked keys of the partitions it moves.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from subengine.db._sql import Db, Query, Result, first_row, nothing, rowcount
from subengine.model._declarations import Subscription
from subengine.model._errors import Fenced, InvalidInput, SubscriptionNotFound
from subengine.model._events import Event, stored_events
from subengine.model._names import validate_key, validate_stream_name
from subengine.model._records import ParkedEvent, ParkedKey
from subengine.subscriptions._failures import database_trouble, error_text
from subengine.subscriptions._handlers import run_handlers

# A part of a batch as parking sees it: its events and the generation it was read in.
BatchPart = tuple[Sequence[Event], int]


def _batch_params(subscription: Subscription, parts: Iterable[BatchPart]) -> dict[str, Any] | None:
    partitions: list[int] = []
    keys: list[str] = []
    positions: list[int] = []
    ids: list[uuid.UUID] = []
    generations: list[int] = []
    for events, generation in parts:
        for event in events:
            partitions.append(event.partition)
            keys.append(event.key)
            positions.append(event.position)
            ids.append(event.id)
            generations.append(generation)
    if not ids:
        return None
    return {
        "name": subscription.name,
        "partitions": partitions,
        "keys": keys,
        "positions": positions,
        "ids": ids,
        "generations": generations,
    }


def _ids(result: Result) -> frozenset[uuid.UUID]:
    return frozenset(row[0] for row in result.rows)


def park_events(
    db: Db, subscription: Subscription, parts: Iterable[BatchPart]
) -> frozenset[uuid.UUID]:
    """Set aside the events of a batch whose key the subscription has parked (in the
    batch's transaction, which holds the parts' position rows): the ids of those events,
    which the handlers must not see. Nothing for a subscription whose policy is not
    park."""
    if subscription.on_error != "park":
        return frozenset()
    params = _batch_params(subscription, parts)
    if params is None:
        return frozenset()
    return db.run(Query("park_events", params, _ids))


def parked_among(
    db: Db, subscription: Subscription, parts: Iterable[BatchPart]
) -> frozenset[uuid.UUID]:
    """The events of a batch that `park_events` would set aside now, recording nothing:
    for an at_least_once batch, whose handlers run before the transaction that sets them
    aside (which then checks it sets aside the same ones; see `check_parked`)."""
    if subscription.on_error != "park":
        return frozenset()
    params = _batch_params(subscription, parts)
    if params is None:
        return frozenset()
    params.pop("positions")
    return db.run(Query("parked_among", params, _ids))


def check_parked(
    db: Db,
    subscription: Subscription,
    parts: Iterable[BatchPart],
    partition: int,
    expected: frozenset[uuid.UUID],
) -> frozenset[uuid.UUID]:
    """`park_events` in the commit of an at_least_once batch, whose handlers skipped the
    events `expected` (`parked_among` before they ran): Fenced, rolling the commit back,
    when an operator released or parked a key of the batch meanwhile, so that the batch
    is read and handled again rather than its events skipped or handled out of order."""
    parked = park_events(db, subscription, parts)
    if parked != expected:
        raise Fenced(
            f"the parked keys of {subscription.name!r} in partition {partition} changed "
            "while the batch's handlers ran (a retry or discard); nothing of it was "
            "committed, and it is handled again"
        )
    return parked


def release_parked_keys(name: str, partitions: Sequence[int]) -> Query[None]:
    """A reset's release of the parked keys of the partitions it moves (superseded)."""
    return Query("release_parked_keys", {"name": name, "partitions": list(partitions)}, nothing)


# what operators do


def parked_keys(
    name: str | None = None, key: str | None = None, everything: bool = False
) -> Query[list[ParkedKey]]:
    """Parked keys (of subscription `name`, of `key`), oldest first; resolved ones too
    with `everything`."""
    if name is not None:
        validate_stream_name(name)
    if key is not None:
        validate_key(key)
    return Query(
        "list_parked_keys",
        {"name": name, "key": key, "all": everything},
        lambda result: [ParkedKey(*row) for row in result.rows],
    )


def parked_events(db: Db, name: str, key: str) -> list[ParkedEvent]:
    """The events parked under a subscription's key: of its open parking, else of its
    latest one; InvalidInput when the subscription never parked the key."""
    _check(name, key)
    rows = db.run(
        Query(
            "list_parked_events",
            {"name": name, "key": key},
            lambda result: [ParkedEvent(*row) for row in result.rows],
        )
    )
    if not rows:
        _require_subscription(db, name)
        raise InvalidInput(f"subscription {name!r} never parked key {key!r}")
    return rows


@dataclass(frozen=True, slots=True)
class ParkedKeyRetry:
    """What a retry of a parked key did. `replayed`: events handled, in position order,
    each in the transaction that marked it replayed. `error`: the handlers failed again
    (recorded; the key stays parked from the first event not replayed). `superseded`: a
    reset released the key during the retry, and handles its events from then on. The key
    is clear when neither is set."""

    subscription: str
    key: str
    replayed: int
    error: str | None = None
    superseded: bool = False


class _HandlerFailed(Exception):
    """A retry step's handlers failed (rolls the step back)."""


class _Superseded(Exception):
    """The key's parking ended before the step (a reset released it)."""


def retry_parked_key(db: Db, subscription: Subscription, key: str) -> ParkedKeyRetry:
    """Replay the events parked under a subscription's key through its handlers, in
    position order, `batch_size` at a time; when none is left waiting, the key is clear
    and later events of it are handled by the workers.

    Each step is one transaction: it locks the partition's position row (waiting for a
    batch that holds it, and holding off the next), checks that the key is still parked
    in the row's generation, runs the handlers on its connection (none for an
    at_least_once subscription), marks the events replayed, releases the key when none
    waits, and compare-and-sets the position row, so each event's effects and its mark
    commit once, together. A step whose handlers fail rolls back and is recorded (the
    error is returned); the steps before it stay. A database error propagates and counts
    nothing. Bad arguments, a key not parked, or waiting events no longer stored raise
    InvalidInput before anything changed.
    """
    name = subscription.name
    _check(name, key)
    found = db.run(Query("find_parked_key", {"name": name, "key": key}, first_row))
    if found is None:
        _require_subscription(db, name)
        raise InvalidInput(
            f"subscription {name!r} has no parked key {key!r} (`subengine parked list "
            "--all` shows the resolved ones)"
        )
    parked_id, partition, stream = int(found[0]), int(found[1]), str(found[2])
    if stream != subscription.stream:
        raise InvalidInput(
            f"subscription {name!r} is stored on stream {stream!r}, but the app declares "
            f"it on {subscription.stream!r}"
        )
    where = {"name": name, "partition": partition, "id": parked_id, "stream": stream}
    gone: list[int] = db.run(Query("parked_events_gone", where, lambda r: [p for (p,) in r.rows]))
    if gone:
        raise InvalidInput(
            f"key {key!r} of subscription {name!r} has parked events no longer stored "
            f"(positions {_shown_positions(gone)} of partition {partition}): it cannot be "
            f"replayed in order; discard it with `subengine parked discard {name} {key}`"
        )
    replayed = 0
    while True:
        try:
            with db.transaction():
                done, count = _retry_step(db, subscription, where)
        except _Superseded:
            return ParkedKeyRetry(name, key, replayed, superseded=True)
        except _HandlerFailed as failed:
            text = str(failed)
            with db.transaction():
                db.run(Query("parked_key_retry_failed", {"id": parked_id, "error": text}, nothing))
            return ParkedKeyRetry(name, key, replayed, error=text)
        replayed += count
        if done:
            return ParkedKeyRetry(name, key, replayed)


def _retry_step(db: Db, subscription: Subscription, where: dict[str, Any]) -> tuple[bool, int]:
    """One step of a retry, in the caller's transaction: whether the key is clear now, and
    how many events it replayed."""
    position, generation = _lock(db, where)
    events_rows = db.run(
        Query(
            "parked_events_to_replay",
            {**where, "limit": subscription.batch_size},
            lambda result: result.rows,
        )
    )
    missing = [row[0] for row in events_rows if row[1] is None]
    if missing:
        raise InvalidInput(
            f"parked events at positions {_shown_positions(missing)} of partition "
            f"{where['partition']} are no longer stored: the retry stops before them; "
            f"discard the key with `subengine parked discard {where['name']} KEY`"
        )
    events = stored_events(row[1:] for row in events_rows)
    try:
        run_handlers(db, subscription, events, subscription.ack == "transactional")
    except Exception as error:
        if database_trouble(error):
            raise  # the database's trouble, not the events' (invariant 8)
        raise _HandlerFailed(error_text(error)) from error
    positions = [event.position for event in events]
    marked, waiting = db.run(
        Query(
            "replayed_parked_events",
            {"id": where["id"], "positions": positions},
            lambda result: (int(result.rows[0][0]), bool(result.rows[0][1])),
        )
    )
    if not waiting:
        db.run(Query("resolve_parked_key", {"id": where["id"], "resolution": "retried"}, nothing))
    confirmed = db.run(
        Query(
            "confirm_position",
            {**where, "position": position, "generation": generation},
            first_row,
        )
    )
    if confirmed is None:
        raise Fenced(
            f"the position of {where['name']!r} in partition {where['partition']} moved "
            "during the retry's step; nothing of it was committed"
        )
    return not waiting, marked


def _lock(db: Db, where: dict[str, Any]) -> tuple[int, int]:
    """Lock the partition's position row, then the parked key; the row's position and
    generation. _Superseded when the key is no longer parked in that generation."""
    row = db.run(Query("lock_position", where, first_row))
    if row is None:
        raise SubscriptionNotFound(
            f"subscription {where['name']!r} has no position in partition {where['partition']} "
            "(deleted?)"
        )
    position, generation = int(row[0]), int(row[1])
    key_row = db.run(Query("lock_parked_key", {"id": where["id"]}, first_row))
    if key_row is None or key_row[1] is not None or int(key_row[0]) != generation:
        raise _Superseded
    return position, generation


def discard_parked_key(db: Db, name: str, key: str) -> int:
    """Release a parked key without handling its events (they stay listed, discarded);
    later events of the key are handled. The number of events discarded; InvalidInput,
    changing nothing, when the key is not parked."""
    _check(name, key)
    with db.transaction():
        found = db.run(Query("find_parked_key", {"name": name, "key": key}, first_row))
        if found is None:
            _require_subscription(db, name)
            raise InvalidInput(f"subscription {name!r} has no parked key {key!r}")
        where = {"name": name, "partition": int(found[1]), "id": int(found[0])}
        try:
            _lock(db, where)
        except _Superseded:
            raise InvalidInput(
                f"key {key!r} of subscription {name!r} was released meanwhile (a retry or "
                "a reset): nothing to discard"
            ) from None
        params = {"id": where["id"], "resolution": "discarded"}
        return db.run(Query("resolve_parked_key", params, rowcount))


def parked_counts(db: Db, names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per subscription of `names` with parked keys: how many, and how many events wait
    under them."""
    return db.run(
        Query(
            "parked_counts",
            {"names": list(names)},
            lambda result: {str(n): (int(k), int(e or 0)) for n, k, e in result.rows},
        )
    )


def _check(name: str, key: str) -> None:
    validate_stream_name(name)
    validate_key(key)


def _require_subscription(db: Db, name: str) -> None:
    if db.run(Query("subscription_exists", {"name": name}, first_row)) is None:
        raise SubscriptionNotFound(f"no subscription named {name!r}")


def _shown_positions(positions: Sequence[int]) -> str:
    shown = ", ".join(map(str, positions[:5]))
    return shown if len(positions) <= 5 else f"{shown} and {len(positions) - 5} more"
