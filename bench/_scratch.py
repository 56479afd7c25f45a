"""The scratch schema a benchmark works in, dropped and migrated again on every run.

A schema carries a marker comment once a benchmark made it; a schema without that marker
is never dropped, so a benchmark pointed at a real database cannot destroy its data.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

import subengine


def reset_scratch_schema(engine: subengine.Engine, marker: str, script: str) -> None:
    """Drop the engine's schema (only one marked with `marker`) and migrate it afresh."""
    schema = sql.Identifier(engine.schema)
    with psycopg.connect(engine.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(obj_description(oid, 'pg_namespace'), '')"
            " FROM pg_namespace WHERE nspname = %s",
            (engine.schema,),
        ).fetchone()
        if row is not None and row[0] != marker:
            raise SystemExit(
                f"{script}: schema {engine.schema!r} exists and was not made by this "
                "benchmark; refusing to drop it. Pick another one with --schema."
            )
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(schema))
    engine.migrate()
    with psycopg.connect(engine.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("COMMENT ON SCHEMA {} IS {}").format(schema, marker))
