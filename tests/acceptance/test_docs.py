"""Every SQL statement and command shown in docs/operations.md runs, in order, against a
database with a subscription, a held partition's worth of events and dead letters; every
command and the Python examples of docs/retention.md run against a fresh database."""

from __future__ import annotations

import functools
import re
import shlex
import signal
import textwrap
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import ROOT, run_subengine, run_subengine_until, watch_has_drawn, write_readme_app

import subengine
from subengine import NewEvent

OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
RETENTION = (ROOT / "docs" / "retention.md").read_text()


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


@pytest.fixture
def operated(engine: subengine.Engine, sql: psycopg.Connection[Any], tmp_path: Path) -> Path:
    """Stream orders (8 partitions) with 20 events in partition 3, subscription billing
    (the README's app), two dead letters at partition 3, positions 17 and 18, and the key
    of them all parked at position 19, with 20 parked after it."""
    write_readme_app(tmp_path)
    sql.execute("CREATE TABLE invoices (order_id text, total int)")
    engine.create_stream("orders", partitions=8)
    key = next(f"order-{n}" for n in range(99) if subengine.partition_for(f"order-{n}", 8) == 3)
    stored = engine.append(
        "orders", [NewEvent(key, "OrderPlaced", {"total": n}) for n in range(20)]
    )
    engine.ensure_subscription(subengine.App().subscription("billing", stream="orders"))
    for a in stored[16:18]:
        sql.execute(
            "INSERT INTO subengine.dead_letters"
            " (subscription, partition, position, generation, event_id, error, attempts)"
            " VALUES ('billing', %s, %s, 1, %s, 'ValueError: test', 5)",
            (a.partition, a.position, a.id),
        )
    [parked] = sql.execute(
        "INSERT INTO subengine.parked_keys"
        " (subscription, partition, key, generation, position, event_id, error, attempts)"
        " VALUES ('billing', 3, %s, 1, 19, %s, 'ValueError: test', 5) RETURNING id",
        (key, stored[18].id),
    ).fetchall()
    for a in stored[18:]:
        sql.execute(
            "INSERT INTO subengine.parked_events (parked_key, position, event_id)"
            " VALUES (%s, %s, %s)",
            (parked[0], a.position, a.id),
        )
    return tmp_path


def test_every_sql_block_of_the_operations_page_runs(
    operated: Path, sql: psycopg.Connection[Any]
) -> None:
    statements = blocks(OPERATIONS, "sql")
    assert len(statements) >= 6
    try:
        for statement in statements:
            sql.execute(statement)
        behind = sql.execute(statements[0]).fetchall()
        assert behind[0][:2] == ("billing", 20)
        stuck = sql.execute(statements[1]).fetchall()
        assert stuck == []
        letters = sql.execute(statements[4]).fetchall()
        assert [(r[1], r[2]) for r in letters] == [(3, 17), (3, 18)]
        parked = sql.execute(statements[5]).fetchall()
        assert [(r[1], r[3], r[5]) for r in parked] == [(3, 19, 2)]
    finally:
        sql.execute(
            "DO $$ BEGIN IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'subengine_operator')"
            " THEN DROP OWNED BY subengine_operator; DROP ROLE subengine_operator; END IF; END $$"
        )


def test_every_command_of_the_operations_page_runs(
    operated: Path, cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    commands = [
        shlex.split(line, comments=True)
        for block in blocks(OPERATIONS, "sh")
        for line in block.splitlines()
        if line.startswith("subengine ")
    ]
    assert len(commands) >= 18
    for command in commands:
        if "--watch" in command:
            since = sql.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
            result = run_subengine_until(
                cli_env,
                *command[1:],
                ready=functools.partial(watch_has_drawn, sql, since),
                signum=signal.SIGINT,
                cwd=operated,
            )
        else:
            result = run_subengine(cli_env, *command[1:], cwd=operated)
        assert result.returncode == 0, (command, result.stderr)
    # what the commands did: paused and resumed, reset to the end, one letter retried
    # (the README handler wrote its invoice) and one discarded, the parked key retried
    # (two invoices, in order)
    resolutions = sql.execute(
        "SELECT position, resolution FROM subengine.dead_letters ORDER BY 1"
    ).fetchall()
    assert resolutions == [(17, "retried"), (18, "discarded")]
    assert sql.execute("SELECT total FROM invoices").fetchall() == [(18,), (19,), (16,)]
    assert sql.execute("SELECT resolution FROM subengine.parked_keys").fetchall() == [("retried",)]
    assert sql.execute(
        "SELECT bool_and(NOT paused), max(generation) FROM subengine.subscriptions"
    ).fetchone() == (True, 2)


def test_every_command_of_the_retention_page_runs(
    cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    commands = [
        shlex.split(line, comments=True)
        for block in blocks(RETENTION, "sh")
        for line in block.splitlines()
        if line.startswith("subengine ")
    ]
    assert len(commands) >= 8
    for command in commands:
        result = run_subengine(cli_env, *command[1:])
        assert result.returncode == 0, (command, result.stderr)
    # what the commands left: orders altered to 30 days alone, payments keeping all
    assert sql.execute("SELECT name, retention FROM subengine.streams ORDER BY 1").fetchall() == [
        ("clicks", {"max_bytes": 100_000_000}),
        ("orders", {"max_age": 30 * 86400}),
        ("payments", None),
    ]


def test_the_python_examples_of_the_retention_page_run(
    engine: subengine.Engine, sql: psycopg.Connection[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    policies, reader, gap_handler = (textwrap.dedent(b) for b in blocks(RETENTION, "python"))
    exec(policies, {"engine": engine})
    assert sql.execute("SELECT retention FROM subengine.streams").fetchall() == [(None,)]
    # the reader meets a gap in partition 3: 5 events, of which retention kept 2
    key = next(f"order-{n}" for n in range(99) if subengine.partition_for(f"order-{n}", 8) == 3)
    engine.append("orders", [NewEvent(key, "T", {"n": n}) for n in range(5)])
    engine.set_retention("orders", subengine.Retention(max_events=2))
    assert engine.run_retention().removed == 3
    handled: list[int] = []
    exec(
        reader,
        {"engine": engine, "subengine": subengine, "handle": lambda e: handled.append(e.position)},
    )
    assert capsys.readouterr().out == "missed positions 1 to 3\n"
    assert handled == [4, 5]
    app = subengine.App()
    namespace: dict[str, Any] = {"app": app}
    exec(gap_handler, namespace)
    assert app.subscriptions["billing"].on_gap == "handler"
    assert app.subscriptions["billing"].gap is namespace["incomplete"]
