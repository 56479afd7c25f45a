"""Tombstones say why a range was removed (seed 002: cap, ttl or mixed).

- partitions.aged_through, partitions.capped_through: the highest position the pruner
  removed while its age limit (max_age, hard_max_age) or its count limit (max_events,
  hard_max_events) wanted it gone, 0 for none. Events go oldest first, so the positions
  either limit removed are a prefix of the partition: a gap from position f on was
  (partly) aged out when f <= aged_through, and (partly) capped when f <= capped_through.
  That is exact for the very range a reader misses, whatever runs removed it. Ranges
  removed before this revision are in neither (their reason is unknown: "retention").

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
ALTER TABLE partitions
    ADD COLUMN aged_through bigint NOT NULL DEFAULT 0,
    ADD COLUMN capped_through bigint NOT NULL DEFAULT 0;
COMMENT ON COLUMN partitions.aged_through IS
    'The highest position retention removed while its age limit wanted it gone (0: none).';
COMMENT ON COLUMN partitions.capped_through IS
    'The highest position retention removed while its count limit wanted it gone (0: none).';
"""
    )


def downgrade() -> None:
    op.execute("ALTER TABLE partitions DROP COLUMN aged_through, DROP COLUMN capped_through")
