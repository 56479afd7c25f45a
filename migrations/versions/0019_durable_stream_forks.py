"""Forks of Durable Streams streams (issue 32; docs/durable-streams.md, "Forks").

- durable_streams.source, forked_from, fork_offset, fork_sub_offset, fork_point: a fork's
  source (its engine stream, a foreign key: a source's row cannot go while a fork names
  it), the source's path, Stream-Fork-Offset and Stream-Fork-Sub-Offset as asked (a PUT
  asking for the same fork again is answered 200), and the fork point: the fork
  inherits its source's messages up to that position and numbers its own on from it.
- durable_streams.deleted_at: a stream deleted while forks read it is deleted softly:
  its row (so its path, which answers 410) and its engine stream stay until the last
  fork is gone.
- durable_stream_inherited: the ranges a fork reads from other engine streams, nothing
  copied: positions after..upto of its source, and of what its source inherits (so a
  read never walks the chain), the last message cut to `cut` bytes when the fork point
  is inside a byte message.
- retention_hold(stream, partition, wait): the lowest position of a partition that a
  fork (not deleted softly) still reads, or NULL: retention keeps it and what follows.
  With `wait` it first takes, exclusively, the lock that a fork's creation holds shared
  on the engine streams it inherits from (durable_stream_pin), and reads the forks in a
  snapshot of its own (a VOLATILE function's statements each take one): a fork created
  while a pruning batch decided is seen by it, or waited for.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-29
"""

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
ALTER TABLE durable_streams
    ADD COLUMN deleted_at      timestamptz,
    ADD COLUMN source          text REFERENCES durable_streams (stream),
    ADD COLUMN forked_from     text,
    ADD COLUMN fork_offset     text,
    ADD COLUMN fork_sub_offset bigint CHECK (fork_sub_offset >= 0),
    ADD COLUMN fork_point      bigint CHECK (fork_point >= 0),
    ADD CONSTRAINT durable_streams_fork_is_whole CHECK (
        (source IS NULL) = (forked_from IS NULL)
        AND (source IS NULL) = (fork_offset IS NULL)
        AND (source IS NULL) = (fork_sub_offset IS NULL)
        AND (source IS NULL) = (fork_point IS NULL));
CREATE INDEX durable_streams_source ON durable_streams (source) WHERE source IS NOT NULL;
COMMENT ON COLUMN durable_streams.deleted_at IS
    'When it was deleted while forks read it (deleted softly: kept until they are gone).';
COMMENT ON COLUMN durable_streams.source IS
    'The engine stream of the stream this one forks (NULL: not a fork).';
COMMENT ON COLUMN durable_streams.fork_point IS
    'A fork inherits its source''s messages up to this position; its own follow it.';

CREATE TABLE durable_stream_inherited (
    stream text NOT NULL REFERENCES durable_streams (stream) ON DELETE CASCADE,
    source text NOT NULL REFERENCES durable_streams (stream),
    after  bigint NOT NULL CHECK (after >= 0),
    upto   bigint NOT NULL,
    cut    bigint CHECK (cut >= 0),
    PRIMARY KEY (stream, upto),
    CHECK (upto > after)
);
CREATE INDEX durable_stream_inherited_source ON durable_stream_inherited (source);
COMMENT ON TABLE durable_stream_inherited IS
    'What forks read of other engine streams: positions after..upto (the last one cut to '
    '`cut` bytes when not NULL).';

CREATE FUNCTION durable_stream_pin(stream_name text) RETURNS void
LANGUAGE sql VOLATILE
SET search_path FROM CURRENT
AS $$
    SELECT pg_advisory_xact_lock_shared(
        hashtext('subengine durable stream fork ' || current_schema()), hashtext(stream_name))
$$;

CREATE FUNCTION retention_hold(stream_name text, partition_number integer, wait boolean)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    held bigint;
BEGIN
    IF partition_number <> 0
       OR NOT EXISTS (SELECT 1 FROM durable_streams d WHERE d.stream = stream_name) THEN
        RETURN NULL;  -- no Durable Streams stream, so no fork's source
    END IF;
    IF wait THEN
        PERFORM pg_advisory_xact_lock(
            hashtext('subengine durable stream fork ' || current_schema()),
            hashtext(stream_name));
    END IF;
    SELECT min(i.after) + 1 INTO held
      FROM durable_stream_inherited i
      JOIN durable_streams f ON f.stream = i.stream
     WHERE i.source = stream_name AND f.deleted_at IS NULL;
    RETURN held;
END
$$;
COMMENT ON FUNCTION retention_hold(text, integer, boolean) IS
    'The lowest position of a partition a Durable Streams fork still reads (NULL: none).';
"""
    )


def downgrade() -> None:
    op.execute(
        """
DROP FUNCTION retention_hold(text, integer, boolean);
DROP FUNCTION durable_stream_pin(text);
DROP TABLE durable_stream_inherited;
ALTER TABLE durable_streams
    DROP CONSTRAINT durable_streams_fork_is_whole,
    DROP COLUMN fork_point,
    DROP COLUMN fork_sub_offset,
    DROP COLUMN fork_offset,
    DROP COLUMN forked_from,
    DROP COLUMN source,
    DROP COLUMN deleted_at;
"""
    )
