"""Webhook subscriptions of the HTTP gateway (P3Sub push).

- webhooks: one row per webhook subscription, under the id its subscriber chose: the
  callback, the streams with their filters, what a delivery carries, the lease and the
  state (pending until the callback echoed the challenge; active; failing while
  deliveries fail; failed after failing longer than the gateway's failure timeout;
  expired when the lease ran out). Each stream of a webhook is an engine subscription
  named webhook.<serial>.<index>, in at_least_once mode, created with the row and
  deleted with it.
  The signing secret is kept as given (a delivery is signed with it), with the one it
  replaced while the overlap of a rotation lasts.
- webhook_status: each webhook with its lag (events not yet delivered), never its secret.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-23
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
CREATE TABLE webhooks (
    id                     text PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$'),
    serial                 bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    key_id                 text,
    callback               text NOT NULL CHECK (char_length(callback) BETWEEN 1 AND 2000),
    streams                jsonb NOT NULL CHECK (jsonb_typeof(streams) = 'array'),
    include_data           boolean NOT NULL,
    max_events             integer NOT NULL CHECK (max_events BETWEEN 1 AND 1000),
    lease_seconds          integer NOT NULL CHECK (lease_seconds BETWEEN 60 AND 2592000),
    state                  text NOT NULL DEFAULT 'pending' CHECK (
                               state IN ('pending', 'active', 'failing', 'failed', 'expired')),
    secret                 text NOT NULL,
    previous_secret        text,
    previous_secret_until  timestamptz,
    created_at             timestamptz NOT NULL DEFAULT now(),
    expires_at             timestamptz NOT NULL,
    state_changed_at       timestamptz NOT NULL DEFAULT now(),
    challenge_due          timestamptz DEFAULT now(),
    verified_at            timestamptz,
    last_attempt_at        timestamptz,
    last_success_at        timestamptz,
    failing_since          timestamptz,
    attempts               integer NOT NULL DEFAULT 0,
    delivered              bigint NOT NULL DEFAULT 0,
    last_error             text
);
CREATE INDEX webhooks_due ON webhooks (state, challenge_due);
COMMENT ON TABLE webhooks IS
    'Webhook subscriptions of the gateway; each stream is the engine subscription '
    'webhook.<serial>.<index>.';
COMMENT ON COLUMN webhooks.secret IS
    'The signing secret (Standard Webhooks, whsec_...): secret, never shown after creation.';
COMMENT ON COLUMN webhooks.attempts IS
    'Failed attempts since the last delivery that succeeded (challenges included).';

CREATE VIEW webhook_status AS
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
         WHERE sub.name LIKE 'webhook.' || w.serial || '.%') AS lag
  FROM webhooks w;
COMMENT ON VIEW webhook_status IS
    'Each webhook subscription: state, last delivery, failed attempts and lag in events.';
"""
    )


def downgrade() -> None:
    op.execute(
        """
DROP VIEW webhook_status;
DROP TABLE webhooks;
DELETE FROM subscriptions WHERE name LIKE 'webhook.%';
"""
    )
