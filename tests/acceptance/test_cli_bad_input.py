"""Bad input given to the `subengine` command: one clear line, a non-zero exit, nothing changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
from helpers import invoke, run_subengine, snapshot

import subengine


def test_cli_bad_input_exits_non_zero_with_the_reason(
    engine: subengine.Engine,
    stored: str,
    sql: psycopg.Connection[Any],
    cli_env: dict[str, str],
    tmp_path: Path,
) -> None:
    before = snapshot(sql)
    cases = [
        (["append", "missing", "--key", "k", "--type", "T", "--data", "{}"], "does not exist"),
        (["append", "orders", "--key", "k", "--type", "T", "--data", "{oops"], "not valid JSON"),
        (
            ["append", "orders; DROP", "--key", "k", "--type", "T", "--data", "{}"],
            "invalid stream name",
        ),
        (["read", "orders", "--partition", "9"], "no partition 9"),
        (["read", "missing"], "does not exist"),
        (["stream", "create", "x" * 10_000, "--partitions", "2"], "invalid stream name"),
        (["stream", "create", "orders", "--partitions", "2"], "exists already"),
        (["stream", "create", "fresh", "--partitions", "0"], "partition count"),
    ]
    for args, message in cases:
        result = invoke(cli_env, *args)
        assert result.returncode != 0, args
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert snapshot(sql) == before


def test_cli_malformed_jsonl_line_names_the_line_and_appends_nothing(
    stored: str, sql: psycopg.Connection[Any], cli_env: dict[str, str], tmp_path: Path
) -> None:
    before = snapshot(sql)
    good = '{"key": "a", "type": "T", "data": {}}'
    files = {
        "broken.jsonl": (f"{good}\n\n{good}\n{{not json\n{good}\n", "line 4"),
        "missing.jsonl": (f'{good}\n{{"key": "a", "type": "T"}}\n', "line 2: missing 'data'"),
        "unknown.jsonl": (
            f'{good}\n{{"key": "a", "type": "T", "data": 1, "x": 2}}\n',
            "line 2: unknown field(s) 'x'",
        ),
        "badkey.jsonl": (
            f'{good}\n{good}\n{{"key": "", "type": "T", "data": 1}}\n',
            "line 3: invalid event key",
        ),
        "empty.jsonl": ("\n\n", "holds no event"),
    }
    for name, (content, message) in files.items():
        path = tmp_path / name
        path.write_text(content)
        result = invoke(cli_env, "append", "orders", "--file", str(path))
        assert result.returncode == 1, (name, result.stderr)
        assert message in result.stderr, (name, result.stderr)
    assert snapshot(sql) == before


def test_cli_reports_an_unreachable_database_in_one_line(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "SUBENGINE_DSN": "postgresql://nobody@127.0.0.1:1/none",
        "SUBENGINE_CONNECT_TIMEOUT": "1",
        "SUBENGINE_HOME": str(tmp_path),
    }
    for args in (["migrate"], ["stream", "list"]):
        result = invoke(env, *args)
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr
        assert "error:" in result.stderr and "127.0.0.1" in result.stderr


def test_serve_refuses_a_durable_streams_prefix_over_the_gateways_own_paths(
    cli_env: dict[str, str],
) -> None:
    for prefix in ("/ui", "/ui/streams", "/metrics", "/healthz", "/v1", "/v1/ds", "ds", "/a{b}"):
        result = run_subengine(
            cli_env, "serve", "--durable-streams", "--durable-streams-prefix", prefix, timeout=20
        )
        assert result.returncode == 2, (prefix, result.stderr)
        assert "--durable-streams-prefix" in result.stderr, (prefix, result.stderr)
        assert "outside /v1, /ui, /healthz, /readyz, /metrics" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
