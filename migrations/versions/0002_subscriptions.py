"""Subscriptions, their per-partition positions, dead letters and workers.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
-- A named consumer of one stream. `start` is where it began (beginning, end, a time or a
-- map of positions) and, with `stream`, what a later run must agree with. `generation`
-- is bumped by every reset: the fencing token of the position compare-and-set.
CREATE TABLE subscriptions (
    name        text PRIMARY KEY
                CONSTRAINT subscription_name_is_valid CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$'),
    stream      text NOT NULL REFERENCES streams (name),
    start       jsonb NOT NULL,
    generation  bigint NOT NULL DEFAULT 1 CHECK (generation >= 1),
    paused      boolean NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- The subscription-state table: per (subscription, partition) the last position whose
-- effects are committed. Workers update it with a compare-and-set on (position,
-- generation) in the same transaction as the handlers' writes (DESIGN.md invariants 2, 3).
CREATE TABLE subscription_positions (
    subscription  text NOT NULL REFERENCES subscriptions (name) ON DELETE CASCADE,
    partition     integer NOT NULL CHECK (partition >= 0),
    position      bigint NOT NULL CHECK (position >= 0),
    generation    bigint NOT NULL CHECK (generation >= 1),
    next_time     timestamptz,
    attempts      integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error    text,
    stopped       boolean NOT NULL DEFAULT false,
    retry_at      timestamptz,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscription, partition)
);
COMMENT ON COLUMN subscription_positions.next_time IS
    'occurred_at of the event after position, when known: workers take the oldest first.';

CREATE TABLE dead_letters (
    subscription  text NOT NULL REFERENCES subscriptions (name) ON DELETE CASCADE,
    partition     integer NOT NULL,
    position      bigint NOT NULL,
    event_id      uuid NOT NULL,
    error         text NOT NULL,
    attempts      integer NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscription, partition, position)
);

-- For inspection only: correctness never depends on this table.
CREATE TABLE workers (
    id             uuid PRIMARY KEY,
    host           text NOT NULL,
    pid            integer NOT NULL,
    subscriptions  text[] NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now(),
    heartbeat_at   timestamptz NOT NULL DEFAULT now()
);
"""
    )


def downgrade() -> None:
    op.execute(
        """
DROP TABLE workers;
DROP TABLE dead_letters;
DROP TABLE subscription_positions;
DROP TABLE subscriptions;
"""
    )
