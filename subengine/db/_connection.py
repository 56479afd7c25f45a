"""Opening connections, and finding the psycopg connection behind what the caller hands us.

`connect` is the one place subengine opens a connection of its own (the engine's pool
opens its connections with the same options): every one carries a connect timeout (an
unreachable host fails instead of hanging) and an application name (the status views and
`pg_stat_activity` tell subengine's connections apart). Nothing else is set on the
session: the schema is in every statement the SQL layer renders, never on the
search_path (handlers run on these connections, and their unqualified names must resolve
as the application expects), and the `options` the DSN, a service file or PGOPTIONS give
stay in force (an `options` keyword of ours would replace them, and PgBouncer refuses it).

A DSN holds a password, and libpq quotes pieces of the DSN in its messages. Every message
that leaves this module names no secret: see `dsn_problem` and `connect`. The errors
PostgreSQL gives are sorted here too, once for all callers: `connection_lost` (the
connection is gone; the statement did not fail on its own) and `may_succeed_later` (a
connection attempt that a starting server, a restart or a full server explains).

Behind a connection pooler in transaction mode (PgBouncer, a hosted database's pooler)
one client connection is served by many server sessions in turn, and a session's state
(prepared statements, LISTEN, advisory locks, settings) goes to whoever gets the session
next. Every connection opened here finds out whether it reaches PostgreSQL that way: the
process id PostgreSQL gave the connection at start-up (kept by libpq) is then the
pooler's, not that of the session serving the statement. On such a connection psycopg's
automatic prepared statements are off, and `pooled(conn)` says so; what needs a session
of its own refuses such a connection (`needs_own_session`). docs/pooler.md has the rest.

`append` runs in the caller's transaction, whether the caller holds a psycopg connection,
a SQLAlchemy `Connection` or a SQLAlchemy `Session` (on the psycopg driver).
"""

from __future__ import annotations

import functools
import logging
import math
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Self, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict

from subengine.db._sql import SQL, Query, first_row
from subengine.model._errors import ConfigurationError, DatabaseUnavailable, InvalidInput

PgConnection = psycopg.Connection[Any]

log = logging.getLogger("subengine")

APPLICATION_NAME = "subengine"

# libpq options whose values are secrets; a message never shows them.
_SECRET_OPTIONS = frozenset(
    {"password", "sslpassword", "oauth_client_secret", "scram_client_key", "scram_server_key"}
)
_HIDDEN = "(hidden)"
# the attribute of an error made without secrets that keeps may_succeed_later's verdict
_MAY_SUCCEED_LATER = "subengine_may_succeed_later"
_QUOTED = re.compile(r'"[^"]*"|\'[^\']*\'')


def connect_options(connect_timeout: float, application_name: str) -> dict[str, Any]:
    """The libpq options every connection of subengine carries (a pool's `kwargs`)."""
    # libpq's connect_timeout is whole seconds, at least 2 (smaller values mean 2)
    return {
        "connect_timeout": max(2, math.ceil(connect_timeout)),
        "application_name": application_name,
    }


# The connections found to go through a pooler; and whether this process said so yet.
_POOLED: weakref.WeakSet[Any] = weakref.WeakSet()
_said = threading.Event()
# The session serving a statement, to compare with the one libpq was told at start-up
# (the query names no table: any schema renders it).
_SERVING_PID = Query("serving_backend_pid", {}, first_row)
_PLAIN = SQL("public")


def pooled(conn: Any) -> bool:
    """Whether `conn` (opened by this module, or from an engine's pool) reaches PostgreSQL
    through a pooler that hands it a different session per transaction."""
    return conn in _POOLED


def _checked(conn: C) -> C:
    """`conn`, its prepared statements off when a pooler stands before PostgreSQL."""
    try:
        row = _PLAIN.run(conn, _SERVING_PID)
        if not conn.autocommit:
            conn.rollback()
    except BaseException:
        conn.close()
        raise
    if row is not None and row[0] != conn.info.backend_pid:
        _mark_pooled(conn)
    return conn


