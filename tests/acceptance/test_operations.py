"""Operating subengine from the command line: status, subscriptions, workers, dead letters."""

from __future__ import annotations

import importlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import APPS, ROOT, Running, start_subengine, wait_for
from helpers import run_ok as run
from psycopg.conninfo import make_conninfo

import subengine
from subengine import NewEvent


def json_lines(text: str) -> list[Any]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def letters_app() -> Iterator[subengine.App]:
    sys.path.insert(0, str(APPS))
    try:
        yield importlib.import_module("letters_app").app
    finally:
        sys.path.remove(str(APPS))


def test_status_shows_lag_per_subscription_and_partition(
    fast_engine: subengine.Engine, cli_env: dict[str, str]
) -> None:
    stored = fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(20)])
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(lambda event, conn: None)
    app.subscription("audit", stream="orders", start="end").handler()(lambda e, c: None)
    for sub in app.subscriptions.values():
        fast_engine.ensure_subscription(sub)
    summary = {
        row["subscription"]: row for row in json_lines(run(cli_env, "status", "--json").stdout)
    }
    assert (summary["billing"]["lag"], summary["billing"]["partitions"]) == (20, 4)
    assert summary["billing"]["ok"] + summary["billing"]["idle"] == 4
    assert summary["audit"]["lag"] == 0 and summary["audit"]["idle"] == 4
    rows = json_lines(run(cli_env, "status", "--subscription", "billing", "--json").stdout)
    lags = {row["partition"]: row["lag"] for row in rows}
    assert lags == {p: sum(1 for a in stored if a.partition == p) for p in range(4)}
    assert all(
        (row["state"] in ("ok", "idle") and row["lag_seconds"] is not None) or row["lag"] == 0
        for row in rows
    )
    table = run(cli_env, "status").stdout
    assert "subscription" in table and "billing" in table and "audit" in table
    with Running(app, fast_engine):
        wait_for(lambda: all(r.lag == 0 for r in fast_engine.subscription_summary()))
    rows = json_lines(run(cli_env, "subscription", "show", "billing", "--json").stdout)
    assert {row["state"] for row in rows} == {"idle"}
    missing = run(cli_env, "status", "--subscription", "nope", ok=False)
    assert missing.returncode == 1 and "no subscription named 'nope'" in missing.stderr


def test_status_watch_redraws_until_interrupted(
    fast_engine: subengine.Engine, cli_env: dict[str, str]
) -> None:
    fast_engine.append("orders", [NewEvent("k", "T", {})])
    fast_engine.ensure_subscription(subengine.App().subscription("billing", stream="orders"))
    watcher = start_subengine(
        "status",
        "--watch",
        "--interval",
        "0.2",
        env=cli_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2)
    watcher.send_signal(signal.SIGINT)
    out, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 0, err
    assert "billing" in out and "lag drained" in out


def test_subscription_list_pause_and_resume(
    fast_engine: subengine.Engine, cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(8)])
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(
        lambda event, conn: conn.execute(
            "INSERT INTO effects VALUES (%s, %s, %s)", (event.id, event.partition, event.position)
        )
    )
    fast_engine.ensure_subscription(app.subscriptions["billing"])
    [listed] = json_lines(run(cli_env, "subscription", "list", "--json").stdout)
    assert (listed["name"], listed["stream"], listed["start"]) == (
        "billing",
        "orders",
        {"kind": "beginning"},
    )
    assert (
        "paused subscription 'billing'" in run(cli_env, "subscription", "pause", "billing").stdout
    )
    with Running(app, fast_engine):
        time.sleep(1)  # several poll intervals: a paused subscription gets no work
        assert sql.execute("SELECT count(*) FROM effects").fetchone()[0] == 0  # type: ignore[index]
        states = {r.state for r in fast_engine.subscription_status("billing")}
        assert states == {"paused"}
        # a stopped partition restarts on resume too
        sql.execute(
            "UPDATE subengine.subscription_positions SET stopped = true WHERE partition = 0"
        )
        out = run(cli_env, "subscription", "resume", "billing").stdout
        assert "restarted stopped partitions 0" in out
        wait_for(lambda: sql.execute("SELECT count(*) FROM effects").fetchone()[0] == 8)  # type: ignore[index]
    bad = run(cli_env, "subscription", "pause", "nope", ok=False)
    assert bad.returncode == 1 and "no subscription named 'nope'" in bad.stderr


