"""`subengine webhook`: create, list, show, pause, resume, replay and delete webhook
subscriptions (docs/webhooks.md, "Operating").

Subscribers create them through the gateway (PUT /v1/webhooks/{id}); an operator may
create one here too, sees their state, failed attempts and lag, pauses and resumes them,
replays one from a cursor or a time, and deletes one. A secret is shown once, when
`create` makes it, never again.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import click

from subengine.model._declarations import Start
from subengine.outside._webhooks import Put, WebhookDefinition, describe_streams, streams_of

from . import _render
from ._context import Context, json_option, pass_context
from ._params import IsoTime

WEBHOOK_COLUMNS = _render.columns(
    "id",
    "state",
    "paused",
    "callback",
    _render.Column("streams", "streams", describe_streams),
    "lag",
    "attempts",
    "last_success_at",
    "expires_at",
)


@click.group()
def webhook() -> None:
    """Webhook subscriptions of the gateway: create them, see their state and lag, pause,
    resume, replay and delete them (see docs/webhooks.md)."""


@webhook.command("list")
@json_option
@pass_context
def webhook_list(context: Context, as_json: bool) -> None:
    """List the webhook subscriptions, oldest first: state (pending, active, failing,
    failed, expired), events not yet delivered (lag), failed attempts since the last
    success, the last success and when the lease ends."""
    hooks = context.engine().webhooks()
    if as_json:
        _render.print_json([hook.to_json() for hook in hooks])
        return
    if not hooks:
        click.echo("no webhook subscriptions")
        return
    _render.print_records(hooks, WEBHOOK_COLUMNS, as_json=False)


@webhook.command("show")
@click.argument("webhook_id", metavar="ID")
@json_option
@pass_context
def webhook_show(context: Context, webhook_id: str, as_json: bool) -> None:
    """Show one webhook subscription, with its last error."""
    hook = context.engine().webhook(webhook_id)
    if as_json:
        _render.print_json([hook.to_json()])
        return
    for name, value in hook.to_json().items():
        shown = describe_streams(hook.streams) if name == "streams" else _render.cell(value)
        click.echo(f"{name}: {shown}")


@webhook.command("delete")
@click.argument("webhook_id", metavar="ID")
@pass_context
def webhook_delete(context: Context, webhook_id: str) -> None:
    """Delete a webhook subscription and its positions: nothing more is sent under its
    id, and a batch in flight for it commits nothing. Its subscriber may subscribe again."""
    context.engine().delete_webhook(webhook_id)
    click.echo(f"deleted webhook subscription {webhook_id}")


@webhook.command("create")
@click.argument("webhook_id", metavar="ID")
@click.option("--callback", required=True, help="The URL deliveries are POSTed to.")
@click.option(
    "--stream", "streams", multiple=True, required=True, help="A stream to deliver (repeat it)."
)
@click.option("--type", "types", multiple=True, help="Deliver only events of this type (repeat).")
@click.option("--key", "keys", multiple=True, help="Deliver only events of this key (repeat).")
@click.option(
    "--start",
    type=click.Choice(["now", "beginning"]),
    default=None,
    help="Deliver what commits from now on (default), or every stored event.",
)
@click.option("--after", "cursor", metavar="CURSOR", help="Start where a gateway cursor stands.")
@click.option("--since", type=IsoTime(), help="Start at the events recorded from a time on.")
@click.option(
    "--max-events",
    type=click.IntRange(1, 1000),
    default=100,
    show_default=True,
    help="Events per POST.",
)
@click.option(
    "--lease-seconds",
    type=click.IntRange(60, 2_592_000),
    default=86_400,
    show_default=True,
    help="How long it lasts unless renewed (the same create, or PUT, again).",
)
@click.option("--no-data", is_flag=True, help="Send events without their data.")
@click.option("--secret", help="The signing secret (whsec_...); made for you when absent.")
@click.option("--replaces", metavar="ID", help="Another webhook id, deleted in the same change.")
@click.option(
    "--api-key",
    "key_id",
    metavar="KEY_ID",
    help="The API key it belongs to: seen, renewed and deleted over HTTP with that key only.",
)
@click.option(
    "--callback-allow",
    default="",
    metavar="CIDRS",
    help="Internal networks the callback may reach (as for `subengine serve`).",
)
@json_option
@pass_context
def webhook_create(
    context: Context,
    webhook_id: str,
    callback: str,
    streams: tuple[str, ...],
    types: tuple[str, ...],
    keys: tuple[str, ...],
    start: str | None,
    cursor: str | None,
    since: datetime | None,
    max_events: int,
    lease_seconds: int,
    no_data: bool,
    secret: str | None,
    replaces: str | None,
    key_id: str | None,
    callback_allow: str,
    as_json: bool,
) -> None:
    """Create webhook subscription ID, as PUT /v1/webhooks/ID does: pending until its
    callback echoes the challenge that a gateway process sends. Prints its secret, which
    is shown this once. The same ID and definition again renews its lease."""
    if sum(given is not None for given in (start, cursor, since)) > 1:
        raise click.UsageError("give one of --start, --after and --since")
    filters = {"type": list(types) or None, "key": list(keys) or None}
    chosen = streams_of({name: filters for name in streams})
    definition = WebhookDefinition(
        _checked_callback(callback, callback_allow),
        chosen,
        include_data=not no_data,
        max_events=max_events,
        lease_seconds=lease_seconds,
    )
    engine = context.engine()
    if key_id is not None and not any(
        key.id == key_id and key.revoked_at is None for key in engine.api_keys()
    ):
        raise click.BadParameter(
            f"no API key {key_id!r} that is not revoked; `subengine gateway key list` "
            "shows the keys",
            param_hint="--api-key",
        )
    names = [s.stream for s in chosen]
    starts: dict[str, Start]
    if start == "beginning":
        starts = {name: "beginning" for name in names}
    else:  # "now": the heads as they are now, as the PUT takes them
        starts = {name: engine.heads(name) for name in names}
    if cursor is not None or since is not None:
        found = engine.webhook_starts(names, after=cursor, since=since)
        missing = [name for name in names if name not in found]
        if missing:
            raise click.UsageError(f"the cursor has no position in stream {missing[0]!r}")
        starts = dict(found)
    put = engine.put_webhook(
        webhook_id, definition, starts, secret=secret, replaces=replaces, key_id=key_id
    )
    _print_put(put, as_json)


def _checked_callback(callback: str, allow: str) -> str:
    """The callback URL, normalized, if it is valid and reaches an address callbacks may
    reach (public ones, and the networks of `allow`)."""
    from subengine.gateway._callbacks import (
        CallbackClient,
        CallbackPolicy,
        CallbackRefused,
        check_callback_url,
    )

    url = check_callback_url(callback)
    with CallbackClient(CallbackPolicy.from_text(allow)) as client:
        try:
            client.check_now(url)
        except CallbackRefused as refused:
            raise click.ClickException(
                f"callback host {refused.host!r} refused: its address {refused.address} is "
                f"{refused.reason}; to allow it, pass --callback-allow here and start every "
                "gateway process with `subengine serve --callback-allow "
                f"{refused.network}` (the delivering ones check it at every connection)"
            ) from None
    return url


def _print_put(put: Put, as_json: bool) -> None:
    shown: dict[str, Any] = put.webhook.to_json()
    if put.secret is not None:
        shown["secret"] = put.secret
    if as_json:
        _render.print_json([shown])
        return
    done = "created" if put.created else "renewed the lease of"
    click.echo(f"{done} webhook subscription {put.webhook.id} ({put.webhook.state})")
    click.echo(f"streams: {describe_streams(put.webhook.streams)}")
    click.echo(f"expires_at: {_render.cell(put.webhook.expires_at)}")
    if put.secret is not None:
        click.echo(f"secret: {put.secret}  (shown this once: keep it where the receiver is)")


@webhook.command("pause")
@click.argument("webhook_id", metavar="ID")
@pass_context
def webhook_pause(context: Context, webhook_id: str) -> None:
    """Pause a webhook subscription: nothing is delivered (a batch in flight is sent
    again after the resume), its positions stay, and its failure timeout waits."""
    context.engine().pause_webhook(webhook_id)
    click.echo(
        f"paused webhook subscription {webhook_id}; "
        f"`subengine webhook resume {webhook_id}` delivers again from where it stands"
    )


@webhook.command("resume")
@click.argument("webhook_id", metavar="ID")
@pass_context
def webhook_resume(context: Context, webhook_id: str) -> None:
    """Resume a paused webhook subscription from where it stands."""
    hook = context.engine().pause_webhook(webhook_id, paused=False)
    click.echo(f"resumed webhook subscription {webhook_id} ({hook.state}, lag {hook.lag})")


@webhook.command("replay")
@click.argument("webhook_id", metavar="ID")
@click.option("--after", "cursor", metavar="CURSOR", help="From where a gateway cursor stands.")
@click.option("--since", type=IsoTime(), help="From the events recorded at this time on.")
@json_option
@pass_context
def webhook_replay(
    context: Context, webhook_id: str, cursor: str | None, since: datetime | None, as_json: bool
) -> None:
    """Deliver a webhook subscription's events again, from a gateway cursor (the streams
    it holds) or a time (every stream). Its positions move through the engine's reset,
    in a new generation: a batch in flight commits nothing, and the batches that follow
    carry the new generation."""
    if (cursor is None) == (since is None):
        raise click.UsageError("give --after CURSOR or --since TIME")
    moved = context.engine().replay_webhook(webhook_id, after=cursor, since=since)
    if as_json:
        _render.print_json([{"stream": name, "positions": p} for name, p in moved.items()])
        return
    for name, positions in moved.items():
        shown = ", ".join(f"{partition}:{at}" for partition, at in sorted(positions.items()))
        click.echo(f"replaying {name} of webhook {webhook_id} from partition:position {shown}")
