"""The watch endpoints: a watch is one event stream of several streams, created by a POST
and opened by its id, an expiring HMAC-signed token that stands for the key that made it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from subengine.gateway._auth import Denied, Principal
from subengine.gateway._connections import ANONYMOUS, WATCH
from subengine.gateway._http import (
    ApiError,
    bad_request,
    json_response,
    parse_stream_name,
    read_json_body,
    refuse_unknown_fields,
)
from subengine.gateway._reading import Selection
from subengine.gateway._sse_response import (
    EventStreamResponse,
    open_event_stream,
    released_on_error,
)
from subengine.gateway._state import Gateway, gateway_of
from subengine.model._errors import InvalidInput
from subengine.model._event_fields import (
    ALL_FIELDS,
    WITHOUT_DATA,
    fields_of,
    fields_text,
    read_fields,
    split_fields,
)
from subengine.model._gateway_cursor import GatewayCursor, StreamPosition
from subengine.model._names import validate_key, validate_type


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


async def create_watch(request: Request) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.auth.principal(request)
    body = await read_json_body(request, gateway.config.max_body_bytes)
    if not isinstance(body, dict) or not isinstance(body.get("streams"), dict):
        raise bad_request('expected {"streams": {"<stream>": {...}, ...}}')
    streams = body["streams"]
    if not streams:
        raise bad_request("a watch needs at least one stream")
    if len(streams) > gateway.config.max_streams_per_watch:
        # not 429: the same request would never succeed, so nothing invites a retry
        raise bad_request(
            f"a watch has at most {gateway.config.max_streams_per_watch} streams; "
            "split these into several watches",
            "too_many_streams",
        )
    refuse_unknown_fields(body, ("streams", "heartbeat"))
    heartbeat = body.get("heartbeat", gateway.config.heartbeat)
    if not isinstance(heartbeat, int | float) or not 1 <= heartbeat <= 60:
        raise bad_request("heartbeat must be a number of seconds from 1 to 60")
    spec = []
    named: dict[str, str] = {}  # the fields of streams that `include_data` cannot say
    positions: dict[str, StreamPosition] = {}
    for name, options in streams.items():
        parse_stream_name(name)
        principal.require(name, "read")
        if not isinstance(options, dict):
            raise bad_request(f"the options of stream {name!r} must be an object")
        unknown = set(options) - {"after", "since", "key", "type", "include_data", "fields"}
        if unknown:
            raise bad_request(f"unknown option {sorted(unknown)[0]!r} for stream {name!r}")
        keys = _list_option(options, "key", name, validate_key)
        types = _list_option(options, "type", name, validate_type)
        include_data = options.get("include_data")
        if "include_data" in options and not isinstance(include_data, bool):
            raise bad_request(f"include_data of stream {name!r} must be true or false")
        names = options.get("fields")
        if names is not None and (
            not isinstance(names, list) or not all(isinstance(each, str) for each in names)
        ):
            raise bad_request(f"fields of stream {name!r} must be a list of field names")
        try:
            fields = read_fields(names, include_data)
        except InvalidInput as error:
            raise bad_request(f"stream {name!r}: {error}") from None
        after, since = options.get("after"), options.get("since")
        if after is not None and since is not None:
            raise bad_request(f"give stream {name!r} either after or since, not both")
        if not isinstance(after, str | None) or not isinstance(since, str | None):
            raise bad_request(f"after and since of stream {name!r} must be strings")
        positions[name] = await gateway.resolve(name, after, since)
        # [name, keys, types, include_data], as gateways before `fields` read it
        spec.append([name, keys, types, "data" in fields])
        if fields not in (ALL_FIELDS, WITHOUT_DATA):
            named[name] = fields_text(fields)
    expires = int(time.time() + gateway.config.watch_ttl)
    payload: dict[str, Any] = {
        "k": None if principal.key is None else principal.key.id,
        "x": expires,
        "h": heartbeat,
        "s": spec,
        "c": GatewayCursor(positions).encode(),
    }
    if named:
        # apart from the streams' entries: a gateway before `fields` ignores it, and
        # sends such a watch whole events (or all but their data), which hold its fields
        payload["f"] = named
    wid = await _sign(gateway, payload)
    return json_response(
        {
            "wid": wid,
            "url": f"/v1/watch/{wid}",
            "cursor": payload["c"],
            "expires_at": datetime.fromtimestamp(expires).astimezone().isoformat(),
        },
        201,
    )


def _list_option(options: dict[str, Any], what: str, stream: str, validate: Any) -> Any:
    value = options.get(what)
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(f"{what} of stream {stream!r} must be a non-empty list of strings")
    try:
        return sorted({validate(item) for item in value})
    except InvalidInput as error:
        raise bad_request(f"{what} of stream {stream!r}: {error}") from None


async def _signing_key(gateway: Gateway) -> bytes:
    secret: bytes = await gateway.engine.signing_secret("watch")
    return secret


async def _mac(gateway: Gateway, body: str) -> bytes:
    return hmac.new(await _signing_key(gateway), body.encode(), hashlib.sha256).digest()


async def _sign(gateway: Gateway, payload: dict[str, Any]) -> str:
    body = _b64(json.dumps(payload, separators=(",", ":")).encode())
    return f"w1.{body}.{_b64(await _mac(gateway, body))}"


async def _verify(gateway: Gateway, wid: str) -> dict[str, Any]:
    parts = wid.split(".")
    if len(parts) != 3 or parts[0] != "w1" or len(wid) > 32_768:
        raise ApiError(404, "watch_not_found", "no such watch (malformed id)")
    _, body, mac = parts
    expected = await _mac(gateway, body)
    try:
        given = _unb64(mac)
        payload = json.loads(_unb64(body))
    except ValueError:
        raise ApiError(404, "watch_not_found", "no such watch (malformed id)") from None
    if not hmac.compare_digest(expected, given):
        raise ApiError(404, "watch_not_found", "no such watch (bad signature)")
    if not isinstance(payload, dict) or payload.get("x", 0) < time.time():
        raise ApiError(410, "watch_expired", "the watch has expired: create a new one")
    return payload


async def open_watch(request: Request) -> Response | EventStreamResponse:
    gateway = gateway_of(request)
    payload = await _verify(gateway, request.path_params["wid"])
    selections = {
        name: Selection(
            name,
            None if keys is None else frozenset(keys),
            None if types is None else frozenset(types),
            _fields(include_data, payload.get("f", {}).get(name)),
        )
        for name, keys, types, include_data in payload["s"]
    }
    principal = await _watch_principal(gateway, request, payload.get("k"))
    for name in selections:
        principal.require(name, "read")
    last_event_id = request.headers.get("last-event-id") or request.query_params.get("after")
    cursor = GatewayCursor.decode(last_event_id or payload["c"])
    if set(cursor.streams) != set(selections):
        raise ApiError(400, "bad_cursor", "the cursor does not name the watch's streams")
    slot = gateway.connections.admit(WATCH, principal.id)
    with released_on_error(slot):
        return await open_event_stream(
            gateway, selections, dict(cursor.streams), payload["h"], principal, slot
        )


async def _watch_principal(gateway: Gateway, request: Request, key_id: Any) -> Principal:
    """Who reads a watch: the key that created it, still active. The watch id stands
    for it (a browser's EventSource cannot send a header); a key sent along must be
    that one."""
    if request.headers.get("authorization") is not None:
        principal = await gateway.auth.principal(request)
        if principal.id != (key_id or ANONYMOUS):
            raise Denied(403, "forbidden", "this watch was created with another key")
        return principal
    if key_id is None:
        if await gateway.auth.required():
            raise Denied(
                401,
                "unauthorized",
                "this watch was created without a key, and the "
                "gateway now needs one: create a new watch",
            )
        # as any request without a key: open mode, from this host only
        return await gateway.auth.principal(request)
    key = await gateway.auth.key_by_id(str(key_id))
    if key is None:
        raise Denied(403, "forbidden", "the key that created this watch was revoked")
    return Principal(key)


def _fields(include_data: bool, named: str | None) -> frozenset[str]:
    """The fields of a watch's stream: those its id names apart, or what its entry's
    `include_data` says."""
    if named is not None:
        return fields_of(split_fields([named]))
    return ALL_FIELDS if include_data else WITHOUT_DATA
