"""The gateway's status page at /ui (docs/status-page.md): the page itself and its
static files (shipped in the wheel, nothing fetched from another host), signing in and
out with an API key, and the routes of its live updates and actions.

The page is one HTML document with one script: it follows the snapshots of the view it
shows (`_ui_live`) and sends actions (`_ui_actions`). Every HTML answer forbids framing,
inline scripts and requests to other hosts (its Content-Security-Policy).
"""

from __future__ import annotations

import functools
import hashlib
import html
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from subengine.gateway._auth import Denied
from subengine.gateway._http import NO_STORE, api_error, error_response
from subengine.gateway._ui_actions import act
from subengine.gateway._ui_live import live, next_snapshot
from subengine.gateway._ui_page import COOKIE, StatusPage, from_own_origin, status_page_of
from subengine.model._errors import DatabaseUnavailable, SchemaNotReady

PREFIX = "/ui"
_FORM_BYTES = 4096
_HTML_HEADERS = {
    "Cache-Control": NO_STORE,
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
}


@functools.cache
def _files() -> dict[str, bytes]:
    """The page's files by their path under ui/, read once."""
    found: dict[str, bytes] = {}
    root = resources.files("subengine.gateway").joinpath("ui")
    folders = [("", root)]
    while folders:
        prefix, folder = folders.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                folders.append((f"{prefix}{entry.name}/", entry))
            elif not entry.name.startswith("."):
                found[prefix + entry.name] = entry.read_bytes()
    return found


def _root(request: Request) -> str:
    """The path the gateway is mounted at ('' when it is the whole application)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def _html(request: Request, name: str, status: int = 200, **values: str) -> Response:
    """The HTML document `name` with each `{{value}}` filled in, escaped."""
    text = _files()[name].decode()
    for key, value in {**values, "root": _root(request)}.items():
        text = text.replace("{{" + key + "}}", html.escape(value))
    return Response(text, status, media_type="text/html; charset=utf-8", headers=_HTML_HEADERS)


def _unavailable_as_html(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """`handler` answering a page that says so while PostgreSQL is out of reach."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except (DatabaseUnavailable, SchemaNotReady) as error:
            answer = _html(request, "message.html", 503, message=str(error))
            answer.headers["Retry-After"] = "5"
            return answer

    endpoint.__name__ = handler.__name__
    return endpoint


@_unavailable_as_html
async def page(request: Request) -> Response:
    """`GET /ui`: the status page, or the sign-in form while no valid key is signed in."""
    status_page = status_page_of(request)
    try:
        principal = await status_page.principal(request)
    except Denied as denied:
        if denied.status != 401:
            return _html(request, "message.html", denied.status, message=denied.message)
        answer = _html(request, "sign-in.html", message=_sign_in_note(request))
        if COOKIE in request.cookies:
            _forget_cookie(answer, request)
        return answer
    key = principal.key
    if key is None:
        who = "open gateway: no API key exists, so this host may do anything"
    else:
        scopes = ", ".join(sorted(key.scopes))
        who = f"key {key.id}" + (f" '{key.name}'" if key.name else "")
        who += f": {scopes} on {', '.join(key.streams)}"
    return _html(
        request,
        "index.html",
        csrf=await status_page.csrf_token(request),
        who=who,
        signed_in="false" if key is None else "true",
        retry="true" if status_page.app_spec else "false",
    )


def _sign_in_note(request: Request) -> str:
    if COOKIE in request.cookies:
        return "The key you signed in with is no longer valid: sign in again."
    return "This gateway needs an API key with the read or admin scope."


async def static(request: Request) -> Response:
    """`GET /ui/static/{name}`: one of the page's files (never an HTML document)."""
    name = request.path_params["name"]
    body = _files().get(name)
    suffix = name[name.rfind(".") :] if "." in name else ""
    if body is None or name.endswith(".html"):
        return Response("not found", 404, media_type="text/plain")
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    headers = {"Cache-Control": "no-cache", "ETag": etag, "X-Content-Type-Options": "nosniff"}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    media_type = _TYPES.get(suffix, "text/plain; charset=utf-8")
    return Response(body, media_type=media_type, headers=headers)


@_unavailable_as_html
async def sign_in(request: Request) -> Response:
    """`POST /ui/sign-in` (a form with `key`): keep the key in the page's cookie."""
    status_page = status_page_of(request)
    if not from_own_origin(request):
        return _html(request, "message.html", 403, message="sign in from the gateway's own page")
    token = (await _form(request)).get("key", "").strip()
    key = await status_page.gateway.engine.authenticate(token) if token else None
    if key is None:
        return _html(request, "sign-in.html", 401, message="That API key is unknown or revoked.")
    if not {"read", "admin"} & set(key.scopes):
        return _html(
            request,
            "sign-in.html",
            403,
            message="That key has neither the read nor the admin scope: it would see nothing.",
        )
    answer = RedirectResponse(_root(request) + PREFIX, 303, headers={"Cache-Control": NO_STORE})
    answer.set_cookie(
        COOKIE,
        token,
        path=_root(request) + PREFIX,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return answer


@_unavailable_as_html
async def sign_out(request: Request) -> Response:
    """`POST /ui/sign-out` (a form with the page's token): forget the key."""
    status_page = status_page_of(request)
    form = await _form(request)
    if not from_own_origin(request) or form.get("csrf") != await status_page.csrf_token(request):
        return _html(request, "message.html", 403, message="sign out from the gateway's own page")
    answer = RedirectResponse(_root(request) + PREFIX, 303, headers={"Cache-Control": NO_STORE})
    _forget_cookie(answer, request)
    return answer


def _forget_cookie(answer: Response, request: Request) -> None:
    answer.delete_cookie(
        COOKIE,
        path=_root(request) + PREFIX,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


async def _form(request: Request) -> dict[str, str]:
    """A small urlencoded form's fields (the first value of each)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > _FORM_BYTES:
            return {}
    fields = parse_qs(body.decode(errors="replace"), keep_blank_values=True)
    return {name: values[0] for name, values in fields.items()}


def _json_errors(handler: Callable[[Request], Awaitable[Any]]) -> Any:
    """`handler` with the gateway's errors answered as JSON."""

    async def endpoint(request: Request) -> Any:
        try:
            return await handler(request)
        except Exception as error:
            return error_response(api_error(error))

    endpoint.__name__ = handler.__name__
    return endpoint


def ui_routes() -> list[Route]:
    """The status page's routes, to add to the gateway's."""
    return [
        Route(PREFIX, page),
        Route(f"{PREFIX}/static/{{name:path}}", static),
        Route(f"{PREFIX}/sign-in", sign_in, methods=["POST"]),
        Route(f"{PREFIX}/sign-out", sign_out, methods=["POST"]),
        Route(f"{PREFIX}/api/live", _json_errors(live)),
        Route(f"{PREFIX}/api/snapshot", _json_errors(next_snapshot)),
        Route(f"{PREFIX}/api/actions", _json_errors(act), methods=["POST"]),
    ]


__all__ = ["StatusPage", "ui_routes"]
