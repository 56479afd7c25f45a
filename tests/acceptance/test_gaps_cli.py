"""Gaps on the command line: `read` prints a tombstone line before the later events,
`subscription show` and `status` show state gap, and `subscription skip-gap` accepts one."""

from __future__ import annotations

import json
from typing import Any

from helpers import invoke_ok as run

import subengine
from subengine import NewEvent, Retention


def pruned(engine: subengine.Engine) -> None:
    """Stream 'capped' (one partition): 10 events, of which retention kept 7 to 10, and
    a subscription 'billing' that handled none of them."""
    engine.create_stream("capped", partitions=1, retention=Retention(max_events=4))
    for n in range(10):
        engine.append("capped", [NewEvent(f"k{n}", "T", {"n": n})])
    engine.ensure_subscription(subengine.Subscription("billing", "capped"))
    assert engine.run_retention().removed == 6


def json_lines(text: str) -> list[Any]:
    return [json.loads(line) for line in text.split("\n") if line]


def test_read_prints_a_tombstone_line_before_the_events_after_the_gap(
    cli_env: dict[str, str], engine: subengine.Engine
) -> None:
    pruned(engine)
    lines = run(cli_env, "read", "capped", "--partition", "0").stdout.splitlines()
    assert lines[0] == (
        "# gap: retention removed positions 1 to 6 of partition 0 of stream 'capped' by its "
        "size limit (floor 7, head 10): the events after it follow"
    )
    assert [line.split()[1] for line in lines[2:]] == ["7", "8", "9", "10"]  # after the header
    as_json = [
        json.loads(line) for line in run(cli_env, "read", "capped", "--json").stdout.splitlines()
    ]
    assert as_json[0] == {
        "tombstone": {
            "stream": "capped",
            "partition": 0,
            "gap_from": 1,
            "gap_to": 6,
            "floor": 7,
            "reason": "cap",
            "head": 10,
            "cursor_below_floor": False,
        }
    }
    assert [item["position"] for item in as_json[1:]] == [7, 8, 9, 10]
    assert "gap" not in run(cli_env, "read", "capped", "--partition", "0", "--after", "6").stdout


def test_a_stopped_gap_shows_in_the_views_and_skip_gap_accepts_it(
    cli_env: dict[str, str], engine: subengine.Engine
) -> None:
    pruned(engine)
    [row] = json_lines(run(cli_env, "subscription", "show", "billing", "--json").stdout)
    assert (row["state"], row["floor"], row["gap_from"], row["gap_to"]) == ("gap", 7, 1, 6)
    [summary] = json_lines(run(cli_env, "status", "--json").stdout)
    assert summary["gap"] == 1
    out = run(cli_env, "subscription", "skip-gap", "billing", "--partition", "0").stdout
    assert out.strip() == (
        "subscription 'billing' skipped the gap: retention removed positions 1 to 6 of "
        "partition 0 of stream 'capped' by its size limit; it goes on from position 7"
    )
    [row] = [
        json.loads(line)
        for line in run(cli_env, "subscription", "show", "billing", "--json").stdout.splitlines()
    ]
    assert (row["state"], row["position"], row["gap_from"]) == ("ok", 6, None)
    again = run(cli_env, "subscription", "skip-gap", "billing", "--partition", "0", ok=False)
    assert again.returncode != 0
    assert again.stderr.strip().splitlines() == [
        "error: partition 0 of subscription 'billing' has no gap: its position 6 is at or past "
        "the floor's eve (6); nothing to skip"
    ]
    unknown = run(cli_env, "subscription", "skip-gap", "nobody", "--partition", "0", ok=False)
    assert "no subscription named 'nobody'" in unknown.stderr
