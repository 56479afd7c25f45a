"""The HTTP gateway's API keys and signing secrets.

- gateway_keys: one row per API key. The token ("sek_<id>_<secret>") is shown once, when
  the key is created; the table keeps only the SHA-256 of its secret part, the key's
  scopes and the stream patterns it may touch. A revoked key keeps its row (revoked_at
  set), so the list of keys shows what was revoked and when.
- gateway_secrets: named random secrets the gateway signs with (watch ids: 'watch'),
  made by the first gateway that asks and shared by every gateway of the schema.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
-- Whether every element of `patterns` is a stream pattern: '*' (every stream), a stream
-- name (that stream), or a stream name followed by '*' (the streams it begins). Stream
-- names follow subengine.model._names.STREAM_NAME. NULL elements are not patterns.
CREATE FUNCTION valid_stream_patterns(patterns text[]) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN NOT EXISTS (
    SELECT FROM unnest(patterns) AS p
     WHERE p IS NULL OR p !~ '^(\*|[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}\*?)$'
);

CREATE TABLE gateway_keys (
    id           text PRIMARY KEY CHECK (id ~ '^[0-9a-f]{12}$'),
    name         text CHECK (char_length(name) BETWEEN 1 AND 200),
    secret_hash  bytea NOT NULL CHECK (octet_length(secret_hash) = 32),
    scopes       text[] NOT NULL CHECK (
                     cardinality(scopes) > 0
                     AND array_position(scopes, NULL) IS NULL
                     AND scopes <@ ARRAY['read', 'append', 'admin']),
    streams      text[] NOT NULL CHECK (
                     cardinality(streams) > 0 AND valid_stream_patterns(streams)),
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz CHECK (revoked_at >= created_at)
);
COMMENT ON TABLE gateway_keys IS
    'API keys of the HTTP gateway: the SHA-256 of each secret, never the secret.';
COMMENT ON COLUMN gateway_keys.secret_hash IS
    'SHA-256 of the secret part of the token sek_<id>_<secret>.';
COMMENT ON COLUMN gateway_keys.streams IS
    'Stream patterns: a stream name, a prefix ending in *, or * for every stream.';

CREATE TABLE gateway_secrets (
    name        text PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_]{0,62}$'),
    secret      bytea NOT NULL CHECK (octet_length(secret) >= 32),
    created_at  timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE gateway_secrets IS
    'Random secrets the gateway signs with (e.g. watch ids), shared by all its processes.';
"""
    )


def downgrade() -> None:
    op.execute(
        """
DROP TABLE gateway_secrets;
DROP TABLE gateway_keys;
DROP FUNCTION valid_stream_patterns(text[]);
"""
    )