def test_workers_lists_running_workers(
    fast_engine: subengine.Engine, cli_env: dict[str, str]
) -> None:
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(lambda event, conn: None)
    with Running(app, fast_engine, concurrency=2):
        wait_for(lambda: fast_engine.workers())
        [worker] = json_lines(run(cli_env, "workers", "--json").stdout)
        assert worker["subscriptions"] == ["billing"] and worker["connected"] is True
        assert "billing" in run(cli_env, "workers").stdout
    assert json_lines(run(cli_env, "workers", "--json").stdout) == []


def test_dead_letters_list_show_retry_and_discard(
    fast_engine: subengine.Engine,
    cli_env: dict[str, str],
    sql: psycopg.Connection[Any],
    letters_app: subengine.App,
) -> None:
    stored = fast_engine.append(
        "orders",
        [NewEvent(f"k{n}", "T", {"poison": n in (2, 5)}) for n in range(8)],
    )
    with Running(letters_app, fast_engine):
        wait_for(lambda: len(fast_engine.dead_letters("letters")) == 2)
    first, second = stored[2], stored[5]  # keys k2 and k5
    listed = json_lines(run(cli_env, "dead-letters", "list", "--json").stdout)
    assert {(r["partition"], r["position"]) for r in listed} == {
        (first.partition, first.position),
        (second.partition, second.position),
    }
    assert all(r["error"] == f"ValueError: cannot handle {r['key']}" for r in listed)
    shown = json.loads(
        run(
            cli_env, "dead-letters", "show", "letters", str(first.partition), str(first.position)
        ).stdout
    )
    assert shown["event"]["id"] == str(first.id) and shown["event"]["data"] == {"poison": True}
    where = ("letters", str(first.partition), str(first.position))
    # still broken: the retry fails, is recorded, and changes nothing else
    failed = run(
        cli_env, "dead-letters", "retry", *where, "--app", "letters_app:app", ok=False, cwd=APPS
    )
    assert failed.returncode == 1 and "failed again" in failed.stderr
    [row] = [
        r
        for r in fast_engine.dead_letters("letters")
        if r.position == first.position and r.partition == first.partition
    ]
    assert (row.retries, row.resolution) == (1, None)
    effects_before = sql.execute("SELECT count(*) FROM effects").fetchone()[0]  # type: ignore[index]
    fixed = dict(cli_env, LETTERS_FIXED="1")
    out = run(fixed, "dead-letters", "retry", *where, "--app", "letters_app:app", cwd=APPS).stdout
    assert "is handled" in out
    assert (
        sql.execute("SELECT count(*) FROM effects WHERE event_id = %s", (first.id,)).fetchone()[0]  # type: ignore[index]
        == 1
    )
    assert sql.execute("SELECT count(*) FROM effects").fetchone()[0] == effects_before + 1  # type: ignore[index]
    again = run(
        fixed, "dead-letters", "retry", *where, "--app", "letters_app:app", ok=False, cwd=APPS
    )
    assert again.returncode == 1 and "no unresolved dead letter" in again.stderr
    run(cli_env, "dead-letters", "discard", "letters", str(second.partition), str(second.position))
    assert json_lines(run(cli_env, "dead-letters", "list", "--json").stdout) == []
    resolved = json_lines(run(cli_env, "dead-letters", "list", "--all", "--json").stdout)
    assert sorted(r["resolution"] for r in resolved) == ["discarded", "retried"]


