"""What the README shows runs: every `subengine` command of its shell blocks, and its
Python example. (docs/operations.md has its own test, test_docs.py.)"""

from __future__ import annotations

import functools
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
import web
from helpers import (
    README,
    GatewayProcess,
    free_port,
    run_subengine,
    run_subengine_until,
    subengine_command,
    wait_for,
    watch_has_drawn,
    write_readme_app,
)

import subengine

TEXT = README.read_text()
REFERENCE = "## The command line"
GATEWAY = "## The gateway"


def shell_commands() -> list[str]:
    """Every distinct `subengine` line of the README's shell blocks, without comments: the
    command-line reference first (it creates what the other sections use), then the others
    in the order they appear. The gateway's (a server, and a key that closes it to
    requests without one) are run by `test_the_readme_gateway_examples_run`."""
    reference: list[str] = []
    others: list[str] = []
    for match in re.finditer(r"```sh\n(.*?)```", TEXT, flags=re.DOTALL):
        section = TEXT.rfind("\n## ", 0, match.start())
        if TEXT.startswith(GATEWAY, section + 1):
            continue
        target = reference if TEXT.startswith(REFERENCE, section + 1) else others
        for line in match.group(1).splitlines():
            if line.startswith("subengine "):
                target.append(line.split("  #")[0].strip())
    commands = []
    for command in reference + others:
        if command not in commands:
            commands.append(command)
    return commands


def words(command: str) -> list[str]:
    """A command line split as the shell would (the README quotes with '...' only)."""
    return [part.strip("'") for part in re.findall(r"'[^']*'|\S+", command)]


def wait_until_caught_up(sql: psycopg.Connection[Any], timeout: float = 60) -> None:
    """Until a worker is registered and no subscription that can move is behind."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        registered, behind = sql.execute(  # type: ignore[misc]
            "SELECT (SELECT count(*) FROM subengine.workers_status WHERE connected),"
            " (SELECT coalesce(sum(lag), 0) FROM subengine.subscription_status"
            "   WHERE state <> 'paused')"
        ).fetchone()
        if registered and not behind:
            return
        time.sleep(0.1)
    raise AssertionError("the worker did not register and catch up")


@pytest.mark.slow
def test_every_command_of_the_readme_runs(
    cli_env: dict[str, str], sql: psycopg.Connection[Any], tmp_path: Path
) -> None:
    commands = shell_commands()
    assert len(commands) >= 20
    assert commands[0] == "subengine migrate"
    write_readme_app(tmp_path)
    sql.execute("CREATE TABLE invoices (order_id text, total int)")
    (tmp_path / "events.jsonl").write_text(
        '{"key": "order-2", "type": "OrderPlaced", "data": {"total": 12}}\n'
        '{"key": "order-2", "type": "OrderPaid", "data": {"amount": 12}}\n'
    )
    for command in commands:
        argv = words(command)
        if "--metrics-port" in argv:
            # the README's port may be taken on this machine (by another run of the suite):
            # the command as written, on a port that is free
            at = argv.index("--metrics-port") + 1
            argv[at] = str(free_port())
        if argv[1] == "worker":
            result = run_subengine_until(
                cli_env,
                *argv[1:],
                ready=lambda: wait_until_caught_up(sql),
                signum=signal.SIGTERM,
                cwd=tmp_path,
            )
        elif "--watch" in argv:
            since = sql.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
            result = run_subengine_until(
                cli_env,
                *argv[1:],
                ready=functools.partial(watch_has_drawn, sql, since),
                signum=signal.SIGINT,
                cwd=tmp_path,
            )
        else:
            result = run_subengine(cli_env, *argv[1:], cwd=tmp_path)
        assert result.returncode == 0, (command, result.stderr)
    # the workers handled both OrderPlaced events (once each, though three workers ran)
    assert sorted(sql.execute("SELECT order_id, total FROM invoices").fetchall()) == [
        ("order-1", 30),
        ("order-2", 12),
    ]
    assert sql.execute(
        "SELECT paused FROM subengine.subscriptions WHERE name = 'billing'"
    ).fetchone() == (True,)


def test_the_readme_python_example_runs(
    cli_env: dict[str, str], sql: psycopg.Connection[Any], tmp_path: Path
) -> None:
    [example] = [
        block
        for block in re.findall(r"```python\n(.*?)```", TEXT, flags=re.DOTALL)
        if "engine = subengine.Engine()" in block
    ]
    sql.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance int)")
    sql.execute("INSERT INTO accounts VALUES (1, 100)")
    result = subprocess.run(
        [sys.executable, "-c", example],
        env=cli_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    assert [line.split()[3] for line in printed] == ["OrderPlaced", "OrderPaid"]
    assert sql.execute("SELECT balance FROM accounts").fetchone() == (70,)


def test_the_readme_gateway_quick_start_runs_as_written(blank_dsn: str, tmp_path: Path) -> None:
    """The section's shell block, line for line in bash, on a database never migrated (on
    a free port instead of 8800)."""
    section = TEXT[TEXT.index(GATEWAY) : TEXT.index("## Spark")]
    [shell] = re.findall(r"```sh\n(.*?)```", section, flags=re.DOTALL)
    port = str(free_port())
    script = shell.replace("subengine serve &", f"subengine serve --port {port} &")
    script = script.replace("localhost:8800", f"localhost:{port}")
    env = {
        "PATH": f"{Path(subengine_command()).parent}:/usr/bin:/bin",
        "SUBENGINE_DSN": blank_dsn,
        "SUBENGINE_HOME": str(tmp_path / "home"),
    }
    result = subprocess.run(
        ["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout
    assert '{"events":[],' in printed  # the page
    assert "retry: 1000" in printed  # the event stream
    assert "created API key" in printed
    assert "does not exist" not in printed + result.stderr


def test_the_readme_gateway_examples_run(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess, cli_env: dict[str, str]
) -> None:
    section = TEXT[TEXT.index("## The gateway") : TEXT.index("## Spark")]
    [shell] = re.findall(r"```sh\n(.*?)```", section, flags=re.DOTALL)
    [example] = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    engine.append(orders, [subengine.NewEvent(f"k{n}", "t", {"n": n}) for n in range(3)])
    for url in re.findall(r"curl [^']*'(localhost:8800[^']*)'", shell):
        address = url.replace("localhost:8800", gateway.url)
        with web.stream("GET", address, timeout=30) as answer:
            assert answer.status_code == 200, address
    seen: list[Any] = []
    cursors: list[str | None] = []

    class Enough(Exception):
        pass

    def handle(item: Any) -> None:
        seen.append(item)

    def save(cursor: str | None) -> None:
        cursors.append(cursor)
        if len(seen) == 3:
            raise Enough

    namespace = {"stored_cursor": "beginning", "handle": handle, "save": save}
    with pytest.raises(Enough):
        exec(example.replace("http://127.0.0.1:8800", gateway.url), namespace)
    assert sorted(item.data["n"] for item in seen) == [0, 1, 2]
    assert cursors[-1] is not None and cursors[-1].startswith("c1.")
    [create] = [line for line in shell.splitlines() if "gateway key create" in line]
    created = run_subengine(cli_env, *shlex.split(create.split("#")[0])[1:])
    assert created.returncode == 0, created.stderr
    wait_for(
        lambda: web.get(f"{gateway.url}/v1/streams/orders/events", timeout=30).status_code == 401,
        "the gateway to ask for a key",
        30,
    )
