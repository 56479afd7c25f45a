"""append_events looks up only the ids its caller gave, and finds each event's partition once.

An append looks for each of its ids among the stream's stored events, so that a retry
stores nothing again. Only an id the caller gave can be such a retry: one made for an
event without an id is random and new. Until now the caller (subengine's append) made
those ids itself and passed them like given ones, so every event of every append was
looked up: for 500 events in a stream of 50,000, 0.47 ms of the function's 7.2 (issue 26's
profile of the gateway's appends). append_events now takes, after its other arguments,
`generated_ids`: for each event whose id is NULL in event_ids, the id the caller made for
it, stored as it is and not looked up. Without it the function makes them as before
(gen_random_uuid) and no longer looks those up either. Should two random ids ever meet,
the (stream, id) unique constraint refuses the append: it never takes one event for
another.

The statement that finds the stream and each event's partition computed every event's
partition twice (the planner pulled the lateral subquery into the one counting events per
partition and evaluated it there again): 0.6 ms of 500 events' 7.2, now half.

Adding a parameter changes the function's signature, so it is dropped and created again.
Callers that pass the nine arguments of before are unchanged.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "DROP FUNCTION append_events("
        "text, uuid[], text[], text[], jsonb[], jsonb[], timestamptz[], text[], bigint[])"
    )
    op.execute(
        r"""
