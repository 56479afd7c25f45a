"""The command's own kinds of option value: finite numbers, times, start points, JSON."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from . import _json

if TYPE_CHECKING:
    TimeType = click.ParamType[datetime]
    StartType = click.ParamType[Any]
else:
    # Generic to type checkers only: click's ParamType takes no parameters before click
    # 8.4, and needs two at run time before Python 3.13.
    TimeType = StartType = click.ParamType


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange lets NaN through (it compares false with both bounds)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if number != number:
            self.fail(f"{value!r} is not a number", param, ctx)
        return number


class IsoTime(TimeType):
    """An ISO 8601 time; one without a zone is taken as UTC, or refused when
    `zone_required` (where a wrong guess would skip or repeat events)."""

    name = "TIME"

    def __init__(self, *, zone_required: bool = False) -> None:
        self.zone_required = zone_required

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> datetime:
        if isinstance(value, datetime):
            return value
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            self.fail(
                f"{_json.shown(value)} is not an ISO 8601 time (e.g. 2026-11-21T10:00:00Z)",
                param,
                ctx,
            )
        if parsed.tzinfo is not None:
            return parsed
        if self.zone_required:
            self.fail(
                f"{_json.shown(value)} names no time zone: add one (Z for UTC, or e.g. +01:00)",
                param,
                ctx,
            )
        return parsed.replace(tzinfo=UTC)


class StartPoint(StartType):
    """`beginning`, `end`, an ISO 8601 time (UTC unless it names a zone), or a JSON object
    of partition to position."""

    name = "beginning|end|TIME|JSON"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or value in ("beginning", "end"):
            return value
        if value.lstrip().startswith("{"):
            try:
                positions = _json.parse(value)
                if not isinstance(positions, dict):
                    raise ValueError("it is not an object")
                return {_partition(key): position for key, position in positions.items()}
            except ValueError as error:
                self.fail(
                    f"{_json.shown(value)} is not a JSON object of partition to position: {error}",
                    param,
                    ctx,
                )
        return IsoTime().convert(value, param, ctx)


def _partition(key: str) -> int:
    # int() would also take ' 1', '1_0' and digits of other scripts
    if not (key.isascii() and key.isdigit()) or len(key) > len(str(2**31)):
        raise ValueError(f"partition {_json.shown(key)} is not a whole number of a partition")
    return int(key)


def json_value(option: str, text: str) -> Any:
    """The JSON value of option `option` (e.g. '--data'); a bad one is a usage error."""
    try:
        return _json.parse(text)
    except ValueError as error:
        raise click.BadParameter(f"not valid JSON: {error}", param_hint=f"'{option}'") from None
