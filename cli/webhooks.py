"""`subengine webhook`: list, show and delete webhook subscriptions (docs/webhooks.md).

Subscribers create them through the gateway (PUT /v1/webhooks/{id}); an operator sees
their state, failed attempts and lag here, and may delete one. No secret is ever shown.
"""

from __future__ import annotations

import click

from subengine.outside._webhooks import describe_streams

from . import _render
from ._context import Context, json_option, pass_context

WEBHOOK_COLUMNS = _render.columns(
    "id",
    "state",
    "callback",
    _render.Column("streams", "streams", describe_streams),
    "lag",
    "attempts",
    "last_success_at",
    "expires_at",
)


@click.group()
def webhook() -> None:
    """Webhook subscriptions of the gateway: their state and lag (see docs/webhooks.md)."""


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