def _mark_pooled(conn: Any) -> None:
    # a prepared statement would live in one server session and be missing (or
    # already exist) in the next: psycopg prepares nothing with no threshold
    conn.prepare_threshold = None
    _POOLED.add(conn)
    if not _said.is_set():
        _said.set()
        log.warning(
            "subengine: a database connection goes through a connection pooler (the "
            "session serving it is not the one it started with): prepared statements are "
            "off on it, and what needs a session of its own (LISTEN, the workers' "
            "partition locks, the pruner's lock) needs SUBENGINE_DIRECT_DSN "
            "(docs/pooler.md)"
        )


class SessionNeeded(ConfigurationError):
    """A connection that goes through a pooler was refused for what needs a session of
    its own (and no SUBENGINE_DIRECT_DSN is set, or it too is pooled)."""


def needs_own_session(what: str) -> SessionNeeded:
    """The error refusing a pooled connection for `what`, which needs a session of its
    own; it says what to set."""
    return SessionNeeded(
        f"{what} needs a database session of its own, and this connection goes through a "
        "connection pooler: set SUBENGINE_DIRECT_DSN to a connection straight to "
        "PostgreSQL (docs/pooler.md)"
    )


def connect(
    dsn: str,
    connect_timeout: float,
    *,
    application_name: str = APPLICATION_NAME,
    autocommit: bool = False,
) -> PgConnection:
    """A new connection to `dsn` that gives up after `connect_timeout` seconds, named
    `application_name`.

    A failure raises the psycopg error libpq gave (OperationalError; ProgrammingError for
    a malformed DSN), its message stripped of the DSN's secrets.
    """
    options = connect_options(connect_timeout, application_name)
    conn = _opened(lambda: psycopg.connect(dsn, autocommit=autocommit, **options), dsn)
    return _checked(conn)


class PooledConnection(psycopg.Connection[Any]):
    """The connections of an engine's pool (its `connection_class`): opened as `connect`
    opens every other, so that the pool's own log lines name no secret either."""

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
        conn = _opened(lambda: super(PooledConnection, cls).connect(conninfo, **kwargs), conninfo)
        return _checked(conn)


C = TypeVar("C", bound=PgConnection)


def _opened(open_connection: Callable[[], C], dsn: str) -> C:
    try:
        return open_connection()
    except psycopg.Error as error:
        failure = _without_secrets(error, dsn)
    # Raised outside the `except`, so that the original error, whose message may quote
    # the password, is not kept as this one's context (tracebacks would print it).
    raise failure


def dsn_problem(dsn: str) -> str | None:
    """Why libpq cannot parse `dsn` (None if it can), quoting none of the DSN's values.

    libpq quotes the offending token, which may be (part of) the password: only quoted
    option names and punctuation are kept.
    """
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as error:
        return _QUOTED.sub(_keep_if_harmless, one_line(str(error)))
    return None


def safe_message(error: BaseException, dsn: str) -> str:
    """`error`'s message on one line, without any secret of `dsn` in it."""
    text = one_line(str(error))
    secrets = _secrets(dsn)
    if secrets is None:
        # the DSN does not parse, so its secrets are unknown: hide every quoted value
        return _QUOTED.sub(_keep_if_harmless, text)
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, _HIDDEN)
    return text


def one_line(text: str) -> str:
    """libpq's messages span lines (a hint, or a sentence wrapped onto tab-indented
    lines): join them into one, a new sentence after a full stop."""
    joined = ""
    for line in (raw.strip() for raw in text.strip().splitlines()):
        if line and joined:
            new_sentence = line[0].isupper() and joined[-1] not in ".:;?!"
            joined += ". " if new_sentence else " "
        joined += line
    return joined


