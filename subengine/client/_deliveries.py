"""What a webhook delivery carries and how the subscriber checks it: the Standard Webhooks
signature, the webhook-ids already taken, and the batch of one partition in its body.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from standardwebhooks import Webhook

from subengine.client._items import Event, event_from_json, tombstone_from_json
from subengine.model._events import Tombstone
from subengine.model._gateway_cursor import GatewayCursor

# webhook-ids remembered to answer a repeated delivery at once (older repeats are
# still recognised by their positions)
REMEMBERED_IDS = 4096


@dataclass(frozen=True, slots=True)
class Batch:
    """Items of one partition covering positions `after` + 1 to `through` (positions
    without an item were passed over by a filter), in the stream's epoch `epoch`."""

    stream: str
    partition: int
    epoch: int
    after: int
    through: int
    items: tuple[Event | Tombstone, ...]


def last_position(item: Event | Tombstone) -> int:
    """The last position `item` covers."""
    return item.position if isinstance(item, Event) else item.gap_to


def first_position(item: Event | Tombstone) -> int:
    """The first position `item` covers."""
    return item.position if isinstance(item, Event) else item.gap_from


def trimmed(item: Event | Tombstone, at: int) -> Event | Tombstone:
    """`item` without the positions up to `at` (a tombstone that straddles it)."""
    if isinstance(item, Tombstone) and item.gap_from <= at:
        return replace(item, gap_from=at + 1)
    return item


def batch_of(message: Mapping[str, Any]) -> Batch:
    """The batch of a delivery's body."""
    stream = str(message["stream"])
    epoch = GatewayCursor.decode(message["cursor"]).streams[stream].epoch
    items: list[Event | Tombstone] = [
        tombstone_from_json(body) for body in message.get("tombstones") or ()
    ]
    items += [event_from_json(body) for body in message.get("events") or ()]
    for item in items:
        if item.stream != stream or item.partition != message["partition"]:
            raise ValueError("an item of another stream or partition")
    return Batch(
        stream,
        int(message["partition"]),
        epoch,
        int(message["after"]),
        int(message["through"]),
        tuple(sorted(items, key=first_position)),
    )


class Signatures:
    """Checks deliveries signed with `secret`, sent at most `tolerance` seconds from now."""

    def __init__(self, secret: str, tolerance: float) -> None:
        self._webhook = Webhook(secret)
        self._tolerance = tolerance

    def verified(self, body: bytes, lowered: Mapping[str, str]) -> bool:
        """Whether one of the signatures (headers with lower-case names) is the secret's
        over "<id>.<timestamp>.<body>", with the timestamp within `tolerance` of now."""
        webhook_id = lowered.get("webhook-id")
        stamp = lowered.get("webhook-timestamp", "")
        signatures = lowered.get("webhook-signature", "")
        if not webhook_id or not stamp.isascii() or not stamp.isdigit() or not signatures:
            return False
        sent = int(stamp)
        if abs(time.time() - sent) > self._tolerance:
            return False
        try:
            text = body.decode()
        except UnicodeDecodeError:
            return False
        expected = self._webhook.sign(webhook_id, datetime.fromtimestamp(sent, UTC), text)
        return any(
            hmac.compare_digest(expected.encode(), signature.encode())
            for signature in signatures.split()
        )


class RememberedIds:
    """The last `size` webhook-ids taken, oldest first (a dict: looked up by hash). Not
    thread-safe: the subscriber's lock guards it."""

    def __init__(self, size: int = REMEMBERED_IDS) -> None:
        self._ids: dict[str, None] = {}
        self._size = size

    def __contains__(self, webhook_id: object) -> bool:
        return webhook_id in self._ids

    def add(self, webhook_id: str) -> None:
        self._ids[webhook_id] = None
        if len(self._ids) > self._size:
            del self._ids[next(iter(self._ids))]
