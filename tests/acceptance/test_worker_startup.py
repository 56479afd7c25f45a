"""`subengine worker` stopped while it starts: every SIGTERM or SIGINT ends in exit 0.

A supervisor may stop a worker it has just started. The signal must not find the worker
without its handlers: during the app's import, or while it waits for PostgreSQL, it ends
the start-up at once with a line saying so.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import APPS, run_subengine, subengine_command, wait_for

import subengine


def start_worker(env: dict[str, str], app: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [subengine_command(), "worker", "--app", app, *args],
        cwd=APPS,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_apps_import_exits_0(
    worker_app_env: dict[str, str], tmp_path: Path, signum: signal.Signals
) -> None:
    marker = tmp_path / "importing"
    env = dict(worker_app_env, SLOW_IMPORT_MARKER=str(marker), SLOW_IMPORT_SECONDS="600")
    worker = start_worker(env, "slow_import_app:app")
    try:
        wait_for(marker.exists, "the app's import to begin")
        worker.send_signal(signum)
        _out, err = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert worker.returncode == 0, err
    name = signal.Signals(signum).name
    assert f"{name} before the worker started: it stopped without starting" in err
    assert "Traceback" not in err


def test_a_sigterm_while_waiting_for_postgresql_exits_0(worker_app_env: dict[str, str]) -> None:
    env = dict(
        worker_app_env,
        SUBENGINE_DSN="postgresql://app@127.0.0.1:1/db",  # port 1: connections refused
        SUBENGINE_CONNECT_TIMEOUT="600",
    )
    worker = start_worker(env, "worker_app:app")
    bound = threading.Timer(60, worker.kill)  # only if the waiting line never comes
    bound.start()
    try:
        said = ""
        while "waiting for PostgreSQL" not in said:  # after the pool's own warnings
            line = worker.stderr.readline()  # type: ignore[union-attr]
            assert line, said
            said += line
        worker.send_signal(signal.SIGTERM)
        _out, err = worker.communicate(timeout=60)
    finally:
        bound.cancel()
        worker.kill()
    assert worker.returncode == 0, said + err
    assert "SIGTERM before the worker started: it stopped without starting" in err


def test_a_sigterm_once_the_worker_runs_still_finishes_cleanly(
    worker_app_env: dict[str, str], engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("orders", partitions=2)
    worker = start_worker(worker_app_env, "worker_app:app")
    try:
        wait_for(
            lambda: sql.execute("SELECT count(*) FROM subengine.workers").fetchone()[0] == 1,  # type: ignore[index]
            "the worker to register",
        )
        worker.send_signal(signal.SIGTERM)
        _out, err = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert worker.returncode == 0, err
    assert "SIGTERM: finishing the current batches, then exiting" in err
    assert sql.execute("SELECT count(*) FROM subengine.workers").fetchone()[0] == 0  # type: ignore[index]


@pytest.mark.parametrize("raw", ["nan", "inf"])
def test_a_worker_with_a_non_finite_poll_interval_exits_with_one_line(
    orders: str, worker_app_env: dict[str, str], raw: str
) -> None:
    # nan made an idle worker spin (~2,000 transactions/s); inf raised OverflowError
    env = dict(worker_app_env, SUBENGINE_POLL_INTERVAL=raw)
    result = run_subengine(env, "worker", "--app", "worker_app:app", cwd=APPS, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (
        "error: setting poll_interval must be a number of seconds above 0 and at most 604800"
        f" (a week), not {raw} (environment variable SUBENGINE_POLL_INTERVAL)\n"
    )