def connection_lost(error: BaseException) -> bool:
    """True when `error` says the connection itself is gone (the server closed or
    terminated it, shut down or crashed, the network broke), so that the statement may
    well succeed on a new connection; False for errors of the statement (a constraint, a
    canceled query, a lock or statement timeout), which a new connection would repeat.

    Accepts SQLAlchemy's wrappers too (their `orig` is the psycopg error).
    """
    original = getattr(error, "orig", None)
    if isinstance(original, psycopg.Error):
        error = original
    if not isinstance(error, psycopg.Error):
        return False
    sqlstate = error.sqlstate
    if sqlstate is None:
        # No SQLSTATE: the client raised it, not the server. OperationalError is then a
        # broken or closed connection ("server closed the connection unexpectedly").
        return isinstance(error, psycopg.OperationalError)
    # class 08: connection exception; 57P01-57P05: admin or crash shutdown, cannot
    # connect now, database dropped, idle session timeout (57014, a canceled query, is not)
    return sqlstate.startswith("08") or sqlstate.startswith("57P")


# What PostgreSQL and libpq say when a connection attempt fails for a reason that the
# next attempt would meet again: a wrong password, role, database or host name, a
# pg_hba.conf rule, an invalid option. PostgreSQL gives no SQLSTATE for a failed
# connection attempt, so its (English) words are all there is; anything else counts as
# a server that may be starting, restarting, full or briefly out of reach.
_FOR_GOOD = re.compile(
    r"authentication failed"  # password, peer, ident, cert, …
    r"|no password supplied"
    r"|pg_hba\.conf"  # no entry for the host, or a reject rule
    r"|does not exist"  # the database or the role
    r"|not permitted to log in"
    r"|permission denied for database"
    r"|\binvalid\b.*\b(value|option|number)\b"  # a malformed sslmode, port, …
    r"|servname not supported"  # a port that is not a number
    r"|failed to resolve host|could not translate host name",  # psycopg's, libpq's
    re.IGNORECASE,
)
_RESOLVER_BUSY = re.compile(
    rf"temporary failure in name resolution|\[Errno {socket.EAI_AGAIN}\]", re.IGNORECASE
)


def may_succeed_later(error: psycopg.Error) -> bool:
    """Whether a failed connection attempt may succeed if tried again: True for a server
    that refuses connections, is starting or shutting down, has no slot free, or does not
    answer; False for a wrong password, role, database, host name or DSN."""
    judged = getattr(error, _MAY_SUCCEED_LATER, None)
    if judged is not None:
        return bool(judged)  # before its secrets were hidden (`_without_secrets`)
    if isinstance(error, psycopg.ProgrammingError):
        return False  # the DSN does not parse
    text = str(error)
    if _RESOLVER_BUSY.search(text):
        return True  # a resolver that could not answer now may answer later
    return _FOR_GOOD.search(text) is None


# How long to wait for the pool before looking at why it has no connection; doubled after
# every look up to the second value. The first is short, so that a wrong password fails,
# and a server that is starting says so, within a second.
_FIRST_LOOK_SECONDS = 0.5
_LONGEST_LOOK_SECONDS = 4.0
# How long to wait for one more connection attempt that explains a pool timeout.
_DIAGNOSIS_TIMEOUT_SECONDS = 5.0


