"""Alembic environment: runs subengine's revisions inside the configured schema.

`subengine.migrate` passes the schema, the name of the version table and, online, an open
SQLAlchemy connection through `config.attributes`. Every revision runs with `search_path`
set to that schema, so the DDL in the revisions names no schema and functions capture it
with `SET search_path FROM CURRENT`. Online runs hold a transaction-scoped advisory lock,
so many processes can migrate at once: the first upgrades, the others wait and then find
nothing to do.

subengine records its revision in a version table of its own name, not Alembic's default
`alembic_version`, which an application's own Alembic keeps in the same schema (`public`,
typically). Installations made before kept theirs in `{schema}.alembic_version`: the
first online migration renames that table to subengine's, under the lock, when it holds
only subengine's revisions and the schema holds subengine's tables. Any other
`alembic_version` is left alone.
"""

from __future__ import annotations

from alembic import context
from psycopg import sql
from sqlalchemy import text

config = context.config
schema: str = config.attributes["schema"]
version_table: str = config.attributes["version_table"]
quoted_schema = sql.Identifier(schema).as_string(None)

# Both statements are built from a validated, quoted identifier (see subengine.model._names).
prelude = [
    f"CREATE SCHEMA IF NOT EXISTS {quoted_schema}",
    f"SET LOCAL search_path TO {quoted_schema}",
]

OLD_VERSION_TABLE = "alembic_version"
# Created by revision 0001: present in every schema subengine ever migrated.
FIRST_TABLES = ("streams", "partitions", "events")


def _regclass(connection, name: str) -> object:
    qualified = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))
    return connection.execute(
        text("SELECT to_regclass(:name)"), {"name": qualified.as_string(None)}
    ).scalar()


def adopt_old_version_table(connection) -> None:
    """Rename `{schema}.alembic_version` to subengine's version table when it is ours."""
    if _regclass(connection, version_table) is not None:
        return
    if _regclass(connection, OLD_VERSION_TABLE) is None:
        return
    old = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(OLD_VERSION_TABLE))
    select = sql.SQL("SELECT version_num FROM {}").format(old).as_string(None)
    stored = set(connection.execute(text(select)).scalars())
    ours = {script.revision for script in context.script.walk_revisions()}
    if not stored or not stored <= ours:
        return  # an application's table: not ours to touch
    if any(_regclass(connection, name) is None for name in FIRST_TABLES):
        return  # our revision names by coincidence, without our tables
    primary_key = connection.execute(
        text(
            "SELECT conname FROM pg_constraint WHERE conrelid = CAST(:table AS regclass)"
            " AND contype = 'p'"
        ),
        {"table": old.as_string(None)},
    ).scalar()
    statements = [sql.SQL("ALTER TABLE {} RENAME TO {}").format(old, sql.Identifier(version_table))]
    if primary_key is not None:
        # the key's index keeps its name otherwise, and would collide with the index of
        # an alembic_version an application creates later
        statements.append(
            sql.SQL("ALTER INDEX {}.{} RENAME TO {}").format(
                sql.Identifier(schema),
                sql.Identifier(primary_key),
                sql.Identifier(f"{version_table}_pkc"),
            )
        )
    for statement in statements:
        connection.execute(text(statement.as_string(None)))


def run_offline() -> None:
    context.configure(
        url="postgresql+psycopg://",
        dialect_name="postgresql",
        version_table=version_table,
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
        version_table=version_table,
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
        adopt_old_version_table(connection)
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
