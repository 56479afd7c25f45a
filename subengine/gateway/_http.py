"""What every endpoint of the gateway shares: JSON answers, errors that name the problem,
and the parsing of query parameters and request bodies.

Every response is JSON (or an event stream) with an explicit Cache-Control; every error is
`{"error": {"code": ..., "message": ...}}` with a 4xx or 5xx status, and changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from subengine.gateway._auth import Denied
from subengine.gateway._callbacks import CallbackRefused
from subengine.gateway._connections import Busy
from subengine.gateway._hub import dumps
from subengine.gateway._request_bodies import BodyTooLarge, read_limited_body
from subengine.model._errors import (
    DatabaseUnavailable,
    EventIdConflict,
    InvalidEvent,
    InvalidInput,
    LeaseConflict,
    LeaseNotFound,
    PartitionNotFound,
    SchemaNotReady,
    StreamNotFound,
    SubengineError,
    SubscriptionNotFound,
    WrongExpectedVersion,
)
from subengine.model._gateway_cursor import InvalidCursor
from subengine.model._names import validate_stream_name
from subengine.outside._webhooks import WebhookConflict, WebhookNotFound

NO_STORE = "no-store"
CURSOR_HEADER = "Subengine-Cursor"
UP_TO_DATE_HEADER = "Subengine-Up-To-Date"
# on a long-poll's 204: a newer long-poll of its session ended it
SUPERSEDED_HEADER = "Subengine-Superseded"


class ApiError(Exception):
    """An answer with a 4xx or 5xx status and a JSON error naming the problem."""

    def __init__(
        self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    text = body if isinstance(body, str) else dumps(body)
    return Response(
        text,
        status_code=status,
        media_type="application/json",
        headers={"Cache-Control": NO_STORE, **(headers or {})},
    )


def error_response(error: ApiError) -> Response:
    body = {"error": {"code": error.code, "message": error.message}}
    return json_response(body, error.status, error.headers)


def bad_request(message: str, code: str = "bad_request") -> ApiError:
    return ApiError(400, code, message)


# The answer to each error of the engine and of the gateway's parts: the first whose type
# fits (a subclass before its base).
_ANSWERS: tuple[tuple[type[Exception], int, str, Mapping[str, str]], ...] = (
    (InvalidCursor, 400, "bad_cursor", {}),
    (WebhookNotFound, 404, "webhook_not_found", {}),
    (WebhookConflict, 409, "webhook_conflict", {}),
    (CallbackRefused, 400, "callback_refused", {}),
    (StreamNotFound, 404, "stream_not_found", {}),
    (SubscriptionNotFound, 404, "subscription_not_found", {}),
    (LeaseNotFound, 404, "lease_not_found", {}),
    (LeaseConflict, 409, "lease_conflict", {}),
    (PartitionNotFound, 404, "partition_not_found", {}),
    (WrongExpectedVersion, 409, "wrong_expected_version", {}),
    (EventIdConflict, 409, "event_id_conflict", {}),
    (InvalidEvent, 400, "bad_event", {}),
    (InvalidInput, 400, "bad_request", {}),
    (DatabaseUnavailable, 503, "unavailable", {"Retry-After": "1"}),
    # the server's condition, not the request's: the schema was dropped or is out of date
    (SchemaNotReady, 503, "schema_not_ready", {"Retry-After": "5"}),
    (SubengineError, 400, "bad_request", {}),
)


def api_error(error: Exception) -> ApiError:
    """The answer to `error`; an error the gateway does not expect is raised again."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, Denied):
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
        return ApiError(error.status, error.code, error.message, headers)
    if isinstance(error, Busy):
        return ApiError(429, error.code, error.message, {"Retry-After": str(error.retry_after)})
    for kind, status, code, answer_headers in _ANSWERS:
        if isinstance(error, kind):
            return ApiError(status, code, str(error), answer_headers)
    raise error


def parse_time(text: str, what: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        hint = ""
        if " " in text:
            # a '+' left unencoded in a query string arrives as a space
            hint = (
                "; a '+' in a URL must be sent encoded as %2B (a time zone such as +00:00 "
                "arrives as ' 00:00' otherwise), or write the UTC time with 'Z'"
            )
        raise bad_request(f"{what} is not an RFC 3339 time: {text[:64]!r}{hint}") from None
    if parsed.tzinfo is None:
        raise bad_request(f"{what} has no time zone: {text[:64]!r}")
    return parsed


def parse_flag(value: str | None, what: str, default: bool) -> bool:
    if value is None:
        return default
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise bad_request(f"{what} must be true or false, not {value[:32]!r}")


def parse_number(value: str | None, what: str, low: float, high: float, default: float) -> float:
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise bad_request(f"{what} must be a number, not {value[:32]!r}") from None
    if not low <= number <= high:  # NaN fails too
        raise bad_request(f"{what} must be from {low:g} to {high:g}, not {value[:32]!r}")
    return number


def parse_whole(value: str | None, what: str, low: int, high: int, default: int) -> int:
    if value is None:
        return default
    if not (value.isascii() and value.isdecimal()) or not low <= int(value) <= high:
        raise bad_request(f"{what} must be a whole number from {low} to {high}, not {value[:32]!r}")
    return int(value)


def parse_names(values: list[str], what: str, validate: Any) -> frozenset[str] | None:
    if not values:
        return None
    try:
        return frozenset(validate(value) for value in values)
    except InvalidInput as error:
        raise bad_request(f"{what}: {error}") from None


def parse_stream_name(name: str) -> str:
    try:
        return validate_stream_name(name)
    except InvalidInput as error:
        raise bad_request(str(error), "bad_stream_name") from None


def path_stream(request: Request) -> str:
    """The stream the request's path names."""
    return parse_stream_name(request.path_params["stream"])


def refuse_unknown_fields(body: Mapping[str, Any], known: Iterable[str]) -> None:
    """Refuse a body that names a field the endpoint does not know."""
    unknown = set(body) - set(known)
    if unknown:
        raise bad_request(f"unknown field {sorted(unknown)[0]!r}")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or 413 if it is over `limit` bytes (`read_limited_body`)."""
    try:
        return await read_limited_body(request, limit)
    except BodyTooLarge as refused:
        raise ApiError(413, "too_large", str(refused), refused.headers) from None


async def read_json_body(request: Request, limit: int) -> Any:
    body = await read_body(request, limit)
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise bad_request("the body is not JSON") from None
