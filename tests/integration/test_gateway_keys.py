"""The gateway's API keys and signing secrets: tokens shown once and stored as hashes,
strict authentication, scopes and stream patterns, revocation, and one signing secret
per name however many ask at once.

The engines' part of it is theirs alike: those tests take `either`, which runs them over
both twins (`Engine` and `AsyncEngine`) as test_engine_contract.py does.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from twins import Twin, either_fixture, twin_fixture  # noqa: F401  (the fixtures)

import subengine
from subengine import ApiKey
from subengine.db._sql import SQL
from subengine.outside import _api_keys

TOKEN = re.compile(r"sek_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")


def keys_table(sql: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return sql.execute("SELECT * FROM subengine.gateway_keys ORDER BY id").fetchall()


def secrets_table(sql: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return sql.execute("SELECT * FROM subengine.gateway_secrets ORDER BY name").fetchall()


def secret_of(token: str) -> str:
    """The secret part of a token (which may itself hold '_')."""
    match = TOKEN.fullmatch(token)
    assert match is not None
    return match.group(2)


def other_secret(token: str) -> str:
    """`token` with the last character of its secret changed."""
    return token[:-1] + ("A" if token[-1] != "A" else "B")


def test_a_created_key_authenticates_with_its_token(either: Any) -> None:
    key, token = either.create_api_key(["read", "append"], ["orders*"], name="billing")
    match = TOKEN.fullmatch(token)
    assert match is not None and match.group(1) == key.id
    assert (key.name, key.scopes, key.streams, key.revoked_at) == (
        "billing",
        ("append", "read"),
        ("orders*",),
        None,
    )
    assert either.authenticate(token) == key
    assert either.api_keys() == [key]


def test_every_key_has_its_own_id_and_secret(either: Any) -> None:
    made = [either.create_api_key(["read"], ["*"]) for _ in range(5)]
    assert len({key.id for key, _ in made}) == len({token for _, token in made}) == 5
    for key, token in made:
        assert either.authenticate(token) == key


def test_the_database_keeps_only_the_hash_of_the_secret(
    either: Any, sql: psycopg.Connection[Any]
) -> None:
    _, token = either.create_api_key(["read"], ["orders"])
    secret = secret_of(token)
    [row] = sql.execute(
        "SELECT secret_hash, to_jsonb(k)::text FROM subengine.gateway_keys k"
    ).fetchall()
    assert bytes(row[0]) == hashlib.sha256(secret.encode()).digest()
    assert secret not in row[1] and token not in row[1]


@pytest.mark.parametrize(
    "change",
    [
        other_secret,
        lambda token: token[:-43] + "A" * 43,
        lambda token: token.replace(token[4:16], "0123456789ab"),  # another id
    ],
    ids=["one-character", "whole-secret", "other-id"],
)
def test_a_wrong_secret_or_id_does_not_authenticate(either: Any, change: Any) -> None:
    _, token = either.create_api_key(["read"], ["orders"])
    assert either.authenticate(change(token)) is None


def test_a_secret_does_not_authenticate_under_another_keys_id(either: Any) -> None:
    _, first_token = either.create_api_key(["read"], ["orders"])
    second, _ = either.create_api_key(["admin"], ["*"])
    swapped = f"sek_{second.id}_{secret_of(first_token)}"
    assert either.authenticate(swapped) is None


MALFORMED: list[Any] = [
    "",
    "sek_",
    "Bearer sek_0123456789ab_" + "A" * 43,
    "sek_0123456789AB_" + "A" * 43,  # upper-case id
    "sek_0123456789a_" + "A" * 43,  # short id
    "sek_0123456789ab_" + "A" * 42,  # short secret
    "sek_0123456789ab_" + "A" * 44,  # long secret
    "sek_0123456789ab_" + "A" * 42 + "=",  # padding
    "sek_0123456789ab_" + "A" * 42 + "+",  # base64, not base64url
    "sek_0123456789ab_" + "A" * 43 + "\n",
    " sek_0123456789ab_" + "A" * 43,
    "SEK_0123456789ab_" + "A" * 43,
    "sek-0123456789ab-" + "A" * 43,
    "x" * 100_000,
    None,
    b"sek_0123456789ab_" + b"A" * 43,
    42,
]


def test_malformed_tokens_are_refused_without_touching_the_database(twin: Twin, dsn: str) -> None:
    engine = twin.engine(dsn)
    engine.close()  # a query would fail: a malformed token must need none
    for token in MALFORMED:
        assert engine.authenticate(token) is None, token


def test_a_well_formed_token_of_no_key_does_not_authenticate(either: Any) -> None:
    assert either.authenticate("sek_0123456789ab_" + "A" * 43) is None


def test_a_revoked_key_no_longer_authenticates(either: Any, sql: psycopg.Connection[Any]) -> None:
    key, token = either.create_api_key(["read"], ["orders"])
    other, other_token = either.create_api_key(["read"], ["orders"])
    revoked = either.revoke_api_key(key.id)
    assert revoked.id == key.id and revoked.revoked_at is not None
    assert revoked.revoked_at >= key.created_at
    assert either.authenticate(token) is None
    assert either.authenticate(other_token) == other
    assert either.api_keys() == [revoked, other]
    [stored] = sql.execute(
        "SELECT revoked_at FROM subengine.gateway_keys WHERE id = %s", (key.id,)
    ).fetchall()
    assert stored == (revoked.revoked_at,)


def test_revoking_a_key_again_keeps_the_first_revocation(either: Any) -> None:
    key, _ = either.create_api_key(["read"], ["orders"])
    first = either.revoke_api_key(key.id)
    assert either.revoke_api_key(key.id) == first


def test_any_active_key_follows_creation_and_revocation(either: Any) -> None:
    assert either.any_active_api_key() is False
    key, _ = either.create_api_key(["read"], ["*"])
    assert either.any_active_api_key() is True
    either.revoke_api_key(key.id)
    assert either.any_active_api_key() is False


def test_revoking_an_unknown_key_raises_and_changes_nothing(
    either: Any, sql: psycopg.Connection[Any]
) -> None:
    either.create_api_key(["read"], ["orders"])
    before = keys_table(sql)
    with pytest.raises(subengine.ApiKeyNotFound, match="'0123456789ab' does not exist"):
        either.revoke_api_key("0123456789ab")
    assert keys_table(sql) == before


@pytest.mark.parametrize("key_id", ["", "0123456789AB", "0123456789a", "0123456789abc", "x' --"])
def test_a_malformed_key_id_is_refused(either: Any, key_id: str) -> None:
    with pytest.raises(subengine.InvalidInput, match="invalid API key id"):
        either.revoke_api_key(key_id)


def test_errors_never_quote_a_token(either: Any, sql: psycopg.Connection[Any]) -> None:
    key, token = either.create_api_key(["read"], ["orders"])
    secret = secret_of(token)
    before = keys_table(sql)
    misuses: list[Callable[[], object]] = [
        lambda: either.revoke_api_key(token),
        lambda: either.revoke_api_key(f" {token}"),
        lambda: either.create_api_key([token], ["orders"]),
        lambda: either.create_api_key(["read"], [token]),
        lambda: either.create_api_key(["read"], [f"{token}*"]),
        lambda: either.create_api_key(["read"], ["orders"], name=token),
        lambda: either.create_api_key(["read"], ["orders"], name=f"ci {token}"),
        lambda: either.signing_secret(token),
        lambda: key.allows("orders", token),
    ]
    for misuse in misuses:
        with pytest.raises(subengine.InvalidInput) as raised:
            misuse()
        assert secret not in str(raised.value) and key.id + "_" not in str(raised.value)
    assert keys_table(sql) == before


ALLOWED = [
    # patterns, stream, allowed
    (["orders"], "orders", True),
    (["orders"], "orders-eu", False),
    (["orders"], "order", False),
    (["orders*"], "orders", True),
    (["orders*"], "orders-eu", True),
    (["orders*"], "order", False),
    (["orders-*"], "orders", False),
    (["*"], "anything.at-all", True),
    (["payments", "orders*"], "payments", True),
    (["payments", "orders*"], "orders.2", True),
    (["payments", "orders*"], "refunds", False),
]


@pytest.mark.parametrize(("patterns", "stream", "allowed"), ALLOWED)
def test_stream_patterns_match_names_prefixes_or_everything(
    either: Any, patterns: list[str], stream: str, allowed: bool
) -> None:
    key, _ = either.create_api_key(["read"], patterns)
    assert key.allows(stream, "read") is allowed


def test_a_key_allows_only_its_scopes(either: Any) -> None:
    reader, _ = either.create_api_key(["read"], ["*"])
    writer, _ = either.create_api_key(["append", "read"], ["*"])
    admin, _ = either.create_api_key(["admin"], ["*"])
    table = {
        key.id: [scope for scope in ("read", "append", "admin") if key.allows("s", scope)]
        for key in (reader, writer, admin)
    }
    assert table == {reader.id: ["read"], writer.id: ["read", "append"], admin.id: ["admin"]}


def test_a_revoked_key_allows_nothing(either: Any) -> None:
    key, _ = either.create_api_key(["read", "append", "admin"], ["*"])
    revoked = either.revoke_api_key(key.id)
    assert not any(revoked.allows("s", scope) for scope in ApiKey.SCOPES)


def test_asking_for_an_unknown_scope_is_an_error_not_a_refusal(either: Any) -> None:
    key, _ = either.create_api_key(["read"], ["*"])
    with pytest.raises(subengine.InvalidInput, match="unknown scope 'raed'"):
        key.allows("orders", "raed")


def test_repeated_scopes_and_patterns_are_stored_once(either: Any) -> None:
    key, _ = either.create_api_key(
        iter(["read", "append", "read"]), ("b*", "a", "b*", "*"), name="twice"
    )
    assert key.scopes == ("append", "read")
    assert key.streams == ("b*", "a", "*")
    assert either.api_keys() == [key]


BAD_KEYS: list[tuple[Any, Any, Any, str]] = [
    # scopes, streams, name, message
    ([], ["orders"], None, "no scope given"),
    ("read", ["orders"], None, "scopes must be a list of strings, not a str"),
    (None, ["orders"], None, "scopes must be a list of strings, not a NoneType"),
    (["read", "write"], ["orders"], None, "unknown scope 'write'"),
    (["READ"], ["orders"], None, "unknown scope 'READ'"),
    ([None], ["orders"], None, "unknown scope None"),
    (["read"], [], None, "no stream pattern given"),
    (["read"], "orders", None, "stream patterns must be a list of strings, not a str"),
    (["read"], [""], None, "invalid stream pattern ''"),
    (["read"], ["**"], None, "invalid stream pattern '**'"),
    (["read"], ["*orders"], None, "invalid stream pattern '*orders'"),
    (["read"], ["ord*ers"], None, "invalid stream pattern 'ord*ers'"),
    (["read"], ["orders'; DROP TABLE x; --"], None, "invalid stream pattern"),
    (["read"], ["-orders"], None, "invalid stream pattern '-orders'"),
    (["read"], ["x" * 101], None, "invalid stream pattern"),
    (["read"], [None], None, "invalid stream pattern None"),
    (["read"], [f"s{n}" for n in range(101)], None, "101 stream patterns given"),
    (["read"], ["orders"], "", "invalid key name ''"),
    (["read"], ["orders"], " ci", "invalid key name ' ci'"),
    (["read"], ["orders"], "c\ni", "invalid key name"),
    (["read"], ["orders"], "x" * 201, "invalid key name"),
    (["read"], ["orders"], 7, "invalid key name 7"),
]


@pytest.mark.parametrize(("scopes", "streams", "name", "message"), BAD_KEYS)
def test_bad_key_inputs_are_refused_and_change_nothing(
    either: Any,
    sql: psycopg.Connection[Any],
    scopes: Any,
    streams: Any,
    name: Any,
    message: str,
) -> None:
    either.create_api_key(["read"], ["orders"])
    before = keys_table(sql)
    with pytest.raises(subengine.InvalidInput, match=re.escape(message)) as raised:
        either.create_api_key(scopes, streams, name=name)
    assert "\n" not in str(raised.value)
    assert keys_table(sql) == before


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("id", "0123456789AB"),
        ("name", ""),
        ("secret_hash", b"short"),
        ("scopes", []),
        ("scopes", ["read", "write"]),
        ("scopes", [None]),
        ("streams", []),
        ("streams", ["**"]),
        ("streams", [None]),
    ],
)
def test_the_table_refuses_rows_the_module_would_refuse(
    sql: psycopg.Connection[Any], column: str, value: Any
) -> None:
    row = {
        "id": "0123456789ab",
        "name": "ci",
        "secret_hash": bytes(32),
        "scopes": ["read"],
        "streams": ["orders*"],
    }
    row[column] = value
    with pytest.raises(psycopg.errors.CheckViolation):
        sql.execute(
            "INSERT INTO subengine.gateway_keys (id, name, secret_hash, scopes, streams)"
            " VALUES (%(id)s, %(name)s, %(secret_hash)s, %(scopes)s::text[], %(streams)s::text[])",
            row,
        )


def test_a_signing_secret_is_made_once_and_kept(
    either: Any, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    secret = either.signing_secret("watch")
    assert isinstance(secret, bytes) and len(secret) == 32
    assert either.signing_secret("watch") == secret
    with subengine.Engine(dsn) as another:
        assert another.signing_secret("watch") == secret
    assert either.signing_secret("webhooks") != secret
    assert [(name, bytes(value)) for name, value, _ in secrets_table(sql)] == [
        ("watch", secret),
        ("webhooks", either.signing_secret("webhooks")),
    ]


def test_two_first_callers_at_once_get_one_signing_secret(dsn: str) -> None:
    # The first caller has inserted but not committed when the second asks: the second
    # waits for it, then must return its secret (not none, not its own).
    queries = SQL("subengine")
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        made = queries.run(first, _api_keys.signing_secret("watch"))
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(queries.run, second, _api_keys.signing_secret("watch"))
            with pytest.raises(TimeoutError):
                waiting.result(timeout=0.5)  # it waits for the first to commit
            first.commit()
            assert waiting.result(timeout=30) == made
        second.commit()
        assert queries.run(second, _api_keys.signing_secret("watch")) == made


def test_a_first_caller_that_rolls_back_leaves_the_secret_to_the_next(dsn: str) -> None:
    queries = SQL("subengine")
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        abandoned = queries.run(first, _api_keys.signing_secret("watch"))
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(queries.run, second, _api_keys.signing_secret("watch"))
            first.rollback()
            made = waiting.result(timeout=30)
        second.commit()
        assert made != abandoned
        assert queries.run(first, _api_keys.signing_secret("watch")) == made


def test_many_engines_asking_at_once_get_one_signing_secret(
    dsn: str, sql: psycopg.Connection[Any]
) -> None:
    callers = 8
    start = threading.Barrier(callers)
    engines = [subengine.Engine(dsn) for _ in range(callers)]
    try:
        for each in engines:
            each.streams()  # connected before the race

        def ask(each: subengine.Engine) -> bytes:
            start.wait()
            return each.signing_secret("watch")

        with ThreadPoolExecutor(callers) as pool:
            got = set(pool.map(ask, engines))
    finally:
        for each in engines:
            each.close()
    assert len(got) == 1
    assert [bytes(value) for _, value, _ in secrets_table(sql)] == list(got)


@pytest.mark.parametrize("name", ["", "Watch", "1watch", "watch-ids", "w" * 64, None])
def test_invalid_secret_names_are_refused_and_change_nothing(
    either: Any, sql: psycopg.Connection[Any], name: Any
) -> None:
    with pytest.raises(subengine.InvalidInput, match="invalid secret name"):
        either.signing_secret(name)
    assert secrets_table(sql) == []


def test_the_async_engine_manages_keys_and_secrets_as_the_sync_one(
    dsn: str, engine: subengine.Engine
) -> None:
    async def scenario() -> set[bytes]:
        async with subengine.AsyncEngine(dsn) as first, subengine.AsyncEngine(dsn) as second:
            assert await first.any_active_api_key() is False
            key, token = await first.create_api_key(["append"], ["orders*"], name="async")
            assert await second.authenticate(token) == key
            assert await second.authenticate(other_secret(token)) is None
            assert await second.authenticate("sek_nonsense") is None
            assert await first.api_keys() == [key]
            assert await first.any_active_api_key() is True
            revoked = await second.revoke_api_key(key.id)
            assert revoked.revoked_at is not None
            assert await first.authenticate(token) is None
            with pytest.raises(subengine.ApiKeyNotFound):
                await first.revoke_api_key("0123456789ab")
            with pytest.raises(subengine.InvalidInput, match="no scope given"):
                await first.create_api_key([], ["orders"])
            asked = (each.signing_secret("watch") for each in (first, second, first, second))
            return set(await asyncio.gather(*asked))

    assert asyncio.run(scenario()) == {engine.signing_secret("watch")}


def test_a_key_change_or_a_lost_listener_moves_the_gateways_cache_version(
    engine: subengine.Engine, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    """What the gateway's key cache trusts: the listener's count of key changes
    (notified in the transaction that changes a key) and of its own connection."""

    async def until(condition: Callable[[], bool]) -> None:
        for _ in range(600):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("timed out")

    async def scenario() -> None:
        async with subengine.AsyncEngine(dsn) as watching:
            changes = watching.listener.watch_changes()
            await until(lambda: changes.listening)
            seen = changes.version
            key, _ = engine.create_api_key(["read"], ["*"])
            await until(lambda: changes.version > seen)
            seen = changes.version
            engine.revoke_api_key(key.id)
            await until(lambda: changes.version > seen)
            seen = changes.version
            sql.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'subengine-tail' AND datname = current_database()"
                " AND pid <> pg_backend_pid()"
            )
            # lost, then back: nothing read before the loss is trusted after it
            await until(lambda: changes.version >= seen + 2 and changes.listening)
            watching.listener.unwatch_changes(changes)
            assert not changes.listening

    asyncio.run(scenario())
