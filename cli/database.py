"""`subengine migrate` and `subengine db`: the schema, and the database it lives in."""

from __future__ import annotations

import click

import subengine

from . import _render
from ._context import Context, json_option, pass_context


@click.command()
@click.option("--sql", "as_sql", is_flag=True, help="Print the SQL instead of running it.")
@json_option
@pass_context
def migrate(context: Context, as_sql: bool, as_json: bool) -> None:
    """Create or upgrade subengine's schema (safe to run from many processes at once)."""
    if as_sql:
        if as_json:
            raise click.UsageError("--sql cannot be combined with --json")
        click.echo(subengine.migration_sql(context.settings.schema), nl=False)
        return
    engine = context.engine()
    engine.migrate()
    revision = engine.schema_revision()
    if as_json:
        _render.print_json([{"schema": engine.schema, "revision": revision}])
    else:
        click.echo(f"schema {engine.schema!r} is at revision {revision}")


@click.group()
def db() -> None:
    """The database subengine uses (the embedded one when no DSN is given)."""


@db.command("url")
@pass_context
def db_url(context: Context) -> None:
    """Print the connection URL (starting the embedded PostgreSQL if needed)."""
    click.echo(context.engine().dsn)


@db.command("stop")
@pass_context
def db_stop(context: Context) -> None:
    """Stop the embedded PostgreSQL of SUBENGINE_HOME."""
    home = context.settings.home.expanduser().resolve()
    if subengine.stop_embedded(home):
        click.echo(f"stopped the embedded PostgreSQL in {home}")
    else:
        click.echo(f"no embedded PostgreSQL is running in {home}")
