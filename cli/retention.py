"""`subengine retention`: prune what the streams' retention policies no longer keep."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Protocol

import click

import subengine

from . import _render
from ._context import Context, json_option, pass_context
from ._errors import CommandBusy

DEFAULT_BATCH: int = inspect.signature(subengine.Engine.run_retention).parameters["batch"].default
# Above this many partitions of one stream, the summary gives their spread, not each one.
LISTED_PARTITIONS = 8


class Cut(Protocol):
    """What the engine plans to remove from one partition (its `PartitionCut`)."""

    @property
    def stream(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def removable(self) -> int: ...


class Pruned(Protocol):
    """What a run removed from one partition (the engine's `PrunedPartition`)."""

    @property
    def stream(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def first(self) -> int: ...

    @property
    def last(self) -> int: ...

    @property
    def removed(self) -> int: ...


@click.group()
def retention() -> None:
    """Prune what the streams' retention policies no longer keep."""


@retention.command("run")
@click.option("--stream", "stream_name", metavar="NAME", help="Prune only this stream.")
@click.option("--dry-run", is_flag=True, help="Report what would be removed; remove nothing.")
@click.option(
    "--batch",
    type=int,
    default=DEFAULT_BATCH,
    show_default=True,
    help="Events removed per transaction.",
)
@json_option
@pass_context
def retention_run(
    context: Context, stream_name: str | None, dry_run: bool, batch: int, as_json: bool
) -> None:
    """Remove the events that every stream with a retention policy (or --stream) no
    longer keeps, oldest first, in batches, raising each partition's floor.

    One pruner runs at a time per schema: if another holds the lock, this one removes
    nothing and exits with status 75 (try again later). A progress bar shows on stderr
    when it is a terminal. --json: one line per partition (stream, partition, first,
    last, removed, dry_run).
    """
    done: dict[tuple[str, int], int] = {}
    try:
        with _render.progress_bar("pruning") as bar:

            def plan(cuts: Sequence[Cut]) -> None:
                bar.total(sum(cut.removable for cut in cuts))

            def progress(cut: Cut, removed: int) -> None:
                where = (cut.stream, cut.partition)
                bar.advance(removed - done.get(where, 0), f"pruning {cut.stream}/{cut.partition}")
                done[where] = removed

            run = context.engine().run_retention(
                stream_name, dry_run=dry_run, batch=batch, plan=plan, progress=progress
            )
    except BaseException:
        # each batch committed on its own: what the run removed before it was interrupted
        # or failed stays removed, and is said (once the bar is erased)
        removed = sum(done.values())
        if removed:
            partitions = sum(1 for events in done.values() if events)
            click.echo(
                f"the run ended early, having removed {count(removed, 'event')} "
                f"from {count(partitions, 'partition')}",
                err=True,
            )
        raise
    if run.locked:
        raise CommandBusy(
            "another pruner is running in this schema; nothing was removed: "
            "try again when it has finished"
        )
    if as_json:
        _render.print_json(
            {**_render.fields_of(part), "dry_run": run.dry_run} for part in run.partitions
        )
        return
    for line in summary(run.partitions, dry_run=run.dry_run):
        click.echo(line)


def summary(parts: Sequence[Pruned], *, dry_run: bool) -> list[str]:
    """Per stream: the partitions pruned, the events removed and the positions; then a
    total line."""
    verb = "would remove" if dry_run else "removed"
    if not parts:
        return [
            f"{'would remove' if dry_run else 'removed'} nothing: every stream is within "
            "its retention policy"
        ]
    by_stream: dict[str, list[Pruned]] = {}
    for part in parts:
        by_stream.setdefault(part.stream, []).append(part)
    lines = []
    for stream, pruned in by_stream.items():
        removed = sum(part.removed for part in pruned)
        lines.append(
            f"stream {stream!r}: {verb} {count(removed, 'event')} "
            f"from {count(len(pruned), 'partition')}"
        )
        if len(pruned) <= LISTED_PARTITIONS:
            lines.extend(
                f"  partition {part.partition}: positions {part.first} to {part.last} "
                f"({count(part.removed, 'event')})"
                for part in pruned
            )
        else:
            lines.append(
                f"  partitions {spans(part.partition for part in pruned)}: positions from "
                f"{min(part.first for part in pruned)} to {max(part.last for part in pruned)}"
                " (--json lists each partition)"
            )
    total = sum(part.removed for part in parts)
    lines.append(
        f"total: {verb} {count(total, 'event')} from {count(len(parts), 'partition')} "
        f"of {count(len(by_stream), 'stream')}"
    )
    return lines


def count(number: int, noun: str) -> str:
    """'1 event', '2 events'."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def spans(numbers: Iterable[int]) -> str:
    """Numbers as runs: 0-3, 5, 7-9."""
    runs: list[list[int]] = []
    for number in sorted(numbers):
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
