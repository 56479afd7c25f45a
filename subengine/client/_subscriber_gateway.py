"""The requests a webhook subscriber makes to the gateway (subscribe, cancel, pull), and
the per-partition batches of a page it pulls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httpx

from subengine.client._core import refusal
from subengine.client._deliveries import Batch, first_position
from subengine.client._errors import GatewayError
from subengine.client._http import new_client
from subengine.client._items import Event, event_from_json, tombstone_from_json
from subengine.model._events import Tombstone
from subengine.model._gateway_cursor import GatewayCursor, StreamPosition
from subengine.model._json import loads


class SubscriberGateway:
    """Every request the subscriber makes, to one gateway. A status of 400 or more
    raises GatewayError (a 5xx too: the caller tries again later either way)."""

    def __init__(
        self, base_url: str, api_key: str | None, timeout: float, client: httpx.Client | None
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._headers = {"Accept": "application/json"}
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = timeout
        self._owns_client = client is None
        self._client = client or new_client()

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: Sequence[tuple[str, str]] = (),
        body: Mapping[str, Any] | None = None,
    ) -> httpx.Response:
        response = self._client.request(
            method,
            self._base_url + path,
            params=list(params),
            json=body,
            headers=self._headers,
            timeout=self._timeout,
        )
        if response.status_code >= 400:
            raise refusal(response.status_code, response.content)
        return response

    def stream(self, name: str) -> dict[str, Any]:
        """GET /v1/streams/{name}: its epoch, partitions and the cursor at its heads."""
        answer: dict[str, Any] = self._request("GET", f"/v1/streams/{quote(name, safe='')}").json()
        return answer

    def position_since(self, name: str, since: str) -> StreamPosition:
        """Where a reader of stream `name` stands right before its events recorded after
        `since`: the cursor of a one-event page read since then, with what that page
        holds given back (each item sets its partition back to just before it)."""
        page = self.events(name, [("since", since), ("limit", "1")])
        at = GatewayCursor.decode(str(page["cursor"])).streams[name]
        positions = list(at.positions)
        for gap in page["tombstones"]:
            positions[gap["partition"]] = min(positions[gap["partition"]], gap["gap_from"] - 1)
        for event in page["events"]:
            positions[event["partition"]] = min(
                positions[event["partition"]], event["position"] - 1
            )
        return StreamPosition(at.epoch, tuple(positions))

    def events(self, name: str, params: Sequence[tuple[str, str]]) -> dict[str, Any]:
        """One page of GET /v1/streams/{name}/events."""
        path = f"/v1/streams/{quote(name, safe='')}/events"
        answer: dict[str, Any] = loads(self._request("GET", path, params=params).content)
        return answer

    def subscribe(self, subscription: str, body: Mapping[str, Any]) -> None:
        """PUT /v1/webhooks/{subscription}: create it, or renew its lease."""
        self._request("PUT", f"/v1/webhooks/{quote(subscription, safe='')}", body=body)

    def cancel(self, subscription: str) -> None:
        """DELETE /v1/webhooks/{subscription}; one the gateway does not know is fine."""
        try:
            self._request("DELETE", f"/v1/webhooks/{quote(subscription, safe='')}")
        except GatewayError as error:
            if error.status != 404:
                raise

    def close(self) -> None:
        if self._owns_client:
            self._client.close()


def page_batches(
    name: str, sent: StreamPosition, ends: StreamPosition, page: Mapping[str, Any]
) -> list[Batch]:
    """The batches, one per partition, of a page of stream `name` pulled from `sent` that
    ends at `ends` (in a new epoch, the batches start at its beginning)."""
    starts = sent if ends.epoch == sent.epoch else StreamPosition(ends.epoch)
    per_partition: dict[int, list[Event | Tombstone]] = {}
    for tombstone in map(tombstone_from_json, page["tombstones"]):
        per_partition.setdefault(tombstone.partition, []).append(tombstone)
    for event in map(event_from_json, page["events"]):
        per_partition.setdefault(event.partition, []).append(event)
    return [
        Batch(
            name,
            partition,
            ends.epoch,
            starts.position(partition),
            ends.position(partition),
            tuple(sorted(per_partition.get(partition, ()), key=first_position)),
        )
        for partition in sorted(set(range(len(ends.positions))) | per_partition.keys())
    ]
