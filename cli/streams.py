"""`subengine stream`: create, alter and delete streams (with their retention policies)
and look at their partitions."""

from __future__ import annotations

import click

from . import _render, _retention
from ._context import Context, json_option, pass_context

STREAM_COLUMNS = _render.columns(
    ("name", "stream"),
    "partitions",
    "epoch",
    "created_at",
    _render.Column("retention", "retention", _retention.describe),
)
PARTITION_COLUMNS = _render.columns("partition", "head", "head_time", "floor")


@click.group()
def stream() -> None:
    """Create and inspect streams and set their retention policies."""


@stream.command("create")
@click.argument("name")
@click.option("--partitions", type=int, required=True, help="Number of partitions (fixed).")
@_retention.retention_options
@json_option
@pass_context
def stream_create(
    context: Context,
    name: str,
    partitions: int,
    max_age: str | None,
    max_events: int | None,
    max_bytes: int | None,
    keep_unprocessed: bool | None,
    hard_max_age: str | None,
    hard_max_events: int | None,
    as_json: bool,
) -> None:
    """Create stream NAME with a fixed number of partitions and, optionally, a retention
    policy (without one, every event is kept; see docs/retention.md)."""
    policy = _retention.policy(
        max_age=max_age,
        max_events=max_events,
        max_bytes=max_bytes,
        keep_unprocessed=keep_unprocessed,
        hard_max_age=hard_max_age,
        hard_max_events=hard_max_events,
    )
    created = context.engine().create_stream(name, partitions, retention=policy)
    if as_json:
        _render.print_json([created])
    else:
        click.echo(
            f"created stream {created.name!r} with {created.partitions} partitions; "
            f"retention: {_retention.describe(created.retention)}"
        )


@stream.command("alter")
@click.argument("name")
@_retention.retention_options
@click.option("--keep-all", is_flag=True, help="Remove the retention policy: keep every event.")
@json_option
@pass_context
def stream_alter(
    context: Context,
    name: str,
    max_age: str | None,
    max_events: int | None,
    max_bytes: int | None,
    keep_unprocessed: bool | None,
    hard_max_age: str | None,
    hard_max_events: int | None,
    keep_all: bool,
    as_json: bool,
) -> None:
    """Replace the retention policy of stream NAME (options not given are unset), or
    remove it with --keep-all. The next pruning run applies it."""
    retention = {
        "max_age": max_age,
        "max_events": max_events,
        "max_bytes": max_bytes,
        "keep_unprocessed": keep_unprocessed,
        "hard_max_age": hard_max_age,
        "hard_max_events": hard_max_events,
    }
    if keep_all and _retention.given(retention):
        raise click.UsageError("--keep-all removes the policy: give it without other options")
    if not keep_all and not _retention.given(retention):
        raise click.UsageError(
            "give the new policy (--max-age, --max-events, --max-bytes, --keep-unprocessed, "
            "--hard-max-age, --hard-max-events) or --keep-all to remove it"
        )
    policy = None if keep_all else _retention.policy(**retention)
    altered = context.engine().set_retention(name, policy)
    if as_json:
        _render.print_json([altered])
    else:
        click.echo(
            f"stream {altered.name!r}: retention removed, every event is kept"
            if altered.retention is None
            else f"stream {altered.name!r}: retention set to "
            f"{_retention.describe(altered.retention)}; the next pruning run applies it"
        )


@stream.command("list")
@json_option
@pass_context
def stream_list(context: Context, as_json: bool) -> None:
    """List the streams, with their epochs and retention policies."""
    _render.print_records(context.engine().streams(), STREAM_COLUMNS, as_json=as_json)


@stream.command("show")
@click.argument("name")
@json_option
@pass_context
def stream_show(context: Context, name: str, as_json: bool) -> None:
    """Show the epoch and retention policy of stream NAME, and the head, head time and
    floor of every partition (--json: one line per partition, each with the stream's
    epoch and stored policy)."""
    engine = context.engine()
    shown = engine.stream(name)
    states = engine.partitions(name)
    if as_json:
        stream_fields = {"epoch": shown.epoch, "retention": shown.retention}
        _render.print_json([{**_render.fields_of(state), **stream_fields} for state in states])
        return
    click.echo(
        f"stream {shown.name!r}: {shown.partitions} partitions, epoch {shown.epoch}; "
        f"retention: {_retention.describe(shown.retention)}"
    )
    _render.print_records(states, PARTITION_COLUMNS, as_json=False)


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

    Refused for the engine stream of a Durable Streams stream (delete that by its URL).
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
