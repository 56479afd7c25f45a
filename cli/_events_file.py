"""Reading events from JSON Lines for `subengine append --file`.

One JSON object per line with "key", "type" and "data", and optionally "metadata", "id"
(a UUID) and "occurred_at" (ISO 8601 with a time zone), in UTF-8; lines end at "\n" only.
Blank lines are skipped. Any bad line fails the whole file before anything is written, and
the error names its line.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import click

import subengine

from . import _json

REQUIRED = ("key", "type", "data")
OPTIONAL = ("metadata", "id", "occurred_at")
JSON_WHITESPACE = " \t\r\n"


class EventsFile(list[subengine.NewEvent]):
    """The events of a file, with the line number each came from."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.line_numbers: list[int] = []

    def line_of(self, index: int) -> int:
        return self.line_numbers[index]


def _event(fields: object) -> subengine.NewEvent:
    if not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, got {type(fields).__name__}")
    missing = [name for name in REQUIRED if name not in fields]
    if missing:
        raise ValueError(f"missing {', '.join(repr(name) for name in missing)}")
    unknown = sorted(set(fields) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(_json.shown, unknown))}")
    event_id = _text(fields, "id")
    occurred_at = _text(fields, "occurred_at")
    try:
        parsed_id = None if event_id is None else uuid.UUID(event_id)
    except ValueError:
        raise ValueError(f"id {_json.shown(event_id or '')} is not a UUID") from None
    try:
        parsed_time = None if occurred_at is None else datetime.fromisoformat(occurred_at)
    except ValueError:
        raise ValueError(
            f"occurred_at {_json.shown(occurred_at or '')} is not an ISO 8601 time"
        ) from None
    return subengine.NewEvent(
        key=fields["key"],
        type=fields["type"],
        data=fields["data"],
        metadata=fields.get("metadata"),
        id=parsed_id,
        occurred_at=parsed_time,
    )


def _text(fields: dict[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string, not {type(value).__name__}")
    return value


def _lines(data: bytes) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line: split on "\n" only, as JSON Lines says.

    JSON allows U+2028, U+2029 and U+0085 raw inside strings, and str.splitlines() would
    break a line there. A "\r" before the "\n" is whitespace to the JSON parser.
    """
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"line {number}: not UTF-8 ({error.reason} at byte {error.start})"
            ) from None


def read_events_file(path: Path) -> EventsFile:
    """The events of the JSON Lines file `path` ('-': stdin); raises InvalidInput naming
    the line."""
    if str(path) == "-":
        source = "stdin"
        data = sys.stdin.buffer.read()
    else:
        source = str(path)
        try:
            data = path.read_bytes()
        except OSError as error:
            raise click.FileError(str(path), hint=error.strerror) from None
    events = EventsFile(source)
    try:
        for number, line in _lines(data):
            if not line.strip(JSON_WHITESPACE):
                continue
            try:
                events.append(_event(_json.parse(line)))
            except ValueError as error:
                raise ValueError(f"line {number}: {error}") from None
            events.line_numbers.append(number)
    except ValueError as error:
        raise subengine.InvalidInput(f"{source} {error}") from None
    if not events:
        raise subengine.InvalidInput(f"{source} holds no event")
    return events
