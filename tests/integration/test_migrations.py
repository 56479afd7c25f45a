"""Migrations: from empty, twice, from several processes at once, and as SQL for a DBA."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import Running, tables, wait_for

import subengine
from subengine.db import _migrate


def test_upgrade_from_empty_creates_the_data_model(blank_dsn: str) -> None:
    with subengine.Engine(blank_dsn) as engine:
        assert engine.schema_revision() is None
        engine.migrate()
        assert engine.schema_revision() == _migrate.head_revision()
    assert {
        "streams",
        "partitions",
        "events",
        "gateway_keys",
        "gateway_secrets",
        "subengine_alembic_version",
    } <= tables(blank_dsn)
    with psycopg.connect(blank_dsn) as conn:
        types: dict[str, str] = dict(
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


def test_upgrade_twice_changes_nothing(blank_dsn: str) -> None:
    with subengine.Engine(blank_dsn) as engine:
        engine.migrate()
        engine.create_stream("orders", partitions=2)
        engine.append("orders", [subengine.NewEvent("k", "T", {})])
        engine.migrate()
        assert engine.heads("orders") == {
            subengine.partition_for("k", 2): 1,
            1 - subengine.partition_for("k", 2): 0,
        }


def test_a_schema_that_was_never_migrated_says_what_to_do(blank_dsn: str) -> None:
    with subengine.Engine(blank_dsn) as engine:
        for call in (
            lambda: engine.append("orders", [subengine.NewEvent("k", "T", {})]),
            lambda: engine.read("orders", 0),
            lambda: engine.streams(),
            lambda: engine.create_stream("orders", 2),
        ):
            with pytest.raises(subengine.SchemaNotReady, match="run `subengine migrate`"):
                call()


def test_printed_sql_builds_a_working_schema(blank_dsn: str) -> None:
    ddl = _migrate.upgrade_sql("subengine")
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        conn.execute(ddl)  # as a DBA would run it with psql
    with subengine.Engine(blank_dsn) as engine:
        assert engine.schema_revision() == _migrate.head_revision()
        engine.create_stream("orders", partitions=2)
        assert engine.append("orders", [subengine.NewEvent("k", "T", {})])[0].position == 1
        engine.migrate()  # recognises the revision the SQL recorded


def migrate_as_before(dsn: str, revision: str) -> None:
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


def create_stream_as_before(dsn: str, name: str, partitions: int) -> None:
    """A stream as every revision stores it (this code's create_stream needs the
    newest schema)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO subengine.streams (name, partitions) VALUES (%s, %s)", (name, partitions)
        )
        conn.execute(
            "INSERT INTO subengine.partitions (stream, partition)"
            " SELECT %s, generate_series(0, %s - 1)",
            (name, partitions),
        )


@pytest.mark.parametrize("revision", ["0002", "head"])
def test_an_older_installation_moves_to_subengines_version_table(
    blank_dsn: str, revision: str
) -> None:
    migrate_as_before(blank_dsn, revision)
    create_stream_as_before(blank_dsn, "orders", 2)
    with subengine.Engine(blank_dsn) as engine:
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


def test_a_dead_letter_from_before_0004_does_not_block_its_replay(blank_dsn: str) -> None:
    # An event dead-lettered, then a reset, then the upgrade: the replay fails on the
    # event again and must record a dead letter of its own.
    migrate_as_before(blank_dsn, "0003")
    app = subengine.App()
    sub = app.subscription("billing", stream="single", on_error="dead_letter", max_attempts=1)

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        if event.position == 2:
            raise ValueError("poison")

    settings = subengine.Settings(dsn=blank_dsn, poll_interval=0.2, retry_delay=0.05)
    create_stream_as_before(blank_dsn, "single", 1)
    with subengine.Engine(settings=settings) as engine, psycopg.connect(blank_dsn) as conn:
        stored = engine.append("single", [subengine.NewEvent("k", "T", {}) for _ in range(3)])
        # as 0003's worker left it (its statements, as this code's need a later schema):
        # the poison dead-lettered, then a reset to the beginning
        conn.execute(
            "INSERT INTO subengine.subscriptions (name, stream, start)"
            " VALUES ('billing', 'single', '{\"kind\": \"beginning\"}')"
        )
        conn.execute(
            "INSERT INTO subengine.subscription_positions (subscription, partition, position,"
            " generation) VALUES ('billing', 0, 0, 1)"
        )
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


def test_key_versions_go_on_across_the_upgrade_to_key_rows(blank_dsn: str) -> None:
    # 0012 kept no row per key: a key's version came from its stored events, or from
    # pruned_keys once retention had removed them all. The upgrade fills stream_keys
    # from both, so that every key goes on at the version after its last one.
    migrate_as_before(blank_dsn, "0012")
    create_stream_as_before(blank_dsn, "orders", 2)
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        for key, count in (("a", 3), ("b", 1)):
            conn.execute(
                "SELECT subengine.append_events('orders', NULL, array_fill(%s::text, ARRAY[%s]),"
                " array_fill('T'::text, ARRAY[%s]), array_fill('{}'::jsonb, ARRAY[%s]))",
                (key, count, count, count),
            )
        # a key whose every event retention removed, as 0010's pruning recorded it
        conn.execute("INSERT INTO subengine.pruned_keys VALUES ('orders', 'gone', 7)")
    with subengine.Engine(blank_dsn) as engine:
        engine.migrate()
        assert engine.schema_revision() == _migrate.head_revision()
        appended = engine.append(
            "orders",
            [subengine.NewEvent(key, "T", {}) for key in ("a", "b", "gone", "new")],
            expected_version={"a": 3, "b": 1, "gone": 7, "new": 0},
        )
    assert [a.key_version for a in appended] == [4, 2, 8, 1]
    assert "pruned_keys" not in tables(blank_dsn)
