"""Two pytest sessions against one PostgreSQL server (two checkouts, or CI beside a
developer) keep to databases of their own: neither drops, reuses or terminates the other's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from helpers import PYTHON, TESTS
from psycopg.conninfo import make_conninfo
from pytest_postgresql.executors import NoopExecutor

# Each session's test waits until the other's has its database too, so the two overlap.
INNER_TEST = """
import os, time
from pathlib import Path

import psycopg


def test_keeps_its_database_while_the_other_session_runs(dsn):
    barrier = Path(os.environ["BARRIER"])
    (barrier / os.environ["SESSION"]).touch()
    deadline = time.monotonic() + 30
    while len(list(barrier.iterdir())) < 2:
        assert time.monotonic() < deadline, "the other session never got a database"
        time.sleep(0.05)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE mine (session text)")
        conn.execute("INSERT INTO mine VALUES (%s)", (os.environ["SESSION"],))
        for _ in range(10):
            time.sleep(0.1)
            assert conn.execute("SELECT session FROM mine").fetchall() == [
                (os.environ["SESSION"],)
            ]
"""


def test_two_sessions_on_one_server_keep_to_their_own_databases(
    postgresql_migrated_server: NoopExecutor, tmp_path: Path
) -> None:
    server = postgresql_migrated_server
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(INNER_TEST)
    shutil.copy(TESTS / "conftest.py", tmp_path)  # this suite's fixtures, helpers on the path
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    dsn = make_conninfo(
        host=server.host,
        port=server.port,
        user=server.user,
        password=server.password or "",
        dbname="postgres",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(SUBENGINE_TEST_DSN=dsn, PYTHONPATH=str(TESTS), BARRIER=str(barrier))
    command = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    sessions = [
        subprocess.Popen(
            [*command, str(test_file)],
            env={**env, "SESSION": name},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("one", "two")
    ]
    outputs = [session.communicate(timeout=120)[0] for session in sessions]
    for session, output in zip(sessions, outputs, strict=True):
        assert session.returncode == 0, output
        assert "1 passed" in output, output
