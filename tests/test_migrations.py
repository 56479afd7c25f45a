"""Migrations: from empty, twice, from several processes at once, and as SQL for a DBA."""

from __future__ import annotations

import subprocess

import psycopg
import pytest
from helpers import Running, subengine_command, wait_for
from psycopg import sql
from psycopg.conninfo import make_conninfo

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
    assert {"streams", "partitions", "events", "subengine_alembic_version"} <= tables(blank_dsn)
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
        assert (
            conn.execute("SELECT count(*) FROM subengine.subengine_alembic_version").fetchone()[0]
            == 1
        )


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
    assert "CREATE TABLE subengine.subengine_alembic_version" in result.stdout
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


def run_migrate(dsn, *args, tmp_path):
    env = {"SUBENGINE_DSN": dsn, "PATH": "/usr/bin:/bin", "SUBENGINE_HOME": str(tmp_path)}
    return subprocess.run(
        [subengine_command(), *args, "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(result, message):
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("app_revision", ["a1b2c3d4", "0003"])
def test_schema_public_beside_an_applications_own_alembic_version(
    blank_dsn, tmp_path, app_revision
):
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


def migrate_as_before(dsn, revision):
    """Migrate to `revision` keeping the version in alembic_version, as subengine did
    before it had a version table of its own."""
    from alembic import command
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    config = _migrate._config("subengine")
    config.attributes["version_table"] = "alembic_version"
    engine = create_engine(
        "postgresql+psycopg://", creator=_migrate.connect_factory(dsn, 10), poolclass=NullPool
    )
    with engine.connect() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
        connection.commit()
    engine.dispose()


@pytest.mark.parametrize("revision", ["0002", "head"])
def test_an_older_installation_moves_to_subengines_version_table(blank_dsn, revision):
    migrate_as_before(blank_dsn, revision)
    with subengine.Engine(blank_dsn) as engine:
        engine.create_stream("orders", partitions=2)
        engine.append("orders", [subengine.NewEvent("k", "T", {})])
        engine.migrate()
        assert engine.schema_revision() == _migrate.head_revision()
        assert sum(engine.heads("orders").values()) == 1
    assert "alembic_version" not in tables(blank_dsn)
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        indexes = conn.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'subengine_alembic_version'"
        ).fetchall()
        assert indexes == [("subengine_alembic_version_pkc",)]
        # an application's Alembic can now create its own table in the same schema
        conn.execute(
            "CREATE TABLE subengine.alembic_version (version_num varchar(32) NOT NULL,"
            " CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"
        )


def test_an_unknown_revision_in_the_database_is_one_line(blank_dsn, tmp_path):
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


def test_permission_denied_is_one_line(blank_dsn, tmp_path):
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


def test_an_applications_table_of_the_same_name_is_one_line(blank_dsn, tmp_path):
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.events (id int)")
    result = run_migrate(blank_dsn, "--schema", "public", tmp_path=tmp_path)
    assert_one_line_error(result, "could not migrate schema 'public': relation")
    assert "give subengine a schema of its own" in result.stderr
    assert tables(blank_dsn, "public") == {"events"}


def test_a_dead_letter_from_before_0004_does_not_block_its_replay(blank_dsn):
    # An event dead-lettered, then a reset, then the upgrade: the replay fails on the
    # event again and must record a dead letter of its own.
    migrate_as_before(blank_dsn, "0003")
    app = subengine.App()
    sub = app.subscription("billing", stream="single", on_error="dead_letter", max_attempts=1)

    @sub.handler()
    def handle(event, conn):
        if event.position == 2:
            raise ValueError("poison")

    settings = subengine.Settings(dsn=blank_dsn, poll_interval=0.2, retry_delay=0.05)
    with subengine.Engine(settings=settings) as engine, psycopg.connect(blank_dsn) as conn:
        engine.create_stream("single", partitions=1)
        stored = engine.append("single", [subengine.NewEvent("k", "T", {}) for _ in range(3)])
        engine.ensure_subscription(sub)
        # as 0003's worker left it: the poison dead-lettered, then a reset to the beginning
        conn.execute(
            "INSERT INTO subengine.dead_letters"
            " (subscription, partition, position, event_id, error, attempts)"
            " VALUES ('billing', 0, 2, %s, 'ValueError: poison', 1)",
            (stored[1].id,),
        )
        conn.execute("UPDATE subengine.subscriptions SET generation = 2")
        conn.execute("UPDATE subengine.subscription_positions SET generation = 2")
        conn.commit()
        engine.migrate()
        with Running(app, engine):
            wait_for(lambda: engine.subscription_positions("billing")[0].position == 3)
        letters = conn.execute(
            "SELECT position, generation, resolution FROM subengine.dead_letters ORDER BY 2"
        ).fetchall()
    assert letters == [(2, 1, "superseded"), (2, 2, None)]
