"""Work a worker can find without scanning every (subscription, partition): next_time kept
by every writer of a position, and an index of the rows that have work.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
-- The time of the next event a subscription standing at `after` in a partition has to
-- handle: the occurred_at of the first event stored after it or, when the partition's
-- head is past it but none of those events is stored any more, the head's time (the
-- worker must still come and report them). NULL when nothing is after it.
CREATE FUNCTION next_event_time(stream_name text, partition_number integer, after bigint)
RETURNS timestamptz
LANGUAGE sql STABLE STRICT PARALLEL SAFE
RETURN coalesce(
    (SELECT e.occurred_at FROM events e
      WHERE e.stream = stream_name AND e.partition = partition_number AND e.position > after
      ORDER BY e.position
      LIMIT 1),
    (SELECT p.head_time FROM partitions p
      WHERE p.stream = stream_name AND p.partition = partition_number AND p.head > after));

-- Every statement that moves a position sets next_time with it, so a row with events
-- after its position has a next_time unless events were appended since its last write.
-- Those appends are what workers track (notifications, heads); everything else a worker
-- finds through this index, oldest first, touching only the rows with work.
CREATE INDEX subscription_positions_work ON subscription_positions (subscription, next_time)
 WHERE next_time IS NOT NULL AND NOT stopped;

UPDATE subscription_positions sp
   SET next_time = next_event_time(s.stream, sp.partition, sp.position)
  FROM subscriptions s
 WHERE s.name = sp.subscription
   AND next_time IS DISTINCT FROM next_event_time(s.stream, sp.partition, sp.position);

COMMENT ON COLUMN subscription_positions.next_time IS
    'When the row was last written: the time of the next event after position (next_event_time), NULL when there was none. Workers take the oldest first.';
"""
    )


def downgrade() -> None:
    op.execute(
        """
COMMENT ON COLUMN subscription_positions.next_time IS
    'occurred_at of the event after position, when known: workers take the oldest first.';
DROP INDEX subscription_positions_work;
DROP FUNCTION next_event_time(text, integer, bigint);
"""
    )
