"""What an operator does from the status page (docs/status-page.md): pause and resume a
subscription, accept a partition's gap, retry or discard a dead letter or a parked key.
Each needs the `admin` scope on the subscription's stream (anyone, on an open gateway),
comes from a page the gateway served (its origin and anti-forgery token), changes the
database as the command line's twin does, says what it did, and is logged (who, what;
never a token).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from subengine.gateway._auth import Denied, Principal
from subengine.gateway._http import ApiError, bad_request, json_response, read_json_body
from subengine.gateway._ui_page import CSRF_HEADER, StatusPage, from_own_origin, status_page_of
from subengine.model._errors import InvalidInput, SubscriptionNotFound
from subengine.model._names import BIGINT_MAX, INTEGER_MAX, validate_key, validate_stream_name
from subengine.subscriptions._parking import ParkedKeyRetry

log = logging.getLogger("subengine.gateway")

ACTIONS = ("pause", "resume", "skip_gap", "retry", "discard", "retry_parked", "discard_parked")
# what each action needs besides the subscription
_NEEDS = {
    "pause": (),
    "resume": (),
    "skip_gap": ("partition",),
    "retry": ("partition", "position"),
    "discard": ("partition", "position"),
    "retry_parked": ("key",),
    "discard_parked": ("key",),
}
_BODY_BYTES = 4096


async def act(request: Request) -> Response:
    """`POST /ui/api/actions` with `{"action": ..., "subscription": ..., "partition":
    ..., "position": ..., "key": ...}`: `{"message": what it did, "ok": whether it did
    it}`."""
    page = status_page_of(request)
    if "authorization" not in request.headers:
        # a browser's request: it must come from a page of this gateway
        await _check_from_the_page(page, request)
    principal = await page.principal(request)
    body = await read_json_body(request, _BODY_BYTES)
    action, name, partition, position, key = _parse(body)
    stream = await _stream_of(page, name)
    if not principal.may(stream, "admin"):
        raise Denied(
            403,
            "forbidden",
            f"this key may not change subscription {name!r}: that needs the admin scope "
            f"on stream {stream!r}",
        )
    ok, message = await asyncio.to_thread(_run, page, action, name, partition, position, key)
    log.info("status page: %s: %s", _who(principal), message)
    page.refresher.poke()
    return json_response({"message": message, "ok": ok})


async def _check_from_the_page(page: StatusPage, request: Request) -> None:
    """Refuse a request that a page of another site could have sent: its origin must be
    the gateway's own, and it must carry the page's anti-forgery token (a header, which a
    form or a cross-site request without the gateway's consent cannot set)."""
    if not from_own_origin(request):
        raise Denied(403, "forbidden", "an action must come from the status page itself")
    expected = await page.csrf_token(request)
    given = request.headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(given.encode(errors="replace"), expected.encode()):
        raise Denied(403, "forbidden", "the page's token is missing or stale: reload the page")


def _parse(body: Any) -> tuple[str, str, int, int, str]:
    """The action, subscription, partition, position and key (0 or '' where the action
    needs none)."""
    if not isinstance(body, dict):
        raise bad_request('expected {"action": ..., "subscription": ...}')
    action = body.get("action")
    if action not in ACTIONS:
        raise bad_request(f"action must be one of {', '.join(ACTIONS)}")
    known = {"action", "subscription", *_NEEDS[action]}
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r} for action {action!r}")
    name = body.get("subscription")
    if not isinstance(name, str):
        raise bad_request("subscription must be a subscription's name")
    try:
        validate_stream_name(name)
    except InvalidInput as error:
        raise bad_request(f"subscription: {error}") from None
    numbers = {"partition": 0, "position": 0}
    for field, low, high in (("partition", 0, INTEGER_MAX), ("position", 1, BIGINT_MAX)):
        if field in _NEEDS[action]:
            value = body.get(field)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise bad_request(f"{field} must be a whole number from {low} to {high}")
            numbers[field] = value
    key = ""
    if "key" in _NEEDS[action]:
        try:
            key = validate_key(body.get("key"))
        except InvalidInput as error:
            raise bad_request(str(error)) from None
    return action, name, numbers["partition"], numbers["position"], key


async def _stream_of(page: StatusPage, name: str) -> str:
    for stored in await page.gateway.engine.subscriptions():
        if stored.name == name:
            return stored.stream
    raise ApiError(404, "subscription_not_found", f"no subscription named {name!r}")


def _run(
    page: StatusPage, action: str, name: str, partition: int, position: int, key: str
) -> tuple[bool, str]:
    """Do `action` (in a thread: the engine's operations are synchronous); whether it
    was done, and what was done, in the command line's words."""
    engine = page.gateway.sync_engine
    try:
        if action == "pause":
            engine.pause_subscription(name)
            return True, f"paused subscription {name!r}"
        if action == "resume":
            restarted = engine.resume_subscription(name)
            note = f"; restarted stopped partitions {', '.join(map(str, restarted))}"
            return True, f"resumed subscription {name!r}{note if restarted else ''}"
        if action == "skip_gap":
            gap = engine.skip_gap(name, partition)
            return True, f"subscription {name!r} skipped the {gap}; it goes on from {gap.floor}"
        if action == "discard_parked":
            discarded = engine.discard_parked_key(name, key)
            return (
                True,
                f"discarded: {discarded} event(s) of key {key!r} of {name!r}; the key is clear",
            )
        where = f"partition {partition} position {position} of {name!r}"
        if action == "discard":
            engine.discard_dead_letter(name, partition, position)
            return True, f"discarded the dead letter at {where}"
        declared = page.app().subscriptions.get(name)
        if declared is None:
            raise InvalidInput(
                f"the gateway's --app {page.app_spec} declares no subscription {name!r}"
            )
        if action == "retry_parked":
            return _retried_key(engine.retry_parked_key(declared, key), name, key)
        error = engine.retry_dead_letter(declared, partition, position)
    except SubscriptionNotFound as error:
        raise ApiError(404, "subscription_not_found", str(error)) from None
    if error is not None:
        return False, f"the handlers failed again at {where} (recorded): {error}"
    return True, f"retried the dead letter at {where}: it is handled"


def _retried_key(result: ParkedKeyRetry, name: str, key: str) -> tuple[bool, str]:
    """What a retry of a parked key did, in `subengine parked retry`'s words."""
    before = f"{result.replayed} event(s) were replayed before it"
    if result.error is not None:
        return False, (
            f"the handlers failed again (recorded; key {key!r} stays parked): "
            f"{result.error}; {before}"
        )
    if result.superseded:
        return False, (
            f"a reset released key {key!r} of {name!r} during the retry: the workers handle "
            f"its events from the reset's positions; {before}"
        )
    return True, (
        f"retried: {result.replayed} event(s) of key {key!r} of {name!r} handled in order; "
        "the key is clear"
    )


def _who(principal: Principal) -> str:
    key = principal.key
    if key is None:
        return "open gateway"
    return f"key {key.id}" + (f" ({key.name})" if key.name else "")
