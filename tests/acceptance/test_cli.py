"""The `subengine` command against the test database, run in the test's process (`invoke`)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import invoke_ok as run
from helpers import stored_events

import subengine
from subengine.db import _migrate


def test_migrate_reports_the_revision(cli_env: dict[str, str]) -> None:
    head = _migrate.head_revision()
    assert f"is at revision {head}" in run(cli_env, "migrate").stdout


def test_stream_create_list_and_show(cli_env: dict[str, str]) -> None:
    assert (
        "created stream 'orders' with 3 partitions"
        in run(cli_env, "stream", "create", "orders", "--partitions", "3").stdout
    )
    run(cli_env, "stream", "create", "audit", "--partitions", "1")
    listed = run(cli_env, "stream", "list").stdout.splitlines()
    as_json = [
        json.loads(line) for line in run(cli_env, "stream", "list", "--json").stdout.splitlines()
    ]
    assert [(s["name"], s["partitions"]) for s in as_json] == [("audit", 1), ("orders", 3)]
    epochs = {s["name"]: s["epoch"] for s in as_json}
    assert [line.split()[:3] for line in listed] == [
        ["stream", "partitions", "epoch"],
        ["audit", "1", str(epochs["audit"])],
        ["orders", "3", str(epochs["orders"])],
    ]
    shown = run(cli_env, "stream", "show", "orders").stdout.splitlines()
    assert (
        shown[0] == f"stream 'orders': 3 partitions, epoch {epochs['orders']}; retention: keep all"
    )
    assert [line.split()[:2] for line in shown[2:]] == [["0", "0"], ["1", "0"], ["2", "0"]]


def test_append_one_event_and_read_it_back(
    cli_env: dict[str, str], engine: subengine.Engine, orders: str
) -> None:
    event_id = str(uuid.uuid4())
    args = ["append", "orders", "--key", "order-1", "--type", "OrderPlaced"]
    out = run(
        cli_env, *args, "--data", '{"total": 5}', "--metadata", '{"by": "cli"}', "--id", event_id
    ).stdout
    partition = subengine.partition_for("order-1", 4)
    assert f"partition {partition} position 1 key version 1 id {event_id}" in out
    again = run(cli_env, *args, "--data", '{"total": 5}', "--id", event_id)
    assert "already stored" in again.stdout
    [event] = stored_events(engine.read("orders", partition))
    assert (event.id, event.data, event.metadata) == (
        uuid.UUID(event_id),
        {"total": 5},
        {"by": "cli"},
    )
    lines = run(cli_env, "read", "orders", "--partition", str(partition), "--json").stdout
    [read] = [json.loads(line) for line in lines.splitlines()]
    assert read["id"] == event_id and read["data"] == {"total": 5} and read["position"] == 1


def test_append_with_expected_version(
    cli_env: dict[str, str], engine: subengine.Engine, orders: str
) -> None:
    args = ["append", "orders", "--key", "k", "--type", "T", "--data", "{}"]
    run(cli_env, *args, "--expected-version", "0")
    failed = run(cli_env, *args, "--expected-version", "0", ok=False)
    assert failed.returncode == 1
    assert "is at version 1, but the append expected version 0" in failed.stderr
    assert sum(engine.heads("orders").values()) == 1


def test_append_a_jsonl_file_in_one_transaction(
    cli_env: dict[str, str], engine: subengine.Engine, orders: str, tmp_path: Path
) -> None:
    lines = [
        json.dumps(
            {
                "key": f"order-{n % 5}",
                "type": "Step",
                "data": {"n": n},
                "occurred_at": "2026-01-02T03:04:05+00:00",
            }
        )
        for n in range(50)
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = run(cli_env, "append", "orders", "--file", str(path))
    assert "appended 50 event(s), 0 already stored" in result.stderr
    assert len(result.stdout.splitlines()) == 50
    assert sum(engine.heads("orders").values()) == 50
    stored = [e for p in range(4) for e in stored_events(engine.read("orders", p))]
    assert {e.occurred_at for e in stored} == {datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)}


def test_append_jsonl_from_stdin(
    cli_env: dict[str, str], engine: subengine.Engine, orders: str
) -> None:
    stdin = '{"key": "a", "type": "T", "data": 1}\n{"key": "b", "type": "T", "data": 2}\n'
    run(cli_env, "append", "orders", "--file", "-", stdin=stdin)
    assert sum(engine.heads("orders").values()) == 2


def test_read_by_partition_after_and_limit(
    cli_env: dict[str, str], engine: subengine.Engine, orders: str
) -> None:
    engine.append("orders", [subengine.NewEvent("k", "T", {"n": n}) for n in range(10)])
    partition = subengine.partition_for("k", 4)
    out = run(
        cli_env,
        "read",
        "orders",
        "--partition",
        str(partition),
        "--after",
        "4",
        "--limit",
        "3",
        "--json",
    ).stdout
    assert [json.loads(line)["position"] for line in out.splitlines()] == [5, 6, 7]
    table = run(cli_env, "read", "orders", "--partition", str(partition), "--limit", "2").stdout
    assert table.splitlines()[0].split()[:3] == ["partition", "position", "key"]
    assert len(table.splitlines()) == 3


def test_read_every_partition_and_since(
    cli_env: dict[str, str], engine: subengine.Engine, orders: str
) -> None:
    engine.append("orders", [subengine.NewEvent(f"k{n}", "T", {"n": n}) for n in range(12)])
    everything = run(cli_env, "read", "orders", "--json").stdout.splitlines()
    assert len(everything) == 12
    assert sorted(json.loads(line)["data"]["n"] for line in everything) == list(range(12))
    limited = run(cli_env, "read", "orders", "--limit", "5", "--json").stdout.splitlines()
    assert len(limited) == 5
    since = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    recent = run(cli_env, "read", "orders", "--since", since, "--json").stdout.splitlines()
    assert len(recent) == 12
    future = (datetime.now(UTC) + timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert run(cli_env, "read", "orders", "--since", future, "--json").stdout == ""


@pytest.mark.parametrize(
    "args",
    [
        ["read", "orders", "--since", "2026-01-01", "--partition", "1"],
        ["append", "orders", "--key", "k"],
        ["append", "orders", "--file", "x.jsonl", "--key", "k"],
    ],
)
def test_conflicting_or_missing_options_are_usage_errors(
    cli_env: dict[str, str], orders: str, args: list[str]
) -> None:
    result = run(cli_env, *args, ok=False)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_db_url_prints_the_configured_dsn(cli_env: dict[str, str], dsn: str) -> None:
    assert run(cli_env, "db", "url").stdout.strip() == dsn


def subscription_rows(sql: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return sql.execute(
        "SELECT partition, position, generation FROM subengine.subscription_positions"
        " WHERE subscription = 'billing' ORDER BY 1"
    ).fetchall()


def test_subscription_create_and_reset(
    cli_env: dict[str, str], engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("orders", partitions=2)
    # one transaction per event, so that each has its own recorded_at
    stored = [engine.append("orders", [subengine.NewEvent(f"k{n}", "T", {})])[0] for n in range(10)]
    heads = engine.heads("orders")
    out = run(cli_env, "subscription", "create", "billing", "--stream", "orders", "--start", "end")
    assert subscription_rows(sql) == [(p, heads[p], 1) for p in (0, 1)]
    assert out.stdout.split()[:3] == ["partition", "position", "generation"]
    # the stored subscription is what later declarations must agree with
    again = run(cli_env, "subscription", "create", "billing", "--stream", "orders", ok=False)
    assert again.returncode == 1
    assert "is stored with stream 'orders' and start end" in again.stderr
    run(cli_env, "subscription", "reset", "billing", "--to", "beginning")
    assert subscription_rows(sql) == [(0, 0, 2), (1, 0, 2)]
    run(cli_env, "subscription", "reset", "billing", "--to", '{"0": 1, "1": 2}')
    assert subscription_rows(sql) == [(0, 1, 3), (1, 2, 3)]
    # by time: the first event recorded at or after it is the next one
    third = next(a for a in stored if a.position == 3)
    [event] = stored_events(engine.read("orders", third.partition, third.position - 1, 1))
    run(cli_env, "subscription", "reset", "billing", "--to", event.recorded_at.isoformat())
    rows = dict((p, position) for p, position, _ in subscription_rows(sql))
    assert rows[third.partition] == third.position - 1


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["nope", "--to", "beginning"], 1, "no subscription named 'nope'"),
        (["billing", "--to", "yesterday"], 2, "is not an ISO 8601 time"),
        (["billing", "--to", '{"9": 1}'], 1, "start names partition 9"),
        (["billing", "--to", '{"0": 99}'], 1, "start position 99 of partition 0 is past its head"),
        (["billing", "--to", '{"x": 1}'], 2, "not a JSON object of partition to position"),
        (["billing"], 2, "Missing option '--to'"),
    ],
)
def test_a_bad_reset_changes_nothing(
    cli_env: dict[str, str],
    engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    args: list[str],
    status: int,
    message: str,
) -> None:
    engine.create_stream("orders", partitions=2)
    engine.append("orders", [subengine.NewEvent(f"k{n}", "T", {}) for n in range(4)])
    run(cli_env, "subscription", "create", "billing", "--stream", "orders")
    before = subscription_rows(sql)
    result = run(cli_env, "subscription", "reset", *args, ok=False)
    assert result.returncode == status
    assert message in result.stderr
    assert subscription_rows(sql) == before


def test_stored_text_that_looks_like_markup_is_printed_as_it_is(
    cli_env: dict[str, str], engine: subengine.Engine, orders: str
) -> None:
    # keys, data and errors are the users' text: a table shows them, never interprets them
    engine.append("orders", [subengine.NewEvent("[b]k", "T", {"p": "[/x]", "q": "[red]y"})])
    result = run(cli_env, "read", "orders")
    assert result.returncode == 0
    assert "[b]k" in result.stdout
    assert '"[/x]"' in result.stdout
    assert '"[red]y"' in result.stdout
