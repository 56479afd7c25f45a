"""`subengine workers`: the registered worker processes, and pruning those that are gone."""

from __future__ import annotations

import click

from . import _render
from ._context import Context, json_option, pass_context

REGISTRATION_COLUMNS = _render.columns(
    "id",
    "host",
    "pid",
    "subscriptions",
    ("started_at", "started"),
    ("heartbeat_at", "heartbeat"),
)
WORKER_COLUMNS = (
    *REGISTRATION_COLUMNS[:5],
    *_render.columns(
        ("seconds_since_heartbeat", "heartbeat s ago"),
        "connected",
        ("partitions_held", "partitions held"),
    ),
)


@click.group(invoke_without_command=True)
@json_option
@click.pass_context
def workers(ctx: click.Context, as_json: bool) -> None:
    """The registered workers: host, pid, heartbeat, connected, partitions held."""
    if ctx.invoked_subcommand is not None:
        return
    context: Context = ctx.obj  # the root group's
    rows = context.engine().workers()
    _render.print_records(rows, WORKER_COLUMNS, as_json=as_json, title="workers")


@workers.command("prune")
@json_option
@pass_context
def workers_prune(context: Context, as_json: bool) -> None:
    """Remove the registrations of workers that are gone (no connection of theirs open,
    no recent heartbeat); each worker also does this when it starts."""
    rows = context.engine().prune_workers()
    _render.print_records(rows, REGISTRATION_COLUMNS, as_json=as_json, title="removed")
