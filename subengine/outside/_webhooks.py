"""Webhook subscriptions (DESIGN.md, "The gateway", push; docs/webhooks.md).

A webhook subscription is stored under the id its subscriber chose, with its callback,
its streams (each with optional type and key filters) and what a delivery carries. Each
of its streams is an engine subscription, named webhook.<serial>.<index>, in
at_least_once mode: the gateway's delivery workers run them, and their positions are
what was delivered. Creating and deleting a webhook creates and deletes those in the same
transaction, so a deleted or replaced webhook fences every batch still in flight for it
(their compare-and-set finds no position).

Nothing here logs, and no error message quotes a secret.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from subengine.db._sql import Db, Query, Result, Row, first_row, nothing
from subengine.model._declarations import Start, Subscription, start_from_json
from subengine.model._errors import InvalidInput, SubengineError
from subengine.model._events import Event
from subengine.model._names import (
    MAX_KEY_LENGTH,
    MAX_TYPE_LENGTH,
    shown_value,
    validate_stream_name,
    validate_whole_number,
)
from subengine.model._secrets import new_secret, validate_secret
from subengine.subscriptions._subscriptions import delete_subscription, ensure_subscription

WEBHOOK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
WEBHOOK_ID_RULE = "1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit"
STATES = ("pending", "active", "failing", "failed", "expired")
MAX_STREAMS = 16
MAX_FILTER_VALUES = 100
MAX_EVENTS = 1000
LEASE_SECONDS = (60, 2_592_000)
# how long the secret a rotation replaced still signs deliveries
ROTATION_OVERLAP_SECONDS = 86_400


class WebhookNotFound(SubengineError, LookupError):
    """No webhook subscription has that id."""

    def __init__(self, webhook_id: str) -> None:
        super().__init__(f"no webhook subscription {webhook_id!r}")
        self.webhook_id = webhook_id


class WebhookConflict(SubengineError):
    """A webhook subscription with that id exists with another definition, or belongs to
    another API key."""


def validate_webhook_id(webhook_id: object) -> str:
    if not isinstance(webhook_id, str) or WEBHOOK_ID.fullmatch(webhook_id) is None:
        raise InvalidInput(f"invalid webhook id {shown_value(webhook_id)}: use {WEBHOOK_ID_RULE}")
    return webhook_id


def _filter(values: object, what: str, stream: str, longest: int) -> tuple[str, ...] | None:
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    if not isinstance(values, Sequence) or not values or len(values) > MAX_FILTER_VALUES:
        raise InvalidInput(
            f"the {what} filter of stream {stream!r} must be a list of 1 to "
            f"{MAX_FILTER_VALUES} strings"
        )
    for value in values:
        if not isinstance(value, str) or not 0 < len(value) <= longest:
            raise InvalidInput(
                f"invalid {what} {shown_value(value)} in the filter of stream {stream!r}: "
                f"use 1 to {longest} characters"
            )
    return tuple(sorted(set(values)))


@dataclass(frozen=True)
class WebhookStream:
    """A stream of a webhook subscription and its filters (None: every type, every key)."""

    stream: str
    types: tuple[str, ...] | None = None
    keys: tuple[str, ...] | None = None

    @classmethod
    def of(cls, stream: object, options: object) -> WebhookStream:
        name = validate_stream_name(stream)
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise InvalidInput(
                f"the options of stream {name!r} must be an object like "
                '{"type": [...], "key": [...]}'
            )
        unknown = set(options) - {"type", "key"}
        if unknown:
            raise InvalidInput(
                f"unknown option {shown_value(sorted(unknown)[0])} of stream {name!r}: "
                "use type and key"
            )
        return cls(
            name,
            _filter(options.get("type"), "type", name, MAX_TYPE_LENGTH),
            _filter(options.get("key"), "key", name, MAX_KEY_LENGTH),
        )

    def wants(self, event: Event) -> bool:
        return (self.types is None or event.type in self.types) and (
            self.keys is None or event.key in self.keys
        )

    def to_json(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"stream": self.stream}
        if self.types is not None:
            shown["type"] = list(self.types)
        if self.keys is not None:
            shown["key"] = list(self.keys)
        return shown

    @classmethod
    def from_json(cls, stored: Mapping[str, Any]) -> WebhookStream:
        types, keys = stored.get("type"), stored.get("key")
        return cls(
            stored["stream"],
            None if types is None else tuple(types),
            None if keys is None else tuple(keys),
        )


def streams_of(value: object) -> tuple[WebhookStream, ...]:
    """The streams of a webhook as given: a list of names, or an object of stream name to
    its filters ({"type": [...], "key": [...]}); sorted by name."""
    if isinstance(value, Mapping):
        chosen = [WebhookStream.of(name, options) for name, options in value.items()]
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        chosen = [WebhookStream.of(name, None) for name in value]
    else:
        raise InvalidInput(
            "streams must be a list of stream names or an object of stream name to its filters"
        )
    if not chosen or len(chosen) > MAX_STREAMS:
        raise InvalidInput(f"a webhook takes 1 to {MAX_STREAMS} streams, not {len(chosen)}")
    if len({s.stream for s in chosen}) != len(chosen):
        raise InvalidInput("a stream is named twice in streams")
    return tuple(sorted(chosen, key=lambda s: s.stream))


@dataclass(frozen=True)
class WebhookDefinition:
    """What a webhook subscription delivers, and where."""

    callback: str
    streams: tuple[WebhookStream, ...]
    include_data: bool = True
    max_events: int = 100
    lease_seconds: int = 86_400

    def __post_init__(self) -> None:
        validate_whole_number(self.max_events, "max_events", 1, MAX_EVENTS)
        validate_whole_number(self.lease_seconds, "lease_seconds", *LEASE_SECONDS)
        if not isinstance(self.include_data, bool):
            raise InvalidInput("include_data must be true or false")

    def delivers_as(self, other: WebhookDefinition) -> bool:
        """Whether `other` delivers the same (its lease may differ)."""
        return (self.callback, self.streams, self.include_data, self.max_events) == (
            other.callback,
            other.streams,
            other.include_data,
            other.max_events,
        )


def subscription_name(serial: int, index: int) -> str:
    """The engine subscription of a webhook's `index`-th stream."""
    return f"webhook.{serial}.{index}"


