"""Reading events from JSON Lines for `subengine append --file`.

One JSON object per line, in UTF-8, as `subengine.NewEvent.from_json` reads it ("key",
"type" and "data", and optionally "metadata", "id" and "occurred_at", an RFC 3339 time
with a zone); lines end at "\n" only.
Blank lines are skipped. Any bad line fails the whole file before anything is written, and
the error names its line.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import click

import subengine

from . import _json

JSON_WHITESPACE = " \t\r\n"


class EventsFile(list[subengine.NewEvent]):
    """The events of a file, with the line number each came from."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.line_numbers: list[int] = []

    def line_of(self, index: int) -> int:
        return self.line_numbers[index]


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
                events.append(subengine.NewEvent.from_json(_json.parse(line)))
            except ValueError as error:
                raise ValueError(f"line {number}: {error}") from None
            events.line_numbers.append(number)
    except ValueError as error:
        raise subengine.InvalidInput(f"{source} {error}") from None
    if not events:
        raise subengine.InvalidInput(f"{source} holds no event")
    return events
