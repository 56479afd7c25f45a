"""The suite's own database supply (tests/databases.py): every database it hands out is
a fresh clone of the template, never handed out twice, and dropped once given back."""

from __future__ import annotations

from typing import Any

import psycopg
from databases import Databases
from helpers import SESSION_TAG
from psycopg.conninfo import make_conninfo
from psycopg.sql import SQL, Identifier
from pytest_postgresql.executors import NoopExecutor


def test_each_database_is_a_fresh_clone_dropped_when_given_back(
    postgresql_migrated_server: NoopExecutor,
) -> None:
    server = postgresql_migrated_server
    params: dict[str, Any] = dict(
        host=server.host, port=server.port, user=server.user, password=server.password or ""
    )
    template = f"subengine_supply_{SESSION_TAG}"
    with psycopg.connect(make_conninfo(**params, dbname="postgres"), autocommit=True) as admin:
        admin.execute(SQL("DROP DATABASE IF EXISTS {}").format(Identifier(template)))
        admin.execute(SQL("CREATE DATABASE {}").format(Identifier(template)))
        with psycopg.connect(make_conninfo(**params, dbname=template), autocommit=True) as conn:
            conn.execute("CREATE TABLE seed (n int)")
            conn.execute("INSERT INTO seed VALUES (1)")

        databases = Databases(prefix=template, template=template, **params)
        names = [databases.take() for _ in range(3)]
        assert len(set(names)) == 3
        for name in names:
            with psycopg.connect(make_conninfo(**params, dbname=name), autocommit=True) as conn:
                assert conn.execute("SELECT n FROM seed").fetchall() == [(1,)]
                conn.execute("INSERT INTO seed VALUES (2)")  # touched: must not come back
        lingering = psycopg.connect(make_conninfo(**params, dbname=names[0]))  # dropped anyway
        for name in names:
            databases.give_back(name)
        databases.close()

        left = admin.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", (f"{template}\\_%",)
        ).fetchall()
        assert left == []
        assert lingering.closed or lingering.broken or _fails(lingering)
        admin.execute(SQL("DROP DATABASE {}").format(Identifier(template)))


def _fails(conn: psycopg.Connection[Any]) -> bool:
    try:
        conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return True
    return False