def test_a_retry_whose_handler_raises_invalid_input_is_recorded_as_a_failure(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # InvalidInput from a handler (e.g. a typed payload that does not fit) is the handler
    # failing again, not a bad argument to the retry
    stored = fast_engine.append("orders", [NewEvent("k", "T", {"poison": True})])
    letters = subengine.App().subscription("letters", stream="orders")

    @letters.handler()
    def refuse(event: subengine.Event, conn: Any) -> None:
        raise subengine.InvalidInput("still not a valid order")

    fast_engine.ensure_subscription(letters)
    sql.execute(
        "INSERT INTO subengine.dead_letters"
        " (subscription, partition, position, generation, event_id, error, attempts)"
        " VALUES ('letters', %s, %s, 1, %s, 'ValueError: first', 5)",
        (stored[0].partition, stored[0].position, stored[0].id),
    )
    error = fast_engine.retry_dead_letter(letters, stored[0].partition, stored[0].position)
    assert error == "InvalidInput: still not a valid order"
    [row] = fast_engine.dead_letters("letters")
    assert (row.retries, row.resolution, row.error) == (1, None, error)
    with pytest.raises(subengine.InvalidInput, match="no unresolved dead letter"):
        fast_engine.retry_dead_letter(letters, stored[0].partition, stored[0].position + 1)


# resetting some partitions, deleting subscriptions, pruning workers


def handled_everything(
    engine: subengine.Engine, name: str, stream: str = "orders"
) -> subengine.App:
    app = subengine.App()
    app.subscription(name, stream=stream).handler()(lambda event, conn: None)
    with Running(app, engine):
        wait_for(
            lambda: (
                {p.partition: p.position for p in engine.subscription_positions(name)}
                == engine.heads(stream)
            )
        )
    return app


def test_a_reset_to_some_partitions_moves_only_those(
    fast_engine: subengine.Engine, cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(40)])
    handled_everything(fast_engine, "billing")
    heads = fast_engine.heads("orders")
    sql.execute(
        "UPDATE subengine.subscription_positions SET stopped = true, last_error = 'stuck'"
        " WHERE subscription = 'billing' AND partition IN (1, 2)"
    )
    after = fast_engine.reset_subscription("billing", {1: 2})
    assert after == {0: heads[0], 1: 2, 2: heads[2], 3: heads[3]}
    rows = {p.partition: p for p in fast_engine.subscription_positions("billing")}
    assert {p: (r.position, r.generation, r.stopped) for p, r in rows.items()} == {
        0: (heads[0], 1, False),
        1: (2, 2, False),  # moved, in the new generation, its failure state cleared
        2: (heads[2], 1, True),  # not named: untouched
        3: (heads[3], 1, False),
    }
    assert rows[2].last_error == "stuck"


def test_a_dry_run_reset_prints_the_moves_and_changes_nothing(
    fast_engine: subengine.Engine, cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(40)])
    handled_everything(fast_engine, "billing")
    heads = fast_engine.heads("orders")
    before = sql.execute("SELECT * FROM subengine.subscription_positions ORDER BY 2").fetchall()
    generation = sql.execute("SELECT generation FROM subengine.subscriptions").fetchone()
    result = run(cli_env, "subscription", "reset", "billing", "--to", '{"3": 0}', "--dry-run")
    assert "dry run: nothing changed" in result.stderr
    lines = [line.split() for line in result.stdout.splitlines()[1:]]
    assert lines == [
        [str(p), str(heads[p]), str(heads[p] if p != 3 else 0)] + ([] if p == 3 else ["unchanged"])
        for p in range(4)
    ]
    assert sql.execute("SELECT * FROM subengine.subscription_positions ORDER BY 2").fetchall() == (
        before
    )
    assert sql.execute("SELECT generation FROM subengine.subscriptions").fetchone() == generation
    result = run(cli_env, "subscription", "reset", "billing", "--to", '{"3": 0}')
    assert fast_engine.subscription_positions("billing")[3].position == 0


