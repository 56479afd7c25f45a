"""The embedded default: with no DSN, subengine runs its own PostgreSQL in SUBENGINE_HOME."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from helpers import run_subengine as run

import subengine
from subengine.db import _embedded


@pytest.fixture
def embedded_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBENGINE_")}
    env["SUBENGINE_HOME"] = str(tmp_path / "home")
    yield env
    _embedded.stop_embedded(tmp_path / "home")


def test_commands_start_reuse_and_stop_the_embedded_server(
    embedded_env: dict[str, str], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    first = run(embedded_env, "db", "url")
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("using the embedded PostgreSQL") == 1
    url = first.stdout.strip()
    with psycopg.connect(url) as conn:
        backend_started = conn.execute("SELECT pg_postmaster_start_time()").fetchone()[0]  # type: ignore[index]
    assert _embedded.is_running(home)

    second = run(embedded_env, "db", "url")
    assert second.stdout.strip() == url
    with psycopg.connect(url) as conn:  # the same server, not a new one
        assert conn.execute("SELECT pg_postmaster_start_time()").fetchone()[0] == backend_started  # type: ignore[index]

    stopped = run(embedded_env, "db", "stop")
    assert "stopped the embedded PostgreSQL" in stopped.stdout
    assert not _embedded.is_running(home)
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=2)
    assert "no embedded PostgreSQL is running" in run(embedded_env, "db", "stop").stdout


def test_the_demo_runs_on_the_embedded_server(embedded_env: dict[str, str]) -> None:
    result = run(embedded_env, "demo", "--events", "600", "--rate", "2000", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "using the embedded PostgreSQL" in result.stderr
    assert "check passed" in result.stdout
    assert "checked 600 events" in result.stdout


def test_engine_without_dsn_uses_the_embedded_server(tmp_path: Path) -> None:
    settings = subengine.Settings(home=tmp_path / "home")
    try:
        with subengine.Engine(settings=settings) as engine:
            assert engine.embedded
            engine.migrate()
            engine.create_stream("s", partitions=1)
            assert engine.append("s", [subengine.NewEvent("k", "T", {})])[0].position == 1
    finally:
        _embedded.stop_embedded(tmp_path / "home")


def test_an_async_engine_without_dsn_says_it_uses_the_embedded_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # an async-only application (no sync Engine to say it) must notice a forgotten DSN too
    home = tmp_path / "home"
    settings = subengine.Settings(home=home)

    async def scenario() -> None:
        async with subengine.AsyncEngine(settings=settings) as engine:
            assert engine.embedded

    try:
        with caplog.at_level("WARNING", logger="subengine"):
            asyncio.run(scenario())
        assert f"using the embedded PostgreSQL in {home.resolve()}" in caplog.text
    finally:
        _embedded.stop_embedded(home)
