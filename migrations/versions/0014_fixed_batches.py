"""A retried batch is the same batch (DESIGN.md, "A retry is the same batch").

- subscription_positions.batch_through: the last position of an at_least_once batch that
  was read and has not committed yet. The batch's bounds are stored when it is first read,
  in the transaction that reads it, before any handler runs: until its position commits,
  every later read of that partition's next batch (a retry after RetryLater, a failure, a
  crash of the process that sent it, from any process) ends there, however many events
  were appended meanwhile. So a webhook batch, whose webhook-id derives from its bounds,
  keeps its id and its events. Moving the position clears it; a reset clears it.
- webhooks.paused: an operator paused the webhook (`subengine webhook pause`): its engine
  subscriptions are paused with it, so no batch of it is taken, its positions stay, and
  no challenge is sent; its failure timeout waits. webhook_status shows it.

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

ALTER TABLE webhooks ADD COLUMN paused boolean NOT NULL DEFAULT false;
COMMENT ON COLUMN webhooks.paused IS
    'Paused by an operator: nothing is delivered (its engine subscriptions are paused too).';

CREATE OR REPLACE VIEW webhook_status AS
SELECT w.id, w.state, w.callback,
       ARRAY(SELECT s ->> 'stream' FROM jsonb_array_elements(w.streams) s) AS streams,
       w.created_at, w.expires_at, w.state_changed_at, w.verified_at, w.last_attempt_at,
       w.last_success_at, w.failing_since, w.attempts, w.delivered, w.last_error,
       (SELECT coalesce(sum(greatest(p.head - sp.position, 0)), 0)::bigint
          FROM subscriptions sub
          JOIN subscription_positions sp ON sp.subscription = sub.name
          JOIN partitions p ON p.stream = sub.stream AND p.partition = sp.partition
         -- the pattern filters the subscriptions (a row each), whose positions are then
         -- found by their key; on the positions' key it would match every position
         WHERE sub.name LIKE 'webhook.' || w.serial || '.%') AS lag,
       w.paused
  FROM webhooks w;
"""
    )


def downgrade() -> None:
    op.execute(
        """
DROP VIEW webhook_status;
CREATE VIEW webhook_status AS
SELECT w.id, w.state, w.callback,
       ARRAY(SELECT s ->> 'stream' FROM jsonb_array_elements(w.streams) s) AS streams,
       w.created_at, w.expires_at, w.state_changed_at, w.verified_at, w.last_attempt_at,
       w.last_success_at, w.failing_since, w.attempts, w.delivered, w.last_error,
       (SELECT coalesce(sum(greatest(p.head - sp.position, 0)), 0)::bigint
          FROM subscriptions sub
          JOIN subscription_positions sp ON sp.subscription = sub.name
          JOIN partitions p ON p.stream = sub.stream AND p.partition = sp.partition
         WHERE sub.name LIKE 'webhook.' || w.serial || '.%') AS lag
  FROM webhooks w;
COMMENT ON VIEW webhook_status IS
    'Each webhook subscription: state, last delivery, failed attempts and lag in events.';
ALTER TABLE webhooks DROP COLUMN paused;
"""
    )
    op.execute("ALTER TABLE subscription_positions DROP COLUMN batch_through;")
