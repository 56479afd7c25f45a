"""`subengine dead-letters`: the events a subscription gave up on, and what to do with
each (retry it through the app's handlers, or discard it)."""

from __future__ import annotations

import click

import subengine

from . import _render, _running
from ._context import Context, json_option, pass_context
from ._errors import CommandError
from .events import HIDDEN_EVENT_FIELDS

DEAD_LETTER_COLUMNS = _render.columns(
    "subscription",
    "partition",
    "position",
    "key",
    "type",
    "attempts",
    "retries",
    "resolution",
    "error",
)


@click.group("dead-letters")
def dead_letters() -> None:
    """Events a subscription gave up on (policy dead_letter)."""


@dead_letters.command("list")
@click.option("--subscription", "name", metavar="NAME", help="Only this subscription.")
@click.option("--all", "everything", is_flag=True, help="Resolved ones too.")
@json_option
@pass_context
def dead_letters_list(context: Context, name: str | None, everything: bool, as_json: bool) -> None:
    """List unresolved dead letters, oldest first."""
    rows = context.engine().dead_letters(name, everything)
    _render.print_records(rows, DEAD_LETTER_COLUMNS, as_json=as_json, title="dead letters")


@dead_letters.command("show")
@click.argument("name")
@click.argument("partition", type=int)
@click.argument("position", type=int)
@pass_context
def dead_letters_show(context: Context, name: str, partition: int, position: int) -> None:
    """Show one dead letter with its event, as one JSON object."""
    engine = context.engine()
    letter = next(
        (
            r
            for r in engine.dead_letters(name, everything=True)
            if (r.partition, r.position) == (partition, position)
        ),
        None,
    )
    if letter is None:
        raise subengine.InvalidInput(
            f"subscription {name!r} has no dead letter at partition {partition} position {position}"
        )
    events = engine.read(letter.stream, partition, position - 1, 1)
    event = _render.fields_of(events[0], HIDDEN_EVENT_FIELDS) if events else None
    _render.print_json([{**_render.fields_of(letter), "event": event}])


@dead_letters.command("retry")
@click.argument("name")
@click.argument("partition", type=int)
@click.argument("position", type=int)
@click.option("--app", "app_spec", required=True, metavar="MODULE:ATTR", help="The app.")
@pass_context
def dead_letters_retry(
    context: Context, name: str, partition: int, position: int, app_spec: str
) -> None:
    """Run one dead letter through NAME's handlers again, in a transaction."""
    app = _running.load_app(app_spec)
    declared = app.subscriptions.get(name)
    if declared is None:
        raise subengine.InvalidInput(f"the app declares no subscription {name!r}")
    error = context.engine().retry_dead_letter(declared, partition, position)
    if error is not None:
        raise CommandError(f"the handlers failed again (recorded): {error}")
    click.echo(f"retried: partition {partition} position {position} of {name!r} is handled")


@dead_letters.command("discard")
@click.argument("name")
@click.argument("partition", type=int)
@click.argument("position", type=int)
@pass_context
def dead_letters_discard(context: Context, name: str, partition: int, position: int) -> None:
    """Mark one dead letter discarded (it stays listed with --all)."""
    context.engine().discard_dead_letter(name, partition, position)
    click.echo(f"discarded: partition {partition} position {position} of {name!r}")
