"""keep_unprocessed keeps failed events too (docs/retention.md).

- retention_unhandled(stream, partition): the lowest position of a partition that some
  subscription of the stream has not handled: the position after the lowest of its
  subscriptions' positions, an open dead letter's, or an event of an open parked key
  still waiting. Retention with `keep_unprocessed` keeps it and what follows, up to the
  hard limits, so a dead letter or a parked key can still be retried. Both of the
  pruner's statements (the plan and each batch) ask it.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-28
"""

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
CREATE FUNCTION retention_unhandled(stream_name text, partition_number integer)
RETURNS bigint
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT least(
        (SELECT min(sp.position) + 1
           FROM subscription_positions sp
           JOIN subscriptions sub ON sub.name = sp.subscription
          WHERE sub.stream = stream_name AND sp.partition = partition_number),
        (SELECT min(d.position)
           FROM dead_letters d
           JOIN subscriptions sub ON sub.name = d.subscription
          WHERE sub.stream = stream_name AND d.partition = partition_number
            AND d.resolution IS NULL),
        (SELECT min(pe.position)
           FROM parked_keys pk
           JOIN subscriptions sub ON sub.name = pk.subscription
           JOIN parked_events pe ON pe.parked_key = pk.id
          WHERE sub.stream = stream_name AND pk.partition = partition_number
            AND pk.resolution IS NULL AND pe.resolution IS NULL))
$$;
COMMENT ON FUNCTION retention_unhandled(text, integer) IS
    'The lowest position of a partition some subscription has not handled: past its '
    'position, an open dead letter, or a waiting event of a parked key (NULL: none).';
"""
    )


def downgrade() -> None:
    op.execute("DROP FUNCTION retention_unhandled(text, integer);")
