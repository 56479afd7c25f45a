"""Running the Alembic migrations in `migrations/` against a database, or printing them.

Safe to call from many processes at once: the environment serialises upgrades with an
advisory lock (see migrations/env.py).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

from subengine._connection import connect

if TYPE_CHECKING:
    from alembic.config import Config

# Alembic and SQLAlchemy are imported where they are used: most commands never migrate,
# and importing them costs a quarter of a second.

# migrations/ is installed as the package subengine.migrations (see pyproject.toml)
MIGRATIONS_DIR = Path(str(resources.files("subengine.migrations")))


def _config(schema: str) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["schema"] = schema
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
    from sqlalchemy import create_engine
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.pool import NullPool

    config = _config(schema)
    engine = create_engine(
        "postgresql+psycopg://", creator=connect_factory(dsn, connect_timeout), poolclass=NullPool
    )
    try:
        with engine.connect() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
            connection.commit()
    except DBAPIError as error:
        if isinstance(error.orig, psycopg.Error):
            raise error.orig from None  # the psycopg error, as everywhere else in subengine
        raise
    finally:
        engine.dispose()


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
    table = psycopg.sql.SQL("{}.alembic_version").format(psycopg.sql.Identifier(schema))
    with connect(dsn, connect_timeout, application_name=APPLICATION_NAME) as conn:
        found = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL", (table.as_string(conn),)
        ).fetchone()
        if not found or not found[0]:
            return None
        row = conn.execute(psycopg.sql.SQL("SELECT version_num FROM {}").format(table)).fetchone()
        return str(row[0]) if row else None


def head_revision() -> str:
    """The newest revision this code ships."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_config("subengine")).get_current_head()
    if head is None:
        raise RuntimeError(f"{MIGRATIONS_DIR} holds no revision: the installation is broken")
    return head