def test_delete_removes_a_subscription_its_positions_and_dead_letters(
    fast_engine: subengine.Engine,
    cli_env: dict[str, str],
    sql: psycopg.Connection[Any],
    letters_app: subengine.App,
) -> None:
    stored = fast_engine.append(
        "orders", [NewEvent(f"k{n}", "T", {"poison": True}) for n in range(8)]
    )
    with Running(letters_app, fast_engine):
        wait_for(lambda: len(fast_engine.dead_letters("letters")) == len(stored))
    result = run(cli_env, "subscription", "delete", "letters")
    assert result.stdout.strip() == (
        f"deleted subscription 'letters' (stream 'orders'): 4 positions, {len(stored)} dead letters"
    )
    for table in ("subscriptions", "subscription_positions", "dead_letters"):
        assert sql.execute(f"SELECT count(*) FROM subengine.{table}").fetchone() == (0,)  # noqa: S608
    result = run(cli_env, "subscription", "delete", "letters", ok=False)
    assert (result.returncode, result.stderr) == (1, "error: no subscription named 'letters'\n")


def test_delete_is_refused_while_a_worker_runs_the_subscription_unless_forced(
    fast_engine: subengine.Engine, cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(8)])
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(lambda event, conn: None)
    fast_engine.ensure_subscription(app.subscriptions["billing"])
    with Running(app, fast_engine):
        wait_for(lambda: fast_engine.subscription_summary("billing")[0].lag == 0)
        before = sql.execute("SELECT * FROM subengine.subscription_positions").fetchall()
        result = run(cli_env, "subscription", "delete", "billing", ok=False)
        assert result.returncode == 1
        assert result.stderr.startswith("error: subscription 'billing' is run by connected")
        assert "--force" in result.stderr and len(result.stderr.splitlines()) == 1
        assert sql.execute("SELECT * FROM subengine.subscription_positions").fetchall() == before
        run(cli_env, "subscription", "delete", "billing", "--force")
        fast_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(8)])
        time.sleep(0.5)  # longer than a poll: the worker would have stored it again
        assert sql.execute("SELECT count(*) FROM subengine.subscription_positions").fetchone() == (
            0,
        )
    # the worker ran on, and stopped cleanly (Running checks it raised nothing)


def test_a_start_point_mismatch_is_fixed_as_its_error_advises(
    fast_engine: subengine.Engine, cli_env: dict[str, str]
) -> None:
    fast_engine.ensure_subscription(subengine.Subscription("billing", "orders", "beginning"))
    moved = subengine.Subscription("billing", "orders", "end")
    with pytest.raises(subengine.SubscriptionMismatch) as mismatch:
        fast_engine.ensure_subscription(moved)
    command = "subengine subscription delete billing"
    assert command in str(mismatch.value)
    run(cli_env, *command.split()[1:])
    fast_engine.ensure_subscription(moved)
    assert fast_engine.subscriptions()[0].start == {"kind": "end"}


def test_status_counts_the_connected_workers_of_an_idle_subscription(
    fast_engine: subengine.Engine, cli_env: dict[str, str]
) -> None:
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(lambda event, conn: None)
    with Running(app, fast_engine), Running(app, fast_engine):
        wait_for(lambda: len(fast_engine.workers()) == 2)
        [row] = json_lines(run(cli_env, "status", "--json").stdout)
        assert (row["lag"], row["workers"]) == (0, 2)


