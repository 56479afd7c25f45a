"""Key-scoped parking (on_error="park"): a key whose event failed max_attempts times is
set aside with every later event of it, while the partition's other keys go on.

- parked_keys: one row per parking of a key by a subscription, in the generation of
  the partition's position then: the event whose failure parked it (position, id,
  error, attempts), the retries an operator ran, and how it ended (resolution:
  retried, discarded, or superseded by a reset; NULL while the key is parked). A key
  is parked at most once at a time per subscription (parked_keys_one_open: a key lies
  in one partition, which leads the index so that a batch's probe of its keys and the
  count of a partition's parked keys are both exact index lookups).
- parked_events: the events set aside under a parked key, the failing one first, each
  recorded in the transaction that moved the position past it, and replayed (retried),
  discarded or superseded with its key.
- subscription_status: per partition, its parked keys and the events waiting under them.

Every write to either table happens under the partition's position row lock (a batch,
an operator's retry or discard, a reset), which orders them with the position.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_STATUS_COLUMNS = """
SELECT sp.subscription, s.stream, sp.partition, sp.position, p.head,
       p.head - sp.position AS lag,
       nx.recorded_at AS next_event_at,
       CASE WHEN nx.recorded_at IS NOT NULL
            THEN round(extract(epoch FROM clock_timestamp() - nx.recorded_at)::numeric, 3)
       END AS lag_seconds,
       CASE WHEN s.paused THEN 'paused'
            WHEN sp.position < p.floor - 1 THEN 'gap'
            WHEN sp.stopped THEN 'stopped'
            WHEN sp.attempts > 0 THEN 'retrying'
            WHEN p.head = sp.position THEN 'idle'
            ELSE 'ok'
       END AS state,
       sp.attempts, sp.last_error, sp.retry_at, sp.generation,
       h.worker_id, h.worker_host, h.worker_pid,
       sp.updated_at,
       p.floor,
       CASE WHEN sp.position < p.floor - 1 THEN sp.position + 1 END AS gap_from,
       CASE WHEN sp.position < p.floor - 1 THEN p.floor - 1 END AS gap_to"""

_STATUS_FROM = """
  FROM subscription_positions sp
  JOIN subscriptions s ON s.name = sp.subscription
  JOIN partitions p ON p.stream = s.stream AND p.partition = sp.partition
  LEFT JOIN events nx
    ON nx.stream = s.stream AND nx.partition = sp.partition AND nx.position = sp.position + 1
  LEFT JOIN partition_holders h
    ON h.lock_class = lock_class(sp.subscription) AND h.partition = sp.partition"""


def upgrade() -> None:
    op.execute(
        f"""
CREATE TABLE parked_keys (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription text NOT NULL REFERENCES subscriptions (name) ON DELETE CASCADE,
    partition    integer NOT NULL CHECK (partition >= 0),
    key          text NOT NULL,
    generation   bigint NOT NULL CHECK (generation >= 1),
    position     bigint NOT NULL CHECK (position >= 1),
    event_id     uuid NOT NULL,
    error        text NOT NULL,
    attempts     integer NOT NULL,
    retries      integer NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL DEFAULT now(),
    resolution   text CHECK (resolution IN ('retried', 'discarded', 'superseded')),
    resolved_at  timestamptz
);
COMMENT ON TABLE parked_keys IS
    'Keys a subscription parked (on_error=park): the event at position failed, and it and every later event of the key are set aside until retried or discarded.';
COMMENT ON COLUMN parked_keys.error IS
    'The error that parked the key, or the last one a retry met.';
CREATE UNIQUE INDEX parked_keys_one_open ON parked_keys (subscription, partition, key)
    WHERE resolution IS NULL;

CREATE TABLE parked_events (
    parked_key  bigint NOT NULL REFERENCES parked_keys (id) ON DELETE CASCADE,
    position    bigint NOT NULL,
    event_id    uuid NOT NULL,
    parked_at   timestamptz NOT NULL DEFAULT now(),
    resolution  text CHECK (resolution IN ('retried', 'discarded', 'superseded')),
    resolved_at timestamptz,
    PRIMARY KEY (parked_key, position)
);
COMMENT ON TABLE parked_events IS
    'Events set aside under a parked key, each when the position moved past it; NULL resolution: still waiting.';

CREATE OR REPLACE VIEW subscription_status AS
{_STATUS_COLUMNS},
       coalesce(pk.keys, 0) AS parked_keys,
       coalesce(pk.events, 0) AS parked_events
{_STATUS_FROM}
  LEFT JOIN LATERAL (
        SELECT count(*) AS keys,
               sum((SELECT count(*) FROM parked_events pe
                     WHERE pe.parked_key = k.id AND pe.resolution IS NULL))::bigint AS events
          FROM parked_keys k
         WHERE k.subscription = sp.subscription AND k.partition = sp.partition
           AND k.resolution IS NULL) pk ON true;
"""  # noqa: S608  (composed of this file's constants, no input)
    )


def downgrade() -> None:
    op.execute(
        f"""
DROP VIEW subscription_status;
CREATE VIEW subscription_status AS
{_STATUS_COLUMNS}
{_STATUS_FROM};
DROP TABLE parked_events;
DROP TABLE parked_keys;
"""
    )
