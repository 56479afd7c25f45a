"""How an open status page follows the snapshots: an event stream (SSE) that sends the
view the page shows at every new version, or, for a client behind a proxy that cuts
event streams, a long-poll that answers with the next version (docs/status-page.md).

Neither reads the database: both wait on the process's one refresher. An event stream
holds a place in the limits as the gateway's other event streams do, is ended by the
server's shutdown and by a slow socket, and closes when its key is revoked.
"""

from __future__ import annotations

import asyncio
import random
import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Send

from subengine.gateway._auth import Principal
from subengine.gateway._connections import LONG_POLL, SSE, Slot
from subengine.gateway._http import NO_STORE, bad_request, parse_number, parse_whole
from subengine.gateway._sse import Blocked, EventStream, Gone, HeldOpen, frame_text
from subengine.gateway._sse_response import close_frame
from subengine.gateway._ui_page import StatusPage, status_page_of
from subengine.gateway._ui_refresher import PageWake
from subengine.gateway._ui_views import SUBSCRIPTION, VIEWS, Visibility
from subengine.model._names import validate_stream_name

SNAPSHOT = "snapshot"
_LONG_POLL_WAIT = 25.0


def _view(request: Request) -> tuple[str, str | None]:
    params = request.query_params
    name = params.get("view", "overview")
    if name not in VIEWS:
        raise bad_request(f"view must be one of {', '.join(VIEWS)}, not {name[:32]!r}")
    if name != SUBSCRIPTION:
        return name, None
    subscription = params.get("name")
    if subscription is None:
        raise bad_request("the subscription view needs name=<subscription>")
    try:
        return name, validate_stream_name(subscription)
    except Exception as error:
        raise bad_request(f"name: {error}") from None


async def live(request: Request) -> LiveResponse:
    """`GET /ui/api/live?view=...`: the view's content at every new snapshot, as SSE
    frames `snapshot`, until the client leaves, the stream's lifetime ends (`close`
    frame `rotate`: EventSource comes back by itself) or the server stops."""
    page = status_page_of(request)
    principal = await page.principal(request)
    name, subscription = _view(request)
    slot = page.gateway.connections.admit(SSE, principal.id)
    return LiveResponse(page, principal, name, subscription, slot)


class LiveResponse(HeldOpen):
    def __init__(
        self,
        page: StatusPage,
        principal: Principal,
        name: str,
        subscription: str | None,
        slot: Slot,
    ) -> None:
        self.page = page
        self.principal = principal
        self.visibility = Visibility(principal.key)
        self.name = name
        self.subscription = subscription
        self.slot = slot

    async def serve(self, receive: Receive, send: Send) -> None:
        gateway = self.page.gateway
        config = gateway.config
        wake = PageWake()
        stream = EventStream(receive, send, wake, config.write_timeout)
        refresher = self.page.refresher
        gateway.open_streams.add(stream)
        gateway.watch_writes()
        refresher.join(wake)
        try:
            if gateway.closing.is_set():
                stream.close()
            await stream.start(
                [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", NO_STORE.encode()),
                    (b"x-accel-buffering", b"no"),
                ]
            )
            await self._write(stream, "retry: 2000\n\n")
            await self._follow(stream, wake)
        except (Gone, Blocked):
            pass
        finally:
            refresher.leave(wake)
            gateway.open_streams.discard(stream)
            self.slot.release()
            await stream.end()

    async def _write(self, stream: EventStream, text: str) -> None:
        before = stream.bytes_sent
        await stream.write(text)
        self.page.gateway.metrics.sent(self.slot.kind, None, stream.bytes_sent - before)

    async def _follow(self, stream: EventStream, wake: PageWake) -> None:
        config = self.page.gateway.config
        ends = time.monotonic() + config.stream_lifetime * random.uniform(0.9, 1.1)
        beat_at = time.monotonic() + config.heartbeat
        sent = 0
        while True:
            wake.clear()
            latest = self.page.refresher.current()
            if latest is not None and latest.version > sent:
                body = latest.encoded(self.visibility, self.name, self.subscription)
                await self._write(stream, frame_text(SNAPSHOT, body.decode(), None))
                sent = latest.version
            now = time.monotonic()
            if stream.closing:
                await self._write(stream, close_frame("shutdown", "the server is shutting down"))
                return
            if now >= ends:
                await self._write(stream, close_frame("rotate", "reconnect to go on"))
                return
            if now >= beat_at:
                if not await self.page.still_allowed(self.principal):
                    await self._write(
                        stream, close_frame("forbidden", "the API key was revoked: sign in again")
                    )
                    return
                await self._write(stream, ": hb\n\n")
                beat_at = now + config.heartbeat
            await stream.wait(min(beat_at, ends) - now)


async def next_snapshot(request: Request) -> Response:
    """`GET /ui/api/snapshot?view=...&after=VERSION&wait=SECONDS`: the view of the first
    snapshot newer than `after`, as soon as there is one; 204 when `wait` ends first."""
    page = status_page_of(request)
    principal = await page.principal(request)
    name, subscription = _view(request)
    params = request.query_params
    after = parse_whole(params.get("after"), "after", 0, 1 << 62, 0)
    wait = parse_number(params.get("wait"), "wait", 0, 60, _LONG_POLL_WAIT)
    slot = page.gateway.connections.admit(LONG_POLL, principal.id)
    refresher = page.refresher
    wake = PageWake()
    refresher.join(wake)
    left = asyncio.ensure_future(_disconnected(request))
    try:
        deadline = time.monotonic() + wait
        while True:
            latest = refresher.current()
            if latest is not None and latest.version > after:
                body = latest.encoded(Visibility(principal.key), name, subscription)
                return Response(
                    body, media_type="application/json", headers={"Cache-Control": NO_STORE}
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0 or left.done() or page.gateway.closing.is_set():
                return Response(status_code=204, headers={"Cache-Control": NO_STORE})
            wake.clear()
            woken = asyncio.ensure_future(wake.wait())
            await asyncio.wait({woken, left}, timeout=remaining, return_when="FIRST_COMPLETED")
            woken.cancel()
    finally:
        left.cancel()
        refresher.leave(wake)
        slot.release()


async def _disconnected(request: Request) -> None:
    """Returns once the client of `request` has left."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
