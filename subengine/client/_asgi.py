"""The webhook subscriber as an ASGI app: it reads a POSTed delivery, hands it to the
subscriber in a worker thread, and sends back the subscriber's answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import anyio.to_thread

# the largest delivery the ASGI app reads; a larger one is answered 413
MAX_BODY_BYTES = 4 * 1024 * 1024
# what the ASGI app asks the gateway to wait before retrying a delivery answered 503
_RETRY_AFTER_SECONDS = "5"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# a delivery's raw body and headers in, (status, response body) out
Answer = Callable[[bytes, Mapping[str, str]], tuple[int, bytes]]


async def serve_deliveries(scope: Scope, receive: Receive, send: Send, answer: Answer) -> None:
    """Serve one ASGI connection: POSTs are deliveries, answered by `answer`."""
    if scope["type"] == "lifespan":
        while True:
            event = await receive()
            if event["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif event["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    if scope["method"] != "POST":
        await _respond(send, 405, b"")
        return
    body = bytearray()
    while True:
        event = await receive()
        if event["type"] == "http.disconnect":
            return
        body += event.get("body", b"")
        if len(body) > MAX_BODY_BYTES:
            await _respond(send, 413, b"")
            return
        if not event.get("more_body", False):
            break
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
    status, reply = await anyio.to_thread.run_sync(answer, bytes(body), headers)
    await _respond(send, status, reply)


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if body:
        headers.append((b"content-type", b"application/json"))
    if status == 503:
        headers.append((b"retry-after", _RETRY_AFTER_SECONDS.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
