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
    occurred_at  timestamptz NOT NULL,
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
-- append. An id already in the stream is not stored again: its row reports the stored
-- event with duplicate = true. expected_keys/expected_versions pair each key with the
-- version it must have before the append (0: no event yet); a mismatch raises SQLSTATE
-- SE409 and writes nothing. An unknown stream raises SE404.
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
    partition_count integer;
    event_count     integer := coalesce(cardinality(event_keys), 0);
    recorded        timestamptz;
    mismatch        record;
BEGIN
    SELECT s.partitions INTO partition_count FROM streams s WHERE s.name = stream_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING
            ERRCODE = 'SE404',
            MESSAGE = format('stream %L does not exist', stream_name),
            HINT = 'create it with `subengine stream create NAME --partitions N`';
    END IF;
    IF event_ids IS NULL THEN
        event_ids := array_fill(NULL::uuid, ARRAY[event_count]);
    END IF;
    IF coalesce(cardinality(event_ids), 0) <> event_count
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
    IF event_count = 0 THEN
        RETURN;
    END IF;
    IF array_position(event_ids, NULL) IS NOT NULL THEN
        event_ids := ARRAY(SELECT coalesce(i, gen_random_uuid()) FROM unnest(event_ids) AS i);
    END IF;

    -- Lock the touched heads in ascending partition order: appends to one partition
    -- serialise here until commit, and two multi-partition appends cannot deadlock.
    PERFORM 1 FROM partitions pt
     WHERE pt.stream = stream_name
       AND pt.partition IN (SELECT partition_for(k, partition_count) FROM unnest(event_keys) AS k)
     ORDER BY pt.partition
       FOR UPDATE;
    -- Taken after the lock, so recorded_at never decreases along a partition.
    recorded := clock_timestamp();

    -- From here on every statement sees what earlier appends to these partitions
    -- committed (READ COMMITTED takes a new snapshot per statement).
    IF cardinality(expected_keys) > 0 THEN
        SELECT x.key, x.expected, coalesce(current_version.v, 0) AS actual
          INTO mismatch
          FROM unnest(expected_keys, expected_versions) AS x(key, expected)
         CROSS JOIN LATERAL (
                SELECT max(e.key_version) AS v FROM events e
                 WHERE e.stream = stream_name AND e.key = x.key) AS current_version
         WHERE coalesce(current_version.v, 0) IS DISTINCT FROM x.expected
           -- a key whose events are all stored already is a retried append: no check
           AND EXISTS (
                SELECT 1 FROM unnest(event_keys, event_ids) AS i(key, id)
                 WHERE i.key = x.key
                   AND NOT EXISTS (
                        SELECT 1 FROM events d WHERE d.stream = stream_name AND d.id = i.id))
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
    WITH input AS (
        SELECT i.ordinal::integer AS ordinal, i.id, i.key, i.type, i.data, i.metadata,
               i.occurred_at, partition_for(i.key, partition_count) AS partition
          FROM unnest(event_ids, event_keys, event_types, event_data,
                      coalesce(event_metadata, array_fill(NULL::jsonb, ARRAY[event_count])),
                      coalesce(event_occurred_at, array_fill(NULL::timestamptz, ARRAY[event_count])))
               WITH ORDINALITY AS i(id, key, type, data, metadata, occurred_at, ordinal)
    ),
    stored AS (
        SELECT e.id, e.partition, e.position, e.key_version
          FROM events e
         WHERE e.stream = stream_name AND e.id = ANY (event_ids)
    ),
    fresh AS (
        -- the first occurrence of each id not stored yet
        SELECT DISTINCT ON (input.id) input.*
          FROM input
         WHERE NOT EXISTS (SELECT 1 FROM stored WHERE stored.id = input.id)
         ORDER BY input.id, input.ordinal
    ),
    key_versions AS (
        SELECT k.key, coalesce((SELECT max(e.key_version) FROM events e
                                 WHERE e.stream = stream_name AND e.key = k.key), 0) AS version
          FROM (SELECT DISTINCT fresh.key FROM fresh) AS k
    ),
    numbered AS (
        SELECT f.ordinal, f.id, f.key, f.type, f.data, f.metadata, f.occurred_at, f.partition,
               pt.head + row_number() OVER (PARTITION BY f.partition ORDER BY f.ordinal) AS position,
               kv.version + row_number() OVER (PARTITION BY f.key ORDER BY f.ordinal) AS key_version
          FROM fresh f
          JOIN partitions pt ON pt.stream = stream_name AND pt.partition = f.partition
          JOIN key_versions kv ON kv.key = f.key
    ),
    inserted AS (
        INSERT INTO events (stream, partition, position, id, key, key_version, type, data,
                            metadata, occurred_at, recorded_at)
        SELECT stream_name, n.partition, n.position, n.id, n.key, n.key_version, n.type, n.data,
               coalesce(n.metadata, '{}'::jsonb), coalesce(n.occurred_at, recorded), recorded
          FROM numbered n
    ),
    moved AS (
        UPDATE partitions pt
           SET head = top.head, head_time = recorded
          FROM (SELECT n.partition, max(n.position) AS head FROM numbered n GROUP BY n.partition) AS top
         WHERE pt.stream = stream_name AND pt.partition = top.partition
        RETURNING pt.partition, pt.head
    ),
    notified AS (
        -- one notification per partition touched; the channel is the schema's name
        SELECT count(pg_notify(current_schema(),
                               json_build_object('stream', stream_name, 'partition', moved.partition,
                                                 'head', moved.head)::text)) AS sent
          FROM moved
    )
    SELECT input.ordinal,
           coalesce(n.partition, s.partition),
           coalesce(n.position, s.position),
           input.id,
           coalesce(n.key_version, s.key_version),
           n.ordinal IS DISTINCT FROM input.ordinal
      FROM input
      LEFT JOIN numbered n ON n.id = input.id
      LEFT JOIN stored s ON s.id = input.id
     CROSS JOIN notified  -- referenced so that the notifications are sent
     ORDER BY input.ordinal;
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
