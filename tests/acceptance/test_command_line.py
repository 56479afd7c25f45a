"""The `subengine` command as a user meets it: help, errors, completion, start-up."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from helpers import README, run_subengine, subengine_command

import subengine
from subengine import NewEvent
from subengine.db import _embedded


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--bogus"], 2, "No such option '--bogus'; see 'subengine --help'"),
        (["nosuch"], 2, "No such command 'nosuch'; see 'subengine --help'"),
        (["append", "orders", "--data"], 2, "Option '--data' requires an argument"),
        (["read", "orders", "x", "y"], 2, "Got unexpected extra arguments (x y)"),
        (["subscription", "reset", "billing"], 2, "Missing option '--to'"),
        (["stream", "create", "s", "--partitions", "many"], 2, "'many' is not a valid integer"),
        (
            ["read", "orders", "--since", "2026-01-01T00:00:00Z", "--partition", "1"],
            2,
            "cannot be combined",
        ),
        (["read", "orders", "--since", "2026-01-01T10:00"], 2, "names no time zone: add one"),
        (
            ["read", "orders", "--after", "c1.AAEGb3JkZXJzAQA", "--partition", "1"],
            2,
            "drop --partition",
        ),
        (["read", "orders", "--after", "ten"], 2, "'ten' is neither a position nor a cursor"),
        (["append", "orders", "--file", "missing.jsonl"], 1, "Could not open file"),
        (["status", "--watch", "--interval", "nan"], 2, "'nan' is not a number"),
        (["demo", "--rate", "NaN"], 2, "'NaN' is not a number"),
    ],
)
def test_every_error_is_one_line(
    cli_env: dict[str, str], tmp_path: Path, args: list[str], status: int, message: str
) -> None:
    result = run_subengine(cli_env, *args, cwd=tmp_path)
    assert result.returncode == status, result.stderr
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("help_option", ["-h", "--help"])
@pytest.mark.parametrize("command", [[], ["stream"], ["subscription", "reset"], ["append"]])
def test_help_takes_h_and_help(
    cli_env: dict[str, str], command: list[str], help_option: str
) -> None:
    result = run_subengine(cli_env, *command, help_option)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Usage: {' '.join(['subengine', *command])} ")


def test_help_imports_no_table_renderer_and_no_demo() -> None:
    # `subengine --help` should start at once: what only some commands need (rich's
    # tables, the demo) is imported by those commands
    probe = (
        "import sys\n"
        "from subengine.cli.main import main\n"
        "sys.argv = ['subengine', '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] == 'rich' or 'demo' in m]\n"
        "print(sorted(loaded), file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert "Usage: subengine" in result.stdout
    assert result.stderr.strip() == "[]"


def test_status_json_prints_counts_as_integers(
    engine: subengine.Engine, orders: str, cli_env: dict[str, str]
) -> None:
    engine.append(orders, [NewEvent(f"k{n}", "T", {}) for n in range(5)])
    engine.ensure_subscription(subengine.Subscription("billing", orders))
    out = run_subengine(cli_env, "status", "--json").stdout
    [row] = [json.loads(line) for line in out.splitlines()]
    counts = ("partitions", "lag", "ok", "idle", "retrying", "stopped", "paused", "workers")
    assert {name: row[name] for name in counts} == {
        "partitions": 4,
        "lag": 5,
        "ok": row["ok"],
        "idle": row["idle"],
        "retrying": 0,
        "stopped": 0,
        "paused": 0,
        "workers": 0,
    }
    assert all(type(row[name]) is int for name in (*counts, "generation")), out
    assert '"lag": 5,' in out


def test_read_says_when_more_events_follow_than_it_shows(
    engine: subengine.Engine, orders: str, cli_env: dict[str, str]
) -> None:
    engine.append(orders, [NewEvent("k", "T", {"n": n}) for n in range(7)])
    partition = str(subengine.partition_for("k", 4))
    env = dict(cli_env, SUBENGINE_READ_LIMIT="5")
    for args in (["--partition", partition], [], ["--since", "2000-01-01T00:00:00Z"]):
        result = run_subengine(env, "read", orders, "--json", *args)
        assert result.returncode == 0, result.stderr
        shown = [json.loads(line)["data"]["n"] for line in result.stdout.splitlines()]
        assert shown == list(range(5))
        assert result.stderr.startswith("note: stopped at 5 events (--limit); more follow")
    on = run_subengine(env, "read", orders, "--partition", partition, "--limit", "3")
    assert on.stderr == (
        "note: stopped at 3 events (--limit); more follow: read on with --after 3\n"
    )
    rest = run_subengine(env, "read", orders, "--partition", partition, "--after", "3")
    assert len(rest.stdout.splitlines()) == 1 + 4 and rest.stderr == ""
    exact = run_subengine(env, "read", orders, "--limit", "7")
    assert exact.returncode == 0 and exact.stderr == ""


def test_a_read_by_time_prints_the_cursor_that_reads_on_without_skipping_or_repeating(
    engine: subengine.Engine, orders: str, cli_env: dict[str, str]
) -> None:
    # one transaction: the events of every partition share one recorded time
    engine.append(orders, [NewEvent(f"k{n}", "T", {"n": n}) for n in range(10)])
    shown: list[int] = []
    result = run_subengine(
        cli_env, "read", orders, "--since", "2000-01-01T00:00:00Z", "--limit", "3", "--json"
    )
    for _ in range(10):
        assert result.returncode == 0, result.stderr
        shown += [json.loads(line)["data"]["n"] for line in result.stdout.splitlines()]
        cursor = result.stderr.split("read on with --after ")[1].strip()
        if "more follow" not in result.stderr:
            break
        result = run_subengine(cli_env, "read", orders, "--after", cursor, "--limit", "3", "--json")
    assert sorted(shown) == list(range(10))
    engine.append(orders, [NewEvent("k1", "T", {"n": 10})])
    later = run_subengine(cli_env, "read", orders, "--after", cursor, "--json")
    assert [json.loads(line)["data"]["n"] for line in later.stdout.splitlines()] == [10]


def test_a_cursor_of_another_stream_is_refused(
    engine: subengine.Engine, orders: str, cli_env: dict[str, str]
) -> None:
    engine.create_stream("payments", partitions=2)
    result = run_subengine(cli_env, "read", "payments", "--since", "2000-01-01T00:00:00Z")
    cursor = result.stderr.split("read on with --after ")[1].strip()
    refused = run_subengine(cli_env, "read", orders, "--after", cursor)
    assert refused.returncode == 1
    assert refused.stderr == (
        f"error: that cursor is not one of stream '{orders}': it names 'payments'\n"
    )


def test_the_embedded_notice_names_the_data_directory_absolutely(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBENGINE_")}
    env["SUBENGINE_HOME"] = "relative-home"
    try:
        result = run_subengine(env, "db", "url", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        home = (tmp_path / "relative-home").resolve()
        assert f"using the embedded PostgreSQL in {home} " in result.stderr
        stopped = run_subengine(env, "db", "stop", cwd=tmp_path)
        assert stopped.stdout == f"stopped the embedded PostgreSQL in {home}\n"
    finally:
        _embedded.stop_embedded(tmp_path / "relative-home")


def completion_lines() -> list[str]:
    """The README's shell lines that load completion."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.DOTALL)
    return [
        line for block in blocks for line in block.splitlines() if "_SUBENGINE_COMPLETE=" in line
    ]


