"""`subengine status`: the lag and state of every subscription, once or live."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

import subengine

from . import _render
from ._context import Context, json_option, pass_context
from ._params import FiniteFloatRange
from .subscriptions import PARTITION_COLUMNS

if TYPE_CHECKING:
    from rich.table import Table

SUMMARY_COLUMNS = _render.columns(
    "subscription",
    "stream",
    "partitions",
    "lag",
    ("lag_seconds", "lag s"),
    "ok",
    "idle",
    "retrying",
    "stopped",
    "paused",
    "gap",
    ("parked_keys", "parked keys"),
    ("parked_events", "parked events"),
    "workers",
    "generation",
)


@click.command()
@click.option("--subscription", "name", metavar="NAME", help="Only this subscription.")
@click.option("--partitions", is_flag=True, help="One row per partition.")
@json_option
@click.option("--watch", is_flag=True, help="Redraw until Ctrl-C, with the lag drained.")
@click.option(
    "--interval",
    type=FiniteFloatRange(0.1, 3600),
    default=1.0,
    show_default=True,
    help="Seconds between redraws with --watch.",
)
@pass_context
def status(
    context: Context,
    name: str | None,
    partitions: bool,
    as_json: bool,
    watch: bool,
    interval: float,
) -> None:
    """Lag and state of every subscription (per partition with --partitions)."""
    if as_json and watch:
        raise click.UsageError("--watch cannot be combined with --json")
    engine = context.engine()
    per_partition = partitions or name is not None
    columns = PARTITION_COLUMNS if per_partition else SUMMARY_COLUMNS

    def rows() -> Sequence[subengine.PartitionStatus | subengine.SubscriptionSummary]:
        if per_partition:
            return engine.subscription_status(name)
        return engine.subscription_summary(name)

    if not watch:
        _render.print_records(rows(), columns, as_json=as_json, title="subscriptions")
        return

    def render() -> tuple[Table, int]:
        current = rows()
        return _render.table(current, columns, "subscriptions"), sum(r.lag for r in current)

    _render.watch(render, interval)
