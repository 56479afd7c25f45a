"""The options of the `subengine` Spark data source, parsed and checked before any job runs.

Spark hands a data source its options as a case-insensitive map of strings; everything
here turns them into typed values with errors that name the option. Connection settings
never travel as options (options show in query plans and logs): the DSN comes from an
environment variable whose name the `dsnEnv` option gives.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from subengine.model._errors import ConfigurationError, InvalidInput
from subengine.model._names import (
    BIGINT_MAX,
    INTEGER_MAX,
    MAX_PARTITIONS,
    validate_schema_name,
    validate_stream_name,
)
from subengine.model._settings import Settings

DEFAULT_DSN_ENV = "SUBENGINE_DSN"
DEFAULT_ROWS_PER_SPLIT = 250_000
SUBSCRIPTION_PREFIX = "subscription:"

# Spark passes these to sinks and sources itself; they are not ours to check.
_SPARK_OPTIONS = frozenset({"path", "paths", "checkpointlocation", "queryname"})
_COMMON = frozenset({"stream", "dsnenv", "dbschema"})
_BATCH_READ = frozenset({"partitions", "since", "until", "rowspersplit", "failondataloss"})
_STREAM_READ = frozenset(
    {
        "partitions",
        "rowspersplit",
        "startingpositions",
        "maxrecordspertrigger",
        "subscription",
        "failondataloss",
    }
)
_WRITE = frozenset({"writeid"})
# Option names that look like connection settings: refused, so a DSN never lands in a plan.
_SECRET_LOOKING = frozenset({"dsn", "url", "password", "conninfo", "connection"})

Role = Literal["read", "batch read", "stream read", "write"]


@dataclass(frozen=True, slots=True)
class Target:
    """Where to find a stream: the DSN's environment variable, the schema, the stream."""

    dsn_env: str
    schema: str
    stream: str

    def dsn(self, where: str) -> str:
        """The DSN from this process's environment; `where` names the process in errors."""
        value = os.environ.get(self.dsn_env, "")
        if not value:
            raise ConfigurationError(
                f"environment variable {self.dsn_env} is not set {where}: subengine's Spark "
                f"data source reads the PostgreSQL DSN from it. Set it on the driver and on "
                f"the executors (spark.executorEnv.{self.dsn_env}, or the cluster's secret "
                "mechanism), or name another variable with the dsnEnv option"
            )
        return value


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """What a batch or streaming read takes from its options."""

    target: Target
    partitions: tuple[int, ...] | None
    since: datetime | None
    until: datetime | None
    rows_per_split: int
    starting_positions: str
    max_records_per_trigger: int | None
    subscription: str | None
    fail_on_data_loss: bool


@dataclass(frozen=True, slots=True)
class WriteOptions:
    """What a batch or streaming write takes from its options."""

    target: Target
    write_id: str | None


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    return {key.lower(): value for key, value in options.items()}


def _check_names(options: dict[str, str], role: Role) -> None:
    allowed = {
        "read": _COMMON | _BATCH_READ | _STREAM_READ,
        "batch read": _COMMON | _BATCH_READ,
        "stream read": _COMMON | _STREAM_READ,
        "write": _COMMON | _WRITE,
    }[role]
    for name in options:
        if name in _SECRET_LOOKING:
            raise ConfigurationError(
                f"option {name!r} would put connection settings into the query plan and the "
                "logs; put the DSN in an environment variable instead (SUBENGINE_DSN, or the "
                "one the dsnEnv option names)"
            )
        if name not in allowed and name not in _SPARK_OPTIONS:
            known = ", ".join(sorted(allowed))
            raise InvalidInput(
                f"the subengine data source has no option {name!r} for a {role}: {known}"
            )


def target(options: Mapping[str, str], role: Role) -> Target:
    """Check the option names for `role` and return the stream to read or write."""
    lowered = _lower(options)
    _check_names(lowered, role)
    stream = lowered.get("stream")
    if not stream:
        raise InvalidInput('the subengine data source needs option "stream": the stream\'s name')
    validate_stream_name(stream)
    dsn_env = lowered.get("dsnenv", DEFAULT_DSN_ENV)
    if not dsn_env or "=" in dsn_env or "\0" in dsn_env:
        raise InvalidInput(f"option dsnEnv must name an environment variable, not {dsn_env!r}")
    # Resolved here, on the driver, so that every executor uses the same schema whatever
    # its own environment says.
    schema = lowered.get("dbschema") or Settings.from_env().schema
    validate_schema_name(schema)
    return Target(dsn_env=dsn_env, schema=schema, stream=stream)


