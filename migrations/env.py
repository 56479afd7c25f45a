"""Alembic environment: runs subengine's revisions inside the configured schema.

`subengine.migrate` passes the schema and, online, an open SQLAlchemy connection through
`config.attributes`. Every revision runs with `search_path` set to that schema, so the DDL
in the revisions names no schema and functions capture it with `SET search_path FROM
CURRENT`. Online runs hold a transaction-scoped advisory lock, so many processes can
migrate at once: the first upgrades, the others wait and then find nothing to do.
"""

from __future__ import annotations

from alembic import context
from psycopg import sql
from sqlalchemy import text

config = context.config
schema: str = config.attributes["schema"]
quoted_schema = sql.Identifier(schema).as_string(None)

# Both statements are built from a validated, quoted identifier (see subengine._names).
prelude = [
    f"CREATE SCHEMA IF NOT EXISTS {quoted_schema}",
    f"SET LOCAL search_path TO {quoted_schema}",
]


def run_offline() -> None:
    context.configure(
        url="postgresql+psycopg://",
        dialect_name="postgresql",
        version_table_schema=schema,
        transactional_ddl=True,
        literal_binds=True,
        as_sql=True,
        # named paramstyle: the printed SQL keeps '%' as it is (format('%L'), modulo)
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        for statement in prelude:
            context.execute(statement)
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes["connection"]
    context.configure(
        connection=connection,
        version_table_schema=schema,
        transactional_ddl=True,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        connection.execute(
            text("SELECT pg_advisory_xact_lock(hashtextextended(:name, 0))"),
            {"name": f"subengine.migrate:{schema}"},
        )
        for statement in prelude:
            connection.execute(text(statement))
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
