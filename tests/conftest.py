"""Fixtures: a real PostgreSQL for the integration and acceptance tiers.

The server is started only when a test asks for a database, so the unit tier never boots
one. By default that is an embedded PostgreSQL (pgserver) in a temporary directory, one
per pytest process (each xdist worker has its own); with SUBENGINE_TEST_DSN set it is that
server instead. pytest-postgresql's no-process mode makes a template database that
subengine's migrations have been applied to, and each test gets a fresh database cloned
from it, cloned before the test asks and dropped after it, off its path
(tests/databases.py). Every name carries a random tag of the pytest process (and under
xdist the worker's id), so workers and whole sessions sharing one server never meet.

The browser tests get a headless Chromium, the system's, driven by Playwright (`page`);
the replication tests a primary with a streaming replica of it (`streaming_replica`),
started from the machine's PostgreSQL 15 programs. Both skip, saying what to install,
where the machine lacks them.

Every test under acceptance/ is marked `slow`. Plain helpers live in helpers.py.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from databases import Databases
from helpers import (  # noqa: F401  (re-exported for tests that still import from conftest)
    APPS,
    DELIVERING,
    POSTGRES_15_BIN,
    PYTHON,
    README,
    REPLICATION_TIMEOUT,
    SESSION_TAG,
    GatewayProcess,
    Proxy,
    Receiver,
    Replication,
    free_port,
    postgres_runner,
    run_subengine,
    run_subengine_until,
    snapshot,
    streaming_replication,
    subengine_command,
    wait_for,
    wait_replayed,
    watched_runner,
    write_readme_app,
)
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pytest_postgresql import factories
from pytest_postgresql.executors import NoopExecutor

import subengine
from subengine.db import _migrate

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

TESTS = Path(__file__).parent
_embedded_server: Any = None


def pytest_configure(config: pytest.Config) -> None:
    # A non-interactive shell starts a command run in the background (`./scripts/test &`)
    # with SIGINT ignored, and every process it starts inherits that: the tests that stop
    # a command with SIGINT, as Ctrl-C does, would wait for it until they time out.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    acceptance = TESTS / "acceptance"
    for item in items:
        if item.path.is_relative_to(acceptance):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Collection imported every test module and what they use (PySpark, Playwright,
    # Hypothesis...), a heap that lives as long as the process: frozen, the collector's
    # full passes walk only what the tests make.
    gc.freeze()


def _use_the_server(config: pytest.Config) -> None:
    """Start the embedded server once (unless SUBENGINE_TEST_DSN names one) and point
    pytest-postgresql at it."""
    global _embedded_server
    dsn = os.environ.get("SUBENGINE_TEST_DSN")
    if not dsn:
        if _embedded_server is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from pgserver import get_server  # type: ignore[attr-defined]  # not in its __all__

                _ensure_the_server_user()
                directory = Path(tempfile.mkdtemp(prefix="subengine-test-pg-"))
                _embedded_server = get_server(directory / "pgdata", cleanup_mode="delete")
        dsn = _embedded_server.get_uri()
    params = conninfo_to_dict(dsn)
    config.option.postgresql_host = params.get("host", "localhost")
    config.option.postgresql_port = int(params.get("port") or 5432)
    config.option.postgresql_user = params.get("user", "postgres")
    config.option.postgresql_password = params.get("password") or None


def _ensure_the_server_user() -> None:
    """As root, pgserver runs PostgreSQL as the system user `pgserver`, which it adds on
    first use; on a new machine every pytest-xdist worker would add it at once, and one
    of them once failed its initdb. Add it once, under a lock all the workers share."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return
    from pgserver.utils import ensure_user_exists

    lock = Path(tempfile.gettempdir()) / "subengine-test-pgserver-user.lock"
    with lock.open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        ensure_user_exists("pgserver")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _embedded_server is not None:
        _embedded_server.cleanup()  # deletes its data directory, not the folder made for it
        shutil.rmtree(Path(_embedded_server.pgdata).parent, ignore_errors=True)


def migrate_template(
    host: str, port: int, user: str, dbname: str, password: str | None, **_: Any
) -> None:
    dsn = make_conninfo(host=host, port=port, user=user, dbname=dbname, password=password or "")
    _migrate.upgrade(dsn, "subengine", subengine.Settings().connect_timeout)


_migrated_template = factories.postgresql_noproc(
    dbname=f"subengine_tests_{SESSION_TAG}_", load=[migrate_template]
)
_blank_template = factories.postgresql_noproc(dbname=f"subengine_blank_{SESSION_TAG}_")


@pytest.fixture(scope="session")
def postgresql_migrated_server(request: pytest.FixtureRequest) -> NoopExecutor:
    """The server, with a migrated template database for each test's database."""
    _use_the_server(request.config)
    executor: NoopExecutor = request.getfixturevalue("_migrated_template")
    return executor


