"""`subengine gateway key`: create, list and revoke the HTTP gateway's API keys.

A key's token is printed once, by `create`; nothing stores or prints it again (the
database keeps only its hash), so `list` and every error show ids, never tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

import subengine

from . import _render
from ._context import Context, json_option, pass_context

OPEN_MODE = (
    "the gateway then needs no key, and `subengine serve` listens on loopback addresses only"
)


def _joined(values: Sequence[str] | None) -> str:
    return ", ".join(values) if values else "-"


KEY_COLUMNS = _render.columns(
    "id",
    "name",
    _render.Column("scopes", "scopes", _joined),
    _render.Column("streams", "streams", _joined),
    "created_at",
    "revoked_at",
)


def _listed(ctx: click.Context, param: click.Parameter, values: Sequence[str]) -> list[str]:
    """Every comma-separated item of every use of the option, in order (an empty item
    is left for the engine to refuse by name)."""
    return [item.strip() for value in values for item in value.split(",")]


def _describe(key: subengine.ApiKey) -> str:
    name = f" {key.name!r}" if key.name is not None else ""
    return f"API key {key.id}{name}"


@click.group()
def gateway() -> None:
    """The HTTP gateway's API keys (see docs/gateway.md, "API keys")."""


@gateway.group()
def key() -> None:
    """Create, list and revoke API keys: with none, the gateway is open on loopback only."""


@key.command("create")
@click.option(
    "--scopes",
    required=True,
    multiple=True,
    callback=_listed,
    metavar="SCOPE[,SCOPE...]",
    help=(
        "What the key may do: read (GET and watches), append (POST events), "
        "consume (remote workers' leases), admin."
    ),
)
@click.option(
    "--streams",
    required=True,
    multiple=True,
    callback=_listed,
    metavar="PATTERN",
    help="Streams it may touch: a name, a prefix ending in '*', or '*' for all. Repeatable.",
)
@click.option("--name", metavar="NAME", help="A name for people: who or what uses the key.")
@json_option
@pass_context
def key_create(
    context: Context, scopes: list[str], streams: list[str], name: str | None, as_json: bool
) -> None:
    """Create an API key and print its token, once: only its hash is stored, so nothing
    can show the token again. --json: one object, the key's fields and `token`."""
    created, token = context.engine().create_api_key(scopes, streams, name=name)
    if as_json:
        _render.print_json([{**_render.fields_of(created), "token": token}])
        return
    click.echo(
        f"created {_describe(created)}: {_joined(created.scopes)} on {_joined(created.streams)}"
    )
    click.echo(f"token: {token}")
    click.echo("Store the token now: it cannot be shown again.")


@key.command("list")
@json_option
@pass_context
def key_list(context: Context, as_json: bool) -> None:
    """List the API keys, revoked ones included, oldest first (ids, never tokens)."""
    keys = context.engine().api_keys()
    if not keys and not as_json:
        click.echo(f"no API keys: {OPEN_MODE}")
        return
    _render.print_records(keys, KEY_COLUMNS, as_json=as_json)


@key.command("revoke")
@click.argument("key_id", metavar="ID")
@json_option
@pass_context
def key_revoke(context: Context, key_id: str, as_json: bool) -> None:
    """Revoke the API key ID (as `key list` shows it): requests with its token are
    refused from now on. Revoking a revoked key changes nothing."""
    engine = context.engine()
    revoked = engine.revoke_api_key(key_id)
    if as_json:
        _render.print_json([revoked])
        return
    since = _render.cell(revoked.revoked_at)
    click.echo(f"{_describe(revoked)} is revoked (since {since}); its token is refused")
    if not engine.any_active_api_key():
        click.echo(f"no API key is active any more: {OPEN_MODE}")