def engine_subscription(
    serial: int, index: int, stream: WebhookStream, max_events: int, start: Start = "end"
) -> Subscription:
    """The declaration of the engine subscription behind one stream of a webhook (its
    handlers are the delivery's)."""
    return Subscription(
        subscription_name(serial, index),
        stream.stream,
        start=start,
        batch_size=max_events,
        ack="at_least_once",
        on_error="stop",
        max_attempts=1000,
        on_gap="skip",
    )


@dataclass(frozen=True)
class Webhook:
    """A webhook subscription as shown (never its secret)."""

    id: str
    key_id: str | None  # the API key that created it (None: made in open mode)
    state: str
    callback: str
    streams: tuple[WebhookStream, ...]
    include_data: bool
    max_events: int
    lease_seconds: int
    created_at: datetime
    expires_at: datetime
    state_changed_at: datetime
    verified_at: datetime | None
    last_attempt_at: datetime | None
    last_success_at: datetime | None
    failing_since: datetime | None
    attempts: int
    delivered: int
    last_error: str | None
    lag: int
    paused: bool  # by an operator (`subengine webhook pause`): nothing is delivered

    def to_json(self) -> dict[str, Any]:
        shown: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            if isinstance(value, datetime):
                value = value.isoformat()
            shown[name] = value
        shown["streams"] = {s.stream: _options(s) for s in self.streams}
        return shown


def _options(stream: WebhookStream) -> dict[str, Any]:
    shown = stream.to_json()
    del shown["stream"]
    return shown


def _webhook(row: Row) -> Webhook:
    values = list(row)
    values[4] = tuple(WebhookStream.from_json(s) for s in values[4])
    return Webhook(*values)


def _webhooks(result: Result) -> list[Webhook]:
    return [_webhook(row) for row in result.rows]


def webhooks(db: Db, webhook_id: str | None = None) -> list[Webhook]:
    """Every webhook subscription, oldest first, or the one of `webhook_id` (if any)."""
    if webhook_id is not None:
        validate_webhook_id(webhook_id)
    return db.run(Query("webhook_records", {"id": webhook_id}, _webhooks))


def webhook(db: Db, webhook_id: str) -> Webhook:
    found = webhooks(db, webhook_id)
    if not found:
        raise WebhookNotFound(webhook_id)
    return found[0]


@dataclass(frozen=True)
class Put:
    """What storing a webhook did: the webhook, whether it is new, and its secret when
    this call made or changed it (nothing shows it again)."""

    webhook: Webhook
    created: bool
    secret: str | None


