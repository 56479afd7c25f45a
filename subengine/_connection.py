"""Opening connections, and finding the psycopg connection behind what the caller hands us.

`connect` is the one place subengine opens a connection of its own: every one carries a
connect timeout (an unreachable host fails instead of hanging) and an application name
(the status views and `pg_stat_activity` tell subengine's connections apart).

`append` runs in the caller's transaction, whether the caller holds a psycopg connection,
a SQLAlchemy `Connection` or a SQLAlchemy `Session` (on the psycopg driver).
"""

from __future__ import annotations

import math
from typing import Any

import psycopg

from subengine._errors import InvalidInput

PgConnection = psycopg.Connection[Any]

APPLICATION_NAME = "subengine"


def connect_options(connect_timeout: float, application_name: str) -> dict[str, Any]:
    """The libpq options every connection of subengine carries (a pool's `kwargs`)."""
    # libpq's connect_timeout is whole seconds, at least 2 (smaller values mean 2)
    return {
        "connect_timeout": max(2, math.ceil(connect_timeout)),
        "application_name": application_name,
    }


def connect(
    dsn: str,
    connect_timeout: float,
    *,
    application_name: str = APPLICATION_NAME,
    autocommit: bool = False,
) -> PgConnection:
    """A new connection to `dsn` that gives up after `connect_timeout` seconds."""
    return psycopg.connect(
        dsn, autocommit=autocommit, **connect_options(connect_timeout, application_name)
    )


def psycopg_connection(conn: object) -> PgConnection:
    """The psycopg connection of `conn`, inside the transaction the caller has open."""
    if isinstance(conn, psycopg.Connection):
        return _in_transaction(conn)
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    if isinstance(conn, Session):
        conn = conn.connection()  # joins (or begins) the session's transaction
    if isinstance(conn, Connection):
        if not conn.in_transaction():
            # What SQLAlchemy's autobegin would do: the caller's commit() commits our rows.
            conn.begin()
        driver_connection = conn.connection.driver_connection
        if isinstance(driver_connection, psycopg.Connection):
            return _in_transaction(driver_connection)
        raise InvalidInput(
            "subengine needs SQLAlchemy's psycopg driver: use a URL starting with "
            f"'postgresql+psycopg://' (this connection uses {conn.dialect.driver!r})"
        )
    raise InvalidInput(
        "expected a psycopg Connection, a SQLAlchemy Connection or a SQLAlchemy Session, "
        f"got {type(conn).__name__}"
    )


def _in_transaction(conn: PgConnection) -> PgConnection:
    # In autocommit mode with no transaction block open, the events would commit at once,
    # whatever the caller does next: refuse rather than surprise.
    if conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        raise InvalidInput(
            "the connection is in autocommit mode with no transaction open, so the events "
            "would commit on their own: open one (`with conn.transaction():`) or use "
            "engine.append()"
        )
    return conn
