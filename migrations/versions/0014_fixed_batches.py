"""A retried batch is the same batch (DESIGN.md, "A retry is the same batch").

- subscription_positions.batch_through: the last position of an at_least_once batch that
  was read and has not committed yet. The batch's bounds are stored when it is first read,
  in the transaction that reads it, before any handler runs: until its position commits,
  every later read of that partition's next batch (a retry after RetryLater, a failure, a
  crash of the process that sent it, from any process) ends there, however many events
  were appended meanwhile. So a webhook batch, whose webhook-id derives from its bounds,
  keeps its id and its events. Moving the position clears it; a reset clears it.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
ALTER TABLE subscription_positions ADD COLUMN batch_through bigint;
COMMENT ON COLUMN subscription_positions.batch_through IS
    'The last position of an at_least_once batch read and not committed yet: a retry of '
    'the partition''s next batch ends there (the same batch). Ignored unless above position.';
"""
    )


def downgrade() -> None:
    op.execute("ALTER TABLE subscription_positions DROP COLUMN batch_through;")