def put_webhook(
    db: Db,
    webhook_id: str,
    definition: WebhookDefinition,
    starts: Mapping[str, Start],
    *,
    secret: str | None = None,
    replaces: str | None = None,
    key_id: str | None = None,
) -> Put:
    """Create the webhook `webhook_id` (pending; its engine subscriptions start at
    `starts`, per stream), or renew its lease when it exists with the same definition
    (a new `secret` rotates the old one out after an overlap). WebhookConflict when it
    exists with another definition, or was made with another API key than `key_id`.
    `replaces`: another webhook deleted in the same transaction (a re-subscription under
    a new id fences the old one)."""
    validate_webhook_id(webhook_id)
    if secret is not None:
        validate_secret(secret)
    if replaces is not None:
        validate_webhook_id(replaces)
        if replaces == webhook_id:
            raise InvalidInput("a webhook cannot replace itself")
    with db.transaction():
        if replaces is not None:
            _delete_replaced(db, replaces, key_id)
        row = db.run(Query("lock_webhook", {"id": webhook_id}, first_row))
        if row is not None:
            if row[8] is not None and row[8] != key_id:
                # renewing would let another key move its lease or change its secret
                raise WebhookConflict(
                    f"webhook {webhook_id!r} belongs to another API key; choose another id"
                )
            stored = WebhookDefinition(
                row[2],
                tuple(WebhookStream.from_json(s) for s in row[3]),
                row[4],
                row[5],
                definition.lease_seconds,
            )
            if not stored.delivers_as(definition):
                raise WebhookConflict(
                    f"webhook {webhook_id!r} exists with another callback, streams or "
                    "options; subscribe under a new id (with replaces), or delete it first"
                )
            changed = secret is not None and secret != row[6]
            params = {
                "id": webhook_id,
                "lease_seconds": definition.lease_seconds,
                "secret": secret,
                "overlap": ROTATION_OVERLAP_SECONDS,
            }
            db.run(Query("renew_webhook", params, nothing))
            return Put(webhook(db, webhook_id), False, secret if changed else None)
        chosen = secret or new_secret()
        params = {
            "id": webhook_id,
            "key_id": key_id,
            "callback": definition.callback,
            "streams": Jsonb([s.to_json() for s in definition.streams]),
            "include_data": definition.include_data,
            "max_events": definition.max_events,
            "lease_seconds": definition.lease_seconds,
            "secret": chosen,
        }
        serial = db.run(Query("insert_webhook", params, first_row))
        assert serial is not None  # an INSERT ... RETURNING gives its row
        for index, stream in enumerate(definition.streams):
            start = starts.get(stream.stream, "end")
            declared = engine_subscription(serial[0], index, stream, definition.max_events, start)
            ensure_subscription(db, declared)
        return Put(webhook(db, webhook_id), True, chosen)


def delete_webhook(db: Db, webhook_id: str) -> None:
    """Delete a webhook subscription and its engine subscriptions, in one transaction:
    nothing more is delivered under its id. WebhookNotFound when there is none."""
    validate_webhook_id(webhook_id)
    with db.transaction():
        row = db.run(Query("lock_webhook", {"id": webhook_id}, first_row))
        if row is None:
            raise WebhookNotFound(webhook_id)
        drop_subscriptions(db, int(row[1]))
        db.run(Query("delete_webhook_row", {"id": webhook_id}, nothing))


def _delete_replaced(db: Db, webhook_id: str, key_id: str | None) -> None:
    """Delete the webhook a new one replaces, if it is there and made with the same key
    (or in open mode): one that is gone already (cancelled, expired, answered 410) has
    nothing left to fence, and another key's is not this one's to end."""
    row = db.run(Query("lock_webhook", {"id": webhook_id}, first_row))
    if row is not None and row[8] in (None, key_id):
        drop_subscriptions(db, int(row[1]))
        db.run(Query("delete_webhook_row", {"id": webhook_id}, nothing))


def drop_subscriptions(db: Db, serial: int) -> None:
    """Delete the engine subscriptions of the webhook `serial` (batches in flight for
    them then find no position to move)."""
    names: Sequence[Row] = db.run(Query("webhook_subscription_names", {"serial": serial}))
    for (name,) in names:
        delete_subscription(db, name, force=True)


