"""The one renderer of the command: records (dataclass instances) as a rich table or as
JSON Lines.

A table shows chosen columns; JSON shows every field of a record, one object per line.
Tables with a title (the operator views: status, workers, dead letters) are framed; the
others are plain columns that read well in a pipe (`stream list`, `read`). rich is
imported by the functions that draw, so that commands printing JSON, and the command
line's start, do not pay for it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import click

from subengine.model import _json as deep_json

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from rich.console import Console, RenderableType
    from rich.progress import Progress, TaskID
    from rich.table import Table

    Record = DataclassInstance | Mapping[str, Any]
else:
    Record = object

# Wider than any terminal: a table in a pipe is never folded, so each row stays a line.
PIPE_WIDTH = 1_000_000


def cell(value: Any) -> str:
    """A value as a table shows it: '-' for nothing, times to the millisecond."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.isoformat(timespec="milliseconds")
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if isinstance(value, dict):
        return deep_json.dumps(value, ensure_ascii=False)
    return str(value)


@dataclass(frozen=True)
class Column:
    """A column of a table: the field it shows, its header, and how a value reads."""

    field: str
    header: str
    shown: Callable[[Any], str] = cell


def columns(*fields: str | tuple[str, str] | Column) -> tuple[Column, ...]:
    """Columns from field names (the header is the name), (field, header) pairs or Columns."""
    made = []
    for spec in fields:
        if isinstance(spec, Column):
            made.append(spec)
        elif isinstance(spec, str):
            made.append(Column(spec, spec))
        else:
            made.append(Column(*spec))
    return tuple(made)


def fields_of(record: Record, hidden: Iterable[str] = ()) -> dict[str, Any]:
    """The fields of a record by name, in their order, without those `hidden`."""
    if isinstance(record, Mapping):
        values = dict(record)
    else:
        values = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    for name in hidden:
        values.pop(name, None)
    return values


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Decimal):
        # seconds the views round: whole ones print as integers
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return fields_of(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def json_line(record: Record, hidden: Iterable[str] = ()) -> str:
    """One record as one line of JSON: every field, times in ISO 8601, UUIDs as text."""
    return deep_json.dumps(fields_of(record, hidden), default=_json_default, ensure_ascii=False)


def print_json(records: Iterable[Record], hidden: Iterable[str] = ()) -> None:
    """One JSON object per record and line (nothing at all for no records)."""
    hidden = tuple(hidden)
    for record in records:
        click.echo(json_line(record, hidden))


def table(records: Sequence[Record], shown: Sequence[Column], title: str | None = None) -> Table:
    """A rich table of `records`: framed under `title`, or plain columns without one."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    if title is None:
        result = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0), header_style="bold")
    else:
        result = Table(title=title, title_justify="left", box=box.HEAVY_HEAD)
    for column in shown:
        result.add_column(column.header, overflow="fold")
    for record in records:
        values = fields_of(record)
        # Text, not str: keys, data and errors are users' text, never rich markup
        result.add_row(*(Text(column.shown(values.get(column.field))) for column in shown))
    return result


def console() -> Console:
    """The terminal, at its width; in a pipe, wide enough never to fold a row."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=PIPE_WIDTH)


def show(renderable: RenderableType) -> None:
    """Print a table (or any rich renderable); in a pipe, without trailing blanks."""
    out = console()
    if out.is_terminal:
        out.print(renderable)
        return
    with out.capture() as captured:
        out.print(renderable)
    for line in captured.get().splitlines():
        click.echo(line.rstrip())


def print_records(
    records: Sequence[Record],
    shown: Sequence[Column],
    *,
    as_json: bool,
    title: str | None = None,
    hidden: Iterable[str] = (),
) -> None:
    """Records as JSON Lines (`as_json`) or as a table of the columns `shown`. A titled
    table of no records says '<title>: none'; a plain one shows its header."""
    if as_json:
        print_json(records, hidden)
    elif title is not None and not records:
        click.echo(f"{title}: none")
    else:
        show(table(records, shown, title))


def watch(render: Callable[[], tuple[Table, int]], interval: float) -> None:
    """Redraw `render()` (a table and the total lag) every `interval` seconds, with a
    progress bar of the lag drained since the watch began, until Ctrl-C."""
    from rich.console import Group
    from rich.live import Live
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("lag drained"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    )
    task = progress.add_task("lag", total=None)
    most = 0
    try:
        with Live(console=console(), refresh_per_second=4) as live:
            while True:
                rendered, lag = render()
                most = max(most, lag)
                progress.update(task, total=most or None, completed=most - lag)
                live.update(Group(rendered, progress) if most else rendered)
                time.sleep(interval)
    except KeyboardInterrupt:
        return


class Bar:
    """A progress bar on stderr (see `progress_bar`); every call does nothing when stderr
    is not a terminal."""

    def __init__(self, progress: Progress | None = None, task: TaskID | None = None) -> None:
        self._progress = progress
        self._task = task

    def total(self, total: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, total=total)

    def advance(self, amount: int, description: str) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=amount, description=description)


@contextmanager
def progress_bar(description: str) -> Iterator[Bar]:
    """A progress bar of work done, drawn on stderr while the block runs and erased after
    it, so stdout keeps only the result; none at all when stderr is not a terminal (a
    pipe, a log file, cron)."""
    if not sys.stderr.isatty():
        yield Bar()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        yield Bar(progress, progress.add_task(description, total=None))
