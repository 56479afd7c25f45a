"""Remote workers (issue 30; docs/remote-workers.md): leases on partitions of a
subscription, taken over HTTP.

- remote_leases: one row per lease. A live lease (ended_at NULL) holds one partition of
  a subscription until its deadline; at most one live lease per partition. It names the
  batch it carries: the position it starts after and its generation (the compare-and-set
  of its ack), its last position `through`, the tombstone of a gap it carries instead of
  events, and the events of parked keys it left out. The position row's retry_at holds
  the same deadline, so every local worker, which already waits for retry_at, skips a
  leased partition, and an expired lease frees it without anyone acting. Ended leases
  stay a while, so a late ack is told 409 (it ended) rather than 404 (never existed).
- remote_policies: the error policy a nack counts attempts toward, per subscription
  (local workers have theirs in their declarations; a remote worker's process has none).
- gateway_keys.scopes may hold 'consume': a key that may take leases.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-28
"""

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
ALTER TABLE gateway_keys DROP CONSTRAINT gateway_keys_scopes_check;
ALTER TABLE gateway_keys ADD CONSTRAINT gateway_keys_scopes_check
    CHECK (cardinality(scopes) > 0 AND array_position(scopes, NULL) IS NULL
           AND scopes <@ ARRAY['read', 'append', 'admin', 'consume']);

CREATE TABLE remote_leases (
    id           uuid PRIMARY KEY,
    subscription text NOT NULL REFERENCES subscriptions (name) ON DELETE CASCADE,
    partition    integer NOT NULL CHECK (partition >= 0),
    worker       text NOT NULL CHECK (char_length(worker) BETWEEN 1 AND 200),
    generation   bigint NOT NULL,
    position     bigint NOT NULL,
    through      bigint NOT NULL CHECK (through > position),
    gap          jsonb,
    parked       uuid[] NOT NULL DEFAULT '{}',
    deadline     timestamptz NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    ended_at     timestamptz,
    ended        text CHECK (ended IN ('acked', 'released', 'nacked', 'lost')),
    CHECK ((ended_at IS NULL) = (ended IS NULL))
);
CREATE UNIQUE INDEX remote_leases_live ON remote_leases (subscription, partition)
    WHERE ended_at IS NULL;
CREATE INDEX remote_leases_ended ON remote_leases (subscription, ended_at)
    WHERE ended_at IS NOT NULL;

CREATE TABLE remote_policies (
    subscription text PRIMARY KEY REFERENCES subscriptions (name) ON DELETE CASCADE,
    on_error     text NOT NULL DEFAULT 'stop'
                 CHECK (on_error IN ('stop', 'dead_letter', 'park')),
    max_attempts integer NOT NULL DEFAULT 5 CHECK (max_attempts BETWEEN 1 AND 1000),
    batch_size   integer NOT NULL DEFAULT 100 CHECK (batch_size BETWEEN 1 AND 10000),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
"""
    )


def downgrade() -> None:
    op.execute(
        """
DROP TABLE remote_policies;
DROP TABLE remote_leases;
UPDATE gateway_keys SET scopes = array_remove(scopes, 'consume');
DELETE FROM gateway_keys WHERE cardinality(scopes) = 0;
ALTER TABLE gateway_keys DROP CONSTRAINT gateway_keys_scopes_check;
ALTER TABLE gateway_keys ADD CONSTRAINT gateway_keys_scopes_check
    CHECK (cardinality(scopes) > 0 AND array_position(scopes, NULL) IS NULL
           AND scopes <@ ARRAY['read', 'append', 'admin']);
"""
    )
