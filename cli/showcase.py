"""`subengine demo`: the engine shown working end to end (see _demo).

The command lives apart from the demo itself, which only `subengine demo` imports: the
command line's start, and its help, load nothing of the demo.
"""

from __future__ import annotations

import sys

import click

import subengine

from ._context import Context, pass_context
from ._params import FiniteFloatRange


@click.command()
@click.option(
    "--events",
    "event_count",
    type=click.IntRange(100, 100_000),
    default=4000,
    show_default=True,
    help="How many order events the producer appends.",
)
@click.option(
    "--rate",
    type=FiniteFloatRange(10, 100_000),
    default=1000,
    show_default=True,
    help="Events per second the producer aims for.",
)
@pass_context
def demo(context: Context, event_count: int, rate: float) -> None:
    """Show the engine working: two worker processes project order events while a
    producer appends them; one is killed half-way; the projection is then checked
    against the events exactly (exit 0 only if it matches).

    It writes only into the schema subengine_demo, which it creates and marks (not the
    one of --schema or SUBENGINE_SCHEMA), and refuses a schema of that name it did not
    make."""
    from . import _demo

    with subengine.Engine(settings=_demo.settings(context.settings)) as engine:
        ok = _demo.run(engine, event_count, rate, click.echo)
    sys.exit(0 if ok else 1)
