"""The HTTP gateway: outside subscribers read streams by cursor, by time, by long-poll and
over server-sent events (DESIGN.md, "The gateway"; the protocol is docs/gateway.md).

`create_app()` is the ASGI application; `subengine serve` runs it with uvicorn.
"""

from subengine.gateway._app import close_all_streams, create_app
from subengine.gateway._http import ApiError
from subengine.gateway._state import Gateway, GatewayConfig
from subengine.model._gateway_cursor import GatewayCursor, InvalidCursor, StreamPosition

__all__ = [
    "ApiError",
    "Gateway",
    "GatewayConfig",
    "GatewayCursor",
    "InvalidCursor",
    "StreamPosition",
    "close_all_streams",
    "create_app",
]