class PoolWait:
    """The decisions of one wait for a pooled connection, shared by `Engine` and
    `AsyncEngine` (which do the waiting, each with its own kind of I/O).

    While the pool fails to connect, a connection attempt of the engine's own tells why: a
    problem no retry fixes raises at once; one that a starting server explains is reported
    once and waited out, up to `timeout`. While the pool connects fine and all its
    connections are in use, the wait goes on until `timeout` too.
    """

    def __init__(self, dsn: str, timeout: float, pool_size: int) -> None:
        self._dsn = dsn
        self._timeout = timeout
        self._pool_size = pool_size
        self._deadline = time.monotonic() + timeout
        self._look = _FIRST_LOOK_SECONDS
        self._reported = False

    def look(self, impatient: bool = False) -> float:
        """How long to wait on the pool now (each look waits longer than the last, but
        an `impatient` one no longer than the first)."""
        longest = _FIRST_LOOK_SECONDS if impatient else self._look
        wait = max(0.0, min(longest, self._deadline - time.monotonic()))
        self._look = min(2 * self._look, _LONGEST_LOOK_SECONDS)
        return wait

    def pool_busy(self) -> None:
        """The pool connects fine, but every connection is in use: wait for one rather
        than open more than SUBENGINE_POOL_MAX_SIZE, up to the deadline."""
        if time.monotonic() >= self._deadline:
            raise DatabaseUnavailable(
                f"no free connection within {self._timeout:g} s (SUBENGINE_CONNECT_TIMEOUT): "
                f"all {self._pool_size} of the pool (SUBENGINE_POOL_MAX_SIZE) are in use"
            )

    def diagnosis_timeout(self) -> float:
        """The connect timeout of the engine's own attempt that tells why."""
        remaining = self._deadline - time.monotonic()
        return max(0.1, min(remaining, _DIAGNOSIS_TIMEOUT_SECONDS))

    def failed(self, error: psycopg.Error) -> None:
        """The engine's own attempt failed too: raise what no retry fixes, or what lasted
        past the deadline; otherwise say once (a warning, which reaches stderr even where
        logging is not configured) that we wait."""
        reason = safe_message(error, self._dsn)
        if not may_succeed_later(error):
            raise ConfigurationError(
                f"cannot connect to PostgreSQL: {reason} (retrying cannot help: check "
                "the DSN, the server's roles and databases, and pg_hba.conf)"
            ) from error
        if time.monotonic() >= self._deadline:
            raise DatabaseUnavailable(
                f"could not connect to PostgreSQL within {self._timeout:g} s "
                f"(SUBENGINE_CONNECT_TIMEOUT): {reason}"
            )
        if not self._reported:
            self._reported = True
            logging.getLogger("subengine").warning(
                "subengine: waiting for PostgreSQL, which does not accept connections "
                "yet: %s; retrying for up to %g s (SUBENGINE_CONNECT_TIMEOUT)",
                reason,
                self._timeout,
            )


def connection_lost_error(error: psycopg.Error, dsn: str) -> DatabaseUnavailable | None:
    """DatabaseUnavailable when `error`, raised inside an engine's call, says the
    connection was lost (the server restarted, the backend was terminated)."""
    if not connection_lost(error):
        return None
    return DatabaseUnavailable(
        f"lost the connection to PostgreSQL: {safe_message(error, dsn)}; "
        "nothing of this call committed unless the loss came during its commit"
    )


def psycopg_connection(
    conn: object,
    *,
    alone: str = "the events would commit on their own",
    instead: str = "engine.append()",
) -> PgConnection:
    """The psycopg connection of `conn`, inside the transaction the caller has open.

    `alone` and `instead` complete the refusal of an autocommit connection with no
    transaction open: what would happen, and what to call instead.
    """
    if isinstance(conn, psycopg.Connection):
        return _in_transaction(conn, alone, instead)
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
            return _in_transaction(driver_connection, alone, instead)
        raise InvalidInput(
            "subengine needs SQLAlchemy's psycopg driver: use a URL starting with "
            f"'postgresql+psycopg://' (this connection uses {conn.dialect.driver!r})"
        )
    raise InvalidInput(
        "expected a psycopg Connection, a SQLAlchemy Connection or a SQLAlchemy Session, "
        f"got {type(conn).__name__}"
    )


def _in_transaction(conn: PgConnection, alone: str, instead: str) -> PgConnection:
    # In autocommit mode with no transaction block open, the work would commit at once,
    # whatever the caller does next: refuse rather than surprise.
    if conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        raise InvalidInput(
            f"the connection is in autocommit mode with no transaction open, so {alone}: "
            f"open one (`with conn.transaction():`) or use {instead}"
        )
    return conn


def _without_secrets(error: psycopg.Error, dsn: str) -> psycopg.Error:
    """`error`, or an error of its class whose message names no secret of `dsn`."""
    text = safe_message(error, dsn)
    if text == one_line(str(error)):
        return error
    hidden = type(error)(text)
    # whether a retry may help is read in the server's words, which hiding a secret may
    # cut (a password "xis" in "does not exist"): judged here, on the words as written
    setattr(hidden, _MAY_SUCCEED_LATER, may_succeed_later(error))
    return hidden