def _whole(options: dict[str, str], name: str, spelled: str, minimum: int) -> int | None:
    raw = options.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not minimum <= value <= BIGINT_MAX:
        raise InvalidInput(
            f"option {spelled} must be a whole number of at least {minimum}, not {raw!r}"
        )
    return value


def _time(options: dict[str, str], name: str) -> datetime | None:
    raw = options.get(name)
    if raw is None:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        value = None
    if value is None or value.tzinfo is None:
        raise InvalidInput(
            f"option {name} must be an ISO 8601 time with a zone, such as "
            f"2026-01-31T00:00:00+00:00, not {raw!r}"
        )
    return value


def _flag(options: dict[str, str], name: str, spelled: str, default: bool) -> bool:
    raw = options.get(name)
    if raw is None:
        return default
    if raw.lower() not in ("true", "false"):
        raise InvalidInput(f"option {spelled} must be true or false, not {raw!r}")
    return raw.lower() == "true"


def _partitions(raw: str | None) -> tuple[int, ...] | None:
    if raw is None:
        return None
    try:
        numbers = sorted({int(part) for part in raw.split(",") if part.strip()})
    except ValueError:
        numbers = []
    if not numbers or not all(0 <= n < MAX_PARTITIONS for n in numbers):
        raise InvalidInput(
            f"option partitions must list partition numbers separated by commas, such as "
            f"0,3,5, not {raw!r}"
        )
    return tuple(numbers)


def parse_starting_positions(raw: str) -> str | dict[int, int]:
    """'earliest', 'latest', a subscription's name (as 'subscription:NAME') or a map of
    partition to position; raises InvalidInput naming the option."""
    if raw in ("earliest", "latest") or raw.startswith(SUBSCRIPTION_PREFIX):
        if raw.startswith(SUBSCRIPTION_PREFIX):
            validate_stream_name(raw.removeprefix(SUBSCRIPTION_PREFIX))
        return raw
    try:
        parsed = json.loads(raw)
    except ValueError as error:
        raise InvalidInput(
            f"option startingPositions must be earliest, latest, subscription:NAME or a JSON "
            f'object of partition to position such as {{"0": 12, "3": 40}}; {raw!r} is not '
            f"valid JSON ({error})"
        ) from None
    if not isinstance(parsed, dict) or not parsed:
        raise InvalidInput(
            f'option startingPositions must be a JSON object such as {{"0": 12, "3": 40}}, '
            f"not {raw!r}"
        )
    positions: dict[int, int] = {}
    for key, value in parsed.items():
        if not key.isdigit() or int(key) > INTEGER_MAX:
            raise InvalidInput(f"startingPositions names {key!r}, which is not a partition number")
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= BIGINT_MAX:
            raise InvalidInput(
                f"startingPositions gives partition {key} the position {value!r}; a position "
                "is a whole number from 0 (before the first event)"
            )
        positions[int(key)] = value
    return positions


def read_options(options: Mapping[str, str], role: Role) -> ReadOptions:
    """The options of a read; `role` is 'read' when it is not yet known which kind."""
    lowered = _lower(options)
    found = target(options, role)
    since, until = _time(lowered, "since"), _time(lowered, "until")
    if since is not None and until is not None and until <= since:
        raise InvalidInput(
            f"option until ({until.isoformat()}) must be after since ({since.isoformat()})"
        )
    starting = lowered.get("startingpositions", "earliest")
    parse_starting_positions(starting)
    subscription = lowered.get("subscription")
    if subscription is not None:
        validate_stream_name(subscription)
    rows_per_split = _whole(lowered, "rowspersplit", "rowsPerSplit", 1)
    return ReadOptions(
        target=found,
        partitions=_partitions(lowered.get("partitions")),
        since=since,
        until=until,
        rows_per_split=DEFAULT_ROWS_PER_SPLIT if rows_per_split is None else rows_per_split,
        starting_positions=starting,
        max_records_per_trigger=_whole(lowered, "maxrecordspertrigger", "maxRecordsPerTrigger", 1),
        subscription=subscription,
        fail_on_data_loss=_flag(lowered, "failondataloss", "failOnDataLoss", True),
    )


def write_options(options: Mapping[str, str]) -> WriteOptions:
    """The options of a write."""
    found = target(options, "write")
    write_id = _lower(options).get("writeid")
    if write_id is not None and not write_id.strip():
        raise InvalidInput("option writeId must not be empty")
    return WriteOptions(target=found, write_id=write_id)
