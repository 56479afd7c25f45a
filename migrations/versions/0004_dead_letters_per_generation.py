"""Dead letters per generation (a rebuilt subscription records a repeated failure again),
and which workers serve metrics.

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
-- Rows from before are put in generation 1, whatever generation their partition is at
-- now: a replay that fails on the event again then records a row of its own (an event is
-- dead-lettered at most once per generation, and comes round again only in a later one).
ALTER TABLE dead_letters ADD COLUMN generation bigint NOT NULL DEFAULT 1;
ALTER TABLE dead_letters
    ALTER COLUMN generation DROP DEFAULT,
    ADD CONSTRAINT dead_letters_generation_check CHECK (generation >= 1),
    DROP CONSTRAINT dead_letters_pkey,
    ADD PRIMARY KEY (subscription, partition, position, generation),
    DROP CONSTRAINT dead_letters_resolution_check,
    ADD CONSTRAINT dead_letters_resolution_check
        CHECK (resolution IN ('retried', 'discarded', 'superseded'));
CREATE UNIQUE INDEX dead_letters_one_open ON dead_letters (subscription, partition, position)
 WHERE resolution IS NULL;

-- Whether a worker serves Prometheus metrics: the lag gauges of a subscription are
-- exported by one of the connected workers that do.
ALTER TABLE workers ADD COLUMN serves_metrics boolean NOT NULL DEFAULT false;
"""
    )


def downgrade() -> None:
    op.execute(
        """
ALTER TABLE workers DROP COLUMN serves_metrics;
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
