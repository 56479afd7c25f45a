"""`subengine migrate` as a process: many at once, printing the DDL, and one-line errors."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psycopg
import pytest
from helpers import run_subengine, start_subengine, tables
from psycopg import sql
from psycopg.conninfo import make_conninfo

import subengine
from subengine.db import _migrate


def test_four_processes_migrating_at_once_all_succeed(blank_dsn: str, tmp_path: Path) -> None:
    env = {"SUBENGINE_DSN": blank_dsn, "PATH": "/usr/bin:/bin", "SUBENGINE_HOME": str(tmp_path)}
    processes = [
        start_subengine(
            "migrate",
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in processes]  # type: ignore[union-attr]
    for p in processes:
        p.stdout.close()  # type: ignore[union-attr]
        p.stderr.close()  # type: ignore[union-attr]
    assert [code for code, _ in results] == [0, 0, 0, 0], results
    with psycopg.connect(blank_dsn) as conn:
        assert (
            conn.execute("SELECT count(*) FROM subengine.subengine_alembic_version").fetchone()[0]  # type: ignore[index]
            == 1
        )


def test_migrate_sql_prints_the_ddl_without_touching_the_database(blank_dsn: str) -> None:
    result = run_subengine(dict(os.environ), "--dsn", blank_dsn, "migrate", "--sql")
    assert result.returncode == 0, result.stderr
    assert "CREATE TABLE events" in result.stdout
    assert "CREATE FUNCTION append_events" in result.stdout
    assert "%%" not in result.stdout  # printed SQL is runnable as it is
    assert "CREATE TABLE subengine.subengine_alembic_version" in result.stdout
    assert tables(blank_dsn) == set()


def run_migrate(dsn: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"SUBENGINE_DSN": dsn, "PATH": "/usr/bin:/bin", "SUBENGINE_HOME": str(tmp_path)}
    return run_subengine(env, *args, "migrate")


def assert_one_line_error(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("app_revision", ["a1b2c3d4", "0003"])
def test_schema_public_beside_an_applications_own_alembic_version(
    blank_dsn: str, tmp_path: Path, app_revision: str
) -> None:
    # the application's Alembic keeps public.alembic_version; subengine keeps its own
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE alembic_version (version_num varchar(32) NOT NULL,"
            " CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"
        )
        conn.execute("INSERT INTO alembic_version VALUES (%s)", (app_revision,))
    result = run_migrate(blank_dsn, "--schema", "public", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"schema 'public' is at revision {_migrate.head_revision()}" in result.stdout
    with psycopg.connect(blank_dsn) as conn:
        assert conn.execute("SELECT version_num FROM public.alembic_version").fetchall() == [
            (app_revision,)
        ]
    with subengine.Engine(blank_dsn, schema="public") as engine:
        assert engine.schema_revision() == _migrate.head_revision()
        engine.create_stream("orders", partitions=2)
        assert engine.append("orders", [subengine.NewEvent("k", "T", {})])[0].position == 1
    assert run_migrate(blank_dsn, "--schema", "public", tmp_path=tmp_path).returncode == 0


def test_an_unknown_revision_in_the_database_is_one_line(blank_dsn: str, tmp_path: Path) -> None:
    with subengine.Engine(blank_dsn) as engine:
        engine.migrate()
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        conn.execute("UPDATE subengine.subengine_alembic_version SET version_num = 'ffff9999'")
    result = run_migrate(blank_dsn, tmp_path=tmp_path)
    assert_one_line_error(
        result, "schema 'subengine' is at revision 'ffff9999', which this version of subengine"
    )
    with pytest.raises(subengine.MigrationError, match="a newer subengine migrated it"):
        subengine.Engine(blank_dsn).migrate()


def test_permission_denied_is_one_line(blank_dsn: str, tmp_path: Path) -> None:
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        role = f"no_create_{conn.info.dbname}"
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        conn.execute(
            sql.SQL("REVOKE CREATE ON DATABASE {} FROM PUBLIC").format(
                sql.Identifier(conn.info.dbname)
            )
        )
    try:
        as_role = make_conninfo(blank_dsn, options=f"-c role={role}")
        result = run_migrate(as_role, tmp_path=tmp_path)
        assert_one_line_error(
            result, "could not migrate schema 'subengine': permission denied for database"
        )
        assert "subengine migrate --sql" in result.stderr
        assert tables(blank_dsn) == set()
    finally:
        with psycopg.connect(blank_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_an_applications_table_of_the_same_name_is_one_line(blank_dsn: str, tmp_path: Path) -> None:
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.events (id int)")
    result = run_migrate(blank_dsn, "--schema", "public", tmp_path=tmp_path)
    assert_one_line_error(result, "could not migrate schema 'public': relation")
    assert "give subengine a schema of its own" in result.stderr
    assert tables(blank_dsn, "public") == {"events"}
