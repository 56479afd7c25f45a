"""The `subengine` command: the root group, its global options, and where each command
lives.

Every command parses its arguments, calls the engine and presents the result, through one
renderer (_render: tables and JSON) and one error handler (_errors: every error one line).
Each global option has an environment variable, named on `subengine --help`.

Starting the command stays cheap (`subengine --help` imports no table renderer, no demo,
no migrations and no database driver of its own): modules that only some commands need
are imported by those commands.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

import subengine

from . import _running
from ._context import Context
from ._errors import CommandLine, InvalidSetting
from .database import db, migrate
from .dead_letters import dead_letters
from .events import append, read
from .gateway import gateway
from .parked import parked
from .retention import retention
from .serve import serve
from .showcase import demo
from .status import status
from .streams import stream
from .subscriptions import subscription
from .webhooks import webhook
from .worker import LOG_FORMAT_HELP, LOG_FORMATS, LOG_LEVELS, worker
from .workers import workers


@click.group(cls=CommandLine, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--dsn", envvar="SUBENGINE_DSN", show_envvar=True, help="PostgreSQL URL or conninfo.")
@click.option(
    "--schema", envvar="SUBENGINE_SCHEMA", show_envvar=True, help="Schema of subengine's objects."
)
@click.option(
    "--home",
    envvar="SUBENGINE_HOME",
    show_envvar=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory of the embedded PostgreSQL (used only without a DSN).",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS),
    envvar="SUBENGINE_LOG_LEVEL",
    show_envvar=True,
    help="Log to stderr from this level on [default: nothing below warning; worker: info].",
)
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    envvar="SUBENGINE_LOG_FORMAT",
    show_envvar=True,
    help=f"{LOG_FORMAT_HELP} [default: text]",
)
@click.version_option(package_name="subengine")
@click.pass_context
def cli(
    ctx: click.Context,
    dsn: str | None,
    schema: str | None,
    home: Path | None,
    log_level: str | None,
    log_format: str | None,
) -> None:
    """subengine: partitioned event streams in PostgreSQL, consumed exactly once."""
    # First, so that a supervisor's SIGTERM during the worker's start-up stops it cleanly.
    stop_signals = _running.StopSignals() if ctx.invoked_subcommand == "worker" else None
    try:
        settings = subengine.Settings.from_env(dsn=dsn, schema=schema, home=home)
    except subengine.SubengineError as error:
        raise InvalidSetting(str(error)) from None
    if ctx.invoked_subcommand != "worker" and (log_level or log_format):
        subengine.configure_logging(
            log_level or "warning", "json" if log_format == "json" else "text"
        )
    context = Context(settings)
    context.stop_signals = stop_signals
    context.log_level, context.log_format = log_level, log_format
    ctx.obj = context
    ctx.call_on_close(context.close)


for command in (
    migrate,
    db,
    stream,
    retention,
    append,
    read,
    worker,
    subscription,
    status,
    workers,
    dead_letters,
    parked,
    serve,
    demo,
    gateway,
    webhook,
):
    cli.add_command(command)


def main() -> None:
    try:
        cli(prog_name="subengine")
    except _running.StoppedBeforeStart as stopped:
        click.echo(str(stopped), err=True)
        sys.exit(0)
