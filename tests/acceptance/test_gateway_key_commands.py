"""`subengine gateway key create|list|revoke`, run in the test's process (docs/gateway.md's
commands as processes): the token printed once and nowhere else, keys listed without
secrets, revocation, and one-line errors that change nothing and never echo a token."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import psycopg
import pytest
from helpers import ROOT, invoke, invoke_ok, run_ok

import subengine

TOKEN = re.compile(r"sek_[0-9a-f]{12}_[A-Za-z0-9_-]{43}")


def keys_table(sql: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return sql.execute("SELECT * FROM subengine.gateway_keys ORDER BY id").fetchall()


def created_token(output: str) -> str:
    [token] = TOKEN.findall(output)
    return str(token)


def test_create_prints_the_token_once_and_says_it_cannot_be_shown_again(
    cli_env: dict[str, str], engine: subengine.Engine
) -> None:
    result = invoke_ok(
        cli_env, "gateway", "key", "create", "--scopes", "read,append",
        "--streams", "orders*", "--streams", "payments", "--name", "billing",
    )  # fmt: skip
    token = created_token(result.stdout)
    key = engine.authenticate(token)
    assert key is not None
    assert result.stdout.splitlines() == [
        f"created API key {key.id} 'billing': append, read on orders*, payments",
        f"token: {token}",
        "Store the token now: it cannot be shown again.",
    ]
    assert (key.scopes, key.streams) == (("append", "read"), ("orders*", "payments"))
    assert result.stderr == ""


def test_create_json_gives_the_key_and_its_token(
    cli_env: dict[str, str], engine: subengine.Engine
) -> None:
    result = invoke_ok(cli_env, "gateway", "key", "create", "--scopes", "admin", "--streams", "*",
                 "--json")  # fmt: skip
    [shown] = [json.loads(line) for line in result.stdout.splitlines()]
    assert set(shown) == {"id", "name", "scopes", "streams", "created_at", "revoked_at", "token"}
    key = engine.authenticate(shown["token"])
    assert key is not None and key.id == shown["id"]
    assert (shown["name"], shown["scopes"], shown["streams"]) == (None, ["admin"], ["*"])


def test_list_shows_the_keys_but_never_a_token_or_hash(
    cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    tokens = [
        created_token(invoke_ok(cli_env, "gateway", "key", "create", "--scopes", "read",
                          "--streams", stream, "--name", f"for {stream}").stdout)
        for stream in ("orders", "payments*")
    ]  # fmt: skip
    hashes = [
        bytes(h).hex() for (h,) in sql.execute("SELECT secret_hash FROM subengine.gateway_keys")
    ]
    table = invoke_ok(cli_env, "gateway", "key", "list").stdout
    as_json = invoke_ok(cli_env, "gateway", "key", "list", "--json").stdout
    for output in (table, as_json):
        for secret in [*tokens, *(token[17:] for token in tokens), *hashes]:
            assert secret not in output
    header, *rows = table.splitlines()
    assert header.split() == ["id", "name", "scopes", "streams", "created_at", "revoked_at"]
    assert [row.split()[1:5] for row in rows] == [
        ["for", "orders", "read", "orders"],
        ["for", "payments*", "read", "payments*"],
    ]
    listed = [json.loads(line) for line in as_json.splitlines()]
    assert [set(key) for key in listed] == [
        {"id", "name", "scopes", "streams", "created_at", "revoked_at"}
    ] * 2


def test_list_without_keys_says_the_gateway_is_open_on_loopback_only(
    cli_env: dict[str, str],
) -> None:
    assert invoke_ok(cli_env, "gateway", "key", "list").stdout == (
        "no API keys: the gateway then needs no key, and `subengine serve` listens on "
        "loopback addresses only\n"
    )
    assert invoke_ok(cli_env, "gateway", "key", "list", "--json").stdout == ""


def test_revoke_refuses_the_token_from_then_on(
    cli_env: dict[str, str], engine: subengine.Engine
) -> None:
    kept, kept_token = engine.create_api_key(["read"], ["orders"], name="kept")
    gone, gone_token = engine.create_api_key(["read"], ["orders"], name="gone")
    result = invoke_ok(cli_env, "gateway", "key", "revoke", gone.id)
    assert re.fullmatch(
        rf"API key {gone.id} 'gone' is revoked \(since [0-9T:.+-]+\); its token is refused\n",
        result.stdout,
    ), result.stdout
    assert engine.authenticate(gone_token) is None
    assert engine.authenticate(kept_token) == kept
    [revoked] = [
        json.loads(line)
        for line in invoke_ok(cli_env, "gateway", "key", "list", "--json").stdout.splitlines()
        if json.loads(line)["id"] == gone.id
    ]
    assert revoked["revoked_at"] is not None
    again = invoke_ok(cli_env, "gateway", "key", "revoke", gone.id, "--json").stdout
    assert json.loads(again)["revoked_at"] == revoked["revoked_at"]


def test_revoking_the_last_active_key_says_the_gateway_is_open_again(
    cli_env: dict[str, str], engine: subengine.Engine
) -> None:
    key, _ = engine.create_api_key(["read"], ["*"])
    [_, open_again] = invoke_ok(cli_env, "gateway", "key", "revoke", key.id).stdout.splitlines()
    assert open_again.startswith("no API key is active any more: the gateway then needs no key")


BAD = [
    (["create", "--streams", "orders"], "Missing option '--scopes'", 2),
    (["create", "--scopes", "read"], "Missing option '--streams'", 2),
    (["create", "--scopes", "read,write", "--streams", "x"], "unknown scope 'write'", 1),
    (["create", "--scopes", "", "--streams", "x"], "unknown scope ''", 1),
    (["create", "--scopes", "read", "--streams", "a b"], "invalid stream pattern 'a b'", 1),
    (["create", "--scopes", "read", "--streams", "*x"], "invalid stream pattern '*x'", 1),
    (["create", "--scopes", "read", "--streams", "x", "--name", ""], "invalid key name ''", 1),
    (["revoke", "0123456789ab"], "API key '0123456789ab' does not exist", 1),
    (["revoke", "'; DROP TABLE x; --"], "invalid API key id", 1),
    (["revoke"], "Missing argument 'ID'", 2),
]


@pytest.mark.parametrize(("args", "message", "status"), BAD)
def test_bad_input_is_one_line_and_changes_nothing(
    cli_env: dict[str, str],
    engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    args: list[str],
    message: str,
    status: int,
) -> None:
    engine.create_api_key(["read"], ["orders"])
    before = keys_table(sql)
    result = invoke(cli_env, "gateway", "key", *args)
    assert result.returncode == status, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and message in line, line
    if status == 2:
        assert line.endswith(f"; see 'subengine gateway key {args[0]} --help'")
    assert result.stdout == ""
    assert keys_table(sql) == before


def test_no_error_echoes_a_token(
    cli_env: dict[str, str], engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    key, token = engine.create_api_key(["read"], ["orders"])
    before = keys_table(sql)
    misuses = [
        ["revoke", token],
        ["revoke", key.id, token],
        ["list", token],
        ["create", "--scopes", token, "--streams", "orders"],
        ["create", "--scopes", "read", "--streams", token],
        ["create", "--scopes", "read", "--streams", "orders", "--name", token],
        ["create", "--scopes", "read", "--streams", "orders", token],
        ["create", f"--{token}"],
    ]
    for args in misuses:
        result = invoke(cli_env, "gateway", "key", *args)
        assert result.returncode != 0, args
        assert token[17:] not in result.stderr + result.stdout, args
        assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert keys_table(sql) == before
    assert engine.authenticate(token) == key


def test_every_command_of_the_keys_page_runs(
    cli_env: dict[str, str], engine: subengine.Engine
) -> None:
    page = (ROOT / "docs" / "gateway.md").read_text()
    commands = [
        shlex.split(line)
        for block in re.findall(r"```sh\n(.*?)```", page, flags=re.DOTALL)
        for line in block.splitlines()
        if line.startswith("subengine gateway key ")
    ]
    assert len(commands) == 6
    shown_id = commands[-1][-1]  # the page revokes a key by an id of its example
    for command in commands:
        if command[1:4] == ["gateway", "key", "revoke"]:
            command[-1] = engine.api_keys()[0].id
        run_ok(cli_env, *command[1:])  # as a process, as a reader of the page runs it
    keys = engine.api_keys()
    assert [(key.name, key.revoked) for key in keys] == [
        ("dashboard", True),
        ("billing", False),
        ("ops", False),
    ]
    assert re.fullmatch("[0-9a-f]{12}", shown_id)
