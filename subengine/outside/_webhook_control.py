"""Operating a webhook subscription (docs/webhooks.md, "Operating"): where its streams
start from a cursor or a time, pausing and resuming it, and replaying it.

A pause sets the webhook's `paused` flag and pauses its engine subscriptions in one
transaction: no process takes a new batch of it (the engine's pause), and the gateways
leave it out of their delivery workers and send no challenge; its positions stay. A
replay resets its engine subscriptions through the engine's reset, in a new generation,
so a batch in flight for the old one commits nothing (invariant 3).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from subengine.db._sql import Db, Query, first_row, nothing
from subengine.model._declarations import Start
from subengine.model._errors import InvalidInput, StreamNotFound
from subengine.model._gateway_cursor import GatewayCursor
from subengine.outside._webhooks import (
    Webhook,
    WebhookNotFound,
    WebhookStream,
    subscription_name,
    validate_webhook_id,
    webhook,
)
from subengine.streams._read import epochs_and_heads, positions_since
from subengine.subscriptions._inspection import set_paused
from subengine.subscriptions._subscriptions import reset_subscription


def starts_from(
    db: Db,
    streams: Iterable[str],
    *,
    after: str | None = None,
    since: datetime | None = None,
) -> dict[str, dict[int, int]]:
    """Each stream's positions (partition to position) that a gateway cursor `after`
    holds (a stream it does not hold is left out), or that the time `since` gives (as a
    PUT's start {"since": ...} does). InvalidInput for a cursor of a stream deleted and
    created again since, or one that holds none of `streams`."""
    names = list(streams)
    if (after is None) == (since is None):
        raise InvalidInput("give a cursor (after) or a time (since), not both or neither")
    found = db.run(epochs_and_heads(names))
    for name in names:
        if name not in found or found[name][1] is None:
            raise StreamNotFound(name)
    if since is not None:
        return {name: dict(enumerate(db.run(positions_since(name, since))[1])) for name in names}
    cursor = GatewayCursor.decode(after or "")
    held = [name for name in names if name in cursor.streams]
    if not held:
        raise InvalidInput(f"the cursor holds none of the streams {', '.join(names)}")
    starts: dict[str, dict[int, int]] = {}
    for name in held:
        at = cursor.streams[name]
        epoch, heads = found[name]
        if at.epoch != epoch:
            raise InvalidInput(
                f"stream {name!r} was deleted and created again since the cursor was made; "
                "start from the beginning of the new stream"
            )
        starts[name] = {partition: at.position(partition) for partition in range(len(heads or ()))}
    return starts


def _locked(db: Db, webhook_id: str) -> tuple[int, tuple[WebhookStream, ...], str, bool]:
    """The webhook's serial, streams, state and pause, its row locked."""
    validate_webhook_id(webhook_id)
    row = db.run(Query("lock_webhook", {"id": webhook_id}, first_row))
    if row is None:
        raise WebhookNotFound(webhook_id)
    streams = tuple(WebhookStream.from_json(s) for s in row[3])
    return int(row[1]), streams, row[7], row[9]


def set_webhook_paused(db: Db, webhook_id: str, paused: bool) -> Webhook:
    """Pause a webhook (pending, active or failing): nothing is delivered and its
    positions stay; or resume it (its failure timeout counts from now). The webhook."""
    with db.transaction():
        serial, streams, state, was = _locked(db, webhook_id)
        if state not in ("pending", "active", "failing"):
            raise InvalidInput(
                f"webhook {webhook_id!r} is {state}: nothing is delivered to pause or resume"
            )
        if was != paused:
            db.run(Query("set_webhook_paused", {"id": webhook_id, "paused": paused}, nothing))
            for index in range(len(streams)):
                set_paused(db, subscription_name(serial, index), paused)
        return webhook(db, webhook_id)


def replay_webhook(
    db: Db,
    webhook_id: str,
    *,
    after: str | None = None,
    since: datetime | None = None,
) -> dict[str, dict[int, int]]:
    """Move the positions of the webhook's streams to where the gateway cursor `after`
    stands (the streams it holds) or to the time `since` (every stream), through the
    engine's reset: a new generation, so a batch in flight commits nothing, and the
    deliveries start again from there. Each stream's positions after the replay."""
    with db.transaction():
        serial, streams, state, _ = _locked(db, webhook_id)
        if state in ("failed", "expired"):
            raise InvalidInput(
                f"webhook {webhook_id!r} is {state}: nothing is delivered to replay; "
                "subscribe again"
            )
        names = [s.stream for s in streams]
        starts = starts_from(db, names, after=after, since=since)
        moved = {}
        for index, name in enumerate(names):
            if name in starts:
                position_map: Start = starts[name]
                moved[name] = reset_subscription(db, subscription_name(serial, index), position_map)
        return moved