def test_the_documented_completion_scripts_load(tmp_path: Path) -> None:
    env = {"PATH": f"{Path(subengine_command()).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    shells = set()
    for line in completion_lines():
        instruction = re.search(r"_SUBENGINE_COMPLETE=(\w+) subengine", line).group(1)  # type: ignore[union-attr]
        shells.add(instruction.removesuffix("_source"))
        script = subprocess.run(
            ["subengine"],
            env={**env, "_SUBENGINE_COMPLETE": instruction},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert script.returncode == 0 and "subengine" in script.stdout, script.stderr
    assert {"bash", "zsh", "fish"} <= shells
    [bash_line] = [line for line in completion_lines() if "bash_source" in line]
    # in bash, as the README says: complete `subengine subscription re<Tab>`
    probe = (
        bash_line.split("#")[0]
        + "\nCOMP_WORDS=(subengine subscription re); COMP_CWORD=2"
        + "\n_subengine_completion subengine; echo ${COMPREPLY[@]}"
    )
    completed = subprocess.run(
        ["bash", "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["remote-policy", "reset", "resume"]


def test_a_read_since_a_time_leaves_out_the_events_recorded_at_it(
    engine: subengine.Engine, orders: str, cli_env: dict[str, str]
) -> None:
    engine.append(orders, [NewEvent(f"k{n}", "T", {"n": n}) for n in range(4)])
    last_had = engine.read_since(orders, datetime(2000, 1, 1, tzinfo=UTC))[-1]
    assert isinstance(last_had, subengine.Event)
    engine.append(orders, [NewEvent("k1", "T", {"n": 4})])
    since = last_had.recorded_at.isoformat()
    later = run_subengine(cli_env, "read", orders, "--since", since, "--json")
    assert [json.loads(line)["data"]["n"] for line in later.stdout.splitlines()] == [4]
