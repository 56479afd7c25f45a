"""Rendering what operators look at: status tables (rich) and their JSON form.

rich is imported by the functions that draw, so that commands printing JSON, and the
command line's start, do not pay for it.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

Row = dict[str, Any]
Columns = Sequence[tuple[str, str]]  # (key in the row, header)

SUMMARY_COLUMNS: Columns = (
    ("subscription", "subscription"),
    ("stream", "stream"),
    ("partitions", "partitions"),
    ("lag", "lag"),
    ("lag_seconds", "lag s"),
    ("ok", "ok"),
    ("idle", "idle"),
    ("retrying", "retrying"),
    ("stopped", "stopped"),
    ("paused", "paused"),
    ("workers", "workers"),
    ("generation", "generation"),
)
PARTITION_COLUMNS: Columns = (
    ("subscription", "subscription"),
    ("partition", "partition"),
    ("position", "position"),
    ("head", "head"),
    ("lag", "lag"),
    ("lag_seconds", "lag s"),
    ("state", "state"),
    ("attempts", "attempts"),
    ("last_error", "last error"),
    ("worker_pid", "worker pid"),
    ("worker_host", "worker host"),
)
WORKER_COLUMNS: Columns = (
    ("id", "id"),
    ("host", "host"),
    ("pid", "pid"),
    ("subscriptions", "subscriptions"),
    ("started_at", "started"),
    ("seconds_since_heartbeat", "heartbeat s ago"),
    ("connected", "connected"),
    ("partitions_held", "partitions held"),
)
DEAD_LETTER_COLUMNS: Columns = (
    ("subscription", "subscription"),
    ("partition", "partition"),
    ("position", "position"),
    ("key", "key"),
    ("type", "type"),
    ("attempts", "attempts"),
    ("retries", "retries"),
    ("resolution", "resolution"),
    ("error", "error"),
)
SUBSCRIPTION_COLUMNS: Columns = (
    ("name", "name"),
    ("stream", "stream"),
    ("start", "start"),
    ("generation", "generation"),
    ("paused", "paused"),
    ("created_at", "created"),
)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.isoformat(timespec="seconds")
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def table(rows: Sequence[Row], columns: Columns, title: str | None = None) -> Table:
    from rich.table import Table

    result = Table(title=title, title_justify="left")
    for _key, header in columns:
        result.add_column(header, overflow="fold")
    for row in rows:
        result.add_row(*(cell(row.get(key)) for key, _header in columns))
    return result


def console() -> Console:
    """The terminal's width on a terminal; wide enough not to fold names in a pipe."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=240)


def print_table(rows: Sequence[Row], columns: Columns, title: str | None = None) -> None:
    if not rows:
        console().print(f"{title or 'nothing'}: none")
        return
    console().print(table(rows, columns, title))


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Decimal):
        # sums come back from SQL as numeric: whole ones print as integers
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def print_json(rows: Sequence[Row]) -> None:
    """One JSON object per line."""
    for row in rows:
        print(json.dumps(row, default=_json_default, ensure_ascii=False))


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
