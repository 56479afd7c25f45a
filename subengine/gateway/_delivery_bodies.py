"""What a webhook delivery sends (docs/webhooks.md, "Deliveries"): its body, made as bytes
with the events' JSON spliced in as it comes (from PostgreSQL, see `claim_batch`), its
webhook-id, its Standard Webhooks signature over those bytes, and the trace context it
carries on (docs/tracing.md).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import time
from collections.abc import Sequence
from typing import Any

import orjson

from subengine.model._events import Event
from subengine.model._gateway_cursor import GatewayCursor, StreamPosition
from subengine.model._tracing import carried_context, tracing_installed

USER_AGENT = "subengine-webhooks/1"


def message_id(
    serial: int, stream: str, partition: int, generation: int, after: int, through: int
) -> str:
    """The webhook-id of a batch: the same for every attempt to send it, wherever it is
    sent from. Its bounds are stored when the engine first reads it (at_least_once), so
    a batch sent again, after a failure or a crash, covers the same positions."""
    text = f"{serial}/{stream}/{partition}/{generation}/{after}/{through}"
    return "msg_" + hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=256)
def _key_bytes(secret: str) -> bytes:
    """The HMAC key of a `whsec_` secret, as Standard Webhooks reads it."""
    return base64.b64decode(secret.removeprefix("whsec_") + "==")


def signed_headers(message: str, body: bytes, keys: Sequence[str]) -> dict[str, str]:
    """Standard Webhooks headers for `body`, signed with every key (during a rotation a
    receiver may know only one of them): "v1," and the base64 of the HMAC-SHA256 of
    "<id>.<timestamp>.<body>" (the body as sent, UTF-8)."""
    timestamp = str(int(time.time()))
    signed = f"{message}.{timestamp}.".encode() + body
    signatures = " ".join(
        "v1,"
        + base64.b64encode(hmac.new(_key_bytes(key), signed, hashlib.sha256).digest()).decode()
        for key in keys
    )
    return {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": message,
        "webhook-timestamp": timestamp,
        "webhook-signature": signatures,
    }


_BODY = (
    b'{"type":"events","subscription":%b,"generation":%d,"stream":%b,"partition":%d,'
    b'"after":%d,"through":%d,"events":[%b],"tombstones":[%b],"cursor":%b}'
)


def batch_body(
    subscription: str,
    generation: int,
    stream: str,
    partition: int,
    after: int,
    through: int,
    events: bytes,
    tombstones: bytes,
    cursor: str,
) -> bytes:
    """A delivery's body (docs/webhooks.md, "Deliveries"), its events and tombstones given
    as JSON already, each list's items joined with commas."""
    return _BODY % (
        orjson.dumps(subscription),
        generation,
        orjson.dumps(stream),
        partition,
        after,
        through,
        events,
        tombstones,
        orjson.dumps(cursor),
    )


def batch_cursor(
    stream: str, epoch: int, positions: Sequence[int], partition: int, through: int
) -> str:
    """The cursor a delivery carries: the stream with the batch's partition at `through`
    and the others where the subscription stands."""
    moved = list(positions)
    if partition < len(moved):
        moved[partition] = through
    return GatewayCursor({stream: StreamPosition(epoch, tuple(moved))}).encode()


def event_body(event: Event, include_data: bool) -> dict[str, Any]:
    """An event as the gateway's pull API shows it."""
    body: dict[str, Any] = {
        "id": str(event.id),
        "stream": event.stream,
        "partition": event.partition,
        "position": event.position,
        "type": event.type,
        "key": event.key,
        "key_version": event.key_version,
        "occurred_at": event.occurred_at.isoformat(),
        "recorded_at": event.recorded_at.isoformat(),
        "metadata": event.metadata,
    }
    if include_data:
        body["data"] = event.data
    return body


_TRACEPARENT_KEY = b'"traceparent"'


def trace_headers(body: bytes) -> dict[str, str]:
    """The W3C trace context headers of a delivery (docs/tracing.md): those of its first
    event whose metadata carries one, where OpenTelemetry is installed; none otherwise.
    The body is decoded only when it names a traceparent at all."""
    if _TRACEPARENT_KEY not in body or not tracing_installed():
        return {}
    for event in orjson.loads(body)["events"]:
        metadata = event.get("metadata")
        context = carried_context(metadata) if isinstance(metadata, dict) else None
        if context is not None:
            return context
    return {}
