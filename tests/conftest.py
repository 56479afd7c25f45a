"""Fixtures: a real PostgreSQL for every test.

By default the suite starts its own embedded PostgreSQL (pgserver) in a temporary
directory; with SUBENGINE_TEST_DSN set it uses that server instead. pytest-postgresql's
no-process mode then gives each test a fresh database cloned from a template that
subengine's migrations have already been applied to.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pytest_postgresql import factories

import subengine
from subengine import _migrate

_embedded_server: Any = None


def pytest_configure(config: pytest.Config) -> None:
    global _embedded_server
    dsn = os.environ.get("SUBENGINE_TEST_DSN")
    if not dsn:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pgserver

            directory = Path(tempfile.mkdtemp(prefix="subengine-test-pg-"))
            _embedded_server = pgserver.get_server(directory / "pgdata", cleanup_mode="delete")
        dsn = _embedded_server.get_uri()
    params = conninfo_to_dict(dsn)
    config.option.postgresql_host = params.get("host", "localhost")
    config.option.postgresql_port = int(params.get("port", 5432))
    config.option.postgresql_user = params.get("user", "postgres")
    config.option.postgresql_password = params.get("password") or None


def pytest_unconfigure(config: pytest.Config) -> None:
    if _embedded_server is not None:
        _embedded_server.cleanup()


def migrate_template(
    host: str, port: int, user: str, dbname: str, password: str | None, **_: Any
) -> None:
    dsn = make_conninfo(host=host, port=port, user=user, dbname=dbname, password=password or "")
    _migrate.upgrade(dsn, "subengine", subengine.Settings().connect_timeout)


postgresql_migrated_server = factories.postgresql_noproc(
    dbname="subengine_tests", load=[migrate_template]
)
postgresql_blank_server = factories.postgresql_noproc(dbname="subengine_blank")
postgresql = factories.postgresql("postgresql_migrated_server")
postgresql_blank = factories.postgresql("postgresql_blank_server")


def _dsn_of(conn: psycopg.Connection[Any], password: str | None) -> str:
    params = conn.info.get_parameters()
    return make_conninfo(**params, password=password or "")


@pytest.fixture
def dsn(postgresql: psycopg.Connection[Any], postgresql_migrated_server: Any) -> str:
    """Connection string of a fresh, migrated database."""
    return _dsn_of(postgresql, postgresql_migrated_server.password)


@pytest.fixture
def blank_dsn(postgresql_blank: psycopg.Connection[Any], postgresql_blank_server: Any) -> str:
    """Connection string of a fresh database that was never migrated."""
    return _dsn_of(postgresql_blank, postgresql_blank_server.password)


@pytest.fixture
def engine(dsn: str) -> Iterator[subengine.Engine]:
    with subengine.Engine(dsn) as engine:
        yield engine


@pytest.fixture
def orders(engine: subengine.Engine) -> str:
    """A stream of 4 partitions named 'orders'."""
    engine.create_stream("orders", partitions=4)
    return "orders"


@pytest.fixture
def fast_engine(dsn: str, sql: psycopg.Connection[Any]) -> Iterator[subengine.Engine]:
    """An engine whose workers poll, retry and beat fast, with a 4-partition stream
    'orders' and an `effects` table."""
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    settings = subengine.Settings(
        dsn=dsn, poll_interval=0.2, retry_delay=0.05, retry_delay_max=0.1, heartbeat_interval=0.5
    )
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("orders", partitions=4)
        yield engine


@pytest.fixture
def sql(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for looking at the database directly."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def cli_env(dsn: str, tmp_path: Path) -> dict[str, str]:
    """Environment for running the `subengine` command against the test database."""
    env = dict(os.environ)
    env.update(SUBENGINE_DSN=dsn, SUBENGINE_HOME=str(tmp_path / "home"))
    env.pop("SUBENGINE_SCHEMA", None)
    return env


PYTHON = sys.executable


def snapshot(sql: psycopg.Connection[Any]) -> tuple[Any, ...]:
    """Everything an append or a stream command can change, to compare before and after."""
    return (
        sql.execute("SELECT name, partitions FROM subengine.streams ORDER BY 1").fetchall(),
        sql.execute(
            "SELECT stream, partition, head, head_time FROM subengine.partitions ORDER BY 1, 2"
        ).fetchall(),
        sql.execute("SELECT count(*), max(recorded_at) FROM subengine.events").fetchone(),
    )


def subengine_command() -> str:
    """The installed `subengine` console script of this interpreter's environment."""
    return str(Path(sys.executable).parent / "subengine")


