"""API keys of the HTTP gateway, and the secrets it signs with (DESIGN.md, "The gateway").

A key's token, "sek_<id>_<secret>", is shown once, when the key is created; the database
keeps the SHA-256 of its secret part, the key's scopes and the stream patterns it may
touch. Nothing here logs, and no error message quotes a token or a secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar

from subengine.db._sql import Query, Result, Row, first_row
from subengine.model._errors import ApiKeyNotFound, InvalidInput, SubengineError
from subengine.model._names import shown_value, validate_stream_name

SCOPES = frozenset({"read", "append", "admin", "consume"})
EVERY_STREAM = "*"
TOKEN_PREFIX = "sek_"
KEY_ID = re.compile(r"[0-9a-f]{12}")
KEY_ID_BYTES = 6
SECRET_BYTES = 32
# base64url of SECRET_BYTES bytes without padding: 43 characters.
SECRET_TEXT = re.compile(r"[A-Za-z0-9_\-]{43}")
TOKEN = re.compile(rf"{TOKEN_PREFIX}({KEY_ID.pattern})_({SECRET_TEXT.pattern})")
MAX_NAME_LENGTH = 200
MAX_PATTERNS = 100
SECRET_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")

_KEY_COLUMNS = 6  # id, name, scopes, streams, created_at, revoked_at


@dataclass(frozen=True)
class ApiKey:
    """An API key of the gateway, as stored (never its secret): what it may do
    (`scopes`: read, append, admin, consume) to which streams (`streams`: patterns, each a stream
    name, a prefix ending in '*', or '*' for every stream). A key that is not revoked is
    the principal a request with its token acts as."""

    SCOPES: ClassVar[frozenset[str]] = SCOPES

    id: str
    name: str | None
    scopes: tuple[str, ...]
    streams: tuple[str, ...]
    created_at: datetime
    revoked_at: datetime | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def allows(self, stream: str, scope: str) -> bool:
        """Whether this key may do `scope` to `stream`: it is not revoked, it has the
        scope, and one of its patterns matches the stream. Raises InvalidInput for a
        scope that does not exist (a typo must not read as a refusal)."""
        if scope not in SCOPES:
            raise InvalidInput(f"unknown scope {_shown(scope)}: use {_scope_list()}")
        if self.revoked or scope not in self.scopes:
            return False
        return any(_matches(pattern, stream) for pattern in self.streams)


def _matches(pattern: str, stream: str) -> bool:
    if pattern == EVERY_STREAM:
        return True
    if pattern.endswith("*"):
        return stream.startswith(pattern[:-1])
    return stream == pattern


def _scope_list() -> str:
    return ", ".join(sorted(SCOPES))


def _holds_token(value: object) -> bool:
    return isinstance(value, str) and TOKEN.search(value) is not None


def _shown(value: object) -> str:
    """`value` as an error message quotes it, unless it holds a token: an argument given
    in the wrong place must not carry a secret into a log."""
    return "(not shown: it holds an API token)" if _holds_token(value) else shown_value(value)


def _refuse_token(value: object, what: str) -> None:
    if _holds_token(value):
        raise InvalidInput(
            f"the {what} given holds an API token (not shown); a token is a secret: keep it "
            "out of names and patterns"
        )


def _key(row: Row) -> ApiKey:
    key_id, name, scopes, streams, created_at, revoked_at = row[:_KEY_COLUMNS]
    return ApiKey(key_id, name, tuple(scopes), tuple(streams), created_at, revoked_at)


def _collection(value: object, what: str) -> list[object]:
    """`value` as a list, refusing a lone string (which would iterate as characters)."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidInput(f"{what} must be a list of strings, not a {type(value).__name__}")
    return list(value)


def validate_scopes(scopes: object) -> list[str]:
    """The scopes, sorted and without repeats; InvalidInput unless they are a non-empty
    collection of read, append, admin and consume."""
    given = _collection(scopes, "scopes")
    if not given:
        raise InvalidInput(f"no scope given: give one or more of {_scope_list()}")
    chosen: set[str] = set()
    for scope in given:
        if not isinstance(scope, str) or scope not in SCOPES:
            raise InvalidInput(f"unknown scope {_shown(scope)}: use {_scope_list()}")
        chosen.add(scope)
    return sorted(chosen)


def validate_stream_pattern(pattern: object) -> str:
    """A stream pattern: '*', a stream name, or a stream name followed by '*'."""
    _refuse_token(pattern, "stream pattern")
    if isinstance(pattern, str):
        if pattern == EVERY_STREAM:
            return pattern
        try:
            validate_stream_name(pattern.removesuffix("*"))
        except InvalidInput:
            pass
        else:
            return pattern
    raise InvalidInput(
        f"invalid stream pattern {_shown(pattern)}: use a stream name ('orders'), a "
        "prefix of one followed by '*' ('orders*'), or '*' for every stream"
    )


def validate_stream_patterns(patterns: object) -> list[str]:
    """The patterns in the order given, without repeats; InvalidInput unless they are a
    non-empty collection of valid patterns."""
    given = _collection(patterns, "stream patterns")
    if not given:
        raise InvalidInput("no stream pattern given: give one or more ('orders', 'orders*', '*')")
    if len(given) > MAX_PATTERNS:
        raise InvalidInput(
            f"{len(given)} stream patterns given: a key takes at most {MAX_PATTERNS}"
        )
    return list(dict.fromkeys(validate_stream_pattern(pattern) for pattern in given))


