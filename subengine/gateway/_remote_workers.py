"""The endpoints of remote workers (docs/remote-workers.md): claim a lease on a partition
of a subscription (waiting for one, as a long-poll), then ack, extend, release or nack it.
A key needs the `consume` scope on the subscription's stream.

A waiting claim tries again whenever a notification says its stream grew (push only
wakes) and at least every second (a lease that expired or was released, a retry that
came due: polling keeps it correct).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from subengine.gateway._http import (
    NO_STORE,
    bad_request,
    json_response,
    read_body,
    refuse_unknown_fields,
)
from subengine.gateway._hub import Watcher, dumps, event_json
from subengine.gateway._state import Gateway, gateway_of
from subengine.model._errors import InvalidInput
from subengine.model._names import validate_stream_name
from subengine.outside._remote_leases import (
    DEFAULT_LEASE_SECONDS,
    Lease,
    parse_lease_id,
    validate_lease_seconds,
    validate_worker_name,
)

# A waiting claim looks again at least this often, whatever notifications say.
CLAIM_POLL_SECONDS = 1.0

_CLAIM_FIELDS = frozenset({"worker", "lease_seconds", "max_events", "wait"})


async def claim(request: Request) -> Response:
    """A lease with its batch (200), or 204 when no partition is free by the end of
    `wait` seconds (default 0: answer at once)."""
    gateway = gateway_of(request)
    name, stream = await _subscription(gateway, request)
    body = await _body(request, gateway, _CLAIM_FIELDS)
    worker = validate_worker_name(body.get("worker", "remote"))
    seconds = validate_lease_seconds(body.get("lease_seconds", DEFAULT_LEASE_SECONDS))
    max_events = body.get("max_events")
    wait = body.get("wait", 0)
    if isinstance(wait, bool) or not isinstance(wait, int | float):
        raise bad_request(f"wait must be a number of seconds, not {dumps(wait)[:32]}")
    if not 0 <= wait <= gateway.config.max_wait:
        raise bad_request(f"wait must be from 0 to {gateway.config.max_wait:g} seconds")
    take = functools.partial(gateway.sync_engine.claim_lease, name, worker, seconds, max_events)
    lease = await asyncio.to_thread(take)
    if lease is None and wait > 0:
        lease = await _wait(gateway, request, stream, take, float(wait))
    if lease is None:
        return Response(status_code=204, headers={"Cache-Control": NO_STORE})
    return json_response(lease_json(lease))


async def ack(request: Request) -> Response:
    """Acknowledge the lease's batch up to `position` (default: all of it); 409 when
    the lease is stale (nothing changes)."""
    gateway = gateway_of(request)
    name, _ = await _subscription(gateway, request)
    lease_id = _lease_id(request)
    body = await _body(request, gateway, {"position"})
    position = await asyncio.to_thread(
        gateway.sync_engine.ack_lease, name, lease_id, body.get("position")
    )
    return json_response({"lease": str(lease_id), "position": position})


async def extend(request: Request) -> Response:
    """Move the lease's deadline to `lease_seconds` from now (a heartbeat)."""
    gateway = gateway_of(request)
    name, _ = await _subscription(gateway, request)
    lease_id = _lease_id(request)
    body = await _body(request, gateway, {"lease_seconds"})
    seconds = validate_lease_seconds(body.get("lease_seconds", DEFAULT_LEASE_SECONDS))
    deadline = await asyncio.to_thread(gateway.sync_engine.extend_lease, name, lease_id, seconds)
    return json_response({"lease": str(lease_id), "deadline": deadline.isoformat()})


async def release(request: Request) -> Response:
    """End the lease without acknowledging anything; its partition is free at once."""
    gateway = gateway_of(request)
    name, _ = await _subscription(gateway, request)
    lease_id = _lease_id(request)
    await _body(request, gateway, set())
    await asyncio.to_thread(gateway.sync_engine.release_lease, name, lease_id)
    return json_response({"lease": str(lease_id), "released": True})