def run_subengine(
    env: dict[str, str],
    *args: str,
    stdin: str | None = None,
    timeout: float = 120,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the `subengine` command as a process and capture what it prints."""
    return subprocess.run(
        [subengine_command(), *args],
        env=env,
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_subengine_until(
    env: dict[str, str],
    *args: str,
    ready: Callable[[], object],
    signum: int,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Start the `subengine` command, call `ready()` (it waits for whatever the command
    should have done), then send it `signum` and collect what it printed."""
    process = subprocess.Popen(
        [subengine_command(), *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready()
    finally:
        process.send_signal(signum)
        out, err = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


APPS = Path(__file__).parent / "apps"
README = Path(__file__).parent.parent / "README.md"


def write_readme_app(directory: Path) -> None:
    """The README's example app, as written, as the package `myproject` in `directory`."""
    readme = README.read_text()
    [source] = [
        block.split("```", 1)[0]
        for block in readme.split("```python\n")
        if block.startswith("# myproject/consumers.py")
    ]
    (directory / "myproject").mkdir()
    (directory / "myproject" / "__init__.py").write_text("")
    (directory / "myproject" / "consumers.py").write_text(source)


@pytest.fixture
def worker_app_env(cli_env: dict[str, str], sql: psycopg.Connection[Any]) -> dict[str, str]:
    """The table `tests/apps/worker_app.py` writes its effects to (no unique constraint),
    and an environment for the `subengine` command with short intervals."""
    sql.execute("CREATE SEQUENCE effect_order")
    sql.execute(
        "CREATE TABLE effects (event_id uuid, key text, key_version bigint, partition int,"
        " position bigint, seq bigint)"
    )
    env = dict(
        cli_env,
        SUBENGINE_POLL_INTERVAL="0.5",
        SUBENGINE_RETRY_DELAY="0.1",
        SUBENGINE_RETRY_DELAY_MAX="0.5",
        SUBENGINE_HEARTBEAT_INTERVAL="1",
        SUBENGINE_PROGRESS_INTERVAL="0.2",
    )
    for name in ("WORKER_APP_SLEEP", "WORKER_APP_MARKS", "WORKER_APP_BATCH"):
        env.pop(name, None)
    return env


class Proxy:
    """A TCP proxy to the PostgreSQL of `dsn`; leaving the `with` block closes it and every
    connection through it, as a network outage would. While `silent` is set, new
    connections are accepted and then never answered, as a host that drops packets would.
    `listener`: a socket bound but not yet listening, which refuses connections until the
    proxy starts (a server that is not up yet)."""

    def __init__(self, dsn, listener=None):
        params = conninfo_to_dict(dsn)
        self.target = (params.get("host") or "localhost", int(params.get("port") or 5432))
        self.listener = listener or socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        self.lock = threading.Lock()
        self.silent = False

    def __enter__(self):
        self.listener.listen()
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc):
        with self.lock:
            for s in self.sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self.sockets.clear()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.silent:
                with self.lock:
                    self.sockets.append(client)
                continue
            server = self._connect()
            with self.lock:
                self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def dsn(self, dsn):
        """`dsn` through the proxy."""
        return make_conninfo(dsn, host="127.0.0.1", port=self.port)

    def _connect(self):
        host, port = self.target
        if host.startswith("/"):  # a Unix-domain socket directory, as libpq names it
            server = socket.socket(socket.AF_UNIX)
            server.connect(f"{host}/.s.PGSQL.{port}")
            return server
        return socket.create_connection(self.target)

    @staticmethod
    def _pipe(source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
