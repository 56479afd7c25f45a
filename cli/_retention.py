"""The retention options that `stream create` and `stream alter` share, and how a stored
policy reads."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

import subengine

from ._errors import CommandError

F = TypeVar("F", bound=Callable[..., object])

OPTIONS = (
    "max_age",
    "max_events",
    "max_bytes",
    "keep_unprocessed",
    "hard_max_age",
    "hard_max_events",
)
# The engine names a policy's fields as Python does; the command's user typed options.
_FIELD = re.compile(r"\b(" + "|".join(OPTIONS) + r")\b")


def option_name(field: str) -> str:
    """The option of a policy field: max_age -> --max-age."""
    return "--" + field.replace("_", "-")


def retention_options(command: F) -> F:
    """--max-age, --max-events, --max-bytes, --keep-unprocessed, --hard-max-age,
    --hard-max-events."""
    options = [
        click.option(
            "--max-age",
            metavar="AGE",
            help="Remove events recorded longer ago than AGE (45s, 30m, 12h, 7d, 2w).",
        ),
        click.option(
            "--max-events",
            type=int,
            metavar="N",
            help="Keep at most the newest N events of each partition.",
        ),
        click.option(
            "--max-bytes",
            type=int,
            metavar="N",
            help="Keep at most N bytes of event data and metadata per partition (newest first).",
        ),
        click.option(
            "--keep-unprocessed",
            is_flag=True,
            default=None,
            help="Keep events a subscription of the stream has not handled yet, up to a "
            "hard limit (one is required).",
        ),
        click.option(
            "--hard-max-age",
            metavar="AGE",
            help="With --keep-unprocessed: remove events older than AGE even if unhandled.",
        ),
        click.option(
            "--hard-max-events",
            type=int,
            metavar="N",
            help="With --keep-unprocessed: keep at most N events per partition even if unhandled.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _is_given(value: object) -> bool:
    # a flag not given is None or (older clicks) False; 0 is a value, so test identity
    return value is not None and value is not False


def given(values: Mapping[str, Any]) -> bool:
    """Whether any retention option was given."""
    return any(_is_given(values[name]) for name in OPTIONS)


def policy(**values: Any) -> subengine.Retention | None:
    """The policy the options describe (None: none given), or a one-line error naming
    the options at fault."""
    if not given(values):
        return None
    chosen = {name: values[name] for name in OPTIONS if _is_given(values[name])}
    try:
        return subengine.Retention(**chosen)
    except subengine.InvalidInput as error:
        raise CommandError(_FIELD.sub(lambda m: option_name(m.group(1)), str(error))) from None


def describe(stored: Mapping[str, Any] | None) -> str:
    """A stored policy as people read it: 'max-age 7d, max-events 1000' or 'keep all'."""
    if stored is None:
        return "keep all"
    try:
        return str(subengine.Retention.from_json(stored))
    except (subengine.InvalidInput, TypeError):
        # written by hand, not by the engine: show it as it is
        return str(dict(stored))
