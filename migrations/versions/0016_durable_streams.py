"""The gateway's Durable Streams surface (docs/durable-streams.md): its catalog of streams,
their idempotent producers, the bytes of their byte messages, and the engine streams
that deleted ones leave to remove.

- durable_streams: one row per Durable Streams stream, under its URL path: the engine
  stream it is (one partition, a generated name, so that a path deleted and created
  again is a new engine stream at once), its content type, TTL or Expires-At and the
  deadline they give (`deadline`, moved by every read or write of a TTL stream), the
  position of its last message (`tail`), its closed state and which producer request
  closed it, and the last Stream-Seq. The row is locked by every append, so appends
  to one stream, and the checks of their producers, are serialised.
- durable_stream_producers: per (engine stream, Producer-Id) the epoch and the last
  accepted Producer-Seq, written in the transaction of the append they accepted.
- durable_stream_bytes: the bytes of each message of a byte stream (any content type
  but application/json), byte for byte, at the position of its event. The event's
  jsonb data says only how long it is: jsonb cannot hold arbitrary bytes (NUL, invalid
  UTF-8), and base64 text in it would be a third larger and no longer the bytes.
- durable_stream_garbage: engine streams of deleted or expired Durable Streams streams,
  which the gateway deletes (in batches, as `subengine stream delete` does) after the
  catalog row went, and deletes again if it was interrupted.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
CREATE TABLE durable_streams (
    path               text PRIMARY KEY CHECK (char_length(path) BETWEEN 1 AND 2000),
    stream             text NOT NULL UNIQUE,
    content_type       text NOT NULL CHECK (char_length(content_type) BETWEEN 1 AND 255),
    ttl_seconds        bigint CHECK (ttl_seconds >= 0),
    expires_at         timestamptz,
    deadline           timestamptz,
    tail               bigint NOT NULL DEFAULT 0 CHECK (tail >= 0),
    closed             boolean NOT NULL DEFAULT false,
    closed_by_producer text,
    closed_by_epoch    bigint,
    closed_by_seq      bigint,
    last_seq           text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    CHECK (ttl_seconds IS NULL OR expires_at IS NULL)
);
CREATE INDEX durable_streams_deadline ON durable_streams (deadline) WHERE deadline IS NOT NULL;
COMMENT ON TABLE durable_streams IS
    'Durable Streams streams of the gateway, by URL path; each is a one-partition engine stream.';
COMMENT ON COLUMN durable_streams.tail IS
    'Position of the last message (0: none); a close marker event may follow it.';
COMMENT ON COLUMN durable_streams.deadline IS
    'When the stream expires: Expires-At, or the last access plus its TTL (NULL: never).';

CREATE TABLE durable_stream_producers (
    stream   text NOT NULL REFERENCES durable_streams (stream) ON DELETE CASCADE,
    producer text NOT NULL CHECK (char_length(producer) BETWEEN 1 AND 1000),
    epoch    bigint NOT NULL CHECK (epoch >= 0),
    seq      bigint NOT NULL CHECK (seq >= 0),
    PRIMARY KEY (stream, producer)
);
COMMENT ON TABLE durable_stream_producers IS
    'Idempotent producers of Durable Streams streams: epoch and last accepted sequence.';

CREATE TABLE durable_stream_bytes (
    stream     text NOT NULL,
    "position" bigint NOT NULL,
    body       bytea NOT NULL,
    PRIMARY KEY (stream, "position")
);
COMMENT ON TABLE durable_stream_bytes IS
    'The bytes of the messages of Durable Streams byte streams, at their events'' positions.';

CREATE TABLE durable_stream_garbage (
    stream     text PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE durable_stream_garbage IS
    'Engine streams of deleted Durable Streams streams, still to delete.';
"""
    )


def downgrade() -> None:
    op.execute(
        "DROP TABLE durable_stream_garbage, durable_stream_bytes, durable_stream_producers, "
        "durable_streams"
    )
