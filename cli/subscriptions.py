"""`subengine subscription`: create, inspect, pause, resume, reset and delete stored
subscriptions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click

import subengine

from . import _render
from ._context import Context, json_option, pass_context
from ._params import StartPoint

SUBSCRIPTION_COLUMNS = _render.columns(
    "name", "stream", "start", "generation", "paused", ("created_at", "created")
)
# Where a subscription stands in each partition: `subengine status --partitions` too.
PARTITION_COLUMNS = _render.columns(
    "subscription",
    "partition",
    "position",
    "head",
    "floor",
    "lag",
    ("lag_seconds", "lag s"),
    "state",
    ("gap_from", "gap from"),
    ("gap_to", "gap to"),
    "attempts",
    ("last_error", "last error"),
    ("worker_pid", "worker pid"),
    ("worker_host", "worker host"),
    ("parked_keys", "parked keys"),
    ("parked_events", "parked events"),
)
POSITION_COLUMNS = _render.columns("partition", "position", "generation")


@dataclass(frozen=True)
class Move:
    """What a reset does to one partition: its position before and after."""

    partition: int
    position: int | None
    after_reset: int
    moves: bool


MOVE_COLUMNS = _render.columns(
    "partition",
    "position",
    ("after_reset", "after reset"),
    _render.Column("moves", "", lambda moves: "" if moves else "unchanged"),
)


@click.group()
def subscription() -> None:
    """Create, inspect, pause, resume and reset stored subscriptions."""


@subscription.command("create")
@click.argument("name")
@click.option("--stream", "stream_name", required=True, help="The stream it consumes.")
@click.option(
    "--start",
    type=StartPoint(),
    default="beginning",
    show_default=True,
    help="Where it begins: beginning, end, a time, or a JSON map of partition to position.",
)
@json_option
@pass_context
def subscription_create(
    context: Context, name: str, stream_name: str, start: Any, as_json: bool
) -> None:
    """Store subscription NAME (an app declaring it later must agree on stream and start)."""
    engine = context.engine()
    engine.ensure_subscription(subengine.Subscription(name, stream_name, start))
    positions = engine.subscription_positions(name)
    _render.print_records(positions, POSITION_COLUMNS, as_json=as_json)


@subscription.command("reset")
@click.argument("name")
@click.option(
    "--to",
    "to",
    type=StartPoint(),
    required=True,
    help="beginning, end, a time (the first event recorded at or after it is next), "
    "or a JSON map of partition to position (only the partitions it names move).",
)
@click.option("--dry-run", is_flag=True, help="Print what the reset would do; change nothing.")
@json_option
@pass_context
def subscription_reset(context: Context, name: str, to: Any, dry_run: bool, as_json: bool) -> None:
    """Move the positions of NAME at once, in a new generation (workers may run)."""
    engine = context.engine()
    before = {p.partition: p.position for p in engine.subscription_positions(name)}
    after = engine.reset_subscription(name, to, dry_run=dry_run)
    named = set(to) if isinstance(to, dict) else set(after)
    moves = [Move(p, before.get(p), a, p in named) for p, a in after.items()]
    _render.print_records(moves, MOVE_COLUMNS, as_json=as_json)
    if dry_run:
        click.echo("dry run: nothing changed", err=True)


@subscription.command("delete")
@click.argument("name")
@click.option("--force", is_flag=True, help="Delete it even while connected workers run it.")
@json_option
@pass_context
def subscription_delete(context: Context, name: str, force: bool, as_json: bool) -> None:
    """Delete subscription NAME with its positions and dead letters, in one transaction.

    Refused while connected workers run it, unless --force. An app that declares it
    again later stores it anew, from its start point."""
    deleted = context.engine().delete_subscription(name, force=force)
    if as_json:
        _render.print_json([deleted])
        return
    click.echo(
        f"deleted subscription {deleted.name!r} (stream {deleted.stream!r}): "
        f"{deleted.partitions} positions, {deleted.dead_letters} dead letters"
    )


@subscription.command("skip-gap")
@click.argument("name")
@click.option("--partition", type=int, required=True, help="The partition in state gap.")
@json_option
@pass_context
def subscription_skip_gap(context: Context, name: str, partition: int, as_json: bool) -> None:
    """Accept the gap of partition --partition of NAME and go on after it.

    Retention removed events NAME had not handled; with policy on_gap='stop' the partition
    halts in state gap. This records the gap (action 'accepted' in the gaps table), moves
    the position past it and restarts the partition, in one transaction."""
    gap = context.engine().skip_gap(name, partition)
    if as_json:
        _render.print_json([gap])
        return
    click.echo(f"subscription {name!r} skipped the {gap}; it goes on from position {gap.floor}")


@subscription.command("list")
@json_option
@pass_context
def subscription_list(context: Context, as_json: bool) -> None:
    """List the stored subscriptions."""
    rows = context.engine().subscriptions()
    _render.print_records(rows, SUBSCRIPTION_COLUMNS, as_json=as_json, title="subscriptions")


@subscription.command("show")
@click.argument("name")
@json_option
@pass_context
def subscription_show(context: Context, name: str, as_json: bool) -> None:
    """Show every partition of subscription NAME: position, lag, state, errors, holder,
    parked keys and events."""
    rows = context.engine().subscription_status(name)
    _render.print_records(rows, PARTITION_COLUMNS, as_json=as_json, title=f"subscription {name}")


@subscription.command("pause")
@click.argument("name")
@pass_context
def subscription_pause(context: Context, name: str) -> None:
    """Pause NAME: workers take none of its partitions (batches in flight finish)."""
    context.engine().pause_subscription(name)
    click.echo(f"paused subscription {name!r}")


@subscription.command("resume")
@click.argument("name")
@pass_context
def subscription_resume(context: Context, name: str) -> None:
    """Resume NAME, and restart its stopped partitions."""
    restarted = context.engine().resume_subscription(name)
    note = f"; restarted stopped partitions {', '.join(map(str, restarted))}" if restarted else ""
    click.echo(f"resumed subscription {name!r}{note}")


@subscription.command("remote-policy")
@click.argument("name")
@click.option(
    "--on-error",
    type=click.Choice(["stop", "dead_letter", "park"]),
    default="stop",
    show_default=True,
    help="What remote workers' nacks lead to at the last attempt.",
)
@click.option("--max-attempts", type=int, default=5, show_default=True, help="Attempts per event.")
@click.option("--batch-size", type=int, default=100, show_default=True, help="Events per lease.")
@pass_context
def subscription_remote_policy(
    context: Context, name: str, on_error: str, max_attempts: int, batch_size: int
) -> None:
    """Set the error policy and batch size of NAME's remote workers (docs/remote-workers.md)."""
    context.engine().set_remote_policy(name, on_error, max_attempts, batch_size)
    click.echo(
        f"remote workers of {name!r}: on_error={on_error}, max_attempts={max_attempts}, "
        f"batch_size={batch_size}"
    )


LEASE_COLUMNS = _render.columns(
    "partition", "worker", "position", "through", "generation", "deadline", "id"
)


@subscription.command("leases")
@click.argument("name")
@json_option
@pass_context
def subscription_leases(context: Context, name: str, as_json: bool) -> None:
    """List NAME's live leases of remote workers (docs/remote-workers.md)."""
    leases = context.engine().remote_leases(name)
    _render.print_records(leases, LEASE_COLUMNS, as_json=as_json, title=f"leases of {name}")
