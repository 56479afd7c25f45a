"""The one error handler of the command: every error prints as one line on stderr.

`error: ...`, then exit status 1 for errors the engine raises on purpose
(`SubengineError`) and for the database's own; click's usage errors keep click's status 2;
75 when another process holds what the command needs (`CommandBusy`).
The root group (`CommandLine`) catches them all, so no command handles errors itself.
"""

from __future__ import annotations

import re
from typing import IO, Any

import click

import subengine

# An API key's token (sek_<id>_<secret>), wherever a message would quote one: click's
# "extra argument (...)" quotes what it was given, and a token given in the wrong place
# must not reach a terminal's scrollback or a CI log.
TOKEN = re.compile(r"sek_[0-9a-f]{12}_[A-Za-z0-9_\-]+")
TOKEN_SHOWN = "sek_<id>_<hidden>"


def one_line(message: str) -> str:
    """`message` on one line, without tokens. Messages quote user input with repr(),
    which escapes line breaks; this catches those that embed text as it is (a file name,
    click's "extra argument (...)")."""
    message = TOKEN.sub(TOKEN_SHOWN, message)
    return " ".join(part.strip() for part in message.strip().splitlines() if part.strip())


class CommandError(click.ClickException):
    """An error shown as one line on stderr, `error: ...`; exit status 1."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.message}", file=file, err=True)


class CommandUsageError(CommandError):
    """A usage error (click's, or a bad setting) shown as one line; exit status 2."""

    exit_code = 2


class CommandBusy(CommandError):
    """Another process holds what the command needs (the pruner's lock): exit status 75,
    EX_TEMPFAIL of sysexits.h, "try again later", so that a scheduler can tell it from a
    failure."""

    exit_code = 75


class InvalidSetting(CommandUsageError):
    """A setting from the environment or a global option is invalid: status 2, as for a
    usage error, without pointing at --help (the fix is in the environment)."""


def _from_click(error: click.ClickException) -> CommandError:
    message = error.format_message()
    ctx = getattr(error, "ctx", None)
    if isinstance(error, click.UsageError) and ctx is not None:
        message = f"{message.rstrip('.')}; see '{ctx.command_path} --help'"
    # click's own statuses: 2 for usage errors, 1 for the others (an unreadable file)
    return CommandUsageError(message) if error.exit_code == 2 else CommandError(message)


def _from_database(error: Exception) -> CommandError:
    # one the engine has no better name for: its first line says what the server refused
    text = str(error).strip()
    first = text.splitlines()[0] if text else repr(error)
    return CommandError(f"the database said: {first}")


class CommandLine(click.Group):
    """The root group: errors raised while parsing or by any command print as one line."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise  # `subengine` alone prints the help
        except CommandError:
            raise
        except click.ClickException as error:
            raise _from_click(error) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.NoArgsIsHelpError, CommandError):
            raise
        except click.ClickException as error:
            raise _from_click(error) from None
        except subengine.SubengineError as error:
            raise CommandError(str(error)) from None
        except Exception as error:
            import psycopg  # here, not at the top: --help needs no database driver

            if not isinstance(error, psycopg.Error):
                raise
            raise _from_database(error) from None
