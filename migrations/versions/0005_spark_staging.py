"""Spark writes: the staging table of task attempts, and the ids their commit derives.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
-- Rows of Spark writes waiting for their write's commit (docs/spark.md, "Exactly once").
-- Every task attempt stages its rows here under an attempt id of its own; the driver's
-- commit appends the rows of the attempts Spark committed, in one transaction, and then
-- deletes the write's rows, those of failed attempts included. UNLOGGED: staging costs no
-- WAL, and a server crash empties the table, which the commit notices (it counts each
-- attempt's rows) and refuses.
CREATE UNLOGGED TABLE spark_staged_events (
    write_id         text NOT NULL,
    batch            bigint NOT NULL,
    attempt          uuid NOT NULL,
    row_number       integer NOT NULL,
    spark_partition  integer NOT NULL,
    content          uuid NOT NULL,
    occurrence       bigint NOT NULL,
    id               uuid,
    key              text NOT NULL,
    type             text NOT NULL,
    data             jsonb NOT NULL,
    metadata         jsonb NOT NULL,
    occurred_at      timestamptz,
    expected_version bigint,
    staged_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (write_id, batch, attempt, row_number)
);
COMMENT ON TABLE spark_staged_events IS
    'Rows staged by Spark write tasks until the write commits; see docs/spark.md.';
COMMENT ON COLUMN spark_staged_events.write_id IS
    'The write: write:<writeId> for a batch write, query:<id> for a streaming query.';
COMMENT ON COLUMN spark_staged_events.batch IS 'The micro-batch of a streaming write; 0 for a batch write.';
COMMENT ON COLUMN spark_staged_events.content IS
    'UUID (version 5) of the write, the micro-batch, the stream and the row''s content.';
COMMENT ON COLUMN spark_staged_events.occurrence IS
    'How many rows of the same content come before this one: in its attempt when staged, in the whole write once the commit numbered them.';
COMMENT ON COLUMN spark_staged_events.id IS 'The row''s own id column; NULL: derived at commit.';

-- The id a Spark write gives the `occurrence`-th row (from 0) of a content: a name-based
-- UUID of version 8 as RFC 9562 shows it: the first 16 bytes of SHA-256 over the 16 bytes
-- of `content` and `occurrence` as 8 big-endian bytes, with the version and variant bits
-- set. One expression of immutable functions, so that the planner inlines it.
CREATE FUNCTION spark_event_id(content uuid, occurrence bigint) RETURNS uuid
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN encode(
    set_byte(
        set_byte(
            substr(sha256(uuid_send(content) || int8send(occurrence)), 1, 16),
            6,
            (get_byte(sha256(uuid_send(content) || int8send(occurrence)), 6) & 15) | 128),
        8,
        (get_byte(sha256(uuid_send(content) || int8send(occurrence)), 8) & 63) | 128),
    'hex')::uuid;
"""
    )


def downgrade() -> None:
    op.execute(
        """
DROP FUNCTION spark_event_id(uuid, bigint);
DROP TABLE spark_staged_events;
"""
    )