@pytest.fixture(scope="session")
def postgresql_blank_server(request: pytest.FixtureRequest) -> NoopExecutor:
    """The server, with an empty template database for each test's database."""
    _use_the_server(request.config)
    executor: NoopExecutor = request.getfixturevalue("_blank_template")
    return executor


def _databases(executor: NoopExecutor) -> Iterator[Databases]:
    databases = Databases(
        prefix=executor.dbname,
        template=executor.template_dbname,
        host=executor.host,
        port=executor.port,
        user=executor.user,
        password=executor.password or "",
    )
    yield databases
    databases.close()


@pytest.fixture(scope="session")
def _migrated_databases(postgresql_migrated_server: NoopExecutor) -> Iterator[Databases]:
    yield from _databases(postgresql_migrated_server)


@pytest.fixture(scope="session")
def _blank_databases(postgresql_blank_server: NoopExecutor) -> Iterator[Databases]:
    yield from _databases(postgresql_blank_server)


def _connected(databases: Databases, executor: NoopExecutor) -> Iterator[psycopg.Connection[Any]]:
    name = databases.take()
    try:
        with psycopg.connect(
            host=executor.host,
            port=executor.port,
            user=executor.user,
            password=executor.password or "",
            dbname=name,
        ) as conn:
            yield conn
    finally:
        databases.give_back(name)


@pytest.fixture
def postgresql(
    _migrated_databases: Databases, postgresql_migrated_server: NoopExecutor
) -> Iterator[psycopg.Connection[Any]]:
    """A connection to a fresh database of this test's own, migrated."""
    yield from _connected(_migrated_databases, postgresql_migrated_server)


@pytest.fixture
def postgresql_blank(
    _blank_databases: Databases, postgresql_blank_server: NoopExecutor
) -> Iterator[psycopg.Connection[Any]]:
    """A connection to a fresh database of this test's own that was never migrated."""
    yield from _connected(_blank_databases, postgresql_blank_server)


def _dsn_of(conn: psycopg.Connection[Any], password: str | None) -> str:
    params = conn.info.get_parameters()
    return make_conninfo(**params, password=password or "")


@pytest.fixture
def dsn(postgresql: psycopg.Connection[Any], postgresql_migrated_server: NoopExecutor) -> str:
    """Connection string of a fresh, migrated database."""
    return _dsn_of(postgresql, postgresql_migrated_server.password)


@pytest.fixture
def blank_dsn(
    postgresql_blank: psycopg.Connection[Any], postgresql_blank_server: NoopExecutor
) -> str:
    """Connection string of a fresh database that was never migrated."""
    return _dsn_of(postgresql_blank, postgresql_blank_server.password)


@pytest.fixture
def engine(dsn: str) -> Iterator[subengine.Engine]:
    with subengine.Engine(dsn) as engine:
        yield engine


@pytest.fixture
def runner() -> Iterator[asyncio.Runner]:
    """An event loop for a synchronous test that runs async code, closed after it; a
    test whose loop hangs fails with its tasks' stacks (`watched_runner`)."""
    with watched_runner() as runner:
        yield runner


@pytest.fixture
def async_engine(dsn: str, runner: asyncio.Runner) -> Iterator[subengine.AsyncEngine]:
    """An opened AsyncEngine on the test's database, on `runner`'s loop."""
    engine = subengine.AsyncEngine(dsn)
    runner.run(engine.open())
    yield engine
    runner.run(engine.close())


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


@pytest.fixture
def gateway(cli_env: dict[str, str], tmp_path: Path) -> Iterator[GatewayProcess]:
    """`subengine serve` on the test database, as a real process on a loopback port."""
    with GatewayProcess(cli_env, "--heartbeat", "1", tmp=tmp_path) as process:
        yield process


@pytest.fixture
def delivering_gateway(cli_env: dict[str, str], tmp_path: Path) -> Iterator[GatewayProcess]:
    """`subengine serve` as `gateway` is, delivering webhooks to loopback callbacks and
    retrying a failed delivery within a second."""
    allow = ("--callback-allow", "127.0.0.0/8", "--webhook-retry-max", "1")
    with GatewayProcess(cli_env, "--heartbeat", "1", *allow, tmp=tmp_path) as process:
        yield process


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


@pytest.fixture
def stored(engine: subengine.Engine, orders: str) -> str:
    """The stream 'orders' with a few events, so that 'nothing changed' has something to keep."""
    engine.append(orders, [subengine.NewEvent(f"k{n}", "T", {"n": n}) for n in range(8)])
    return orders


# The flags that let Chromium run headless as root in a container and keep it off the
# network: no sandbox (it needs user namespaces), no GPU, no QUIC, and none of the
# background fetches (updates, sync, component downloads) a desktop browser makes.
# Playwright adds --headless and a fresh --user-data-dir of its own to every launch.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Every wait of a browser test ends: a launch, a navigation, an evaluation.
BROWSER_TIMEOUT_MS = 20_000


