"""Streams, partitions and events; the partition function and the append functions.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
CREATE TABLE streams (
    name        text PRIMARY KEY
                CONSTRAINT stream_name_is_valid CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$'),
    partitions  integer NOT NULL CHECK (partitions BETWEEN 1 AND 4096),
    retention   jsonb,
    created_at  timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE streams IS 'Partitioned, append-only event logs; the partition count is fixed.';

-- One row per partition. Appends lock the row while they run (UPDATE of head), so
-- appends to one partition commit in position order: positions are dense and a reader of
-- "position > x" never skips an event that commits later (DESIGN.md invariant 1).
CREATE TABLE partitions (
    stream      text NOT NULL REFERENCES streams (name) ON DELETE CASCADE,
    partition   integer NOT NULL CHECK (partition >= 0),
    head        bigint NOT NULL DEFAULT 0 CHECK (head >= 0),
    head_time   timestamptz,
    floor       bigint NOT NULL DEFAULT 1 CHECK (floor >= 1),
    PRIMARY KEY (stream, partition)
);
COMMENT ON COLUMN partitions.head IS 'Highest committed position (0: empty).';
COMMENT ON COLUMN partitions.head_time IS 'recorded_at of the head event.';
COMMENT ON COLUMN partitions.floor IS 'Lowest position still stored.';

-- No foreign key to partitions: append_events inserts only into partitions it has
-- locked, and a per-row key check would cost every append.
CREATE TABLE events (
    stream       text NOT NULL,
    partition    integer NOT NULL,
    position     bigint NOT NULL CHECK (position >= 1),
    id           uuid NOT NULL,
    key          text NOT NULL CHECK (key <> ''),
    key_version  bigint NOT NULL CHECK (key_version >= 1),
    type         text NOT NULL CHECK (type <> ''),
    data         jsonb NOT NULL,
    metadata     jsonb NOT NULL DEFAULT '{}',
    occurred_at  timestamptz NOT NULL
                 -- the years a Python datetime can hold, in any time zone
                 CONSTRAINT occurred_at_is_readable CHECK (occurred_at BETWEEN '0001-01-02 00:00Z' AND '9999-12-30 00:00Z'),
    recorded_at  timestamptz NOT NULL,
    PRIMARY KEY (stream, partition, position),
    CONSTRAINT event_id_is_unique UNIQUE (stream, id),
    CONSTRAINT key_version_is_unique UNIQUE (stream, key, key_version)
);
-- recorded_at is taken after the partition lock, so it never decreases along a partition.
CREATE INDEX events_recorded_at ON events (stream, recorded_at);

-- The documented partition function: the first 8 bytes of MD5(UTF-8 key) as a big-endian
-- integer with the top bit cleared, modulo the partition count (subengine.partition_for).
CREATE FUNCTION partition_for(key text, partitions integer) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN (((('x' || left(md5(key), 16))::bit(64)::bigint) & 9223372036854775807) % partitions)::integer;

-- Append events to a stream inside the caller's transaction. Arrays are parallel: one
-- element per event. NULL ids get a random UUID; NULL occurred_at gets the time of
-- append. An id already in the stream (or earlier in the same call) is not stored again:
-- its row reports the stored event with duplicate = true. expected_keys/expected_versions
-- pair each key with the version it must have before the append (0: no event yet); a
-- mismatch raises SQLSTATE SE409 and writes nothing. An unknown stream raises SE404; an
-- id stored already for another key or type raises SE410.
-- Rows come back in no particular order; `ordinal` (from 1) says which event each is.
CREATE FUNCTION append_events(
    stream_name         text,
    event_ids           uuid[],
    event_keys          text[],
    event_types         text[],
    event_data          jsonb[],
    event_metadata      jsonb[] DEFAULT NULL,
    event_occurred_at   timestamptz[] DEFAULT NULL,
    expected_keys       text[] DEFAULT NULL,
    expected_versions   bigint[] DEFAULT NULL
) RETURNS TABLE (
    ordinal      integer,
    partition    integer,
    "position"   bigint,
    id           uuid,
    key_version  bigint,
    duplicate    boolean
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
-- Every statement below has the same good plan whatever the arguments (index lookups by
-- stream and key, id or partition); re-planning them on every call would cost more than
-- running them.
SET plan_cache_mode = force_generic_plan
AS $function$
#variable_conflict use_column
DECLARE
    partition_count  integer;
    event_count      integer := coalesce(cardinality(event_keys), 0);
    event_ordinals   integer[];     -- which events are stored: 1..n unless some are duplicates
    event_partitions integer[];
    touched          integer[];     -- the partitions this call appends to, ascending
    touched_counts   bigint[];      -- how many events each of them receives
    old_heads        bigint[];
    lock_times       timestamptz[]; -- recorded_at of each touched partition's new events
    old_head         bigint;
    lock_time        timestamptz;
    mismatch         record;
    conflict         record;
    i                integer;
BEGIN
    SELECT s.partitions INTO partition_count FROM streams s WHERE s.name = stream_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING
            ERRCODE = 'SE404',
            MESSAGE = format('stream %L does not exist', stream_name),
            HINT = 'create it with `subengine stream create NAME --partitions N`';
    END IF;
    IF coalesce(cardinality(event_ids), event_count) <> event_count
       OR coalesce(cardinality(event_types), 0) <> event_count
       OR coalesce(cardinality(event_data), 0) <> event_count
       OR coalesce(cardinality(event_metadata), event_count) <> event_count
       OR coalesce(cardinality(event_occurred_at), event_count) <> event_count
       OR coalesce(cardinality(expected_keys), 0) <> coalesce(cardinality(expected_versions), 0)
    THEN
        RAISE EXCEPTION USING
            ERRCODE = '22023',
            MESSAGE = 'append_events: the arrays of one call must have one element per event';
    END IF;
    IF array_position(event_keys, NULL) IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = '22004',
            MESSAGE = format('append_events: event %s has no key', array_position(event_keys, NULL));
    END IF;
    IF expected_keys IS NOT NULL  -- a plain expression first: no query when there are none
       AND EXISTS (SELECT 1 FROM unnest(expected_keys) AS k WHERE k IS NULL OR k <> ALL (event_keys))
    THEN
        RAISE EXCEPTION USING
            ERRCODE = '22023',
            MESSAGE = 'append_events: every expected key must be the key of an event of the call';
    END IF;
    IF event_count = 0 THEN
        RETURN;
    END IF;
    IF event_ids IS NULL OR array_position(event_ids, NULL) IS NOT NULL THEN
        event_ids := ARRAY(SELECT coalesce(event_ids[n], gen_random_uuid())
                             FROM generate_series(1, event_count) AS n ORDER BY n);
    END IF;

    -- Each event's partition, and which events to store: all of them, unless an id repeats
    -- an earlier one of this call. Ids stored by earlier calls are looked up under the
    -- partition locks below.
    event_partitions := ARRAY(
        SELECT partition_for(event_keys[n], partition_count)
          FROM generate_series(1, event_count) AS n ORDER BY n);
    IF event_count > 1 AND (SELECT count(DISTINCT x) FROM unnest(event_ids) AS x) < event_count THEN
        event_ordinals := ARRAY(
            SELECT min(n) FROM generate_series(1, event_count) AS n
             GROUP BY event_ids[n] ORDER BY 1);
        SELECT event_ids[later.n] AS id, event_keys[first.n] AS key, event_types[first.n] AS type
          INTO conflict
          FROM generate_series(1, event_count) AS later(n)
          JOIN unnest(event_ordinals) AS first(n) ON event_ids[first.n] = event_ids[later.n]
         WHERE (event_keys[later.n], event_types[later.n])
               IS DISTINCT FROM (event_keys[first.n], event_types[first.n])
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION USING
                ERRCODE = 'SE410',
                MESSAGE = format('event id %s names two events of one append', conflict.id),
                DETAIL = json_build_object('id', conflict.id, 'key', conflict.key, 'type', conflict.type,
                                           'stored', false)::text;
        END IF;
    ELSE
        event_ordinals := ARRAY(SELECT generate_series(1, event_count));
    END IF;
    SELECT array_agg(p ORDER BY p), array_agg(c ORDER BY p)
      INTO touched, touched_counts
      FROM (SELECT event_partitions[n] AS p, count(*) AS c
              FROM unnest(event_ordinals) AS n GROUP BY 1) AS per_partition;

    -- Lock and advance the touched heads in ascending partition order: appends to one
    -- partition serialise here until commit (positions are dense and commit in order), and
    -- two multi-partition appends cannot deadlock. head_time, set after the lock is held,
    -- never decreases along a partition; it becomes the new events' recorded_at.
    old_heads := '{}';
    lock_times := '{}';
    FOR i IN 1 .. cardinality(touched) LOOP
        UPDATE partitions pt
           SET head = pt.head + touched_counts[i],
               head_time = greatest(pt.head_time, clock_timestamp())  -- even if the clock steps back
         WHERE pt.stream = stream_name AND pt.partition = touched[i]
        RETURNING pt.head - touched_counts[i], pt.head_time INTO old_head, lock_time;
        old_heads[i] := old_head;
        lock_times[i] := lock_time;
    END LOOP;

    -- From here on every statement sees what earlier appends to these partitions
    -- committed (READ COMMITTED takes a new snapshot per statement).
    IF EXISTS (SELECT 1 FROM events e WHERE e.stream = stream_name AND e.id = ANY (event_ids)) THEN
        -- A retried append: keep only events whose id is new, give back the positions
        -- reserved for the others. An id stored for another event is an error.
        SELECT e.id, e.key, e.type INTO conflict
          FROM unnest(event_ids, event_keys, event_types) AS i(id, key, type)
          JOIN events e ON e.stream = stream_name AND e.id = i.id
         WHERE (e.key, e.type) IS DISTINCT FROM (i.key, i.type)
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION USING
                ERRCODE = 'SE410',
                MESSAGE = format('event id %s is stored already, for key %L and type %L',
                                 conflict.id, conflict.key, conflict.type),
                DETAIL = json_build_object('id', conflict.id, 'key', conflict.key, 'type', conflict.type,
                                           'stored', true)::text;
        END IF;
        event_ordinals := ARRAY(
            SELECT n FROM unnest(event_ordinals) AS n
             WHERE NOT EXISTS (SELECT 1 FROM events e
                                WHERE e.stream = stream_name AND e.id = event_ids[n])
             ORDER BY n);
        touched_counts := ARRAY(
            SELECT count(n) FROM unnest(touched) WITH ORDINALITY AS t(p, i)
              LEFT JOIN unnest(event_ordinals) AS n ON event_partitions[n] = t.p
             GROUP BY t.i ORDER BY t.i);
        UPDATE partitions pt
           SET head = u.old_head + u.count,
               head_time = CASE WHEN u.count > 0 THEN pt.head_time ELSE
                               (SELECT e.recorded_at FROM events e
                                 WHERE e.stream = stream_name AND e.partition = u.partition
                                   AND e.position = u.old_head) END
          FROM unnest(touched, old_heads, touched_counts) AS u(partition, old_head, count)
         WHERE pt.stream = stream_name AND pt.partition = u.partition;
    END IF;

    IF cardinality(expected_keys) > 0 THEN
        SELECT x.key, x.expected, coalesce(current_version.v, 0) AS actual
          INTO mismatch
          FROM unnest(expected_keys, expected_versions) AS x(key, expected)
         CROSS JOIN LATERAL (
                SELECT max(e.key_version) AS v FROM events e
                 WHERE e.stream = stream_name AND e.key = x.key) AS current_version
         WHERE coalesce(current_version.v, 0) IS DISTINCT FROM x.expected
           -- a key whose events are all stored already is a retried append: no check
           AND x.key IN (SELECT event_keys[n] FROM unnest(event_ordinals) AS n)
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION USING
                ERRCODE = 'SE409',
                MESSAGE = format('key %L in stream %L is at version %s, but the append expected version %s',
                                 mismatch.key, stream_name, mismatch.actual, mismatch.expected),
                DETAIL = json_build_object('key', mismatch.key, 'expected', mismatch.expected,
                                           'actual', mismatch.actual)::text;
        END IF;
    END IF;

    RETURN QUERY
    WITH numbered AS (
        SELECT n AS ordinal, event_ids[n] AS id, event_keys[n] AS key, event_partitions[n] AS partition,
               h.old_head + row_number() OVER (PARTITION BY event_partitions[n] ORDER BY n) AS position,
               kv.version + row_number() OVER (PARTITION BY event_keys[n] ORDER BY n) AS key_version,
               h.recorded
          FROM unnest(event_ordinals) AS n
          JOIN unnest(touched, old_heads, lock_times) AS h(partition, old_head, recorded)
            ON h.partition = event_partitions[n]
         CROSS JOIN LATERAL (
                SELECT coalesce(max(e.key_version), 0) AS version FROM events e
                 WHERE e.stream = stream_name AND e.key = event_keys[n]) AS kv
    ),
    inserted AS (
        INSERT INTO events (stream, partition, position, id, key, key_version, type, data,
                            metadata, occurred_at, recorded_at)
        SELECT stream_name, n.partition, n.position, n.id, n.key, n.key_version,
               event_types[n.ordinal], event_data[n.ordinal],
               coalesce(event_metadata[n.ordinal], '{}'::jsonb),
               coalesce(event_occurred_at[n.ordinal], n.recorded), n.recorded
          FROM numbered n
    )
    SELECT n.ordinal, n.partition, n.position, n.id, n.key_version, false FROM numbered n;

    IF cardinality(event_ordinals) < event_count THEN
        -- the duplicates: point at the stored event (stored earlier, or just now)
        RETURN QUERY
        SELECT n, e.partition, e.position, e.id, e.key_version, true
          FROM generate_series(1, event_count) AS n
          JOIN events e ON e.stream = stream_name AND e.id = event_ids[n]
         WHERE n <> ALL (event_ordinals);
    END IF;

    -- one notification per partition that received events; the channel is the schema's name
    PERFORM pg_notify(current_schema(),
                      json_build_object('stream', stream_name, 'partition', t.p,
                                        'head', t.old_head + t.c)::text)
       FROM unnest(touched, old_heads, touched_counts) AS t(p, old_head, c)
      WHERE t.c > 0;
END
$function$;

-- One event, for plain SQL: SELECT * FROM subengine.append('orders', 'order-1',
-- 'OrderPlaced', '{"total": 10}');
CREATE FUNCTION append(
    stream_name       text,
    key               text,
    type              text,
    data              jsonb,
    metadata          jsonb DEFAULT NULL,
    id                uuid DEFAULT NULL,
    occurred_at       timestamptz DEFAULT NULL,
    expected_version  bigint DEFAULT NULL
) RETURNS TABLE (partition integer, "position" bigint, id uuid, key_version bigint, duplicate boolean)
LANGUAGE sql
SET search_path FROM CURRENT
AS $function$
    SELECT a.partition, a.position, a.id, a.key_version, a.duplicate
      FROM append_events(
            stream_name, ARRAY[append.id], ARRAY[append.key], ARRAY[append.type],
            ARRAY[append.data], ARRAY[append.metadata], ARRAY[append.occurred_at],
            CASE WHEN expected_version IS NULL THEN NULL ELSE ARRAY[append.key] END,
            CASE WHEN expected_version IS NULL THEN NULL ELSE ARRAY[expected_version] END) AS a
$function$;
"""
    )


def downgrade() -> None:
    op.execute(
        """
DROP FUNCTION append(text, text, text, jsonb, jsonb, uuid, timestamptz, bigint);
DROP FUNCTION append_events(text, uuid[], text[], text[], jsonb[], jsonb[], timestamptz[],
                            text[], bigint[]);
DROP FUNCTION partition_for(text, integer);
DROP TABLE events;
DROP TABLE partitions;
DROP TABLE streams;
"""
    )
