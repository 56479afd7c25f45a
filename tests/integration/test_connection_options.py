"""What subengine sets on its connections, and what it leaves alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import subengine


def test_the_options_of_a_service_file_stay_in_force_on_the_engines_connections(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An `options` keyword of subengine's own would replace the service file's (and
    # PgBouncer refuses it): a session setting given there must reach every connection.
    given = conninfo_to_dict(dsn)
    service = tmp_path / "pg_service.conf"
    service.write_text("[subengine-test]\noptions=-c work_mem=12MB\n")
    monkeypatch.setenv("PGSERVICEFILE", str(service))
    with_service = make_conninfo(
        "", service="subengine-test", **{k: v for k, v in given.items() if k != "options"}
    )
    with subengine.Engine(with_service) as engine:
        with engine.connection() as conn:
            assert _work_mem(conn) == "12MB"
        with engine.connect() as conn:
            assert _work_mem(conn) == "12MB"


def _work_mem(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SHOW work_mem").fetchone()
    assert row is not None
    return str(row[0])
