"""Migrations: from empty, twice, from several processes at once, and as SQL for a DBA."""

from __future__ import annotations

import subprocess

import psycopg
import pytest
from conftest import subengine_command

import subengine
from subengine import _migrate


def tables(dsn: str, schema: str = "subengine") -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,)
        ).fetchall()
    return {row[0] for row in rows}


def test_upgrade_from_empty_creates_the_data_model(blank_dsn):
    with subengine.Engine(blank_dsn) as engine:
        assert engine.schema_revision() is None
        engine.migrate()
        assert engine.schema_revision() == _migrate.head_revision()
    assert {"streams", "partitions", "events", "alembic_version"} <= tables(blank_dsn)
    with psycopg.connect(blank_dsn) as conn:
        types = dict(
            conn.execute(
                "SELECT table_name || '.' || column_name, data_type FROM information_schema.columns"
                " WHERE table_schema = 'subengine'"
            ).fetchall()
        )
    assert types["events.position"] == "bigint"
    assert types["events.key_version"] == "bigint"
    assert types["partitions.head"] == "bigint"
    assert types["partitions.floor"] == "bigint"
    assert types["events.occurred_at"] == "timestamp with time zone"
    assert types["events.recorded_at"] == "timestamp with time zone"
    assert types["partitions.head_time"] == "timestamp with time zone"


def test_upgrade_twice_changes_nothing(blank_dsn):
    with subengine.Engine(blank_dsn) as engine:
        engine.migrate()
        engine.create_stream("orders", partitions=2)
        engine.append("orders", [subengine.NewEvent("k", "T", {})])
        engine.migrate()
        assert engine.heads("orders") == {
            subengine.partition_for("k", 2): 1,
            1 - subengine.partition_for("k", 2): 0,
        }


def test_four_processes_migrating_at_once_all_succeed(blank_dsn, tmp_path):
    env = {"SUBENGINE_DSN": blank_dsn, "PATH": "/usr/bin:/bin", "SUBENGINE_HOME": str(tmp_path)}
    processes = [
        subprocess.Popen(
            [subengine_command(), "migrate"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in processes]
    for p in processes:
        p.stdout.close()
        p.stderr.close()
    assert [code for code, _ in results] == [0, 0, 0, 0], results
    with psycopg.connect(blank_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM subengine.alembic_version").fetchone()[0] == 1


def test_a_schema_that_was_never_migrated_says_what_to_do(blank_dsn):
    with subengine.Engine(blank_dsn) as engine:
        for call in (
            lambda: engine.append("orders", [subengine.NewEvent("k", "T", {})]),
            lambda: engine.read("orders", 0),
            lambda: engine.streams(),
            lambda: engine.create_stream("orders", 2),
        ):
            with pytest.raises(subengine.SchemaNotReady, match="run `subengine migrate`"):
                call()


def test_migrate_sql_prints_the_ddl_without_touching_the_database(blank_dsn):
    result = subprocess.run(
        [subengine_command(), "--dsn", blank_dsn, "migrate", "--sql"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "CREATE TABLE events" in result.stdout
    assert "CREATE FUNCTION append_events" in result.stdout
    assert "%%" not in result.stdout  # printed SQL is runnable as it is
    assert tables(blank_dsn) == set()


def test_printed_sql_builds_a_working_schema(blank_dsn):
    ddl = _migrate.upgrade_sql("subengine")
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        conn.execute(ddl)  # as a DBA would run it with psql
    with subengine.Engine(blank_dsn) as engine:
        assert engine.schema_revision() == _migrate.head_revision()
        engine.create_stream("orders", partitions=2)
        assert engine.append("orders", [subengine.NewEvent("k", "T", {})])[0].position == 1
        engine.migrate()  # recognises the revision the SQL recorded
