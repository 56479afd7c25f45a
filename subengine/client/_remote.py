"""Remote workers (docs/remote-workers.md): `RemoteWorker` (threads) and
`AsyncRemoteWorker` (asyncio) take a share of a subscription's partitions through the
gateway, competing with local workers and with each other. Each loop claims a lease
(waiting for one as a long-poll), runs the handler on its events in order while a
heartbeat extends the lease, then acks; a handler's exception nacks the failing event
(the ones before it are acknowledged), which counts an attempt toward the subscription's
remote error policy. Effects are at least once: a lease lost before its ack (a crash, a
missed heartbeat, a reset) hands the same events to another worker, so handlers should
be idempotent, keyed by the event's stable `id`. A worker that learns its lease is lost,
or cannot be sure it still holds it, handles no further event of it: the partition's
next holder may already be handling them, and order per key is kept only if the two do
not overlap (so keep one event's handling well inside the lease's length).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx

from subengine.client._core import refusal
from subengine.client._errors import GatewayError
from subengine.client._http import new_async_client, new_client
from subengine.client._items import Event, event_from_json, tombstone_from_json
from subengine.model._events import Tombstone

log = logging.getLogger("subengine.client.remote")

# After a failed call to the gateway (unreachable, 5xx), a loop waits this long.
_PAUSE_SECONDS = 1.0
# A lease is taken as held until this share of its length after the claim's answer or
# the last extend sent (the gateway's own deadline is a little later: a margin for the
# way of the answer and for clocks).
_SURE_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class Lease:
    """A claimed lease: the batch of one partition after `position` up to `through`
    (`events`, or the `tombstone` of a gap to acknowledge past), held until `deadline`."""

    id: str
    subscription: str
    stream: str
    partition: int
    generation: int
    position: int
    through: int
    deadline: datetime
    events: list[Event]
    tombstone: Tombstone | None


def lease_from_json(body: dict[str, Any]) -> Lease:
    tombstone = body.get("tombstone")
    return Lease(
        id=body["lease"],
        subscription=body["subscription"],
        stream=body["stream"],
        partition=body["partition"],
        generation=body["generation"],
        position=body["position"],
        through=body["through"],
        deadline=datetime.fromisoformat(body["deadline"]),
        events=[event_from_json(event) for event in body["events"]],
        tombstone=None if tombstone is None else tombstone_from_json(tombstone),
    )


class _Protocol:
    """What both workers share: the requests of the protocol and reading their answers."""

    def __init__(
        self,
        base_url: str,
        subscription: str,
        api_key: str | None,
        worker: str | None,
        lease_seconds: float,
        max_events: int | None,
        wait: float,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.subscription = subscription
        self.headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}"
        self.lease_seconds = lease_seconds
        self.max_events = max_events
        self.wait = wait
        self.heartbeat = max(lease_seconds / 3, 0.2)

    def claim_call(self) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "worker": self.worker,
            "lease_seconds": self.lease_seconds,
            "wait": self.wait,
        }
        if self.max_events is not None:
            body["max_events"] = self.max_events
        return f"{self._subscription_url()}/claim", body

    def lease_url(self, lease: Lease, verb: str) -> str:
        return f"{self._subscription_url()}/leases/{lease.id}/{verb}"

    def _subscription_url(self) -> str:
        return f"{self.base_url}/v1/subscriptions/{quote(self.subscription, safe='')}"

    def read_timeout(self) -> float:
        return self.wait + 10.0

    @staticmethod
    def answer(response: httpx.Response) -> dict[str, Any] | None:
        """The JSON of a 2xx answer (None for 204); GatewayError for any other."""
        if response.status_code == 204:
            return None
        if response.is_success:
            body: dict[str, Any] = response.json()
            return body
        raise refusal(response.status_code, response.content)

    @staticmethod
    def failure(event: Event | None, error: BaseException) -> dict[str, Any]:
        body: dict[str, Any] = {"error": f"{type(error).__name__}: {error}"}
        if event is not None:
            body["position"] = event.position
        return body


def _lost(error: GatewayError) -> bool:
    """Whether the gateway said the lease is gone (it expired, ended, or a reset moved
    the position): the batch is someone else's now."""
    return error.status in (404, 409)


