"""`subengine stream`: create streams and look at their partitions."""

from __future__ import annotations

import click

from . import _render
from ._context import Context, json_option, pass_context

STREAM_COLUMNS = _render.columns(("name", "stream"), "partitions", "created_at")
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
    states = context.engine().partitions(name)
    _render.print_records(states, PARTITION_COLUMNS, as_json=as_json)
