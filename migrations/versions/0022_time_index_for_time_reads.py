"""The index of events by time serves reads by time only.

- events_recorded_at (stream, recorded_at) is now partial, `WHERE recorded_at IS NOT
  NULL`: it still holds every event (the column is NOT NULL) and still serves every read
  that asks by time (a comparison on recorded_at implies the predicate), but the planner
  can no longer take it for a read by position, which asks for the stream alone. It did
  when the statistics predate a stream: a stream that was not there when the table was
  last analysed is estimated at one row, the time index looked as cheap as the primary
  key, and each batch of that stream read every one of its events to keep a few (2 to
  15 ms a batch at 20,000 events, growing with the stream). On a large table the
  statistics may stay that old for good: adding a stream grows it too little to analyse
  it again.

The new index is built under another name before the old one is dropped: while it builds
(it reads the whole table once), appends wait and reads go on; the old one's drop and the
rename then lock the table until the upgrade commits, which is the moment it takes.

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-29
"""

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
CREATE INDEX events_recorded_at_0022 ON events (stream, recorded_at)
    WHERE recorded_at IS NOT NULL;
DROP INDEX events_recorded_at;
ALTER INDEX events_recorded_at_0022 RENAME TO events_recorded_at;
"""
    )


def downgrade() -> None:
    op.execute(
        """
CREATE INDEX events_recorded_at_0021 ON events (stream, recorded_at);
DROP INDEX events_recorded_at;
ALTER INDEX events_recorded_at_0021 RENAME TO events_recorded_at;
"""
    )