class _Hold:
    """What a worker knows of the lease in hand: `held()` until the gateway said it is
    lost, or until the latest time it can be sure of (a share of the lease's length after
    the claim's answer or after an extend that succeeded was sent) passed unrenewed."""

    def __init__(self, lease: Lease, seconds: float) -> None:
        self.lease = lease
        self._seconds = seconds * _SURE_SHARE
        self._until = time.monotonic() + self._seconds
        self._lost = False

    def renewed(self, sent: float) -> None:
        self._until = max(self._until, sent + self._seconds)

    @property
    def lost(self) -> bool:
        """Whether the gateway said so, or the lease was found not surely held."""
        return self._lost

    def lose(self, error: GatewayError) -> None:
        self._lost = True
        log.warning("lease %s of partition %d was lost: %s", self.lease.id,
                    self.lease.partition, error)  # fmt: skip

    def held(self, event: Event | None = None) -> bool:
        if self._lost:
            return False
        if time.monotonic() < self._until:
            return True
        where = "" if event is None else f" before position {event.position}"
        log.warning("lease %s of partition %d was not extended in time; stopping%s",
                    self.lease.id, self.lease.partition, where)  # fmt: skip
        self._lost = True
        return False


class RemoteWorker:
    """A remote worker on threads: `handler(event)` runs for each event of each lease, in
    position order per partition; `gap_handler(tombstone)` (optional) for a gap before
    it is acknowledged. `run()` loops until `stop()`; `run_once()` handles one lease."""

    def __init__(
        self,
        base_url: str,
        subscription: str,
        handler: Callable[[Event], Any],
        *,
        api_key: str | None = None,
        worker: str | None = None,
        lease_seconds: float = 30.0,
        max_events: int | None = None,
        wait: float = 30.0,
        gap_handler: Callable[[Tombstone], Any] | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        self._protocol = _Protocol(
            base_url, subscription, api_key, worker, lease_seconds, max_events, wait
        )
        self._handler = handler
        self._gap_handler = gap_handler
        self._client = client or new_client()
        self._stopping = threading.Event()

    def __enter__(self) -> RemoteWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def stop(self) -> None:
        """Make `run` return after the lease in hand (the next claim is not made)."""
        self._stopping.set()

    def run(self) -> None:
        """Claim, handle and acknowledge leases until `stop()`. A gateway that cannot be
        reached, or answers 5xx, is tried again after a pause; a refusal (a bad key, an
        unknown subscription) raises GatewayError."""
        while not self._stopping.is_set():
            try:
                self.run_once()
            except (httpx.TransportError, GatewayError) as error:
                if isinstance(error, GatewayError) and (error.status or 500) < 500:
                    raise
                log.warning("the gateway failed (%s); trying again", error)
                self._stopping.wait(_PAUSE_SECONDS)

    def run_once(self) -> int:
        """Claim one lease (waiting up to `wait` seconds), handle it and acknowledge it;
        the number of events handled (0 when there was none to claim)."""
        protocol = self._protocol
        url, body = protocol.claim_call()
        response = self._client.post(
            url, json=body, headers=protocol.headers,
            timeout=httpx.Timeout(10.0, read=protocol.read_timeout()),
        )  # fmt: skip
        answer = protocol.answer(response)
        if answer is None:
            return 0
        hold = _Hold(lease_from_json(answer), protocol.lease_seconds)
        done = threading.Event()
        beat = threading.Thread(target=self._beat, args=(hold, done), daemon=True)
        beat.start()
        try:
            return self._handle(hold)
        finally:
            done.set()
            beat.join()

    def _handle(self, hold: _Hold) -> int:
        protocol, lease = self._protocol, hold.lease
        handled = 0
        if lease.tombstone is not None and self._gap_handler is not None:
            try:
                self._gap_handler(lease.tombstone)
            except Exception as error:
                self._post(hold, "nack", protocol.failure(None, error))
                return 0
        for event in lease.events:
            if not hold.held(event):
                return handled
            try:
                self._handler(event)
            except Exception as error:
                log.warning("handler failed on %s/%d/%d: %s", event.stream, event.partition,
                            event.position, error)  # fmt: skip
                self._post(hold, "nack", protocol.failure(event, error))
                return handled
            handled += 1
        if not hold.lost:  # a lease heard lost during the last event is not acked
            self._post(hold, "ack", {})
        return handled

    def _post(self, hold: _Hold, verb: str, body: dict[str, Any]) -> None:
        protocol = self._protocol
        try:
            response = self._client.post(
                protocol.lease_url(hold.lease, verb), json=body, headers=protocol.headers
            )
            protocol.answer(response)
        except GatewayError as error:
            if not _lost(error):
                raise
            hold.lose(error)

    def _beat(self, hold: _Hold, done: threading.Event) -> None:
        """Extend the lease every third of its length until `done`."""
        protocol = self._protocol
        while not done.wait(protocol.heartbeat):
            sent = time.monotonic()
            try:
                response = self._client.post(
                    protocol.lease_url(hold.lease, "extend"),
                    json={"lease_seconds": protocol.lease_seconds},
                    headers=protocol.headers,
                )
                protocol.answer(response)
            except GatewayError as error:
                if _lost(error):
                    hold.lose(error)
                    return
                log.warning("a heartbeat of lease %s failed: %s", hold.lease.id, error)
            except httpx.TransportError as error:
                log.warning("a heartbeat of lease %s failed: %s", hold.lease.id, error)
            except Exception:  # an answer it cannot read: the lease is no longer sure
                log.exception("a heartbeat of lease %s failed", hold.lease.id)
                return
            else:
                hold.renewed(sent)


class AsyncRemoteWorker:
    """`RemoteWorker` for asyncio: `handler(event)` may be a coroutine function (so may
    `gap_handler`); the heartbeat is a task beside it."""

    def __init__(
        self,
        base_url: str,
        subscription: str,
        handler: Callable[[Event], Any],
        *,
        api_key: str | None = None,
        worker: str | None = None,
        lease_seconds: float = 30.0,
        max_events: int | None = None,
        wait: float = 30.0,
        gap_handler: Callable[[Tombstone], Any] | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._protocol = _Protocol(
            base_url, subscription, api_key, worker, lease_seconds, max_events, wait
        )
        self._handler = handler
        self._gap_handler = gap_handler
        self._client = client or new_async_client()
        self._stopping = asyncio.Event()

    async def __aenter__(self) -> AsyncRemoteWorker:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._client.aclose()

    def stop(self) -> None:
        """Make `run` return after the lease in hand."""
        self._stopping.set()

    async def run(self) -> None:
        """Claim, handle and acknowledge leases until `stop()` (see `RemoteWorker.run`)."""
        while not self._stopping.is_set():
            try:
                await self.run_once()
            except (httpx.TransportError, GatewayError) as error:
                if isinstance(error, GatewayError) and (error.status or 500) < 500:
                    raise
                log.warning("the gateway failed (%s); trying again", error)
                await asyncio.sleep(_PAUSE_SECONDS)

    async def run_once(self) -> int:
        """Claim one lease, handle it and acknowledge it; the events handled."""
        protocol = self._protocol
        url, body = protocol.claim_call()
        response = await self._client.post(
            url, json=body, headers=protocol.headers,
            timeout=httpx.Timeout(10.0, read=protocol.read_timeout()),
        )  # fmt: skip
        answer = protocol.answer(response)
        if answer is None:
            return 0
        hold = _Hold(lease_from_json(answer), protocol.lease_seconds)
        beat = asyncio.ensure_future(self._beat(hold))
        try:
            return await self._handle(hold)
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)

    async def _handle(self, hold: _Hold) -> int:
        protocol, lease = self._protocol, hold.lease
        handled = 0
        if lease.tombstone is not None and self._gap_handler is not None:
            try:
                await _call(self._gap_handler, lease.tombstone)
            except Exception as error:
                await self._post(hold, "nack", protocol.failure(None, error))
                return 0
        for event in lease.events:
            if not hold.held(event):
                return handled
            try:
                await _call(self._handler, event)
            except Exception as error:
                log.warning("handler failed on %s/%d/%d: %s", event.stream, event.partition,
                            event.position, error)  # fmt: skip
                await self._post(hold, "nack", protocol.failure(event, error))
                return handled
            handled += 1
        if not hold.lost:
            await self._post(hold, "ack", {})
        return handled

    async def _post(self, hold: _Hold, verb: str, body: dict[str, Any]) -> None:
        protocol = self._protocol
        try:
            response = await self._client.post(
                protocol.lease_url(hold.lease, verb), json=body, headers=protocol.headers
            )
            protocol.answer(response)
        except GatewayError as error:
            if not _lost(error):
                raise
            hold.lose(error)

    async def _beat(self, hold: _Hold) -> None:
        protocol = self._protocol
        while True:
            await asyncio.sleep(protocol.heartbeat)
            sent = time.monotonic()
            try:
                response = await self._client.post(
                    protocol.lease_url(hold.lease, "extend"),
                    json={"lease_seconds": protocol.lease_seconds},
                    headers=protocol.headers,
                )
                protocol.answer(response)
            except GatewayError as error:
                if _lost(error):
                    hold.lose(error)
                    return
                log.warning("a heartbeat of lease %s failed: %s", hold.lease.id, error)
            except httpx.TransportError as error:
                log.warning("a heartbeat of lease %s failed: %s", hold.lease.id, error)
            except Exception:  # an answer it cannot read: the lease is no longer sure
                log.exception("a heartbeat of lease %s failed", hold.lease.id)
                return
            else:
                hold.renewed(sent)


async def _call(function: Callable[[Any], Any], argument: Any) -> None:
    result = function(argument)
    if inspect.isawaitable(result):
        await result
