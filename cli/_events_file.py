"""Reading events from JSON Lines for `subengine append --file`.

One JSON object per line with "key", "type" and "data", and optionally "metadata", "id"
(a UUID) and "occurred_at" (ISO 8601 with a time zone). Blank lines are skipped. Any bad
line fails the whole file before anything is written, and the error names its line.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import click

import subengine

REQUIRED = ("key", "type", "data")
OPTIONAL = ("metadata", "id", "occurred_at")


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
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}")
    event_id = fields.get("id")
    occurred_at = fields.get("occurred_at")
    try:
        parsed_id = None if event_id is None else uuid.UUID(str(event_id))
    except ValueError:
        raise ValueError(f"id {event_id!r} is not a UUID") from None
    try:
        parsed_time = None if occurred_at is None else datetime.fromisoformat(str(occurred_at))
    except ValueError:
        raise ValueError(f"occurred_at {occurred_at!r} is not an ISO 8601 time") from None
    return subengine.NewEvent(
        key=fields["key"],
        type=fields["type"],
        data=fields["data"],
        metadata=fields.get("metadata"),
        id=parsed_id,
        occurred_at=parsed_time,
    )


def read_events_file(path: Path | None, lines: Iterable[str] | None = None) -> EventsFile:
    """The events of `path` ('-': stdin) or of `lines`; raises InvalidInput naming the line."""
    if lines is None:
        if path is None:
            raise ValueError("read_events_file needs a path or lines")
        if str(path) == "-":
            source, lines = "stdin", sys.stdin
        else:
            source = str(path)
            try:
                lines = path.read_text("utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as error:
                raise click.FileError(str(path), hint=str(error)) from None
    else:
        source = "--data"
    events = EventsFile(source)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            events.append(_event(json.loads(line)))
        except (ValueError, json.JSONDecodeError) as error:
            raise subengine.InvalidInput(f"{source} line {number}: {error}") from None
        events.line_numbers.append(number)
    if not events:
        raise subengine.InvalidInput(f"{source} holds no event")
    return events