def test_workers_prune_removes_workers_that_are_gone(
    fast_engine: subengine.Engine, cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(lambda event, conn: None)
    dead = [
        ("11111111-1111-1111-1111-111111111111", "1 minute"),
        ("22222222-2222-2222-2222-222222222222", "1 second"),  # may not have connected yet
    ]
    for worker_id, ago in dead:
        sql.execute(
            "INSERT INTO subengine.workers (id, host, pid, subscriptions, heartbeat_at)"
            " VALUES (%s, 'gone', 1, '{billing}', now() - %s::interval)",
            (worker_id, ago),
        )
    with Running(app, fast_engine):
        # a starting worker prunes too
        wait_for(lambda: any(row.host != "gone" for row in fast_engine.workers()))
        ids = {str(row.id) for row in fast_engine.workers()}
        assert dead[0][0] not in ids and dead[1][0] in ids
        sql.execute("UPDATE subengine.workers SET heartbeat_at = now() - interval '1 minute'")
        [removed] = json_lines(run(cli_env, "workers", "prune", "--json").stdout)
        assert removed["id"] == dead[1][0]
        [alive] = fast_engine.workers()
        assert alive.connected and alive.host != "gone"
        # a live worker removed by mistake comes back with its next heartbeat
        sql.execute("DELETE FROM subengine.workers")
        wait_for(lambda: len(fast_engine.workers()) == 1)


OPERATIONS = (ROOT / "docs" / "operations.md").read_text()


def test_the_documented_operator_role_runs_every_read_only_command(
    fast_engine: subengine.Engine, cli_env: dict[str, str], sql: psycopg.Connection[Any], dsn: str
) -> None:
    stored = fast_engine.append("orders", [NewEvent(f"k{n}", "T", {"n": n}) for n in range(8)])
    fast_engine.ensure_subscription(subengine.App().subscription("billing", stream="orders"))
    letter = stored[3]
    sql.execute(
        "INSERT INTO subengine.dead_letters"
        " (subscription, partition, position, generation, event_id, error, attempts)"
        " VALUES ('billing', %s, %s, 1, %s, 'ValueError: test', 5)",
        (letter.partition, letter.position, letter.id),
    )
    sql.execute(
        "INSERT INTO subengine.parked_keys"
        " (subscription, partition, key, generation, position, event_id, error, attempts)"
        " VALUES ('billing', %s, 'k4', 1, %s, %s, 'ValueError: test', 5)",
        (stored[4].partition, stored[4].position, stored[4].id),
    )
    sql.execute(
        "INSERT INTO subengine.parked_events (parked_key, position, event_id)"
        " SELECT id, position, event_id FROM subengine.parked_keys"
    )
    [grants] = [
        block
        for block in re.findall(r"```sql\n(.*?)```", OPERATIONS, flags=re.DOTALL)
        if "CREATE ROLE subengine_operator" in block
    ]
    role = f"operator_{sql.info.dbname}"  # roles belong to the whole server
    sql.execute(grants.replace("subengine_operator", role))
    operator = dict(cli_env, SUBENGINE_DSN=make_conninfo(dsn, options=f"-c role={role}"))
    partition, position = str(letter.partition), str(letter.position)
    try:
        for args in (
            ["status"],
            ["status", "--partitions"],
            ["status", "--subscription", "billing", "--json"],
            ["subscription", "list"],
            ["subscription", "show", "billing"],
            ["workers"],
            ["dead-letters", "list", "--all"],
            ["dead-letters", "show", "billing", partition, position],
            ["parked", "list", "--all"],
            ["parked", "show", "billing", "k4"],
            ["stream", "list"],
            ["stream", "show", "orders"],
            ["read", "orders"],
            ["read", "orders", "--partition", partition, "--json"],
            ["read", "orders", "--since", "2000-01-01T00:00:00Z"],
        ):
            result = run(operator, *args)
            assert result.stdout, args
        read = json_lines(run(operator, "read", "orders", "--json").stdout)
        assert sorted(event["data"]["n"] for event in read) == list(range(8))
        for args in (
            ["subscription", "pause", "billing"],
            ["subscription", "reset", "billing", "--to", "end"],
            ["dead-letters", "discard", "billing", partition, position],
            ["parked", "discard", "billing", "k4"],
            ["append", "orders", "--key", "k", "--type", "T", "--data", "{}"],
        ):
            refused = run(operator, *args, ok=False)
            assert refused.returncode == 1, args
            assert refused.stderr.startswith("error: the database said: permission denied")
            assert refused.stderr.count("\n") == 1
    finally:
        sql.execute(f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')
