"""The fork server (tests/forked.py): a forked `subengine` process shows a test what an
exec'd one shows. Each case runs `subengine worker --app probe_app:app` both ways (the
probe does its thing while it is imported, before the worker connects anywhere) and
compares what the test can see: the exit status, the output, the environment, the
working directory, the file descriptors, signals, timeouts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import forked
import pytest
from helpers import APPS, subengine_command

# no server listens on port 1: nothing here gets as far as connecting
DSN = "postgresql://probe@127.0.0.1:1/probe"
WORKER = ("--dsn", DSN, "worker", "--app", "probe_app:app")


def both(
    probe: str,
    stdin: str | None = None,
    cwd: Path = APPS,
    python: dict[str, str] | None = None,
    **popen: Any,
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """The probe run exec'd, then forked: (exec'd, forked). `python`: start-up variables
    of the environment (PYTHON*), none by default."""
    env = {"PATH": "/usr/bin:/bin", "PROBE": probe, "TZ": "Pacific/Auckland", "ZZ_ONLY": "x"}
    env.update(python or {})
    results = []
    for start in (subprocess.Popen, forked.ForkedPopen):
        with start(
            [subengine_command(), *WORKER],
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **popen,
        ) as process:
            out, err = process.communicate(stdin, timeout=60)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return results[0], results[1]


def facts(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_the_process_gets_exactly_its_environment_arguments_directory_and_input(
    tmp_path: Path,
) -> None:
    (tmp_path / "probe_app.py").write_text((APPS / "probe_app.py").read_text())
    execd, fork = both("facts", stdin="the input", cwd=tmp_path)
    seen, expected = facts(fork), facts(execd)
    assert seen["env"] == expected["env"]
    assert seen["argv"] == expected["argv"] == [subengine_command(), *WORKER]
    assert seen["cwd"] == expected["cwd"] == str(tmp_path)
    assert seen["path"] == expected["path"]  # the import path starts where a fresh one's does
    assert seen["stdin"] == expected["stdin"] == "the input"
    assert seen["fds"] == expected["fds"]  # 0, 1, 2 and what the probe itself opened
    assert seen["tz"] == expected["tz"]
    assert seen["session"] is expected["session"] is False
    assert fork.stderr == execd.stderr == "to stderr\n"


@pytest.mark.parametrize(
    "python",
    [{}, {"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}, {"LC_ALL": "C"}],
    ids=["none", "unbuffered", "c-locale"],
)
def test_the_standard_streams_and_bytecode_follow_the_environment(
    python: dict[str, str],
) -> None:
    # whatever the fork server's own environment said when it started
    execd, fork = both("facts", python=python)
    seen, expected = facts(fork), facts(execd)
    assert seen["stdio"] == expected["stdio"]
    assert seen["bytecode"] is expected["bytecode"]
    assert seen["env"] == expected["env"]


def test_an_environment_that_shapes_the_interpreter_otherwise_is_exec_d() -> None:
    assert forked.forkable(None)
    assert forked.forkable(dict(os.environ, PYTHONUNBUFFERED="", PYTHONPATH="elsewhere"))
    assert not forked.forkable(dict(os.environ, PYTHONHASHSEED="7"))
    execd = forked.popen([subengine_command(), "--help"], env={"PYTHONHASHSEED": "7"})
    assert type(execd) is subprocess.Popen
    execd.wait(timeout=60)


def test_a_new_session_is_one() -> None:
    execd, fork = both("facts", start_new_session=True)
    assert facts(fork)["session"] is facts(execd)["session"] is True


@pytest.mark.parametrize(
    "probe", ["exit:0", "exit:7", "exit:300", "message", "raise", "interrupt", "shutdown"]
)
def test_the_exit_status_and_the_last_words_are_those_of_a_process(probe: str) -> None:
    execd, fork = both(probe)
    assert fork.returncode == execd.returncode
    assert fork.stdout == execd.stdout
    if "Traceback" in execd.stderr:
        # the same frames from the app's import on (before it, the fork server's own)
        tail = execd.stderr[execd.stderr.index("probe_app.py") :]
        assert fork.stderr.endswith(tail), (execd.stderr, fork.stderr)
    else:
        assert fork.stderr == execd.stderr


def test_a_signal_and_a_timeout_reach_the_process() -> None:
    env = {"PATH": "/usr/bin:/bin", "PROBE": "wait"}
    process = forked.ForkedPopen(
        [subengine_command(), *WORKER], env=env, cwd=APPS, stdout=subprocess.PIPE, text=True
    )
    with process:
        assert process.stdout is not None
        assert process.stdout.readline() == "waiting\n"
        assert process.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.2)
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL


def test_a_missing_working_directory_fails_in_the_test_as_popen_does(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        forked.ForkedPopen([subengine_command(), "--help"], cwd=tmp_path / "missing")
