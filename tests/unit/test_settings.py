"""Settings: one typed object, every setting with a default and an environment variable."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from helpers import PASSWORD, README

import subengine
from subengine import Settings


def test_defaults() -> None:
    settings = Settings.from_env({})
    assert settings.dsn is None
    assert settings.home == Path(".subengine")
    assert settings.schema == "subengine"
    assert settings.max_event_bytes == 1_048_576


def test_environment_values_are_parsed_by_type() -> None:
    settings = Settings.from_env(
        {
            "SUBENGINE_DSN": "postgresql://x/y",
            "SUBENGINE_HOME": "/tmp/h",
            "SUBENGINE_SCHEMA": "other",
            "SUBENGINE_MAX_EVENT_BYTES": "2048",
            "SUBENGINE_CONNECT_TIMEOUT": "2.5",
        }
    )
    assert (settings.dsn, settings.home, settings.schema) == (
        "postgresql://x/y",
        Path("/tmp/h"),
        "other",
    )
    assert (settings.max_event_bytes, settings.connect_timeout) == (2048, 2.5)


def test_overrides_win_over_the_environment() -> None:
    settings = Settings.from_env({"SUBENGINE_SCHEMA": "env"}, schema="given", dsn=None)
    assert settings.schema == "given"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"SUBENGINE_MAX_EVENT_BYTES": "lots"},
            "SUBENGINE_MAX_EVENT_BYTES='lots' is not a valid int",
        ),
        ({"SUBENGINE_MAX_EVENT_BYTES": "0"}, "max_event_bytes must be at least 1"),
        ({"SUBENGINE_SCHEMA": 'x"; drop'}, "invalid schema name"),
        ({"SUBENGINE_SCHEMA": "Upper"}, "invalid schema name"),
        (
            {"SUBENGINE_CONNECT_TIMEOUT": "-1"},
            "connect_timeout must be a number of seconds above 0",
        ),
        ({"SUBENGINE_POOL_MIN_SIZE": "5", "SUBENGINE_POOL_MAX_SIZE": "2"}, "pool_max_size"),
    ],
)
def test_invalid_settings_are_refused(environ: dict[str, str], message: str) -> None:
    with pytest.raises(subengine.ConfigurationError, match=message):
        Settings.from_env(environ)


def test_every_setting_has_an_environment_variable_and_a_description() -> None:
    described = list(Settings.describe())
    assert [name for name, *_ in described] == [f.name for f in dataclasses.fields(Settings)]
    for name, env, _default, doc in described:
        assert env == "SUBENGINE_" + name.upper()
        assert doc


def test_the_readme_configuration_table_lists_every_setting() -> None:
    readme = README.read_text()
    for name, env, default, _doc in Settings.describe():
        row = next((line for line in readme.splitlines() if line.startswith(f"| {name} |")), None)
        assert row is not None, f"README has no row for {name}"
        assert f"`{env}`" in row
        assert (f"`{default}`" in row) or (default == "unset" and "unset" in row)


def test_invalid_dsn_is_a_configuration_error() -> None:
    with pytest.raises(subengine.ConfigurationError, match="invalid DSN"):
        subengine.Engine("host=x port")


def test_invalid_direct_dsn_is_a_configuration_error_that_names_it() -> None:
    settings = Settings(dsn="host=localhost", direct_dsn="host=x port")
    with pytest.raises(subengine.ConfigurationError, match="invalid direct DSN"):
        subengine.Engine(settings=settings)


def test_unreachable_database_fails_with_the_reason() -> None:
    settings = Settings(dsn="postgresql://nobody@127.0.0.1:1/none", connect_timeout=1)
    with (
        subengine.Engine(settings=settings) as engine,
        pytest.raises(subengine.DatabaseUnavailable, match="could not connect"),
    ):
        engine.streams()


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "1e999", "1e300", "604801", "0"])
@pytest.mark.parametrize(
    ("name", "env"),
    [
        ("poll_interval", "SUBENGINE_POLL_INTERVAL"),
        ("connect_timeout", "SUBENGINE_CONNECT_TIMEOUT"),
        ("retry_delay_max", "SUBENGINE_RETRY_DELAY_MAX"),
        ("outage_timeout", "SUBENGINE_OUTAGE_TIMEOUT"),
    ],
)
def test_non_finite_and_absurd_durations_are_refused(name: str, env: str, raw: str) -> None:
    message = rf"setting {name} must be a number of seconds above 0 and at most 604800 .*{env}"
    with pytest.raises(subengine.ConfigurationError, match=message):
        Settings.from_env({env: raw})
    with pytest.raises(subengine.ConfigurationError, match=message):
        Settings(**{name: float(raw)})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"poll_interval": "5"}, "poll_interval must be a number of seconds, not '5'"),
        ({"poll_interval": True}, "poll_interval must be a number of seconds, not True"),
        ({"read_limit": 2.5}, "read_limit must be a whole number, not 2.5"),
        ({"pool_max_size": None}, "pool_max_size must be a whole number, not None"),
    ],
)
def test_settings_of_the_wrong_type_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(subengine.ConfigurationError, match=message):
        Settings(**changes)


def test_a_week_is_the_longest_duration() -> None:
    assert Settings(poll_interval=604800, outage_timeout=604800.0).poll_interval == 604800


def test_settings_never_show_the_dsn_and_its_password() -> None:
    settings = subengine.Settings(dsn="postgresql://app:Sup3rSecret@db.example/app")
    assert "Sup3rSecret" not in repr(settings)
    assert "Sup3rSecret" not in str(settings)
    assert settings.dsn == "postgresql://app:Sup3rSecret@db.example/app"


def test_a_malformed_dsn_keeps_the_option_name_it_is_about() -> None:
    with pytest.raises(subengine.ConfigurationError) as raised:
        subengine.Engine(f"host=localhost password {PASSWORD}")
    assert 'missing "=" after "password"' in str(raised.value)


def test_retention_interval_zero_turns_pruning_off_and_other_durations_stay_checked() -> None:
    assert Settings.from_env({"SUBENGINE_RETENTION_INTERVAL": "0"}).retention_interval == 0
    for raw in ("-1", "nan", "604801"):
        with pytest.raises(subengine.ConfigurationError, match="setting retention_interval"):
            Settings.from_env({"SUBENGINE_RETENTION_INTERVAL": raw})
    with pytest.raises(subengine.ConfigurationError, match="setting poll_interval"):
        Settings(poll_interval=0)
