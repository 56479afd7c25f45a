"""`subengine parked`: the keys a subscription parked (policy park), with the events set
aside under them, and what to do with each (retry them through the app's handlers, in
order, or discard them)."""

from __future__ import annotations

import click

import subengine

from . import _render, _running
from ._context import Context, json_option, pass_context
from ._errors import CommandError
from .events import HIDDEN_EVENT_FIELDS

PARKED_COLUMNS = _render.columns(
    "subscription",
    "partition",
    "key",
    "position",
    "waiting",
    "events",
    "attempts",
    "retries",
    "resolution",
    "error",
)


@click.group("parked")
def parked() -> None:
    """Keys a subscription parked (policy park) and the events set aside under them."""


@parked.command("list")
@click.option("--subscription", "name", metavar="NAME", help="Only this subscription.")
@click.option("--all", "everything", is_flag=True, help="Retried, discarded and superseded too.")
@json_option
@pass_context
def parked_list(context: Context, name: str | None, everything: bool, as_json: bool) -> None:
    """List parked keys, oldest first: where each was parked and how many events wait."""
    rows = context.engine().parked_keys(name, everything=everything)
    _render.print_records(rows, PARKED_COLUMNS, as_json=as_json, title="parked keys")


@parked.command("show")
@click.argument("name")
@click.argument("key")
@pass_context
def parked_show(context: Context, name: str, key: str) -> None:
    """Show NAME's parking of KEY (the open one, else the latest) as one JSON object: the
    event whose failure parked it, and every event set aside under it."""
    engine = context.engine()
    events = engine.parked_events(name, key)  # InvalidInput when it never parked the key
    parkings = engine.parked_keys(name, key, everything=True)
    shown = next((p for p in parkings if p.resolution is None), parkings[-1])
    stored = engine.read(shown.stream, shown.partition, shown.position - 1, 1)
    failing = next(
        (
            _render.fields_of(e, HIDDEN_EVENT_FIELDS)
            for e in stored
            if isinstance(e, subengine.Event) and e.position == shown.position
        ),
        None,
    )
    _render.print_json(
        [
            {
                **_render.fields_of(shown),
                "event": failing,
                "parked_events": [
                    _render.fields_of(e, ("subscription", "stream", "partition", "key"))
                    for e in events
                ],
            }
        ]
    )


@parked.command("retry")
@click.argument("name")
@click.argument("key")
@click.option("--app", "app_spec", required=True, metavar="MODULE:ATTR", help="The app.")
@pass_context
def parked_retry(context: Context, name: str, key: str, app_spec: str) -> None:
    """Replay the events parked under KEY through NAME's handlers, in position order, each
    exactly once; the key is clear when none is left."""
    app = _running.load_app(app_spec)
    declared = app.subscriptions.get(name)
    if declared is None:
        raise subengine.InvalidInput(f"the app declares no subscription {name!r}")
    result = context.engine().retry_parked_key(declared, key)
    before = f"{result.replayed} event(s) were replayed before it"
    if result.error is not None:
        raise CommandError(
            f"the handlers failed again (recorded; key {key!r} stays parked): "
            f"{result.error}; {before}"
        )
    if result.superseded:
        raise CommandError(
            f"a reset released key {key!r} of {name!r} during the retry: the workers handle "
            f"its events from the reset's positions; {before}"
        )
    click.echo(
        f"retried: {result.replayed} event(s) of key {key!r} of {name!r} handled in order; "
        "the key is clear"
    )


@parked.command("discard")
@click.argument("name")
@click.argument("key")
@pass_context
def parked_discard(context: Context, name: str, key: str) -> None:
    """Release KEY without handling its parked events (they stay listed with --all);
    later events of the key are handled."""
    discarded = context.engine().discard_parked_key(name, key)
    click.echo(f"discarded: {discarded} event(s) of key {key!r} of {name!r}; the key is clear")