async def nack(request: Request) -> Response:
    """Event `position` (default: the batch's first) failed with `error`: the events
    before it are acknowledged, and an attempt counts toward the remote error policy."""
    gateway = gateway_of(request)
    name, _ = await _subscription(gateway, request)
    lease_id = _lease_id(request)
    body = await _body(request, gateway, {"error", "position", "retry_after"})
    error = body.get("error", "nacked")
    failure = await asyncio.to_thread(
        gateway.sync_engine.nack_lease,
        name,
        lease_id,
        error,
        body.get("position"),
        body.get("retry_after"),
    )
    answer: dict[str, Any] = {
        "lease": str(lease_id),
        "attempts": failure.attempts,
        "action": failure.action,
    }
    if failure.key is not None:
        answer["key"] = failure.key
    return json_response(answer)


def lease_json(lease: Lease) -> str:
    """A lease as the claim answers it, its events as the gateway writes events."""
    head = {
        "lease": str(lease.id),
        "subscription": lease.subscription,
        "stream": lease.stream,
        "partition": lease.partition,
        "worker": lease.worker,
        "generation": lease.generation,
        "position": lease.position,
        "through": lease.through,
        "deadline": lease.deadline.isoformat(),
        "tombstone": None
        if lease.gap is None
        else {
            "stream": lease.gap.stream,
            "partition": lease.gap.partition,
            "gap_from": lease.gap.gap_from,
            "gap_to": lease.gap.gap_to,
            "floor": lease.gap.floor,
            "reason": lease.gap.reason,
            "head": lease.gap.head,
        },
    }
    events = ",".join(event_json(event) for event in lease.events)
    return f'{dumps(head)[:-1]},"events":[{events}]}}'


async def _subscription(gateway: Gateway, request: Request) -> tuple[str, str]:
    """The subscription the path names and its stream, once the caller may consume it."""
    principal = await gateway.auth.principal(request)
    try:
        name = validate_stream_name(request.path_params["name"])
    except InvalidInput as error:
        raise bad_request(str(error), "bad_subscription_name") from None
    remote = await asyncio.to_thread(gateway.sync_engine.remote_subscription, name)
    principal.require(remote.stream, "consume")
    return name, remote.stream


def _lease_id(request: Request) -> Any:
    try:
        return parse_lease_id(request.path_params["lease"])
    except InvalidInput as error:
        raise bad_request(str(error), "bad_lease_id") from None


async def _body(request: Request, gateway: Gateway, known: set[str] | frozenset[str]) -> Any:
    """The request's JSON object (an empty body is {}), refused when it names an
    unknown field."""
    raw = await read_body(request, gateway.config.max_body_bytes)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad_request("the body is not JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    refuse_unknown_fields(body, known)
    return body


async def _wait(
    gateway: Gateway, request: Request, stream: str, take: Any, wait: float
) -> Lease | None:
    """Claim again when the stream grows, or every CLAIM_POLL_SECONDS, until a lease is
    taken, `wait` ends, the client leaves or the gateway shuts down."""
    deadline = time.monotonic() + wait
    watcher = Watcher({stream: None})
    gateway.hub.add(watcher)
    gone = asyncio.ensure_future(_disconnected(request))
    closing = asyncio.ensure_future(gateway.closing.wait())
    try:
        while True:
            now = time.monotonic()
            if now >= deadline or gone.done() or closing.done():
                return None
            woken = asyncio.ensure_future(watcher.event.wait())
            try:
                await asyncio.wait(
                    {woken, gone, closing},
                    timeout=min(deadline - now, CLAIM_POLL_SECONDS),
                    return_when="FIRST_COMPLETED",
                )
            finally:
                woken.cancel()
            if gone.done() or closing.done():
                return None
            watcher.take()  # what moves from now on wakes the next wait
            lease: Lease | None = await asyncio.to_thread(take)
            if lease is not None:
                return lease
    finally:
        gone.cancel()
        closing.cancel()
        gateway.hub.remove(watcher)


async def _disconnected(request: Request) -> None:
    """Return once the client has disconnected (its body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
