"""The access log of `subengine serve --access-log`, with what grants access left out.

uvicorn writes one line per request, the request's path and query string included. A
cursor (`after=`), a watch id (`/v1/watch/{wid}`) and an API token read streams for
whoever holds them, so the filter here rewrites each line's target before it is written:
they become `<redacted>`. Headers (`Authorization`, `Last-Event-ID`) are never logged.
"""

from __future__ import annotations

import logging
from urllib.parse import unquote_plus

REDACTED = "<redacted>"
ACCESS_LOGGER = "uvicorn.access"
# query parameters whose value grants access, whatever it looks like
_SECRET_PARAMETERS = frozenset({"after", "token", "access_token", "api_key", "apikey"})
# what a cursor, a watch id and an API token start with, wherever they appear
_SECRET_PREFIXES = ("c1.", "w1.", "sek_")


def _secret(value: str) -> bool:
    return unquote_plus(value).strip().startswith(_SECRET_PREFIXES)


def redact_target(target: str) -> str:
    """`target` (a path and query string) with cursors, watch ids and tokens replaced."""
    path, mark, query = target.partition("?")
    segments = path.split("/")
    for index, segment in enumerate(segments):
        after_watch = index > 0 and segments[index - 1] == "watch"
        if segment and (after_watch or _secret(segment)):
            segments[index] = REDACTED
    pieces = []
    for piece in query.split("&") if query else ():
        name, equals, value = piece.partition("=")
        if equals and (unquote_plus(name).lower() in _SECRET_PARAMETERS or _secret(value)):
            value = REDACTED
        elif not equals and _secret(name):
            name = REDACTED
        pieces.append(f"{name}{equals}{value}")
    return "/".join(segments) + mark + "&".join(pieces)


class RedactingFilter(logging.Filter):
    """Rewrites the request target of each access-log record (any text argument that is
    a path), so that no handler of the logger ever sees a cursor, watch id or token."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            # uvicorn's formatter unpacks the arguments: keep them, redacted
            record.args = tuple(
                redact_target(arg) if isinstance(arg, str) and arg.startswith("/") else arg
                for arg in record.args
            )
        else:  # a line of another shape: redact every word of it that is a path
            words = record.getMessage().split(" ")
            record.msg = " ".join(redact_target(w) if w.startswith("/") else w for w in words)
            record.args = None
        return True


def redact_access_log() -> None:
    """Install the filter on uvicorn's access logger (once per process)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(each, RedactingFilter) for each in logger.filters):
        logger.addFilter(RedactingFilter())