def validate_key_name(name: object) -> str | None:
    """A key's name (None: no name): 1 to MAX_NAME_LENGTH printable characters."""
    if name is None:
        return None
    _refuse_token(name, "key name")
    if (
        not isinstance(name, str)
        or not name
        or len(name) > MAX_NAME_LENGTH
        or not name.isprintable()
        or name.strip() != name
    ):
        raise InvalidInput(
            f"invalid key name {_shown(name)}: use 1 to {MAX_NAME_LENGTH} printable "
            "characters without leading or trailing spaces"
        )
    return name


def validate_key_id(key_id: object) -> str:
    """A key id: 12 lower-case hexadecimal characters. The message never quotes what was
    given: it may be a token pasted in the wrong place."""
    if isinstance(key_id, str) and KEY_ID.fullmatch(key_id):
        return key_id
    if isinstance(key_id, str) and key_id.startswith(TOKEN_PREFIX):
        raise InvalidInput(
            "that is a token, not a key id: the id is the 12 characters after 'sek_' "
            "(`subengine gateway key list` shows the ids)"
        )
    raise InvalidInput(
        "invalid API key id: use the 12 lower-case hexadecimal characters "
        "`subengine gateway key list` shows"
    )


def _secret_hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("ascii")).digest()


def create_key(
    name: str | None, scopes: Iterable[str], streams: Iterable[str]
) -> Query[tuple[ApiKey, str]]:
    """Store a new key (validated first) with a random id and secret; the key and its
    token, which only this call ever sees."""
    params: dict[str, object] = {
        "name": validate_key_name(name),
        "scopes": validate_scopes(scopes),
        "streams": validate_stream_patterns(streams),
        "id": secrets.token_hex(KEY_ID_BYTES),
    }
    secret = base64.urlsafe_b64encode(secrets.token_bytes(SECRET_BYTES)).rstrip(b"=").decode()
    params["secret_hash"] = _secret_hash(secret)

    def read(result: Result) -> tuple[ApiKey, str]:
        if not result.rows:
            # 1 chance in 2**48 per key stored: not worth a second draw in here
            raise SubengineError(
                "the random id drawn for the key is taken; nothing was stored: try again"
            )
        key = _key(result.rows[0])
        return key, f"{TOKEN_PREFIX}{key.id}_{secret}"

    return Query("create_gateway_key", params, read)


def list_keys() -> Query[list[ApiKey]]:
    """Every API key, revoked ones included, oldest first."""
    return Query("list_gateway_keys", {}, lambda result: [_key(row) for row in result.rows])


def revoke_key(key_id: str) -> Query[ApiKey]:
    """Revoke a key (a revoked key stays revoked, at its first revocation time); the key.
    ApiKeyNotFound when no key has that id."""
    validate_key_id(key_id)

    def read(result: Result) -> ApiKey:
        if not result.rows:
            raise ApiKeyNotFound(key_id)
        return _key(result.rows[0])

    return Query("revoke_gateway_key", {"id": key_id}, read)


def authenticate(token: object) -> Query[ApiKey | None] | None:
    """The query that finds the key of `token` (None when it is unknown, revoked or its
    secret is wrong), or None at once when the token is malformed. Never raises on a bad
    token, and never quotes it."""
    if not isinstance(token, str):
        return None
    parsed = TOKEN.fullmatch(token)
    if parsed is None:
        return None
    key_id, secret = parsed.groups()
    expected = _secret_hash(secret)

    def read(result: Result) -> ApiKey | None:
        if not result.rows:
            return None
        row = result.rows[0]
        # compare_digest: the time taken says nothing of how much of the hash matched
        if not hmac.compare_digest(bytes(row[_KEY_COLUMNS]), expected):
            return None
        key = _key(row)
        return None if key.revoked else key

    return Query("gateway_key_for_token", {"id": key_id}, read)


def any_active_key() -> Query[bool]:
    """Whether any API key is not revoked (without one, the gateway runs open)."""

    def read(result: Result) -> bool:
        row = first_row(result)
        return bool(row and row[0])

    return Query("any_active_gateway_key", {}, read)


def validate_secret_name(name: object) -> str:
    if not isinstance(name, str) or SECRET_NAME.fullmatch(name) is None:
        raise InvalidInput(
            f"invalid secret name {_shown(name)}: use 1 to 63 lower-case letters, "
            "digits and '_', starting with a letter"
        )
    return name


def signing_secret(name: str) -> Query[bytes]:
    """The signing secret `name` (SECRET_BYTES random bytes), made by the first caller
    and the same for every caller after, however many ask at once."""
    params = {"name": validate_secret_name(name), "secret": secrets.token_bytes(SECRET_BYTES)}

    def read(result: Result) -> bytes:
        row = first_row(result)
        if row is None:  # the statement always gives a row; a change to it must too
            raise SubengineError(f"signing secret {name!r} was neither found nor stored")
        return bytes(row[0])

    return Query("gateway_signing_secret", params, read)