CREATE FUNCTION append_events(
    stream_name         text,
    event_ids           uuid[],
    event_keys          text[],
    event_types         text[],
    event_data          jsonb[],
    event_metadata      jsonb[] DEFAULT NULL,
    event_occurred_at   timestamptz[] DEFAULT NULL,
    expected_keys       text[] DEFAULT NULL,
    expected_versions   bigint[] DEFAULT NULL,
    -- for an event without an id (NULL in event_ids), the id the caller made for it: new
    -- (random), so not looked up; made here when NULL
    generated_ids       uuid[] DEFAULT NULL
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
-- running them. A session plans them once, perhaps while the tables are empty or their
-- statistics early, and keeps the plans as the tables grow; so no plan may read a whole
-- table or stream: sequential scans are off, and a lookup by id or key asks for the
-- order of its own index, which no other index gives.
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $function$
#variable_conflict use_column
DECLARE
    event_count      integer := coalesce(cardinality(event_keys), 0);
    partition_count  integer;
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
    new_version      bigint;
    given_ids        uuid[];        -- the ids the caller gave, which a retry repeats
BEGIN
    -- The stream; each event's partition; the partitions touched, ascending, with how many
    -- events each receives. One statement: each statement of a function is a trip through
    -- the executor, which costs more than the work of these.
    SELECT s.partitions, p.partitions, t.touched, t.counts,
           ARRAY(SELECT generate_series(1, event_count))
      INTO partition_count, event_partitions, touched, touched_counts, event_ordinals
      FROM streams s
     CROSS JOIN LATERAL (
            SELECT ARRAY(SELECT partition_for(k.key, s.partitions)
                           FROM unnest(event_keys) WITH ORDINALITY AS k(key, n)
                          ORDER BY k.n) AS partitions
             OFFSET 0  -- kept apart: pulled up into t below, it would be computed twice
         ) AS p
     CROSS JOIN LATERAL (
            SELECT array_agg(g.p ORDER BY g.p) AS touched, array_agg(g.c ORDER BY g.p) AS counts
              FROM (SELECT x.p, count(*) AS c FROM unnest(p.partitions) AS x(p) GROUP BY x.p) AS g
         ) AS t
     WHERE s.name = stream_name;
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
       OR coalesce(cardinality(generated_ids), event_count) <> event_count
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
    -- Only the ids the caller gave can repeat an event (a retry): an id made for an event
    -- without one, here or by the caller (generated_ids, random), is new. Should two
    -- random ids ever meet, event_id_is_unique refuses the append rather than take one
    -- event for the other.
    given_ids := coalesce(array_remove(event_ids, NULL), '{}');
    IF cardinality(given_ids) < event_count THEN
        event_ids := ARRAY(SELECT coalesce(event_ids[n], generated_ids[n], gen_random_uuid())
                             FROM generate_series(1, event_count) AS n ORDER BY n);
    END IF;

    -- An id that repeats an earlier one of this call is not stored again. Ids stored by
    -- earlier calls are looked up under the partition locks below.
    IF cardinality(given_ids) > 1 THEN  -- a plain expression first: no query for one id
      IF (SELECT count(DISTINCT x) FROM unnest(given_ids) AS x) < cardinality(given_ids) THEN
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
        SELECT array_agg(p ORDER BY p), array_agg(c ORDER BY p)
          INTO touched, touched_counts
          FROM (SELECT event_partitions[n] AS p, count(*) AS c
                  FROM unnest(event_ordinals) AS n GROUP BY 1) AS per_partition;
      END IF;
    END IF;

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
        IF NOT FOUND THEN
            -- delete_stream removed the partitions first (or removed them while this
            -- append waited for the row): the stream takes no more events
            RAISE EXCEPTION USING
                ERRCODE = 'SE404',
                MESSAGE = format('stream %L is being deleted', stream_name),
                DETAIL = json_build_object('deleting', true)::text,
                HINT = format('`subengine stream delete %s` finishes the delete; then the name can be created again', stream_name);
        END IF;
        old_heads[i] := old_head;
        lock_times[i] := lock_time;
    END LOOP;

    -- From here on every statement sees what earlier appends to these partitions
    -- committed (READ COMMITTED takes a new snapshot per statement).
    -- Each id is looked up as the range from it to itself, in id order, which only the
    -- (stream, id) index gives without a sort. Asked as an equality, with statistics that
    -- say the table is empty, the planner may as well filter the whole stream out of
    -- another index, once per id.
    IF cardinality(given_ids) > 0  -- a plain expression first: no query when none was given
       AND EXISTS (SELECT 1 FROM unnest(given_ids) AS x(id)
                CROSS JOIN LATERAL (SELECT FROM events e
                                     WHERE e.stream = stream_name AND e.id >= x.id AND e.id <= x.id
                                     ORDER BY e.id LIMIT 1) AS stored)
    THEN
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
        SELECT x.key, x.expected, coalesce(k.version, 0) AS actual
          INTO mismatch
          FROM unnest(expected_keys, expected_versions) AS x(key, expected)
          LEFT JOIN stream_keys k ON k.stream = stream_name AND k.key = x.key
         WHERE coalesce(k.version, 0) IS DISTINCT FROM x.expected
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

    IF event_count = 1 AND cardinality(event_ordinals) = 1 THEN
        -- One event to store, the most common call: the same steps as below in two small
        -- statements instead of the numbering query, whose plan costs more to start than
        -- the work of one event.
        INSERT INTO stream_keys AS k (stream, key, version) VALUES (stream_name, event_keys[1], 1)
        ON CONFLICT (stream, key) DO UPDATE SET version = k.version + 1
        RETURNING k.version INTO new_version;
        INSERT INTO events (stream, partition, position, id, key, key_version, type, data,
                            metadata, occurred_at, recorded_at)
        VALUES (stream_name, touched[1], old_heads[1] + 1, event_ids[1], event_keys[1],
                new_version, event_types[1], event_data[1],
                coalesce(event_metadata[1], '{}'::jsonb),
                coalesce(event_occurred_at[1], lock_times[1]), lock_times[1]);
        ordinal := 1;
        partition := touched[1];
        "position" := old_heads[1] + 1;
        id := event_ids[1];
        key_version := new_version;
        duplicate := false;
        RETURN NEXT;
        PERFORM pg_notify(current_schema(),
                          json_build_object('stream', stream_name, 'partition', touched[1],
                                            'head', old_heads[1] + 1)::text);
        RETURN;
    END IF;

    RETURN QUERY
    -- Each key's row is locked (under its partition's lock, so in no other order) and
    -- moved past this call's events of the key: it returns the key's new last version.
    WITH per_key AS MATERIALIZED (
        SELECT event_keys[n] AS key, count(*) AS count FROM unnest(event_ordinals) AS n GROUP BY 1
    ),
    versions AS (
        INSERT INTO stream_keys AS k (stream, key, version)
        SELECT stream_name, p.key, p.count FROM per_key p
        ON CONFLICT (stream, key) DO UPDATE SET version = k.version + excluded.version
        RETURNING k.key, k.version
    ),
    numbered AS (
        SELECT n AS ordinal, event_ids[n] AS id, event_keys[n] AS key, event_partitions[n] AS partition,
               h.old_head + row_number() OVER (PARTITION BY event_partitions[n] ORDER BY n) AS position,
               v.version - p.count + row_number() OVER (PARTITION BY event_keys[n] ORDER BY n) AS key_version,
               h.recorded
          FROM unnest(event_ordinals) AS n
          JOIN unnest(touched, old_heads, lock_times) AS h(partition, old_head, recorded)
            ON h.partition = event_partitions[n]
          JOIN per_key p ON p.key = event_keys[n]
          JOIN versions v ON v.key = event_keys[n]
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
         CROSS JOIN LATERAL (SELECT e.partition, e.position, e.id, e.key_version FROM events e
                              WHERE e.stream = stream_name
                                AND e.id >= event_ids[n] AND e.id <= event_ids[n]  -- as above
                              ORDER BY e.id LIMIT 1) AS e
         WHERE n <> ALL (event_ordinals);
    END IF;

    -- one notification per partition that received events; the channel is the schema's
    -- name (plain expressions, evaluated without a query)
    FOR i IN 1 .. cardinality(touched) LOOP
        IF touched_counts[i] > 0 THEN
            PERFORM pg_notify(current_schema(),
                              json_build_object('stream', stream_name, 'partition', touched[i],
                                                'head', old_heads[i] + touched_counts[i])::text);
        END IF;
    END LOOP;
END
$function$;
"""
    )


def downgrade() -> None:
    op.execute(
        "DROP FUNCTION append_events("
        "text, uuid[], text[], text[], jsonb[], jsonb[], timestamptz[], text[], bigint[], uuid[])"
    )
    op.execute(
        r"""
-- As revision 0013 made it.
CREATE OR REPLACE FUNCTION append_events(
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
-- running them. A session plans them once, perhaps while the tables are empty or their
-- statistics early, and keeps the plans as the tables grow; so no plan may read a whole
-- table or stream: sequential scans are off, and a lookup by id or key asks for the
-- order of its own index, which no other index gives.
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $function$
#variable_conflict use_column
DECLARE
    event_count      integer := coalesce(cardinality(event_keys), 0);
    partition_count  integer;
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
    new_version      bigint;
BEGIN
    -- The stream; each event's partition; the partitions touched, ascending, with how many
    -- events each receives. One statement: each statement of a function is a trip through
    -- the executor, which costs more than the work of these.
    SELECT s.partitions, p.partitions, t.touched, t.counts,
           ARRAY(SELECT generate_series(1, event_count))
      INTO partition_count, event_partitions, touched, touched_counts, event_ordinals
      FROM streams s
     CROSS JOIN LATERAL (
            SELECT ARRAY(SELECT partition_for(k.key, s.partitions)
                           FROM unnest(event_keys) WITH ORDINALITY AS k(key, n)
                          ORDER BY k.n) AS partitions) AS p
     CROSS JOIN LATERAL (
            SELECT array_agg(g.p ORDER BY g.p) AS touched, array_agg(g.c ORDER BY g.p) AS counts
              FROM (SELECT x.p, count(*) AS c FROM unnest(p.partitions) AS x(p) GROUP BY x.p) AS g
         ) AS t
     WHERE s.name = stream_name;
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

    -- An id that repeats an earlier one of this call is not stored again. Ids stored by
    -- earlier calls are looked up under the partition locks below.
    IF event_count > 1 THEN  -- a plain expression first: no query for one event
      IF (SELECT count(DISTINCT x) FROM unnest(event_ids) AS x) < event_count THEN
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
        SELECT array_agg(p ORDER BY p), array_agg(c ORDER BY p)
          INTO touched, touched_counts
          FROM (SELECT event_partitions[n] AS p, count(*) AS c
                  FROM unnest(event_ordinals) AS n GROUP BY 1) AS per_partition;
      END IF;
    END IF;

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
        IF NOT FOUND THEN
            -- delete_stream removed the partitions first (or removed them while this
            -- append waited for the row): the stream takes no more events
            RAISE EXCEPTION USING
                ERRCODE = 'SE404',
                MESSAGE = format('stream %L is being deleted', stream_name),
                DETAIL = json_build_object('deleting', true)::text,
                HINT = format('`subengine stream delete %s` finishes the delete; then the name can be created again', stream_name);
        END IF;
        old_heads[i] := old_head;
        lock_times[i] := lock_time;
    END LOOP;

    -- From here on every statement sees what earlier appends to these partitions
    -- committed (READ COMMITTED takes a new snapshot per statement).
    -- Each id is looked up as the range from it to itself, in id order, which only the
    -- (stream, id) index gives without a sort. Asked as an equality, with statistics that
    -- say the table is empty, the planner may as well filter the whole stream out of
    -- another index, once per id.
    IF EXISTS (SELECT 1 FROM unnest(event_ids) AS x(id)
                CROSS JOIN LATERAL (SELECT FROM events e
                                     WHERE e.stream = stream_name AND e.id >= x.id AND e.id <= x.id
                                     ORDER BY e.id LIMIT 1) AS stored)
    THEN
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
        SELECT x.key, x.expected, coalesce(k.version, 0) AS actual
          INTO mismatch
          FROM unnest(expected_keys, expected_versions) AS x(key, expected)
          LEFT JOIN stream_keys k ON k.stream = stream_name AND k.key = x.key
         WHERE coalesce(k.version, 0) IS DISTINCT FROM x.expected
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

    IF event_count = 1 AND cardinality(event_ordinals) = 1 THEN
        -- One event to store, the most common call: the same steps as below in two small
        -- statements instead of the numbering query, whose plan costs more to start than
        -- the work of one event.
        INSERT INTO stream_keys AS k (stream, key, version) VALUES (stream_name, event_keys[1], 1)
        ON CONFLICT (stream, key) DO UPDATE SET version = k.version + 1
        RETURNING k.version INTO new_version;
        INSERT INTO events (stream, partition, position, id, key, key_version, type, data,
                            metadata, occurred_at, recorded_at)
        VALUES (stream_name, touched[1], old_heads[1] + 1, event_ids[1], event_keys[1],
                new_version, event_types[1], event_data[1],
                coalesce(event_metadata[1], '{}'::jsonb),
                coalesce(event_occurred_at[1], lock_times[1]), lock_times[1]);
        ordinal := 1;
        partition := touched[1];
        "position" := old_heads[1] + 1;
        id := event_ids[1];
        key_version := new_version;
        duplicate := false;
        RETURN NEXT;
        PERFORM pg_notify(current_schema(),
                          json_build_object('stream', stream_name, 'partition', touched[1],
                                            'head', old_heads[1] + 1)::text);
        RETURN;
    END IF;

    RETURN QUERY
    -- Each key's row is locked (under its partition's lock, so in no other order) and
    -- moved past this call's events of the key: it returns the key's new last version.
    WITH per_key AS MATERIALIZED (
        SELECT event_keys[n] AS key, count(*) AS count FROM unnest(event_ordinals) AS n GROUP BY 1
    ),
    versions AS (
        INSERT INTO stream_keys AS k (stream, key, version)
        SELECT stream_name, p.key, p.count FROM per_key p
        ON CONFLICT (stream, key) DO UPDATE SET version = k.version + excluded.version
        RETURNING k.key, k.version
    ),
    numbered AS (
        SELECT n AS ordinal, event_ids[n] AS id, event_keys[n] AS key, event_partitions[n] AS partition,
               h.old_head + row_number() OVER (PARTITION BY event_partitions[n] ORDER BY n) AS position,
               v.version - p.count + row_number() OVER (PARTITION BY event_keys[n] ORDER BY n) AS key_version,
               h.recorded
          FROM unnest(event_ordinals) AS n
          JOIN unnest(touched, old_heads, lock_times) AS h(partition, old_head, recorded)
            ON h.partition = event_partitions[n]
          JOIN per_key p ON p.key = event_keys[n]
          JOIN versions v ON v.key = event_keys[n]
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
         CROSS JOIN LATERAL (SELECT e.partition, e.position, e.id, e.key_version FROM events e
                              WHERE e.stream = stream_name
                                AND e.id >= event_ids[n] AND e.id <= event_ids[n]  -- as above
                              ORDER BY e.id LIMIT 1) AS e
         WHERE n <> ALL (event_ordinals);
    END IF;

    -- one notification per partition that received events; the channel is the schema's
    -- name (plain expressions, evaluated without a query)
    FOR i IN 1 .. cardinality(touched) LOOP
        IF touched_counts[i] > 0 THEN
            PERFORM pg_notify(current_schema(),
                              json_build_object('stream', stream_name, 'partition', touched[i],
                                                'head', old_heads[i] + touched_counts[i])::text);
        END IF;
    END LOOP;
END
$function$;
"""
    )
