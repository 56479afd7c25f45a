"""`helpers.invoke`, the tests' in-process run of a one-shot `subengine` command: it must
show what the process would (exit status, stdout, stderr, a crash as a traceback) and see
exactly the environment and directory it is given, leaving the test's own behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest
from helpers import invoke

import subengine


def test_the_exit_status_and_the_streams_are_the_commands(tmp_path: Path) -> None:
    env = {"SUBENGINE_HOME": str(tmp_path)}
    done = invoke(env, "db", "stop")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"no embedded PostgreSQL is running in {tmp_path}\n"
    usage = invoke(env, "stream", "no-such-command")
    assert usage.returncode == 2 and usage.stdout == ""
    assert usage.stderr.startswith("error: ") and usage.stderr.count("\n") == 1
    assert usage.args == ["subengine", "stream", "no-such-command"]


def test_only_the_given_environment_is_seen_and_the_tests_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUBENGINE_SCHEMA", "not a schema name")
    before = dict(os.environ)
    env = {"SUBENGINE_HOME": str(tmp_path)}
    assert invoke(env, "db", "stop").returncode == 0
    refused = invoke(dict(env, SUBENGINE_SCHEMA="not a schema name"), "db", "stop")
    assert refused.returncode == 2 and refused.stderr.startswith("error: ")
    assert dict(os.environ) == before


def test_the_command_runs_in_cwd_and_the_test_stays_where_it_was(tmp_path: Path) -> None:
    here = os.getcwd()
    done = invoke({"SUBENGINE_HOME": "relative"}, "db", "stop", cwd=tmp_path)
    assert done.stdout == f"no embedded PostgreSQL is running in {tmp_path / 'relative'}\n"
    assert os.getcwd() == here


def test_an_unexpected_exception_is_a_traceback_and_status_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(*args: object, **kwargs: object) -> subengine.Settings:
        raise RuntimeError("a bug in the command")

    monkeypatch.setattr(subengine.Settings, "from_env", crash)
    crashed = invoke({"SUBENGINE_HOME": str(tmp_path)}, "db", "stop")
    assert crashed.returncode == 1
    assert crashed.stderr.startswith("Traceback (most recent call last):")
    assert crashed.stderr.endswith("RuntimeError: a bug in the command\n")


def test_logging_and_the_signal_handlers_are_put_back(tmp_path: Path) -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    done = invoke({"SUBENGINE_HOME": str(tmp_path)}, "--log-level", "debug", "db", "stop")
    assert done.returncode == 0
    assert (root.handlers, root.level) == (handlers, level)
    assert {s: signal.getsignal(s) for s in signals} == signals


def test_it_refuses_to_run_outside_the_main_thread(tmp_path: Path) -> None:
    # os.environ, the directory and signal handlers belong to the whole process
    raised: list[BaseException] = []

    def call() -> None:
        try:
            invoke({"SUBENGINE_HOME": str(tmp_path)}, "db", "stop")
        except RuntimeError as error:
            raised.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert len(raised) == 1 and "main thread" in str(raised[0])


def test_a_warning_is_printed_on_stderr_as_a_process_prints_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from_env = subengine.Settings.from_env

    def warn_then_read(**options: object) -> subengine.Settings:
        warnings.warn("a warning of the command", UserWarning, stacklevel=1)
        return from_env(**options)  # type: ignore[arg-type]

    monkeypatch.setattr(subengine.Settings, "from_env", warn_then_read)
    for _ in range(2):  # each call is a new process: shown again
        done = invoke({"SUBENGINE_HOME": str(tmp_path)}, "db", "stop")
        assert done.returncode == 0
        assert "UserWarning: a warning of the command\n" in done.stderr


def test_a_command_that_outlasts_its_timeout_raises_timeout_expired(tmp_path: Path) -> None:
    alarm = signal.getsignal(signal.SIGALRM)
    fifo = tmp_path / "events.jsonl"
    os.mkfifo(fifo)  # opening it for reading waits for a writer, which never comes
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        invoke(
            {"SUBENGINE_HOME": str(tmp_path)}, "append", "orders", "--file", str(fifo), timeout=1
        )
    assert time.monotonic() - started < 30
    assert signal.getsignal(signal.SIGALRM) == alarm
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
