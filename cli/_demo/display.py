"""What the demo shows while it runs: a live table and progress bar on a terminal,
elsewhere a line a second."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

import subengine

from .. import _render
from ..demo_app import SUBSCRIPTION
from ..subscriptions import PARTITION_COLUMNS
from .processes import Workers
from .producer import Producer

Say = Callable[[str], None]
Rows = Sequence[subengine.PartitionStatus]
Show = Callable[[Rows, Producer, Workers], None]
# one subscription's: narrow enough for 80 columns
COLUMNS = tuple(
    column
    for column in PARTITION_COLUMNS
    if column.field not in ("subscription", "attempts", "worker_host")
)


class Display:
    """A live table and progress bar on a terminal; elsewhere a line a second."""

    def __init__(self, say: Say) -> None:
        self.say = say
        self.console = _render.console()
        self.live: Live | None = None
        self.progress = Progress(
            TextColumn("projected"), BarColumn(), MofNCompleteColumn(), TextColumn("events")
        )
        self.task = self.progress.add_task("projected", total=None)
        self.last_line = 0.0
        self.rows: Rows = []
        self.started = time.monotonic()

    def __enter__(self) -> Show:
        if self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=8)
            self.live.__enter__()
        return self.show

    def __exit__(self, *exc_info: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)
        elif self.rows:
            self.console.print(_render.table(self.rows, COLUMNS, SUBSCRIPTION))

    def show(self, rows: Rows, producer: Producer, workers: Workers) -> None:
        self.rows = rows
        projected = sum(r.position for r in rows)
        heads = sum(r.head for r in rows)
        lag = heads - projected
        pids = ", ".join(str(p.pid) for p in workers.running())
        if self.live is not None:
            self.progress.update(self.task, total=heads or None, completed=projected)
            caption = f"appended {producer.appended:,} of {producer.count:,}; workers {pids}"
            table = _render.table(rows, COLUMNS, f"{SUBSCRIPTION} ({caption})")
            self.live.update(Group(table, self.progress))
            return
        now = time.monotonic()
        if now - self.last_line >= 1.0:
            self.last_line = now
            self.say(
                f"{now - self.started:5.1f} s  appended {producer.appended:>6,}  "
                f"projected {projected:>6,}  lag {lag:>5,}  workers {pids}"
            )
