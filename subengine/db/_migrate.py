"""Running the Alembic migrations in `migrations/` against a database, or printing them.

Safe to call from many processes at once: the environment serialises upgrades with an
advisory lock (see migrations/env.py). subengine's revision is kept in its own version
table, `{schema}.subengine_alembic_version`, so an application's Alembic can share the
schema; env.py moves an older installation's `alembic_version` there. Every failure is a
`MigrationError` with a one-line message, except connection failures, which stay
psycopg's `OperationalError` for the engine to report as `DatabaseUnavailable`.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

from subengine.db._connection import connect
from subengine.db._sql import SQL, Query
from subengine.model._errors import MigrationError

if TYPE_CHECKING:
    from alembic.config import Config

# Alembic and SQLAlchemy are imported where they are used: most commands never migrate,
# and importing them costs a quarter of a second.

# migrations/ is installed as the package subengine.migrations (see pyproject.toml)
MIGRATIONS_DIR = Path(str(resources.files("subengine.migrations")))
# sql/migrate.sql names it too
VERSION_TABLE = "subengine_alembic_version"


def _config(schema: str) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["schema"] = schema
    config.attributes["version_table"] = VERSION_TABLE
    return config


APPLICATION_NAME = "subengine migrate"


def connect_factory(
    dsn: str, connect_timeout: float
) -> Callable[[], psycopg.Connection[tuple[object, ...]]]:
    """A connection factory SQLAlchemy can use, for any DSN psycopg accepts."""

    def factory() -> psycopg.Connection[tuple[object, ...]]:
        return connect(dsn, connect_timeout, application_name=APPLICATION_NAME)

    return factory


def upgrade(dsn: str, schema: str, connect_timeout: float) -> None:
    """Upgrade the schema to the newest revision (creating it when missing)."""
    from alembic import command
    from alembic.util import CommandError
    from sqlalchemy import create_engine
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.pool import NullPool

    config = _config(schema)
    engine = create_engine(
        "postgresql+psycopg://",
        creator=connect_factory(dsn, connect_timeout),
        poolclass=NullPool,
    )
    try:
        with engine.connect() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
            connection.commit()
    except DBAPIError as error:
        if isinstance(error.orig, psycopg.OperationalError):
            raise error.orig from None  # the server is unreachable or went away
        if isinstance(error.orig, psycopg.Error):
            raise _failed(schema, error.orig) from None
        raise
    except psycopg.OperationalError:
        raise
    except psycopg.Error as error:  # raised by the connection factory, not a statement
        raise _failed(schema, error) from None
    except CommandError as error:
        raise _command_failed(dsn, schema, connect_timeout, error) from None
    finally:
        engine.dispose()


def _failed(schema: str, error: psycopg.Error) -> MigrationError:
    reason = (error.diag.message_primary or str(error)).strip().splitlines()[0]
    hint = ""
    if isinstance(error, psycopg.errors.InsufficientPrivilege):
        hint = (
            "; migrate as a role that may create objects there, or have a DBA apply "
            "`subengine migrate --sql`"
        )
    elif isinstance(error, psycopg.errors.DuplicateObject | psycopg.errors.DuplicateTable):
        hint = "; another application's object has that name: give subengine a schema of its own"
    return MigrationError(f"could not migrate schema {schema!r}: {reason}{hint}")


def _command_failed(
    dsn: str, schema: str, connect_timeout: float, error: Exception
) -> MigrationError:
    # Alembic raises CommandError above all when the version table names a revision this
    # code does not ship: say which, and the likely causes
    try:
        stored = current_revision(dsn, schema, connect_timeout)
    except psycopg.Error:
        stored = None
    if stored is not None and stored not in known_revisions():
        return MigrationError(
            f"schema {schema!r} is at revision {stored!r}, which this version of subengine "
            f"does not know (it ships up to {head_revision()!r}): a newer subengine migrated "
            f"it, or {schema}.{VERSION_TABLE} is not subengine's; upgrade subengine, or use "
            "another schema"
        )
    reason = " ".join(str(error).split())
    return MigrationError(f"could not migrate schema {schema!r}: {reason}")


def upgrade_sql(schema: str) -> str:
    """The SQL that `upgrade` runs on an empty database, for a DBA to review and apply."""
    from alembic import command

    buffer = io.StringIO()
    config = _config(schema)
    config.output_buffer = buffer
    command.upgrade(config, "head", sql=True)
    return buffer.getvalue()


def current_revision(dsn: str, schema: str, connect_timeout: float) -> str | None:
    """The revision the schema is at, or None when it has never been migrated."""
    queries = SQL(schema)
    exists = Query("version_table_exists", {"schema": schema}, lambda result: result.rows[0][0])
    revision = Query(
        "schema_revision", {}, lambda result: str(result.rows[0][0]) if result.rows else None
    )
    with connect(dsn, connect_timeout, application_name=APPLICATION_NAME) as conn:
        if not queries.run(conn, exists):
            return None
        return queries.run(conn, revision)


def known_revisions() -> set[str]:
    """Every revision this code ships."""
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(_config("subengine"))
    return {script.revision for script in scripts.walk_revisions()}


# The newest revision in migrations/versions: `subengine serve` and every check that the
# schema is current compare with it without loading Alembic, whose import was a third of
# the gateway's start-up. A test fails when a new revision is added and this is not moved.
HEAD_REVISION = "0022"


def head_revision() -> str:
    """The newest revision this code ships."""
    return HEAD_REVISION


def scripted_head_revision() -> str:
    """The head of the revisions as Alembic reads them from migrations/versions."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_config("subengine")).get_current_head()
    if head is None:
        raise RuntimeError(f"{MIGRATIONS_DIR} holds no revision: the installation is broken")
    return head
