"""`subengine stream delete` against the test database, run in the test's process."""

from __future__ import annotations

import json
from typing import Any

import psycopg
from helpers import invoke_ok as run


def test_stream_delete_is_refused_with_subscriptions_then_forced(
    cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    run(cli_env, "stream", "create", "orders", "--partitions", "2")
    for n in range(3):
        run(cli_env, "append", "orders", "--key", f"k{n}", "--type", "T", "--data", "{}")
    run(cli_env, "subscription", "create", "billing", "--stream", "orders")
    [old] = [
        json.loads(line) for line in run(cli_env, "stream", "list", "--json").stdout.splitlines()
    ]

    refused = run(cli_env, "stream", "delete", "orders", ok=False)
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: stream 'orders' has subscriptions: billing;")
    assert "--force" in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert sql.execute("SELECT count(*) FROM subengine.events").fetchone() == (3,)

    deleted = run(cli_env, "stream", "delete", "orders", "--force").stdout
    assert deleted == (
        f"deleted stream 'orders' (epoch {old['epoch']}): 3 events, subscriptions: billing\n"
    )
    assert run(cli_env, "stream", "list", "--json").stdout == ""
    gone = run(cli_env, "stream", "delete", "orders", ok=False)
    assert (gone.returncode, gone.stderr.splitlines()[0]) == (
        1,
        "error: stream 'orders' does not exist; create it with "
        "`subengine stream create orders --partitions N`",
    )

    run(cli_env, "stream", "create", "orders", "--partitions", "2")
    [new] = [
        json.loads(line) for line in run(cli_env, "stream", "list", "--json").stdout.splitlines()
    ]
    assert new["epoch"] > old["epoch"]
    shown = run(cli_env, "stream", "show", "orders").stdout.splitlines()
    assert shown[0] == f"stream 'orders': 2 partitions, epoch {new['epoch']}; retention: keep all"
    as_json = run(cli_env, "stream", "delete", "orders", "--json").stdout
    assert json.loads(as_json) == {
        "name": "orders",
        "epoch": new["epoch"],
        "events": 0,
        "subscriptions": [],
    }
