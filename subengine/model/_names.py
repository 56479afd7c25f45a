"""Validation of the names users give: streams, event types, keys and the schema.

Names are checked before any SQL runs, so a hostile name never reaches the database and
the error says exactly which rule it broke.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from subengine.model._errors import ConfigurationError, InvalidInput

STREAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}")
STREAM_NAME_RULE = (
    "1 to 100 characters: letters, digits, '_', '.', '-', starting with a letter or digit"
)
SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
MAX_KEY_LENGTH = 1000
MAX_TYPE_LENGTH = 200
MAX_PARTITIONS = 4096
# The times an event may carry, and the bounds of every read by time: PostgreSQL stores a
# wider range, but Python reads back only years 1 to 9999, in any zone.
EARLIEST = datetime(1, 1, 2, tzinfo=UTC)
LATEST = datetime(9999, 12, 30, tzinfo=UTC)


def _shown(value: str) -> str:
    return repr(value) if len(value) <= 60 else repr(value[:60]) + f"... ({len(value)} chars)"


def shown_value(value: object) -> str:
    """`value` as an error message quotes it: its repr, cut short when it is long."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int too long to print, a structure too deep
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= 60 else f"{text[:60]}... ({len(text)} characters)"


def validate_stream_name(name: object) -> str:
    if not isinstance(name, str) or STREAM_NAME.fullmatch(name) is None:
        shown = _shown(name) if isinstance(name, str) else type(name).__name__
        raise InvalidInput(f"invalid stream name {shown}: use {STREAM_NAME_RULE}")
    return name


def validate_schema_name(name: str) -> str:
    if SCHEMA_NAME.fullmatch(name) is None:
        raise ConfigurationError(
            f"invalid schema name {_shown(name)}: use 1 to 63 lower-case letters, digits "
            "and '_', not starting with a digit"
        )
    return name


BIGINT_MAX = 2**63 - 1
INTEGER_MAX = 2**31 - 1


def is_whole_number(value: object, minimum: int, maximum: int) -> bool:
    """An int (not a bool) from `minimum` to `maximum`."""
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum


def validate_whole_number(value: object, what: str, minimum: int, maximum: int) -> int:
    if not is_whole_number(value, minimum, maximum):
        raise InvalidInput(
            f"{what} must be a whole number from {minimum} to {maximum}, not {shown_value(value)}"
        )
    return value  # type: ignore[return-value]


def validate_partition_count(partitions: object) -> int:
    if not is_whole_number(partitions, 1, MAX_PARTITIONS):
        raise InvalidInput(
            f"invalid partition count {shown_value(partitions)}: use a whole number from 1 to "
            f"{MAX_PARTITIONS}"
        )
    return partitions  # type: ignore[return-value]


def validate_key(key: object) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        shown = _shown(key) if isinstance(key, str) else type(key).__name__
        raise InvalidInput(
            f"invalid event key {shown}: use 1 to {MAX_KEY_LENGTH} printable characters"
        )
    return key


def validate_type(event_type: object) -> str:
    if (
        not isinstance(event_type, str)
        or not event_type
        or len(event_type) > MAX_TYPE_LENGTH
        or not event_type.isprintable()
        or event_type.strip() != event_type
    ):
        shown = _shown(event_type) if isinstance(event_type, str) else type(event_type).__name__
        raise InvalidInput(
            f"invalid event type {shown}: use 1 to {MAX_TYPE_LENGTH} printable characters "
            "without leading or trailing spaces"
        )
    return event_type
