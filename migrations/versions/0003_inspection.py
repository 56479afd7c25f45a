"""Inspection: status views, the partition lock key, and dead letters' outcomes.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
-- The advisory lock a worker holds while it works on (subscription, partition) is the
-- bigint lock_class(subscription) << 32 | partition: in pg_locks, classid is the class
-- and objid the partition. The class hashes the schema and the subscription (31 bits of
-- MD5), so two installations in one database do not share locks. Workers compute the same
-- key in Python. A collision of two classes would only make two subscriptions share
-- locks (less parallelism); correctness never rests on these locks.
CREATE FUNCTION lock_class(subscription text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path FROM CURRENT
AS $$
    SELECT (('x' || substr(md5(current_schema() || '.' || subscription), 1, 8))::bit(32)::integer
            & 2147483647)::bigint
$$;

-- Workers' lock connections are named 'subengine worker <id>' (application_name).
CREATE VIEW partition_holders AS
SELECT w.id AS worker_id, w.host AS worker_host, w.pid AS worker_pid,
       l.classid::bigint AS lock_class, l.objid::bigint AS partition
  FROM pg_locks l
  JOIN pg_stat_activity a ON a.pid = l.pid
  JOIN workers w ON a.application_name = 'subengine worker ' || w.id::text
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database());

-- One row per (subscription, partition): where it stands, how far behind, and why.
CREATE VIEW subscription_status AS
SELECT sp.subscription, s.stream, sp.partition, sp.position, p.head,
       p.head - sp.position AS lag,
       nx.recorded_at AS next_event_at,
       CASE WHEN nx.recorded_at IS NOT NULL
            THEN round(extract(epoch FROM clock_timestamp() - nx.recorded_at)::numeric, 3)
       END AS lag_seconds,
       CASE WHEN s.paused THEN 'paused'
            WHEN sp.stopped THEN 'stopped'
            WHEN sp.attempts > 0 THEN 'retrying'
            WHEN p.head = sp.position THEN 'idle'
            ELSE 'ok'
       END AS state,
       sp.attempts, sp.last_error, sp.retry_at, sp.generation,
       h.worker_id, h.worker_host, h.worker_pid,
       sp.updated_at
  FROM subscription_positions sp
  JOIN subscriptions s ON s.name = sp.subscription
  JOIN partitions p ON p.stream = s.stream AND p.partition = sp.partition
  LEFT JOIN events nx
    ON nx.stream = s.stream AND nx.partition = sp.partition AND nx.position = sp.position + 1
  LEFT JOIN partition_holders h
    ON h.lock_class = lock_class(sp.subscription) AND h.partition = sp.partition;

-- One row per (stream, partition).
CREATE VIEW stream_status AS
SELECT stream, partition, head, floor, head_time,
       greatest(head - floor + 1, 0) AS events
  FROM partitions;

-- Registered workers; `connected` is whether any connection of theirs is open now, and
-- `partitions_held` how many partitions they hold.
CREATE VIEW workers_status AS
SELECT w.id, w.host, w.pid, w.subscriptions, w.started_at, w.heartbeat_at,
       round(extract(epoch FROM clock_timestamp() - w.heartbeat_at)::numeric, 3)
           AS seconds_since_heartbeat,
       EXISTS (SELECT FROM pg_stat_activity a
                WHERE a.application_name = 'subengine worker ' || w.id::text) AS connected,
       (SELECT count(*) FROM partition_holders h WHERE h.worker_id = w.id) AS partitions_held
  FROM workers w;

-- What happened to a dead letter after the policy put it there.
ALTER TABLE dead_letters
    ADD COLUMN retries      integer NOT NULL DEFAULT 0,
    ADD COLUMN resolution   text CHECK (resolution IN ('retried', 'discarded')),
    ADD COLUMN resolved_at  timestamptz;
"""
    )


def downgrade() -> None:
    op.execute(
        """
ALTER TABLE dead_letters DROP COLUMN resolved_at, DROP COLUMN resolution, DROP COLUMN retries;
DROP VIEW workers_status;
DROP VIEW stream_status;
DROP VIEW subscription_status;
DROP VIEW partition_holders;
DROP FUNCTION lock_class(text);
"""
    )
