"""The Python client of the gateway (DESIGN.md, "The gateway"; docs/gateway.md).

`Reader` (threads) and `AsyncReader` (asyncio) read one stream exactly once across
catch-up and live, resuming by the cursor the caller stores with its own state;
`Reader.watch` and `AsyncReader.watch` read several streams at once; `Subscriber`
receives a webhook subscription's pushes, and pulls when they fail; `RemoteWorker` and
`AsyncRemoteWorker` take a share of a subscription's partitions through leases
(docs/remote-workers.md).
"""

from subengine.client._async import AsyncReader
from subengine.client._core import Reconnect, StreamOptions
from subengine.client._errors import GatewayError
from subengine.client._items import Event, Item, Reset
from subengine.client._remote import AsyncRemoteWorker, Lease, RemoteWorker
from subengine.client._sync import Reader
from subengine.client._webhooks import Subscriber
from subengine.model._events import Tombstone

__all__ = [
    "AsyncReader",
    "AsyncRemoteWorker",
    "Event",
    "GatewayError",
    "Item",
    "Lease",
    "Reader",
    "Reconnect",
    "RemoteWorker",
    "Reset",
    "StreamOptions",
    "Subscriber",
    "Tombstone",
]
