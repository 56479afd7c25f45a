"""The webhook endpoints (docs/webhooks.md): subscribe a callback or renew its lease, show
a subscription, cancel it; the deliveries themselves are `_delivery`'s."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from subengine.gateway._auth import Principal
from subengine.gateway._callbacks import check_callback_url
from subengine.gateway._http import (
    NO_STORE,
    ApiError,
    bad_request,
    json_response,
    parse_time,
    read_json_body,
    refuse_unknown_fields,
)
from subengine.gateway._state import Gateway, gateway_of
from subengine.model._declarations import Start
from subengine.model._errors import StreamNotFound
from subengine.model._gateway_cursor import GatewayCursor
from subengine.outside._webhooks import (
    Webhook,
    WebhookDefinition,
    WebhookNotFound,
    streams_of,
    validate_webhook_id,
)

_WEBHOOK_FIELDS = frozenset(
    {
        "callback",
        "streams",
        "start",
        "include_data",
        "max_events",
        "lease_seconds",
        "secret",
        "replaces",
    }
)


async def put_webhook(request: Request) -> Response:
    """Subscribe a callback (pending until it echoes the challenge), or renew the lease
    of the same subscription: 202 when created, 200 when renewed."""
    gateway = gateway_of(request)
    principal = await gateway.auth.principal(request)
    webhook_id = validate_webhook_id(request.path_params["webhook_id"])
    body = await read_json_body(request, gateway.config.max_body_bytes)
    if not isinstance(body, dict):
        raise bad_request('expected {"callback": "...", "streams": {...}, ...}')
    refuse_unknown_fields(body, _WEBHOOK_FIELDS)
    if not isinstance(body.get("callback"), str):
        raise bad_request("callback must be the URL deliveries are posted to")
    callback = check_callback_url(body["callback"])
    streams = streams_of(body.get("streams"))
    for stream in streams:
        principal.require(stream.stream, "read")
    definition = WebhookDefinition(
        callback,
        streams,
        include_data=body.get("include_data", True),
        max_events=body.get("max_events", 100),
        lease_seconds=body.get("lease_seconds", 86_400),
    )
    replaces = body.get("replaces")  # the engine deletes it if it is there and this key's
    starts = {
        s.stream: await _webhook_start(gateway, s.stream, body.get("start", "now")) for s in streams
    }
    # refused now when its name resolves to an address deliveries may not reach; every
    # delivery checks again, on the address it connects to
    await asyncio.to_thread(gateway.callbacks.check_now, callback)
    put = await asyncio.to_thread(
        gateway.sync_engine.put_webhook,
        webhook_id,
        definition,
        starts,
        secret=body.get("secret"),
        replaces=replaces,
        key_id=None if principal.key is None else principal.key.id,
    )
    if gateway.deliveries is not None:
        gateway.deliveries.wake()
    shown = put.webhook.to_json()
    if put.secret is not None:
        shown["secret"] = put.secret
    return json_response(shown, 202 if put.created else 200)


async def _webhook_start(gateway: Gateway, stream: str, start: Any) -> Start:
    """Where a webhook's engine subscription of `stream` starts: "now", "beginning",
    {"after": cursor} (of this stream's epoch) or {"since": time}."""
    if start == "beginning":
        return "beginning"
    if start == "now":
        found = await gateway.engine.epochs_and_heads([stream])
        if stream not in found or found[stream][1] is None:
            raise StreamNotFound(stream)
        return dict(enumerate(found[stream][1] or ()))
    if not isinstance(start, dict) or len(start) != 1 or not set(start) <= {"after", "since"}:
        raise bad_request(
            'start must be "now", "beginning", {"after": "<cursor>"} or {"since": "<time>"}'
        )
    if "since" in start:
        if not isinstance(start["since"], str):
            raise bad_request("since must be an RFC 3339 time")
        _, positions = await gateway.engine.positions_since(
            stream, parse_time(start["since"], "since")
        )
        return dict(enumerate(positions))
    cursor = GatewayCursor.decode(start["after"])
    if stream not in cursor.streams:
        raise ApiError(400, "bad_cursor", f"the cursor has no position in stream {stream!r}")
    at = cursor.streams[stream]
    found = await gateway.engine.epochs_and_heads([stream])
    if stream not in found:
        raise StreamNotFound(stream)
    if found[stream][0] != at.epoch:
        raise ApiError(
            409,
            "reset",
            f"stream {stream!r} was deleted and created again since the cursor was made; "
            "start from the beginning of the new stream",
        )
    return dict(enumerate(at.positions)) if at.positions else "beginning"


async def _owned_webhook(gateway: Gateway, principal: Principal, webhook_id: Any) -> Webhook:
    """The webhook `webhook_id`, if `principal` may see and change it (it was made with
    the same key, or in open mode); WebhookNotFound otherwise (not saying it exists)."""
    webhook_id = validate_webhook_id(webhook_id)
    found = await asyncio.to_thread(gateway.sync_engine.webhook, webhook_id)
    made_by = found.key_id
    if made_by is not None and (principal.key is None or principal.key.id != made_by):
        raise WebhookNotFound(webhook_id)
    return found


async def show_webhook(request: Request) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.auth.principal(request)
    found = await _owned_webhook(gateway, principal, request.path_params["webhook_id"])
    return json_response(found.to_json())


async def delete_webhook(request: Request) -> Response:
    """Cancel a webhook subscription: nothing more is sent under its id."""
    gateway = gateway_of(request)
    principal = await gateway.auth.principal(request)
    found = await _owned_webhook(gateway, principal, request.path_params["webhook_id"])
    await asyncio.to_thread(gateway.sync_engine.delete_webhook, found.id)
    if gateway.deliveries is not None:
        gateway.deliveries.wake()
    return Response(status_code=204, headers={"Cache-Control": NO_STORE})