@pytest.fixture
def browser() -> Iterator[Browser]:
    """A headless Chromium for this test: the system's (/usr/bin/chromium, or
    SUBENGINE_TEST_CHROMIUM), driven by Playwright's synchronous API.

    One per test, not per session: while Playwright's synchronous API runs, it marks its
    event loop as running in this thread, so `asyncio.run` fails here until it stops; a
    browser that outlived its test would break the async tests after it. A launch costs
    about a second. The same holds inside a browser test: it cannot run asyncio code
    in its own thread.
    """
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright is not installed: pip install -e '.[test]'")
    chromium = Path(os.environ.get("SUBENGINE_TEST_CHROMIUM", "/usr/bin/chromium"))
    if not chromium.is_file():
        pytest.skip(
            f"no Chromium at {chromium}: install it (Debian: apt-get install chromium) "
            "or set SUBENGINE_TEST_CHROMIUM to a Chromium or Chrome executable"
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium,
            headless=True,
            chromium_sandbox=False,
            args=CHROMIUM_FLAGS,
            timeout=BROWSER_TIMEOUT_MS,
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Browser) -> Page:
    """A blank page of a fresh browser context (no cookies, no cache) of `browser`, whose
    every Playwright call gives up after BROWSER_TIMEOUT_MS."""
    context = browser.new_context()
    context.set_default_timeout(BROWSER_TIMEOUT_MS)
    return context.new_page()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A webhook callback on a loopback port that records what it receives."""
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def hooks(cli_env: dict[str, str], tmp_path: Path) -> Iterator[GatewayProcess]:
    """A gateway that delivers webhooks to loopback callbacks, retrying within a second."""
    with GatewayProcess(cli_env, *DELIVERING, tmp=tmp_path) as process:
        yield process


@pytest.fixture(scope="session")
def streaming_replica() -> Iterator[Replication]:
    """(primary_dsn, replica_dsn): a fresh PostgreSQL 15 primary, migrated, and a replica
    streaming from it (read-only, hot standby), each on a free loopback port; the replica
    has replayed the migrations. Shared by the tests of a session (each xdist worker
    starts its own pair, in about a second): give streams names of your own, and call
    `wait_replayed` before reading on the replica what the primary just committed."""
    if not (POSTGRES_15_BIN / "initdb").is_file():
        pytest.skip(
            f"PostgreSQL 15's server programs are not in {POSTGRES_15_BIN}: install them "
            "(Debian: apt-get install postgresql-15)"
        )
    runner = postgres_runner()
    if runner is None:
        pytest.skip(
            "initdb refuses to run as root, and root cannot run it as the postgres OS user "
            "here: create that user, or run the tests as another user"
        )
    with streaming_replication(runner) as replication:
        _migrate.upgrade(replication.primary_dsn, "subengine", subengine.Settings().connect_timeout)
        wait_replayed(*replication, timeout=REPLICATION_TIMEOUT)
        yield replication


# a connection pooler in transaction mode (docs/pooler.md)

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _run_as() -> list[str]:
    """PgBouncer refuses to run as root: then it runs as the embedded server's user (its
    socket directory is that user's) or as nobody."""
    if os.geteuid() != 0:
        return []
    for name in ("pgserver", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return ["-u", name]
    pytest.skip("running as root, with no user for PgBouncer to run as")


@pytest.fixture
def bouncer(dsn: str) -> Iterator[str]:
    """The DSN of `dsn`'s database through a PgBouncer in transaction mode."""
    if not os.path.exists(PGBOUNCER):
        pytest.skip("PgBouncer is not installed (apt-get install pgbouncer; .ci/run does)")
    params = conninfo_to_dict(dsn)
    server = " ".join(
        f"{key}={value}"
        for key, value in (
            ("host", params.get("host", "localhost")),
            ("port", params.get("port", 5432)),
            ("user", params.get("user", "postgres")),
            ("password", params.get("password")),
        )
        if value
    )
    directory = Path(tempfile.mkdtemp(prefix="subengine-test-pgbouncer-"))
    directory.chmod(0o777)  # PgBouncer may run as another user (see _run_as)
    port = free_port()
    ini = directory / "pgbouncer.ini"
    ini.write_text(
        f"[databases]\n* = {server}\n\n[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        "auth_type = any\npool_mode = transaction\ndefault_pool_size = 2\n"
        "max_client_conn = 200\nignore_startup_parameters = extra_float_digits,options\n"
        f"logfile = {directory}/pgbouncer.log\npidfile = {directory}/pgbouncer.pid\n"
    )
    ini.chmod(0o644)
    process = subprocess.Popen([PGBOUNCER, *_run_as(), str(ini)], stderr=subprocess.PIPE)
    through = make_conninfo(
        host="127.0.0.1", port=port, dbname=params["dbname"], user=params.get("user", "")
    )

    def up() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"PgBouncer exited: {process.stderr.read()!r}")  # type: ignore[union-attr]
        try:
            psycopg.connect(through, connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    try:
        wait_for(up, "PgBouncer to accept connections", timeout=30)
        yield through
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(directory, ignore_errors=True)
