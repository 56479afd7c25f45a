"""Retention and gaps: stream epochs, the time of the floor, recorded gaps, state `gap`.

- streams.epoch: a stream's identity at creation, from a sequence, so a stream deleted
  and created again under its name has another epoch and an old cursor is detected.
- streams.retention: the policy (see subengine.Retention), a JSON object or NULL.
- partitions.floor_time: recorded_at of the last event retention removed (position
  floor - 1); a read by time since then may have lost events, a read from before not.
- gaps: every gap a subscription passed (policy `skip`, a gap handler, or an operator
  accepting it), with the range, the floor then and the time.
- subscription_status: state `gap` when the position is below floor - 1 (events it has
  not handled are no longer stored), with the floor and the missing range.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
CREATE SEQUENCE stream_epochs;
ALTER TABLE streams
    ADD COLUMN epoch bigint NOT NULL DEFAULT nextval('stream_epochs'),
    ADD CONSTRAINT retention_is_an_object
        CHECK (retention IS NULL OR jsonb_typeof(retention) = 'object');
ALTER SEQUENCE stream_epochs OWNED BY streams.epoch;
COMMENT ON COLUMN streams.epoch IS
    'Identity of this stream''s creation: another stream of the same name has another.';
COMMENT ON COLUMN streams.retention IS 'Retention policy (subengine.Retention), or NULL: keep all.';

ALTER TABLE partitions ADD COLUMN floor_time timestamptz;
COMMENT ON COLUMN partitions.floor_time IS
    'recorded_at of the last event retention removed (position floor - 1).';

-- The first position of a partition recorded at or after `cutoff` (head + 1 when none;
-- NULL without a cutoff): retention by age keeps it and what follows, as recorded_at
-- never decreases along a partition. A binary search over the dense positions from the
-- floor to the head, each step one primary-key lookup: about 23 for a partition of
-- millions, whatever the other partitions hold (the index on (stream, recorded_at) would
-- walk past every partition's events after the cutoff).
CREATE FUNCTION retention_age_cut(
    stream_name text, partition_number integer, head bigint, head_time timestamptz,
    cutoff timestamptz
) RETURNS bigint
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    low   bigint;
    high  bigint := head;  -- recorded at head_time, not before the cutoff
    mid   bigint;
    found timestamptz;
BEGIN
    IF cutoff IS NULL THEN
        RETURN NULL;
    END IF;
    IF head_time IS NULL OR head_time < cutoff THEN
        RETURN head + 1;
    END IF;
    SELECT p.floor INTO low FROM partitions p
     WHERE p.stream = stream_name AND p.partition = partition_number;
    WHILE low < high LOOP
        mid := low + (high - low) / 2;
        SELECT e.recorded_at INTO found FROM events e
         WHERE e.stream = stream_name AND e.partition = partition_number AND e.position = mid;
        IF found IS NULL OR found < cutoff THEN  -- a missing position goes with the old
            low := mid + 1;
        ELSE
            high := mid;
        END IF;
    END LOOP;
    RETURN low;
END
$$;

CREATE TABLE gaps (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription  text NOT NULL REFERENCES subscriptions (name) ON DELETE CASCADE,
    stream        text NOT NULL,
    partition     integer NOT NULL,
    generation    bigint NOT NULL,
    gap_from      bigint NOT NULL,
    gap_to        bigint NOT NULL CHECK (gap_to >= gap_from),
    floor         bigint NOT NULL,
    reason        text NOT NULL,
    action        text NOT NULL CHECK (action IN ('skipped', 'handled', 'accepted')),
    recorded_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX gaps_of_subscription ON gaps (subscription, partition, id);
COMMENT ON TABLE gaps IS
    'Gaps subscriptions passed: positions gap_from..gap_to were removed before they handled them.';

CREATE OR REPLACE VIEW subscription_status AS
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
       CASE WHEN sp.position < p.floor - 1 THEN p.floor - 1 END AS gap_to
  FROM subscription_positions sp
  JOIN subscriptions s ON s.name = sp.subscription
  JOIN partitions p ON p.stream = s.stream AND p.partition = sp.partition
  LEFT JOIN events nx
    ON nx.stream = s.stream AND nx.partition = sp.partition AND nx.position = sp.position + 1
  LEFT JOIN partition_holders h
    ON h.lock_class = lock_class(sp.subscription) AND h.partition = sp.partition;

CREATE OR REPLACE VIEW stream_status AS
SELECT stream, partition, head, floor, head_time,
       greatest(head - floor + 1, 0) AS events,
       floor_time
  FROM partitions;
"""
    )


def downgrade() -> None:
    op.execute(
        """
CREATE OR REPLACE VIEW stream_status AS
SELECT stream, partition, head, floor, head_time,
       greatest(head - floor + 1, 0) AS events
  FROM partitions;
DROP VIEW subscription_status;
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
DROP TABLE gaps;
DROP FUNCTION retention_age_cut(text, integer, bigint, timestamptz, timestamptz);
ALTER TABLE partitions DROP COLUMN floor_time;
ALTER TABLE streams DROP CONSTRAINT retention_is_an_object, DROP COLUMN epoch;
"""
    )
