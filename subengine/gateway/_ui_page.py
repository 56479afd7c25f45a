"""The status page's state in a gateway process (docs/status-page.md): its refresher,
who a page's request comes from (the API key in its cookie, or nobody on an open
gateway), the token that proves an action comes from the page itself, and the
application whose handlers a retry of a dead letter runs.

Sign-in puts the API key in an HttpOnly, SameSite=Strict cookie scoped to /ui, so page
scripts never see it and other sites' requests never carry it; it never appears in a
URL. An action also needs the page's anti-forgery token in a header, which only a page
served by the gateway has: an open gateway has no cookie to lean on.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib
import os
import sys
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request

from subengine.engine._status_page import read_status_snapshot
from subengine.gateway._auth import Denied, Principal
from subengine.gateway._state import Gateway, gateway_of
from subengine.gateway._ui_refresher import Refresher
from subengine.model._errors import ConfigurationError

if TYPE_CHECKING:
    from subengine.worker._app import App

COOKIE = "subengine_ui_key"
CSRF_HEADER = "subengine-csrf"
# The name of the signing secret (the gateway's `gateway_secrets` table) the anti-forgery
# tokens are made with, the same in every gateway process of the schema.
_SECRET_NAME = "status_page"


class StatusPage:
    """The status page of one gateway application."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        engine = gateway.engine
        self.refresher = Refresher(lambda: read_status_snapshot(engine), gateway.closing)
        self._secret: bytes | None = None
        self._app: App | None = None
        gateway.metrics.registry.register(_PageCollector(self.refresher))

    # who asks

    async def principal(self, request: Request) -> Principal:
        """The caller: the key of an `Authorization` header, else of the page's cookie,
        else nobody on an open gateway (from its own host, by a loopback name: a page of
        another site that a rebound DNS name points here is refused). Denied (401)
        otherwise."""
        auth = self.gateway.auth
        token = request.cookies.get(COOKIE)
        if "authorization" not in request.headers and token:
            try:
                return await auth.principal(_with_bearer(request, token))
            except Denied:
                if await auth.required():
                    raise Denied(
                        401, "unauthorized", "the API key is unknown or revoked: sign in again"
                    ) from None
        return await auth.principal(request)

    async def still_allowed(self, principal: Principal) -> bool:
        """Whether the page of `principal` may still look (its key was not revoked; an
        open gateway did not get a key)."""
        if principal.key is None:
            return not await self.gateway.auth.required()
        return await self.gateway.auth.key_by_id(principal.key.id) is not None

    # the anti-forgery token

    async def csrf_token(self, request: Request) -> str:
        """The token a page of this cookie (or of an open gateway) sends with an action:
        a MAC of the cookie's key, which pages of other sites can neither read nor make."""
        if self._secret is None:
            self._secret = await self.gateway.engine.signing_secret(_SECRET_NAME)
        subject = request.cookies.get(COOKIE) or "open"
        mac = hmac.new(self._secret, b"status-page:" + subject.encode(), hashlib.sha256)
        return base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode()

    # retries of dead letters

    @property
    def app_spec(self) -> str | None:
        return self.gateway.config.ui_app

    def app(self) -> App:
        """The application named by `--app` (for the handlers of a retry), imported once."""
        if self._app is None:
            if self.app_spec is None:
                raise ConfigurationError(
                    "a retry runs the subscription's handlers: start the gateway with "
                    "--app MODULE:ATTR, or run `subengine dead-letters retry ... --app ...`"
                )
            self._app = load_app(self.app_spec)
        return self._app

    async def close(self) -> None:
        await self.refresher.close()


def load_app(spec: str) -> App:
    """The `App` named by `MODULE:ATTR`, importable from the current directory."""
    from subengine.worker._app import App

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"--app {spec!r} is not MODULE:ATTR")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ConfigurationError(
            f"--app {spec}: cannot import {module_name!r}: {type(error).__name__}: {error}"
        ) from None
    app = getattr(module, attribute, None)
    if not isinstance(app, App):
        raise ConfigurationError(f"--app {spec}: {attribute!r} is not a subengine.App")
    return app


_pages: weakref.WeakKeyDictionary[Gateway, StatusPage] = weakref.WeakKeyDictionary()


def status_page_of(request: Request) -> StatusPage:
    """The status page of the request's gateway, made on first use."""
    gateway = gateway_of(request)
    page = _pages.get(gateway)
    if page is None:
        page = _pages[gateway] = StatusPage(gateway)
    return page


async def close_status_page(gateway: Gateway) -> None:
    page = _pages.pop(gateway, None)
    if page is not None:
        await page.close()


def from_own_origin(request: Request) -> bool:
    """Whether a browser sent `request` from a page of the gateway's own host: its
    `Origin` names the host the request was sent to (the scheme is not compared, so that
    a proxy may end TLS in front of the gateway), and `Sec-Fetch-Site`, where the browser
    sends it, says same-origin. A page of another site can forge neither."""
    origin = request.headers.get("origin", "")
    scheme, _, host = origin.partition("://")
    site = request.headers.get("sec-fetch-site")
    return (
        scheme in ("http", "https")
        and bool(host)
        and host == request.headers.get("host")
        and site in (None, "same-origin")
    )


def _with_bearer(request: Request, token: str) -> Request:
    headers = [(name, value) for name, value in request.scope["headers"] if name != b"cookie"]
    headers.append((b"authorization", b"Bearer " + token.encode(errors="replace")))
    return Request({**request.scope, "headers": headers})


class _PageCollector(Collector):
    """The status page's counts at /metrics, read when scraped."""

    def __init__(self, refresher: Refresher) -> None:
        self._refresher = refresher

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "subengine_gateway_status_page_queries",
            "Reads of the status page's snapshot: one per refresh while any page is "
            "open, however many pages are.",
            value=self._refresher.queries,
        )
        yield GaugeMetricFamily(
            "subengine_gateway_status_page_pages",
            "Status pages following the snapshots now (event streams and long-polls).",
            value=self._refresher.pages,
        )
