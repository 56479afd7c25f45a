"""Connecting: no password in any message, lost connections named as such, and a wrong
DSN that fails at once while a server that is not up yet is waited for, visibly."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc
from helpers import (
    APPS,
    PASSWORD,
    Proxy,
    invoke,
    run_subengine,
    start_subengine,
    stored_events,
)
from helpers import free_port as refused_port
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.sql import SQL, Identifier, Literal

import subengine
from subengine import NewEvent

# DSNs libpq cannot parse, each with the password (or a piece of it) where libpq's
# message would quote it
MALFORMED = {
    "bad percent-escape": f"postgresql://app:{PASSWORD}%zz@localhost/db",
    "space in a URL": f"postgresql://app:{PASSWORD} x@localhost/db",
    "no '=' in conninfo": f"host=localhost {PASSWORD}",
    "unknown option": f"host=localhost {PASSWORD}=1",
    "unknown URL parameter": f"postgresql://app@localhost/db?{PASSWORD}=1",
    "unclosed IPv6 bracket": f"postgresql://app:{PASSWORD}@[::1/db",
}


def with_password(dsn: str, password: str = PASSWORD, **changes: Any) -> str:
    return make_conninfo(dsn, password=password, **changes)


def assert_no_password(*texts: str) -> None:
    for text in texts:
        assert PASSWORD not in text, text
        assert PASSWORD[:9] not in text, text  # nor a piece of it


# 13: a password is never printed


@pytest.mark.parametrize("dsn", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_dsn_is_refused_without_quoting_its_password(dsn: str) -> None:
    with pytest.raises(subengine.ConfigurationError) as raised:
        subengine.Engine(dsn)
    message = str(raised.value)
    assert message.startswith("invalid DSN: ")
    assert_no_password(message, repr(raised.value))
    assert raised.value.__context__ is None or PASSWORD not in str(raised.value.__context__)


@pytest.mark.parametrize("dsn", MALFORMED.values(), ids=MALFORMED.keys())
def test_the_command_never_prints_the_password_of_a_malformed_dsn(
    cli_env: dict[str, str], dsn: str
) -> None:
    by_option = invoke(cli_env, "--dsn", dsn, "stream", "list", timeout=60)
    by_environment = invoke(dict(cli_env, SUBENGINE_DSN=dsn), "stream", "list", timeout=60)
    for result in (by_option, by_environment):
        assert result.returncode == 1
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("error: invalid DSN: ")
        assert_no_password(result.stdout, result.stderr)


def test_the_worker_never_prints_the_password_of_a_malformed_dsn(cli_env: dict[str, str]) -> None:
    env = dict(cli_env, SUBENGINE_DSN=MALFORMED["bad percent-escape"])
    result = run_worker(env)
    assert result.returncode == 1
    assert "invalid DSN" in result.stderr
    assert_no_password(result.stdout, result.stderr)


def test_no_password_when_a_well_formed_dsn_fails_to_connect(
    dsn: str, cli_env: dict[str, str]
) -> None:
    wrong = {
        "refused port": with_password(dsn, host="127.0.0.1", port=refused_port()),
        "unknown database": with_password(dsn, dbname="no_such_database"),
        "unknown role": with_password(dsn, user="no_such_role"),
        "password as sslmode": with_password(dsn, sslmode=PASSWORD),
    }
    for what, wrong_dsn in wrong.items():
        settings = subengine.Settings(dsn=wrong_dsn, connect_timeout=1)
        with pytest.raises(subengine.SubengineError) as raised:
            with subengine.Engine(settings=settings) as engine:
                engine.streams()
        assert_no_password(str(raised.value), repr(raised.value))
        env = dict(cli_env, SUBENGINE_DSN=wrong_dsn, SUBENGINE_CONNECT_TIMEOUT="1")
        result = invoke(env, "stream", "list", timeout=60)
        assert result.returncode == 1, what
        assert_no_password(result.stdout, result.stderr)
        worker = run_worker(env)
        assert worker.returncode == 1, what
        assert_no_password(worker.stdout, worker.stderr)


def run_worker(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_subengine(
        env, "worker", "--app", "worker_app:app", "--log-level", "debug", cwd=APPS, timeout=60
    )


# 15: a lost connection is DatabaseUnavailable, and the engine recovers


def connection_lost(error: BaseException) -> bool:
    from subengine.db._connection import connection_lost  # where the worker finds it too

    return connection_lost(error)


def test_append_on_terminated_connections_raises_database_unavailable_then_works(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    # three pooled connections, all idle, then PostgreSQL terminates them (as a restart does)
    with engine.connection(), engine.connection(), engine.connection():
        pass
    terminated = sql.execute(  # type: ignore[index]
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'subengine'"
    ).fetchone()[0]
    assert terminated >= 3
    with pytest.raises(subengine.DatabaseUnavailable) as raised:
        engine.append(orders, [NewEvent("k", "Lost", {})])
    assert isinstance(raised.value.__cause__, psycopg.OperationalError)
    assert "lost the connection to PostgreSQL" in str(raised.value)
    stored = engine.append(orders, [NewEvent("k", "Kept", {})])
    assert [e.type for e in stored_events(engine.read(orders, stored[0].partition))] == ["Kept"]


def test_a_canceled_statement_is_not_database_unavailable(
    engine: subengine.Engine, orders: str
) -> None:
    with pytest.raises(psycopg.errors.QueryCanceled) as raised:
        with engine.connection() as conn:
            conn.execute("SET LOCAL statement_timeout = '50ms'")
            conn.execute("SELECT pg_sleep(5)")
    assert not connection_lost(raised.value)


def test_a_lock_timeout_is_not_database_unavailable(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    with sql.transaction():
        sql.execute("SELECT * FROM subengine.partitions FOR UPDATE")
        with pytest.raises(psycopg.errors.LockNotAvailable) as raised:
            with engine.connection() as conn:
                conn.execute("SET LOCAL lock_timeout = '50ms'")
                conn.execute("SELECT * FROM subengine.partitions FOR UPDATE")
    assert not connection_lost(raised.value)


def test_connection_lost_knows_a_terminated_connection_also_wrapped_by_sqlalchemy(
    dsn: str, sql: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn) as victim:
        sql.execute("SELECT pg_terminate_backend(%s)", (victim.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError) as raised:
            victim.execute("SELECT 1")
        assert connection_lost(raised.value)
        with pytest.raises(psycopg.OperationalError) as closed:
            victim.execute("SELECT 1")  # the connection is now closed, client side
        assert connection_lost(closed.value)
    wrapped = sqlalchemy.exc.OperationalError("SELECT 1", {}, raised.value)
    assert connection_lost(wrapped)
    assert not connection_lost(ValueError("not a database error"))


# 19: a wrong DSN fails at once; a server that is not up yet is waited for, visibly

LONG_WAIT = "600"  # seconds: a command that waited for it would outlast the test's bound


def test_an_unknown_database_fails_at_once_with_one_line(dsn: str, cli_env: dict[str, str]) -> None:
    # the server's own credentials: a server that checks passwords (as CI's PostgreSQL 15
    # does) refuses a made-up one before it says that the database is unknown
    env = dict(
        cli_env,
        SUBENGINE_DSN=make_conninfo(dsn, dbname="no_such_database"),
        SUBENGINE_CONNECT_TIMEOUT=LONG_WAIT,
    )
    result = invoke(env, "stream", "list", timeout=60)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: cannot connect to PostgreSQL: ")
    assert 'database "no_such_database" does not exist' in line
    password = conninfo_to_dict(dsn).get("password")
    assert not password or password not in line  # type: ignore[operator]


def test_an_unknown_host_name_fails_at_once(cli_env: dict[str, str]) -> None:
    env = dict(
        cli_env,
        SUBENGINE_DSN=f"postgresql://app:{PASSWORD}@no-such-host.invalid/db",
        SUBENGINE_CONNECT_TIMEOUT=LONG_WAIT,
    )
    result = invoke(env, "stream", "list", timeout=60)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert "no-such-host.invalid" in line
    assert_no_password(line)


def test_a_wrong_dsn_fails_at_once_in_python_too(dsn: str) -> None:
    settings = subengine.Settings(
        dsn=with_password(dsn, user="no_such_role"), connect_timeout=float(LONG_WAIT)
    )
    # a server that checks passwords says so rather than whether the role exists
    unknown = (
        'role "no_such_role" does not exist|password authentication failed for user "no_such_role"'
    )
    with subengine.Engine(settings=settings) as engine:
        with pytest.raises(subengine.ConfigurationError, match=unknown):
            engine.append("orders", [NewEvent("k", "T", {})])


def test_a_refused_port_is_waited_for_and_said_so_while_it_runs(cli_env: dict[str, str]) -> None:
    env = dict(
        cli_env,
        SUBENGINE_DSN=f"postgresql://app:{PASSWORD}@127.0.0.1:{refused_port()}/db",
        SUBENGINE_CONNECT_TIMEOUT=LONG_WAIT,
    )
    process = start_subengine(
        "stream",
        "list",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    bound = threading.Timer(60, process.kill)  # only if the line never comes
    bound.start()
    try:
        line = process.stderr.readline()  # type: ignore[union-attr]
        assert process.poll() is None, "it gave up instead of waiting"
    finally:
        bound.cancel()
        process.kill()
        process.communicate()
    assert line.startswith("subengine: waiting for PostgreSQL")
    assert "Connection refused" in line
    assert f"retrying for up to {LONG_WAIT} s (SUBENGINE_CONNECT_TIMEOUT)" in line
    assert_no_password(line)


def test_a_server_that_comes_up_while_waited_for_is_used(dsn: str) -> None:
    """A TCP port that refuses connections, then forwards them to PostgreSQL: the engine
    says it waits, and connects once the server is there."""
    waiting = threading.Event()
    said = _Said(waiting)
    logging.getLogger("subengine").addHandler(said)
    try:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
            port = listener.getsockname()[1]
            settings = subengine.Settings(
                dsn=make_conninfo(dsn, host="127.0.0.1", port=port), connect_timeout=600
            )
            with subengine.Engine(settings=settings) as engine:
                result: list[Any] = []
                caller = threading.Thread(target=lambda: result.append(engine.streams()))
                caller.start()
                assert waiting.wait(timeout=60)
                assert caller.is_alive()
                with Proxy(dsn, listener):
                    caller.join(timeout=60)
                assert result == [[]]
    finally:
        logging.getLogger("subengine").removeHandler(said)


class _Said(logging.Handler):
    def __init__(self, waiting: threading.Event) -> None:
        super().__init__()
        self.waiting = waiting

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting for PostgreSQL" in record.getMessage():
            self.waiting.set()


# a real wrong password: the suite's server trusts local connections, so this one checks

CHECKED_ROLE = "checked_role"
RIGHT_PASSWORD = "the-right-one"


@pytest.fixture(scope="module")
def password_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A DSN of a role whose password is checked, on a PostgreSQL of its own (the
    suite's trusts every local connection); the password in it is the right one."""
    import pgserver

    directory = tmp_path_factory.mktemp("password-server") / "pgdata"
    server = pgserver.get_server(directory, cleanup_mode="delete")  # type: ignore[attr-defined]
    try:
        uri = server.get_uri()
        with psycopg.connect(uri, autocommit=True) as conn:
            conn.execute(
                SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    Identifier(CHECKED_ROLE), Literal(RIGHT_PASSWORD)
                )
            )
            hba = Path(conn.execute("SHOW hba_file").fetchone()[0])  # type: ignore[index]
            checked = "".join(
                f"{kind} all {CHECKED_ROLE} {where} scram-sha-256\n"
                for kind, where in (("local", ""), ("host", "127.0.0.1/32"), ("host", "::1/128"))
            )
            hba.write_text(checked + hba.read_text())
            conn.execute("SELECT pg_reload_conf()")
        checked_dsn = make_conninfo(uri, user=CHECKED_ROLE, password=RIGHT_PASSWORD)
        _wait_until_passwords_are_checked(checked_dsn)
        yield checked_dsn
    finally:
        server.cleanup()


def _wait_until_passwords_are_checked(dsn: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            psycopg.connect(make_conninfo(dsn, password="not-it")).close()
        except psycopg.OperationalError:
            return
        time.sleep(0.05)
    raise AssertionError("the server did not start checking passwords")


def test_a_wrong_password_fails_at_once_and_is_never_printed(
    password_dsn: str, cli_env: dict[str, str]
) -> None:
    psycopg.connect(password_dsn).close()  # the right one works
    env = dict(
        cli_env,
        SUBENGINE_DSN=with_password(password_dsn),
        SUBENGINE_CONNECT_TIMEOUT=LONG_WAIT,
    )
    result = invoke(env, "stream", "list", timeout=60)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: cannot connect to PostgreSQL: ")
    assert f'password authentication failed for user "{CHECKED_ROLE}"' in line
    assert_no_password(result.stdout, result.stderr)
    worker = run_worker(env)
    assert worker.returncode == 1
    assert "password authentication failed" in worker.stderr
    assert_no_password(worker.stdout, worker.stderr)
    with pytest.raises(subengine.ConfigurationError) as raised:
        with subengine.Engine(with_password(password_dsn)) as engine:
            engine.streams()
    assert_no_password(str(raised.value), repr(raised.value))
