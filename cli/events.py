"""`subengine append` and `subengine read`: events into a stream, and out of it."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import click

import subengine
from subengine.model import _json as deep_json
from subengine.model._events import stored_events
from subengine.model._gateway_cursor import GatewayCursor, StreamPosition

from . import _json, _render
from ._context import Context, json_option, pass_context
from ._events_file import EventsFile, read_events_file
from ._params import IsoTime, json_value

# PostgreSQL's bigint: the engine refuses a larger limit, so none is asked for past it.
LARGEST_LIMIT = 2**63 - 1


def _as_json(value: Any) -> str:
    return deep_json.dumps(value, ensure_ascii=False)


EVENT_COLUMNS = _render.columns(
    "partition",
    "position",
    "key",
    ("key_version", "version"),
    "type",
    "recorded_at",
    _render.Column("data", "data", _as_json),
)
# `payload` is a handler's typed view of `data`, not part of the stored event
HIDDEN_EVENT_FIELDS = ("payload",)


@click.command()
@click.argument("stream_name", metavar="STREAM")
@click.option("--key", help="Ordering key of the event.")
@click.option("--type", "event_type", help="Event type.")
@click.option("--data", help="Event data as JSON.")
@click.option("--metadata", help="Event metadata as a JSON object.")
@click.option(
    "--id", "event_id", type=click.UUID, help="Event id (UUID); makes retries idempotent."
)
@click.option("--expected-version", type=int, help="Version the key must have (0: new key).")
@click.option(
    "--file",
    "events_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="JSON Lines file, one event per line ('-' for stdin); all or nothing.",
)
@json_option
@pass_context
def append(
    context: Context,
    stream_name: str,
    key: str | None,
    event_type: str | None,
    data: str | None,
    metadata: str | None,
    event_id: uuid.UUID | None,
    expected_version: int | None,
    events_file: Path | None,
    as_json: bool,
) -> None:
    """Append one event, or every event of a JSON Lines file, to STREAM in one transaction."""
    single = (key, event_type, data, metadata, event_id, expected_version)
    if events_file is not None and any(option is not None for option in single):
        raise click.UsageError(
            "--file cannot be combined with --key/--type/--data/--id/--metadata/--expected-version"
        )
    events = _events_to_append(key, event_type, data, metadata, event_id, events_file)
    try:
        stored = context.engine().append(stream_name, events, expected_version)
    except subengine.InvalidEvent as error:
        if isinstance(events, EventsFile):
            raise subengine.InvalidInput(
                f"{events.source} line {events.line_of(error.index)}: {error.reason}"
            ) from None
        raise subengine.InvalidInput(error.reason) from None
    if as_json:
        _render.print_json(a._asdict() for a in stored)
    else:
        for a in stored:
            note = "  (already stored)" if a.duplicate else ""
            click.echo(
                f"partition {a.partition} position {a.position} key version "
                f"{a.key_version} id {a.id}{note}"
            )
    duplicates = sum(1 for a in stored if a.duplicate)
    click.echo(
        f"appended {len(stored) - duplicates} event(s), {duplicates} already stored", err=True
    )


def _events_to_append(
    key: str | None,
    event_type: str | None,
    data: str | None,
    metadata: str | None,
    event_id: uuid.UUID | None,
    events_file: Path | None,
) -> list[subengine.NewEvent]:
    """The events of --file, or the one event of --key, --type, --data and the rest."""
    if events_file is not None:
        return read_events_file(events_file)
    if key is None or event_type is None or data is None:
        raise click.UsageError("give --key, --type and --data (or --file)")
    event = subengine.NewEvent(
        key=key,
        type=event_type,
        data=json_value("--data", data),
        metadata=None if metadata is None else json_value("--metadata", metadata),
        id=event_id,
    )
    return [event]


@click.command()
@click.argument("stream_name", metavar="STREAM")
@click.option("--partition", type=int, help="Read one partition (default: all, in turn).")
@click.option(
    "--after",
    default="0",
    show_default=True,
    metavar="POSITION|CURSOR",
    help="Start after a position, or (every partition) after the cursor a read printed.",
)
@click.option(
    "--since",
    type=IsoTime(zone_required=True),
    help="Read every partition after a recorded time, not at it (ISO 8601 with a zone).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    help="At most this many events [default: SUBENGINE_READ_LIMIT, 1000].",
)
@json_option
@pass_context
def read(
    context: Context,
    stream_name: str,
    partition: int | None,
    after: str,
    since: datetime | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """Read events of STREAM by position (per partition), by time (--since) or after a
    cursor (--after c1...), the last two across partitions, oldest first.

    When more events follow than --limit shows, a note on stderr says so and how to read
    on; a read by time or cursor always ends with the cursor to read on from.
    """
    cursor = _cursor(after) if after.startswith("c1.") else None
    position = 0 if cursor is not None else _position(after)
    if since is not None and (partition is not None or cursor is not None or position):
        raise click.UsageError("--since cannot be combined with --partition or --after")
    if cursor is not None and partition is not None:
        raise click.UsageError("--after CURSOR reads every partition: drop --partition")
    engine = context.engine()
    limit = limit or engine.settings.read_limit
    # one event more than is shown tells whether more follow
    wanted = limit + 1 if limit < LARGEST_LIMIT else limit
    items: list[subengine.Event | subengine.Tombstone]
    read_on = None
    start = since or cursor
    if start is not None:
        items, read_on = _read_by_cursor(engine, stream_name, start, wanted)
    elif partition is not None:
        items = engine.read(stream_name, partition, position, wanted)
    else:
        items = list(_read_all_partitions(engine, stream_name, position, wanted))
    # a gap comes before every later event of its partition: its line before them all
    gaps = [item for item in items if isinstance(item, subengine.Tombstone)]
    events = [item for item in items if isinstance(item, subengine.Event)]
    for gap in gaps:
        click.echo(
            _render.json_line({"tombstone": dataclasses.asdict(gap)}, ())
            if as_json
            else f"# {gap} ({_floor_and_head(gap)}): the events after it follow"
        )
    _render.print_records(
        events[:limit], EVENT_COLUMNS, as_json=as_json, hidden=HIDDEN_EVENT_FIELDS
    )
    if read_on is not None:
        more = f"stopped at {limit} events (--limit); more follow: " if len(events) > limit else ""
        click.echo(
            f"note: {more}read on with --after {read_on.cursor(gaps, events[:limit])}", err=True
        )
    elif len(events) > limit:
        click.echo(
            f"note: stopped at {limit} events (--limit); more follow: "
            f"{_how_to_read_on(events[:limit], partition)}",
            err=True,
        )


def _floor_and_head(gap: subengine.Tombstone) -> str:
    return f"floor {gap.floor}" + ("" if gap.head is None else f", head {gap.head}")


def _position(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise click.BadParameter(
            f"{_json.shown(text)} is neither a position nor a cursor (c1...)",
            param_hint="'--after'",
        )
    return int(text)


def _cursor(text: str) -> GatewayCursor:
    try:
        return GatewayCursor.decode(text)
    except subengine.InvalidInput as error:
        raise click.BadParameter(str(error), param_hint="'--after'") from None


@dataclasses.dataclass(frozen=True)
class _ReadOn:
    """Where a read by cursor began: the stream, its epoch and the position per partition."""

    stream: str
    epoch: int
    positions: tuple[int, ...]

    def cursor(self, gaps: Sequence[subengine.Tombstone], shown: Sequence[subengine.Event]) -> str:
        """The cursor after the gaps and the events shown: per partition, the last position
        shown, so that a read from it repeats and skips nothing."""
        positions = list(self.positions)
        items: list[subengine.Tombstone | subengine.Event] = [*gaps, *shown]
        for item in items:
            positions[item.partition] = item.position
        return GatewayCursor({self.stream: StreamPosition(self.epoch, tuple(positions))}).encode()


def _read_by_cursor(
    engine: subengine.Engine, stream_name: str, start: datetime | GatewayCursor, limit: int
) -> tuple[list[subengine.Event | subengine.Tombstone], _ReadOn]:
    """The gaps and events after a time or a cursor, oldest first across partitions, and
    where the read began."""
    if isinstance(start, datetime):
        epoch, positions = engine.positions_since(stream_name, start)
    else:
        if list(start.streams) != [stream_name]:
            named = ", ".join(repr(name) for name in start.streams) or "no stream"
            raise subengine.InvalidInput(
                f"that cursor is not one of stream {stream_name!r}: it names {named}"
            )
        epoch, positions = (
            start.streams[stream_name].epoch,
            list(start.streams[stream_name].positions),
        )
    page = engine.read_page(stream_name, positions, limit)
    if page.epoch != epoch or not page.fits:
        raise subengine.InvalidInput(
            f"that cursor is of an earlier stream {stream_name!r} (deleted and created "
            "again since): read it anew with --since or from the beginning"
        )
    start_positions = tuple(positions) or (0,) * len(page.heads)
    items: list[subengine.Event | subengine.Tombstone] = list(page.tombstones)
    items += stored_events(page.events)
    return items, _ReadOn(stream_name, page.epoch, start_positions)


def _how_to_read_on(shown: Sequence[subengine.Event], partition: int | None) -> str:
    if partition is not None:
        return f"read on with --after {shown[-1].position}"
    return "read one partition at a time (--partition, --after) or give a higher --limit"


def _read_all_partitions(
    engine: subengine.Engine, stream_name: str, after: int, limit: int
) -> Iterator[subengine.Event | subengine.Tombstone]:
    remaining = limit
    for state in engine.partitions(stream_name):
        if remaining <= 0:
            return
        batch = engine.read(stream_name, state.partition, after, remaining)
        remaining -= sum(isinstance(item, subengine.Event) for item in batch)
        yield from batch
