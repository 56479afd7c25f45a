"""Retention from the command line: `stream create`/`alter` with a policy, the policy and
epoch in `stream show`/`list`, and `retention run`, against PostgreSQL: in the test's
process, and as a process on a terminal for the progress bar."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
from typing import Any

import psycopg
import pytest
from helpers import invoke_ok as run
from helpers import start_subengine, wait_for

import subengine
from subengine import NewEvent


def json_lines(text: str) -> list[Any]:
    return [json.loads(line) for line in text.splitlines()]


def stored_state(sql: psycopg.Connection[Any]) -> tuple[Any, ...]:
    """Everything the retention commands can change: streams with their policies and
    epochs, partitions with their floors, and the events."""
    return (
        sql.execute(
            "SELECT name, partitions, epoch, retention FROM subengine.streams ORDER BY 1"
        ).fetchall(),
        sql.execute(
            "SELECT stream, partition, head, floor FROM subengine.partitions ORDER BY 1, 2"
        ).fetchall(),
        sql.execute("SELECT count(*) FROM subengine.events").fetchone(),
    )


def key_in(partition: int, partitions: int) -> str:
    """A key whose events land in `partition`."""
    return next(
        f"key-{n}"
        for n in range(10_000)
        if subengine.partition_for(f"key-{n}", partitions) == partition
    )


@pytest.fixture
def pruned(engine: subengine.Engine, cli_env: dict[str, str]) -> str:
    """Stream 'orders' (4 partitions) keeping 3 events per partition, with 10 events in
    partition 1, 5 in partition 2 and 2 in partition 3."""
    run(cli_env, "stream", "create", "orders", "--partitions", "4", "--max-events", "3")
    for partition, events in ((1, 10), (2, 5), (3, 2)):
        key = key_in(partition, 4)
        engine.append("orders", [NewEvent(key, "T", {"n": n}) for n in range(events)])
    return "orders"


def floors(cli_env: dict[str, str], stream: str) -> dict[int, int]:
    shown = json_lines(run(cli_env, "stream", "show", stream, "--json").stdout)
    return {row["partition"]: row["floor"] for row in shown}


def test_stream_create_with_a_policy_shows_it_in_show_and_list(cli_env: dict[str, str]) -> None:
    created = run(
        cli_env, "stream", "create", "orders", "--partitions", "2", "--max-age", "7d",
        "--max-events", "1000000",
    )  # fmt: skip
    policy = "max-age 7d, max-events 1000000"
    assert created.stdout == f"created stream 'orders' with 2 partitions; retention: {policy}\n"
    [summary, header, *rows] = run(cli_env, "stream", "show", "orders").stdout.splitlines()
    assert summary == f"stream 'orders': 2 partitions, epoch 1; retention: {policy}"
    assert header.split() == ["partition", "head", "head_time", "floor"]
    assert [row.split() for row in rows] == [["0", "0", "-", "1"], ["1", "0", "-", "1"]]
    [listed] = run(cli_env, "stream", "list").stdout.splitlines()[1:]
    assert listed.split()[:3] == ["orders", "2", "1"] and listed.endswith(policy)
    stored = {"max_age": 7 * 86400, "max_events": 1_000_000}
    [as_json] = json_lines(run(cli_env, "stream", "list", "--json").stdout)
    assert (as_json["epoch"], as_json["retention"]) == (1, stored)
    shown = json_lines(run(cli_env, "stream", "show", "orders", "--json").stdout)
    assert [(row["partition"], row["epoch"], row["retention"]) for row in shown] == [
        (0, 1, stored),
        (1, 1, stored),
    ]


def test_a_stream_without_a_policy_keeps_all(cli_env: dict[str, str]) -> None:
    created = run(cli_env, "stream", "create", "audit", "--partitions", "1").stdout
    assert created == "created stream 'audit' with 1 partitions; retention: keep all\n"
    assert run(cli_env, "stream", "list").stdout.splitlines()[1].endswith("keep all")
    [shown] = json_lines(run(cli_env, "stream", "show", "audit", "--json").stdout)
    assert shown["retention"] is None


def test_keep_unprocessed_with_a_hard_limit_is_stored(cli_env: dict[str, str]) -> None:
    run(
        cli_env, "stream", "create", "orders", "--partitions", "1", "--max-age", "1d",
        "--keep-unprocessed", "--hard-max-age", "2w", "--hard-max-events", "500",
    )  # fmt: skip
    [listed] = json_lines(run(cli_env, "stream", "list", "--json").stdout)
    assert listed["retention"] == {
        "max_age": 86400,
        "keep_unprocessed": True,
        "hard_max_age": 14 * 86400,
        "hard_max_events": 500,
    }
    assert (
        run(cli_env, "stream", "list")
        .stdout.splitlines()[1]
        .endswith("max-age 1d, hard-max-age 14d, hard-max-events 500, keep-unprocessed")
    )


def test_stream_alter_replaces_the_whole_policy(
    cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    run(cli_env, "stream", "create", "orders", "--partitions", "2", "--max-age", "7d")
    altered = run(cli_env, "stream", "alter", "orders", "--max-events", "50").stdout
    assert altered.startswith("stream 'orders': retention set to max-events 50;")
    # --max-age was not given again, so it is unset
    assert sql.execute("SELECT retention FROM subengine.streams").fetchone() == (
        {"max_events": 50},
    )
    [summary] = run(cli_env, "stream", "show", "orders").stdout.splitlines()[:1]
    assert summary.endswith("retention: max-events 50")
    [as_json] = json_lines(
        run(cli_env, "stream", "alter", "orders", "--max-age", "12h", "--json").stdout
    )
    assert (as_json["name"], as_json["retention"]) == ("orders", {"max_age": 43200})


def test_stream_alter_keep_all_removes_the_policy(
    cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    run(cli_env, "stream", "create", "orders", "--partitions", "2", "--max-age", "7d")
    removed = run(cli_env, "stream", "alter", "orders", "--keep-all").stdout
    assert removed == "stream 'orders': retention removed, every event is kept\n"
    assert sql.execute("SELECT retention FROM subengine.streams").fetchone() == (None,)
    assert run(cli_env, "stream", "show", "orders").stdout.startswith(
        "stream 'orders': 2 partitions, epoch 1; retention: keep all\n"
    )


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (
            ["stream", "create", "fresh", "--partitions", "2", "--max-age", "0d"],
            1,
            "--max-age must be a whole number above 0 and a unit (s, m, h, d or w), such as "
            "7d or 12h, not '0d'",
        ),
        (
            ["stream", "create", "fresh", "--partitions", "2", "--max-age", "7 days"],
            1,
            "--max-age must be a whole number above 0 and a unit",
        ),
        (
            ["stream", "create", "fresh", "--partitions", "2", "--max-events", "-1"],
            1,
            "--max-events must be a whole number from 1 to",
        ),
        (
            ["stream", "create", "fresh", "--partitions", "2", "--max-events", "many"],
            2,
            "'many' is not a valid integer",
        ),
        (
            ["stream", "create", "fresh", "--partitions", "2", "--max-age", "7d",
             "--keep-unprocessed"],
            1,
            "--keep-unprocessed needs a hard limit (--hard-max-age, --hard-max-events or both)",
        ),
        (
            ["stream", "create", "fresh", "--partitions", "2", "--max-events", "10",
             "--hard-max-events", "100"],
            1,
            "--hard-max-age and --hard-max-events bound --keep-unprocessed",
        ),
        (
            ["stream", "create", "fresh", "--partitions", "2", "--max-events", "10",
             "--keep-unprocessed", "--hard-max-events", "5"],
            1,
            "--hard-max-events must not be below --max-events",
        ),
        (
            ["stream", "create", "fresh", "--partitions", "2", "--keep-unprocessed"],
            1,
            "a retention policy needs --max-age, --max-events or --max-bytes",
        ),
        (["stream", "alter", "orders", "--max-age", "0d"], 1, "--max-age must be"),
        (["stream", "alter", "orders", "--max-age", "99999999w"], 1, "--max-age must be from"),
        (["stream", "alter", "orders", "--max-events", "0"], 1, "--max-events must be"),
        (
            ["stream", "alter", "orders", "--max-age", "1d", "--keep-unprocessed"],
            1,
            "--keep-unprocessed needs a hard limit",
        ),
        (
            ["stream", "alter", "orders"],
            2,
            "give the new policy (--max-age, --max-events, --max-bytes, --keep-unprocessed, "
            "--hard-max-age, --hard-max-events) or --keep-all to remove it",
        ),
        (
            ["stream", "alter", "orders", "--keep-all", "--max-age", "1d"],
            2,
            "--keep-all removes the policy: give it without other options",
        ),
        (["stream", "alter", "missing", "--max-age", "1d"], 1, "stream 'missing' does not exist"),
        (["retention", "run", "--stream", "audit"], 1, "stream 'audit' has no retention policy"),
        (["retention", "run", "--batch", "0"], 1, "the prune batch must be a whole number"),
    ],
)  # fmt: skip
def test_bad_retention_input_is_one_line_and_changes_nothing(
    engine: subengine.Engine,
    pruned: str,
    cli_env: dict[str, str],
    sql: psycopg.Connection[Any],
    args: list[str],
    status: int,
    message: str,
) -> None:
    engine.create_stream("audit", partitions=1)
    before = stored_state(sql)
    result = run(cli_env, *args, ok=False)
    assert result.returncode == status, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert message in result.stderr
    assert result.stdout == ""
    assert stored_state(sql) == before


def test_retention_run_dry_run_reports_and_removes_nothing(
    pruned: str, cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    before = stored_state(sql)
    result = run(cli_env, "retention", "run", "--dry-run")
    assert result.stdout.splitlines() == [
        "stream 'orders': would remove 9 events from 2 partitions",
        "  partition 1: positions 1 to 7 (7 events)",
        "  partition 2: positions 1 to 2 (2 events)",
        "total: would remove 9 events from 2 partitions of 1 stream",
    ]
    assert result.stderr == ""  # no progress bar outside a terminal
    assert stored_state(sql) == before
    as_json = json_lines(run(cli_env, "retention", "run", "--dry-run", "--json").stdout)
    assert as_json == [
        {"stream": "orders", "partition": 1, "first": 1, "last": 7, "removed": 7, "dry_run": True},
        {"stream": "orders", "partition": 2, "first": 1, "last": 2, "removed": 2, "dry_run": True},
    ]
    assert stored_state(sql) == before


def test_retention_run_removes_and_raises_the_floors(
    pruned: str, cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    assert floors(cli_env, "orders") == {0: 1, 1: 1, 2: 1, 3: 1}
    result = run(cli_env, "retention", "run", "--batch", "2")
    assert result.stdout.splitlines() == [
        "stream 'orders': removed 9 events from 2 partitions",
        "  partition 1: positions 1 to 7 (7 events)",
        "  partition 2: positions 1 to 2 (2 events)",
        "total: removed 9 events from 2 partitions of 1 stream",
    ]
    assert result.stderr == ""
    assert floors(cli_env, "orders") == {0: 1, 1: 8, 2: 3, 3: 1}
    remaining = sql.execute(
        "SELECT partition, min(position), count(*) FROM subengine.events"
        " GROUP BY partition ORDER BY partition"
    ).fetchall()
    assert remaining == [(1, 8, 3), (2, 3, 3), (3, 1, 2)]
    again = run(cli_env, "retention", "run", "--stream", "orders")
    assert again.stdout == "removed nothing: every stream is within its retention policy\n"


def test_retention_run_starts_from_the_raised_floor(
    engine: subengine.Engine, pruned: str, cli_env: dict[str, str]
) -> None:
    run(cli_env, "retention", "run")
    engine.append("orders", [NewEvent(key_in(1, 4), "T", n) for n in range(2)])
    lines = run(cli_env, "retention", "run").stdout.splitlines()
    assert lines[1] == "  partition 1: positions 8 to 9 (2 events)"
    assert floors(cli_env, "orders")[1] == 10


def test_retention_run_json_lists_what_it_removed(pruned: str, cli_env: dict[str, str]) -> None:
    as_json = json_lines(run(cli_env, "retention", "run", "--stream", "orders", "--json").stdout)
    assert as_json == [
        {"stream": "orders", "partition": 1, "first": 1, "last": 7, "removed": 7, "dry_run": False},
        {"stream": "orders", "partition": 2, "first": 1, "last": 2, "removed": 2, "dry_run": False},
    ]
    assert floors(cli_env, "orders") == {0: 1, 1: 8, 2: 3, 3: 1}


def test_the_progress_bar_is_drawn_on_stderr_when_it_is_a_terminal(
    pruned: str, cli_env: dict[str, str]
) -> None:
    leader, follower = pty.openpty()
    process = start_subengine(
        "retention",
        "run",
        "--batch",
        "1",
        env=dict(cli_env, TERM="xterm-256color", COLUMNS="100"),
        stdout=subprocess.PIPE,
        stderr=follower,
        text=True,
    )
    os.close(follower)
    drawn = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the command closed its end
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    terminal = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn.decode())
    assert "9/9" in terminal and "pruning" in terminal
    # stdout, a pipe, has the summary alone
    assert out.splitlines()[-1] == "total: removed 9 events from 2 partitions of 1 stream"
    assert "\x1b" not in out


@pytest.mark.parametrize("ended_by", ["SIGINT", "terminated backend"])
def test_a_run_ended_early_says_what_it_had_removed(
    pruned: str, cli_env: dict[str, str], dsn: str, sql: psycopg.Connection[Any], ended_by: str
) -> None:
    # the run prunes partition 1, then waits for the rows of partition 2 held here
    waiting = (
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND datname = current_database()"
    )
    with psycopg.connect(dsn) as blocker:
        blocker.execute(
            "SELECT 1 FROM subengine.events WHERE stream = 'orders' AND partition = 2 FOR UPDATE"
        )
        process = start_subengine(
            "retention", "run", "--batch", "2", env=cli_env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_for(lambda: len(sql.execute(waiting).fetchall()) == 1, "the pruner waiting")
            if ended_by == "SIGINT":  # Ctrl-C
                process.send_signal(signal.SIGINT)
            else:
                sql.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
            out, err = process.communicate(timeout=60)
        finally:
            process.kill()
            process.wait(10)
            blocker.rollback()
    assert process.returncode != 0
    assert out == ""
    assert "the run ended early, having removed 7 events from 1 partition\n" in err
    assert floors(cli_env, "orders") == {0: 1, 1: 8, 2: 1, 3: 1}


def test_retention_run_summarises_many_partitions(
    engine: subengine.Engine, cli_env: dict[str, str]
) -> None:
    run(cli_env, "stream", "create", "wide", "--partitions", "12", "--max-events", "1")
    for partition in range(12):
        key = key_in(partition, 12)
        engine.append("wide", [NewEvent(key, "T", n) for n in range(partition % 3 + 2)])
    lines = run(cli_env, "retention", "run").stdout.splitlines()
    assert lines == [
        "stream 'wide': removed 24 events from 12 partitions",
        "  partitions 0-11: positions from 1 to 3 (--json lists each partition)",
        "total: removed 24 events from 12 partitions of 1 stream",
    ]
    assert set(floors(cli_env, "wide").values()) == {2, 3, 4}


def test_retention_run_while_another_pruner_runs_exits_75_and_removes_nothing(
    pruned: str, cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    before = stored_state(sql)
    # the lock a running pruner holds (subengine/db/sql/queries.sql, retention_lock)
    held = "hashtext('subengine retention'), hashtext('subengine')"
    sql.execute(f"SELECT pg_advisory_lock({held})")
    try:
        result = run(cli_env, "retention", "run", ok=False)
        as_json = run(cli_env, "retention", "run", "--json", ok=False)
    finally:
        sql.execute(f"SELECT pg_advisory_unlock({held})")
    assert result.returncode == 75, result.stderr
    assert result.stderr == (
        "error: another pruner is running in this schema; nothing was removed: "
        "try again when it has finished\n"
    )
    assert result.stdout == ""
    assert (as_json.returncode, as_json.stdout) == (75, "")
    assert stored_state(sql) == before
    assert run(cli_env, "retention", "run").stdout.startswith("stream 'orders': removed 9")


def test_max_bytes_keeps_the_newest_events_that_fit_in_each_partition(
    cli_env: dict[str, str], engine: subengine.Engine
) -> None:
    # each event holds 10 bytes: data {"n": 1} (8) and metadata {} (2), as PostgreSQL writes them
    created = run(cli_env, "stream", "create", "sized", "--partitions", "2", "--max-bytes", "35")
    assert created.stdout.endswith("retention: max-bytes 35\n")
    key = key_in(1, 2)
    engine.append("sized", [NewEvent(key, "T", {"n": n}) for n in range(10)])
    run(cli_env, "retention", "run")
    assert floors(cli_env, "sized") == {0: 1, 1: 8}  # 8, 9 and 10 fit; a fourth would not
    [gap] = json_lines(run(cli_env, "read", "sized", "--partition", "1", "--json").stdout)[:1]
    assert gap["tombstone"] == {
        "stream": "sized", "partition": 1, "gap_from": 1, "gap_to": 7, "floor": 8,
        "reason": "cap", "head": 10, "cursor_below_floor": False,
    }  # fmt: skip
