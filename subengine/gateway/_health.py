"""The endpoints that tell how a gateway process is: alive (`/healthz`), able to read
PostgreSQL (`/readyz`), and its metrics in Prometheus' text format (`/metrics`)."""

from __future__ import annotations

import asyncio

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from subengine.gateway._http import NO_STORE, json_response
from subengine.gateway._state import gateway_of


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def metrics(request: Request) -> Response:
    """The gateway's metrics in Prometheus' text format (docs/gateway.md, "Metrics")."""
    gateway = gateway_of(request)
    return Response(
        generate_latest(gateway.metrics.registry),
        media_type=CONTENT_TYPE_LATEST,
        headers={"Cache-Control": NO_STORE},
    )


async def readyz(request: Request) -> Response:
    gateway = gateway_of(request)
    try:
        await asyncio.wait_for(gateway.read_engine.streams(), 5)
    except Exception:
        return json_response({"status": "unavailable"}, 503, {"Retry-After": "1"})
    return json_response({"status": "ready"})
