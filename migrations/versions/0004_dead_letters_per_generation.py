"""Dead letters per generation: a rebuilt subscription records a repeated failure again.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
-- A reset replays events; a poison event then fails again in the new generation. Each
-- generation's dead letter is its own row. Only one dead letter of an event is open
-- (unresolved) at a time: recording a new one marks older open ones 'superseded'.
ALTER TABLE dead_letters ADD COLUMN generation bigint;
UPDATE dead_letters d SET generation = sp.generation
  FROM subscription_positions sp
 WHERE sp.subscription = d.subscription AND sp.partition = d.partition;
UPDATE dead_letters SET generation = 1 WHERE generation IS NULL;
ALTER TABLE dead_letters
    ALTER COLUMN generation SET NOT NULL,
    ADD CONSTRAINT dead_letters_generation_check CHECK (generation >= 1),
    DROP CONSTRAINT dead_letters_pkey,
    ADD PRIMARY KEY (subscription, partition, position, generation),
    DROP CONSTRAINT dead_letters_resolution_check,
    ADD CONSTRAINT dead_letters_resolution_check
        CHECK (resolution IN ('retried', 'discarded', 'superseded'));
CREATE UNIQUE INDEX dead_letters_one_open ON dead_letters (subscription, partition, position)
 WHERE resolution IS NULL;
"""
    )


def downgrade() -> None:
    op.execute(
        """
DROP INDEX dead_letters_one_open;
DELETE FROM dead_letters d
 WHERE EXISTS (SELECT FROM dead_letters n
                WHERE (n.subscription, n.partition, n.position)
                      = (d.subscription, d.partition, d.position)
                  AND n.generation > d.generation);
ALTER TABLE dead_letters
    DROP CONSTRAINT dead_letters_resolution_check,
    ADD CONSTRAINT dead_letters_resolution_check CHECK (resolution IN ('retried', 'discarded')),
    DROP CONSTRAINT dead_letters_pkey,
    ADD PRIMARY KEY (subscription, partition, position),
    DROP COLUMN generation;
"""
    )