def describe_streams(streams: Iterable[WebhookStream]) -> str:
    parts = []
    for stream in streams:
        filters = [
            f"{what}={','.join(values)}"
            for what, values in (("type", stream.types), ("key", stream.keys))
            if values is not None
        ]
        parts.append(stream.stream + (f" ({'; '.join(filters)})" if filters else ""))
    return ", ".join(parts)


# what the gateway's delivery workers run


@dataclass(frozen=True)
class Deliverable:
    """A webhook whose events are delivered now (active or failing)."""

    id: str
    serial: int
    streams: tuple[WebhookStream, ...]
    max_events: int
    starts: tuple[Start, ...]  # of each stream's engine subscription, as stored


def deliverable() -> Query[list[Deliverable]]:
    def read(result: Result) -> list[Deliverable]:
        return [
            Deliverable(
                row[0],
                int(row[1]),
                tuple(WebhookStream.from_json(s) for s in row[2]),
                row[3],
                tuple(start_from_json(start) for start in row[4]),
            )
            for row in result.rows
        ]

    return Query("deliverable_webhooks", {}, read)


@dataclass(frozen=True)
class DeliveryContext:
    """What a delivery of one batch needs, read just before it is sent."""

    state: str
    callback: str
    secrets: tuple[str, ...]  # the current secret, then the one a rotation replaced
    include_data: bool
    generation: int
    epoch: int
    positions: tuple[int, ...]


def delivery_context(webhook_id: str, name: str) -> Query[DeliveryContext | None]:
    def read(result: Result) -> DeliveryContext | None:
        row = first_row(result)
        if row is None:
            return None
        state, callback, secret, previous, include_data, generation, epoch, positions = row
        kept = (secret,) if previous is None else (secret, previous)
        return DeliveryContext(
            state, callback, kept, include_data, generation, epoch, tuple(positions)
        )

    return Query("delivery_context", {"id": webhook_id, "name": name}, read)


def delivery_succeeded(webhook_id: str, events: int) -> Query[None]:
    return Query("delivery_succeeded", {"id": webhook_id, "events": events}, nothing)


def delivery_failed(webhook_id: str, error: str) -> Query[int | None]:
    """Record a failed delivery; the failed attempts since the last success (None: the
    webhook is no longer delivered)."""

    def read(result: Result) -> int | None:
        row = first_row(result)
        return None if row is None else int(row[0])

    return Query("delivery_failed", {"id": webhook_id, "error": error[:1000]}, read)


@dataclass(frozen=True)
class Challenge:
    id: str
    callback: str
    secret: str
    lease_seconds: int
    attempts: int


def claim_challenges(limit: int, hold: float) -> Query[list[Challenge]]:
    return Query(
        "claim_challenges",
        {"limit": limit, "hold": hold},
        lambda result: [Challenge(*row) for row in result.rows],
    )


def challenge_passed(webhook_id: str) -> Query[None]:
    return Query("challenge_passed", {"id": webhook_id}, nothing)


def challenge_failed(webhook_id: str, error: str, retry_in: float) -> Query[None]:
    params = {"id": webhook_id, "error": error[:1000], "retry_in": retry_in}
    return Query("challenge_failed", params, nothing)


def end_lapsed(db: Db, failure_timeout: float) -> list[tuple[str, str]]:
    """Mark `expired` the webhooks whose lease ran out (their engine subscriptions are
    deleted: nothing is kept for them) and `failed` those pending or failing for longer
    than `failure_timeout` seconds (deliveries stop; pulling still works). The (id, new
    state) of each."""
    ended = []
    with db.transaction():
        rows: Sequence[Row] = db.run(
            Query("webhooks_to_expire", {"failure_timeout": failure_timeout})
        )
        for webhook_id, serial, state in rows:
            if state == "expired":
                drop_subscriptions(db, int(serial))
            db.run(Query("set_webhook_state", {"id": webhook_id, "state": state}, nothing))
            ended.append((webhook_id, state))
    return ended


def next_deadline(failure_timeout: float, keep: float) -> Query[float | None]:
    """Seconds until a webhook's lease runs out, its failure timeout passes, its challenge
    falls due or, expired, it is to be removed, whichever comes first (None: none ever;
    negative: one is due now)."""

    def read(result: Result) -> float | None:
        row = first_row(result)
        return None if row is None or row[0] is None else float(row[0])

    params = {"failure_timeout": failure_timeout, "keep": keep}
    return Query("next_webhook_deadline", params, read)


def forget_expired(keep: float) -> Query[None]:
    return Query("forget_expired_webhooks", {"keep": keep}, nothing)
