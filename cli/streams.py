"""`subengine stream`: create, delete and list streams, and look at their partitions."""

from __future__ import annotations

import click

import subengine

from . import _render
from ._context import Context, json_option, pass_context

STREAM_COLUMNS = _render.columns(("name", "stream"), "partitions", "epoch", "created_at")
PARTITION_COLUMNS = _render.columns("partition", "head", "head_time", "floor")


@click.group()
def stream() -> None:
    """Create and inspect streams."""


@stream.command("create")
@click.argument("name")
@click.option("--partitions", type=int, required=True, help="Number of partitions (fixed).")
@json_option
@pass_context
def stream_create(context: Context, name: str, partitions: int, as_json: bool) -> None:
    """Create stream NAME with a fixed number of partitions."""
    created = context.engine().create_stream(name, partitions)
    if as_json:
        _render.print_json([created])
    else:
        click.echo(f"created stream {created.name!r} with {created.partitions} partitions")


@stream.command("list")
@json_option
@pass_context
def stream_list(context: Context, as_json: bool) -> None:
    """List the streams."""
    _render.print_records(context.engine().streams(), STREAM_COLUMNS, as_json=as_json)


@stream.command("show")
@click.argument("name")
@json_option
@pass_context
def stream_show(context: Context, name: str, as_json: bool) -> None:
    """Show the head, head time and floor of every partition of stream NAME."""
    engine = context.engine()
    states = engine.partitions(name)
    if not as_json:
        click.echo(stream_heading(engine.stream(name)))
    _render.print_records(states, PARTITION_COLUMNS, as_json=as_json)


def stream_heading(shown: subengine.Stream) -> str:
    """The line `stream show` prints above the partitions: the stream's identity."""
    return f"stream {shown.name!r}: {shown.partitions} partitions, epoch {shown.epoch}"


@stream.command("delete")
@click.argument("name")
@click.option(
    "--force",
    is_flag=True,
    help="Delete its subscriptions too, even while connected workers run them.",
)
@json_option
@pass_context
def stream_delete(context: Context, name: str, force: bool, as_json: bool) -> None:
    """Delete stream NAME: its partitions, then its events in batches (each its own
    transaction), then the stream.

    Refused while subscriptions of it are stored, unless --force, which deletes them too
    (positions, dead letters, gaps). Appends to it fail from the start; running the
    command again finishes an interrupted delete. A stream created later under the name
    has a new epoch (`stream list` and `stream show` print it)."""
    deleted = context.engine().delete_stream(name, force=force)
    if as_json:
        _render.print_json([deleted])
        return
    subscriptions = ", ".join(deleted.subscriptions) or "none"
    click.echo(
        f"deleted stream {deleted.name!r} (epoch {deleted.epoch}): {deleted.events} events, "
        f"subscriptions: {subscriptions}"
    )
