"""What every command shares: the settings, an engine made on first use, and the options
that several commands take alike (`--json`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

import subengine

from . import _running

F = TypeVar("F", bound=Callable[..., object])


class Context:
    """The settings of this run of the command, and an engine made on first use."""

    def __init__(self, settings: subengine.Settings) -> None:
        self.settings = settings
        self._engine: subengine.Engine | None = None
        # installed by the root group for `subengine worker`, before anything slow
        self.stop_signals: _running.StopSignals | None = None
        # --log-level and --log-format of the root group (None: not given)
        self.log_level: str | None = None
        self.log_format: str | None = None

    def engine(self) -> subengine.Engine:
        if self._engine is None:
            self._engine = subengine.Engine(settings=self.settings)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


pass_context = click.make_pass_decorator(Context)


def json_option(command: F) -> F:
    """`--json`: print every record as one JSON object per line, with all its fields."""
    return click.option(
        "--json", "as_json", is_flag=True, help="One JSON object per line, every field."
    )(command)