def _secrets(dsn: str) -> list[str] | None:
    """The values of the DSN's secret options; None when it does not parse."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return None
    return [str(value) for key, value in params.items() if key in _SECRET_OPTIONS and value]


@functools.cache
def _option_names() -> frozenset[str]:
    return frozenset(option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults())


def _keep_if_harmless(quoted: re.Match[str]) -> str:
    inner = quoted.group(0)[1:-1]
    if inner in _option_names() or not any(c.isalnum() for c in inner):
        return quoted.group(0)
    return _HIDDEN


# asyncio: the same options, the same secret-free errors


async def connect_async(
    dsn: str,
    connect_timeout: float,
    *,
    application_name: str = APPLICATION_NAME,
    autocommit: bool = False,
) -> psycopg.AsyncConnection[Any]:
    """`connect` for asyncio: a new `AsyncConnection` with the same options, whose
    errors name no secret of `dsn` either."""
    options = connect_options(connect_timeout, application_name)
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit, **options)
    except psycopg.Error as error:
        failure = _without_secrets(error, dsn)
    else:
        return await _checked_async(conn)
    raise failure  # outside the `except`: see `_opened`


async def _checked_async(conn: psycopg.AsyncConnection[Any]) -> psycopg.AsyncConnection[Any]:
    """`_checked` for asyncio."""
    try:
        row = await _PLAIN.run_async(conn, _SERVING_PID)
        if not conn.autocommit:
            await conn.rollback()
    except BaseException:
        await conn.close()
        raise
    if row is not None and row[0] != conn.info.backend_pid:
        _mark_pooled(conn)
    return conn


class PooledAsyncConnection(psycopg.AsyncConnection[Any]):
    """The connections of an `AsyncEngine`'s pool, opened as `connect_async` opens them."""

    @classmethod
    async def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
        try:
            conn = await super().connect(conninfo, **kwargs)
        except psycopg.Error as error:
            failure = _without_secrets(error, conninfo)
        else:
            await _checked_async(conn)
            return conn
        raise failure


async def async_psycopg_connection(
    conn: object,
    *,
    alone: str = "the events would commit on their own",
    instead: str = "await async_engine.append()",
) -> psycopg.AsyncConnection[Any]:
    """`psycopg_connection` for asyncio: the psycopg `AsyncConnection` of `conn` (one, or
    a SQLAlchemy `AsyncConnection` or `AsyncSession` on the psycopg driver), inside the
    transaction the caller has open (a SQLAlchemy one is begun, as its autobegin would)."""
    if isinstance(conn, psycopg.AsyncConnection):
        # the same attributes as a sync connection's, so the same refusal
        _in_transaction(conn, alone, instead)  # type: ignore[arg-type]
        return conn
    if isinstance(conn, psycopg.Connection):
        raise InvalidInput(
            "expected an asyncio connection, got a sync psycopg Connection: "
            "use subengine.append() with it"
        )
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(conn, AsyncSession):
        conn = await conn.connection()  # joins (or begins) the session's transaction
    if isinstance(conn, AsyncConnection):
        if not conn.in_transaction():
            await conn.begin()
        raw = await conn.get_raw_connection()
        driver_connection = raw.driver_connection
        if isinstance(driver_connection, psycopg.AsyncConnection):
            _in_transaction(driver_connection, alone, instead)  # type: ignore[arg-type]
            return driver_connection
        raise InvalidInput(
            "subengine needs SQLAlchemy's psycopg driver: use a URL starting with "
            f"'postgresql+psycopg://' (this connection uses {conn.dialect.driver!r})"
        )
    raise InvalidInput(
        "expected a psycopg AsyncConnection, a SQLAlchemy AsyncConnection or a SQLAlchemy "
        f"AsyncSession, got {type(conn).__name__}"
    )
