"""Every tunable of subengine in one typed object, with its default and environment name.

`Settings.from_env()` reads the environment; `Settings.describe()` lists every setting
(the README's configuration table is checked against it). Nothing else in the package
reads environment variables.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from subengine.model._errors import ConfigurationError
from subengine.model._names import shown_value, validate_schema_name


def _setting(
    default: Any, env: str, doc: str, *, shown: bool = True, zero_is_off: bool = False
) -> Any:
    metadata = {"env": env, "doc": doc, "zero_is_off": zero_is_off}
    return field(default=default, repr=shown, metadata=metadata)


@dataclass(frozen=True)
class Settings:
    """Configuration of an engine; every field has a default and an environment variable."""

    dsn: str | None = _setting(
        None,
        "SUBENGINE_DSN",
        "PostgreSQL URL or libpq conninfo. Unset: an embedded PostgreSQL in SUBENGINE_HOME.",
        shown=False,  # it may hold a password: never in a repr, so never in a log line
    )
    direct_dsn: str | None = _setting(
        None,
        "SUBENGINE_DIRECT_DSN",
        "A connection straight to PostgreSQL, for what needs a session of its own (LISTEN, "
        "partition locks, the pruner's lock) when SUBENGINE_DSN goes through a "
        "transaction-mode pooler (docs/pooler.md). Unset: SUBENGINE_DSN.",
        shown=False,  # it may hold a password
    )
    lock_provider: str = _setting(
        "pals",
        "SUBENGINE_LOCK_PROVIDER",
        "How worker slots lock partitions: pals (session advisory locks through pals), "
        "builtin (the same locks by one statement per switch) or rows (no advisory lock: "
        "batches wait on their partition's row; for transaction-mode poolers). "
        'docs/pooler.md, "Lock providers".',
    )
    home: Path = _setting(
        Path(".subengine"),
        "SUBENGINE_HOME",
        "Directory of the embedded PostgreSQL's data (used only when no DSN is given).",
    )
    schema: str = _setting(
        "subengine",
        "SUBENGINE_SCHEMA",
        "Schema holding every subengine object; two installations can share a database.",
    )
    max_event_bytes: int = _setting(
        1_048_576,
        "SUBENGINE_MAX_EVENT_BYTES",
        "Largest accepted event payload: UTF-8 JSON of data plus metadata, in bytes.",
    )
    pool_min_size: int = _setting(
        1, "SUBENGINE_POOL_MIN_SIZE", "Connections an Engine keeps open at least."
    )
    pool_max_size: int = _setting(
        10, "SUBENGINE_POOL_MAX_SIZE", "Connections an Engine opens at most."
    )
    connect_timeout: float = _setting(
        30.0,
        "SUBENGINE_CONNECT_TIMEOUT",
        "Seconds to wait for a database connection before failing.",
    )
    read_limit: int = _setting(
        1000, "SUBENGINE_READ_LIMIT", "Events returned by one read when no limit is given."
    )
    poll_interval: float = _setting(
        5.0,
        "SUBENGINE_POLL_INTERVAL",
        "Seconds between a worker's polls, which find what notifications did not bring.",
    )
    retry_delay: float = _setting(
        1.0,
        "SUBENGINE_RETRY_DELAY",
        "Seconds before the first retry of a failed batch; doubled after every failure.",
    )
    retry_delay_max: float = _setting(
        60.0,
        "SUBENGINE_RETRY_DELAY_MAX",
        "Longest wait between two retries of a batch, in seconds.",
    )
    heartbeat_interval: float = _setting(
        10.0, "SUBENGINE_HEARTBEAT_INTERVAL", "Seconds between a worker's heartbeats."
    )
    outage_timeout: float = _setting(
        60.0,
        "SUBENGINE_OUTAGE_TIMEOUT",
        "Seconds a worker keeps reconnecting to a lost database before it exits with an error.",
    )
    progress_interval: float = _setting(
        10.0,
        "SUBENGINE_PROGRESS_INTERVAL",
        "Seconds between a worker's progress lines and its readings of the lag (one query).",
    )

    retention_interval: float = _setting(
        60.0,
        "SUBENGINE_RETENTION_INTERVAL",
        "Seconds between the pruning runs of a worker (one pruner at a time per database "
        "applies the streams' retention policies); 0: workers do not prune.",
        zero_is_off=True,
    )

    def __post_init__(self) -> None:
        validate_schema_name(self.schema)
        if self.lock_provider not in LOCK_PROVIDERS:
            raise ConfigurationError(
                f"setting lock_provider must be one of {', '.join(LOCK_PROVIDERS)}, not "
                f"{shown_value(self.lock_provider)} (environment variable "
                "SUBENGINE_LOCK_PROVIDER)"
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                _check_count(f, value)
            elif f.type == "float" and not (f.metadata["zero_is_off"] and value == 0):
                _check_seconds(f, value)
        if self.pool_max_size < self.pool_min_size:
            raise ConfigurationError("setting pool_max_size must be at least pool_min_size")
        if self.retry_delay_max < self.retry_delay:
            raise ConfigurationError("setting retry_delay_max must be at least retry_delay")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from the environment; keyword overrides that are not None win."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is not None and raw != "":
                values[f.name] = _parse(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_changes(self, **changes: Any) -> Settings:
        """A copy with some settings changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def describe(cls) -> Iterator[tuple[str, str, str, str]]:
        """(name, environment variable, default, description) for every setting."""
        for f in dataclasses.fields(cls):
            default = "unset" if f.default is None else str(f.default)
            yield f.name, f.metadata["env"], default, f.metadata["doc"]


# The providers of worker slots' partition locks (db/_locks.py).
LOCK_PROVIDERS = ("pals", "builtin", "rows")

# Waits longer than this are mistakes (a worker that polls once a month), and far longer
# ones overflow the timers they reach (threading.Event.wait, libpq's connect_timeout).
MAX_SECONDS = 7 * 24 * 3600.0


def _refuse(f: dataclasses.Field[Any], rule: str, value: object) -> ConfigurationError:
    return ConfigurationError(
        f"setting {f.name} must be {rule}, not {shown_value(value)} "
        f"(environment variable {f.metadata['env']})"
    )


def _check_count(f: dataclasses.Field[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _refuse(f, "a whole number", value)
    if value < 1:
        raise _refuse(f, "at least 1", value)


def _check_seconds(f: dataclasses.Field[Any], value: object) -> None:
    # NaN compares false with everything, so `value <= 0` would let it through
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _refuse(f, "a number of seconds", value)
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise _refuse(f, f"a number of seconds above 0 and at most {MAX_SECONDS:g} (a week)", value)


def _parse(f: dataclasses.Field[Any], raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ConfigurationError(
            f"{f.metadata['env']}={shown_value(raw)} is not a valid {kind}"
        ) from None
    if kind == "Path":
        return Path(raw)
    return raw
