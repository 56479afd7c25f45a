-- Generated from the migrations by scripts/schema (subengine.migration_sql()): do not
-- edit. Regenerate it with scripts/schema after adding or changing a migration.

BEGIN;

CREATE SCHEMA IF NOT EXISTS "subengine";

SET LOCAL search_path TO "subengine";

CREATE TABLE subengine.subengine_alembic_version (
    version_num VARCHAR(32) NOT NULL, 
    CONSTRAINT subengine_alembic_version_pkc PRIMARY KEY (version_num)
);

-- Running upgrade  -> 0001

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
$function$;;

INSERT INTO subengine.subengine_alembic_version (version_num) VALUES ('0001') RETURNING subengine.subengine_alembic_version.version_num;

-- Running upgrade 0001 -> 0002

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
);;

UPDATE subengine.subengine_alembic_version SET version_num='0002' WHERE subengine.subengine_alembic_version.version_num = '0001';

-- Running upgrade 0002 -> 0003

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
    ADD COLUMN resolved_at  timestamptz;;

UPDATE subengine.subengine_alembic_version SET version_num='0003' WHERE subengine.subengine_alembic_version.version_num = '0002';

-- Running upgrade 0003 -> 0004

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
ALTER TABLE workers ADD COLUMN serves_metrics boolean NOT NULL DEFAULT false;;

UPDATE subengine.subengine_alembic_version SET version_num='0004' WHERE subengine.subengine_alembic_version.version_num = '0003';

-- Running upgrade 0004 -> 0005

-- Rows of Spark writes waiting for their write's commit (docs/spark.md, "Exactly once").
-- Every task attempt stages its rows here under an attempt id of its own; the driver's
-- commit appends the rows of the attempts Spark committed, in one transaction, and then
-- deletes the write's rows, those of failed attempts included. UNLOGGED: staging costs no
-- WAL, and a server crash empties the table, which the commit notices (it counts each
-- attempt's rows) and refuses.
CREATE UNLOGGED TABLE spark_staged_events (
    write_id         text NOT NULL,
    batch            bigint NOT NULL,
    attempt          uuid NOT NULL,
    row_number       integer NOT NULL,
    spark_partition  integer NOT NULL,
    content          uuid NOT NULL,
    occurrence       bigint NOT NULL,
    id               uuid,
    key              text NOT NULL,
    type             text NOT NULL,
    data             jsonb NOT NULL,
    metadata         jsonb NOT NULL,
    occurred_at      timestamptz,
    expected_version bigint,
    staged_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (write_id, batch, attempt, row_number)
);
COMMENT ON TABLE spark_staged_events IS
    'Rows staged by Spark write tasks until the write commits; see docs/spark.md.';
COMMENT ON COLUMN spark_staged_events.write_id IS
    'The write: write:<writeId> for a batch write, query:<id> for a streaming query.';
COMMENT ON COLUMN spark_staged_events.batch IS 'The micro-batch of a streaming write; 0 for a batch write.';
COMMENT ON COLUMN spark_staged_events.content IS
    'UUID (version 5) of the write, the micro-batch, the stream and the row''s content.';
COMMENT ON COLUMN spark_staged_events.occurrence IS
    'How many rows of the same content come before this one: in its attempt when staged, in the whole write once the commit numbered them.';
COMMENT ON COLUMN spark_staged_events.id IS 'The row''s own id column; NULL: derived at commit.';

-- The id a Spark write gives the `occurrence`-th row (from 0) of a content: a name-based
-- UUID of version 8 as RFC 9562 shows it: the first 16 bytes of SHA-256 over the 16 bytes
-- of `content` and `occurrence` as 8 big-endian bytes, with the version and variant bits
-- set. One expression of immutable functions, so that the planner inlines it.
CREATE FUNCTION spark_event_id(content uuid, occurrence bigint) RETURNS uuid
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN encode(
    set_byte(
        set_byte(
            substr(sha256(uuid_send(content) || int8send(occurrence)), 1, 16),
            6,
            (get_byte(sha256(uuid_send(content) || int8send(occurrence)), 6) & 15) | 128),
        8,
        (get_byte(sha256(uuid_send(content) || int8send(occurrence)), 8) & 63) | 128),
    'hex')::uuid;;

UPDATE subengine.subengine_alembic_version SET version_num='0005' WHERE subengine.subengine_alembic_version.version_num = '0004';

-- Running upgrade 0005 -> 0006

-- The time of the next event a subscription standing at `after` in a partition has to
-- handle: the occurred_at of the first event stored after it or, when the partition's
-- head is past it but none of those events is stored any more, the head's time (the
-- worker must still come and report them). NULL when nothing is after it.
CREATE FUNCTION next_event_time(stream_name text, partition_number integer, after bigint)
RETURNS timestamptz
LANGUAGE sql STABLE STRICT PARALLEL SAFE
RETURN coalesce(
    (SELECT e.occurred_at FROM events e
      WHERE e.stream = stream_name AND e.partition = partition_number AND e.position > after
      ORDER BY e.position
      LIMIT 1),
    (SELECT p.head_time FROM partitions p
      WHERE p.stream = stream_name AND p.partition = partition_number AND p.head > after));

-- Every statement that moves a position sets next_time with it, so a row with events
-- after its position has a next_time unless events were appended since its last write.
-- Those appends are what workers track (notifications, heads); everything else a worker
-- finds through this index, oldest first, touching only the rows with work.
CREATE INDEX subscription_positions_work ON subscription_positions (subscription, next_time)
 WHERE next_time IS NOT NULL AND NOT stopped;

UPDATE subscription_positions sp
   SET next_time = next_event_time(s.stream, sp.partition, sp.position)
  FROM subscriptions s
 WHERE s.name = sp.subscription
   AND next_time IS DISTINCT FROM next_event_time(s.stream, sp.partition, sp.position);

COMMENT ON COLUMN subscription_positions.next_time IS
    'When the row was last written: the time of the next event after position (next_event_time), NULL when there was none. Workers take the oldest first.';;

UPDATE subengine.subengine_alembic_version SET version_num='0006' WHERE subengine.subengine_alembic_version.version_num = '0005';

-- Running upgrade 0006 -> 0007

-- As revision 0001 made it, but for SET enable_seqscan and the two lookups by id.
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
         CROSS JOIN LATERAL (SELECT e.partition, e.position, e.id, e.key_version FROM events e
                              WHERE e.stream = stream_name
                                AND e.id >= event_ids[n] AND e.id <= event_ids[n]  -- as above
                              ORDER BY e.id LIMIT 1) AS e
         WHERE n <> ALL (event_ordinals);
    END IF;

    -- one notification per partition that received events; the channel is the schema's name
    PERFORM pg_notify(current_schema(),
                      json_build_object('stream', stream_name, 'partition', t.p,
                                        'head', t.old_head + t.c)::text)
       FROM unnest(touched, old_heads, touched_counts) AS t(p, old_head, c)
      WHERE t.c > 0;
END
$function$;;

UPDATE subengine.subengine_alembic_version SET version_num='0007' WHERE subengine.subengine_alembic_version.version_num = '0006';

-- Running upgrade 0007 -> 0008

CREATE FUNCTION lock_companions(
    subscription_name  text,
    stream_name        text,
    chosen_partition   integer,
    room               integer,
    companion_limit    integer
) RETURNS TABLE (
    part            integer,
    part_position   bigint,
    part_generation bigint,
    halted          boolean,
    attempts        integer,
    head            bigint,
    take            bigint,
    id              uuid,
    stream          text,
    partition       integer,
    "position"      bigint,
    key             text,
    key_version     bigint,
    type            text,
    data            jsonb,
    metadata        jsonb,
    occurred_at     timestamptz,
    recorded_at     timestamptz
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $function$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH companion AS MATERIALIZED (
        SELECT sp.partition, sp.position, sp.generation, sp.next_time
          FROM subscription_positions sp
         WHERE sp.subscription = subscription_name AND sp.next_time IS NOT NULL
           AND NOT sp.stopped AND sp.partition <> chosen_partition AND sp.attempts = 0
           AND (sp.retry_at IS NULL OR sp.retry_at <= now())
           AND NOT EXISTS (SELECT FROM subscriptions s
                            WHERE s.name = subscription_name AND s.paused)
         ORDER BY sp.next_time
         -- each has an event at least: no more rows than the room can use
         LIMIT least(companion_limit, room)
           FOR UPDATE OF sp SKIP LOCKED
    ), member AS (
        SELECT c.partition, c.position, c.generation, p.head,
               row_number() OVER (ORDER BY c.next_time, c.partition) AS rank
          FROM companion c
          JOIN partitions p ON p.stream = stream_name AND p.partition = c.partition
    ), share AS (
        -- what each partition takes: its events, as far as the ones before it left room
        SELECT m.*,
               -- head - position is below 0 for a row that a batch moved past this
               -- statement's head and committed since: it has nothing
               greatest(0, least(m.head - m.position,
                                 room - coalesce(sum(greatest(0, least(m.head - m.position,
                                                                       room)))
                                                     OVER (ORDER BY m.rank ROWS BETWEEN
                                                           UNBOUNDED PRECEDING
                                                           AND 1 PRECEDING),
                                                 0)))::bigint AS take
          FROM member m
    )
    SELECT x.partition, x.position, x.generation, false, 0, x.head, x.take,
           e.id, e.stream, e.partition, e.position, e.key, e.key_version, e.type, e.data,
           e.metadata, e.occurred_at, e.recorded_at
      FROM share x
      CROSS JOIN LATERAL (
            SELECT * FROM events e
             WHERE e.stream = stream_name AND e.partition = x.partition
               AND e.position > x.position
             ORDER BY e.position
             LIMIT x.take + 1) e
     WHERE x.take > 0
     ORDER BY x.rank, e.position;
END
$function$;

CREATE FUNCTION commit_positions(
    subscription_name  text,
    stream_name        text,
    partition_numbers  integer[],
    old_positions      bigint[],
    new_positions      bigint[],
    generations        bigint[],
    next_times         timestamptz[]
) RETURNS TABLE (partition integer, next_time timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $function$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE subscription_positions sp
       SET position = x.new,
           next_time = coalesce(x.next_time, next_event_time(stream_name, x.partition, x.new)),
           attempts = 0, last_error = NULL, retry_at = NULL, updated_at = now()
      FROM unnest(partition_numbers, old_positions, new_positions, generations, next_times)
           AS x(partition, old, new, generation, next_time)
     WHERE sp.subscription = subscription_name AND sp.partition = x.partition
       AND sp.position = x.old AND sp.generation = x.generation
    RETURNING sp.partition, sp.next_time;
END
$function$;;

UPDATE subengine.subengine_alembic_version SET version_num='0008' WHERE subengine.subengine_alembic_version.version_num = '0007';

-- Running upgrade 0008 -> 0009

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
  FROM partitions;;

UPDATE subengine.subengine_alembic_version SET version_num='0009' WHERE subengine.subengine_alembic_version.version_num = '0008';

-- Running upgrade 0009 -> 0010

-- The last key version of each key retention removed entirely (pruning writes it, with
-- the delete): a key's versions go on after its events are gone, so `expected_version`
-- keeps meaning what it says and no key version is used twice.
CREATE TABLE pruned_keys (
    stream       text NOT NULL REFERENCES streams (name) ON DELETE CASCADE,
    key          text NOT NULL,
    key_version  bigint NOT NULL,
    PRIMARY KEY (stream, key)
);

-- As revision 0007 made it, but for the check that each head was found, and key
-- versions that go on after retention removed a key's events (pruned_keys).
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
        SELECT x.key, x.expected, coalesce(current_version.v, 0) AS actual
          INTO mismatch
          FROM unnest(expected_keys, expected_versions) AS x(key, expected)
         CROSS JOIN LATERAL (
                SELECT coalesce(max(e.key_version),
                                (SELECT k.key_version FROM pruned_keys k
                                  WHERE k.stream = stream_name AND k.key = x.key)) AS v
                  FROM events e
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
                SELECT coalesce(max(e.key_version),
                                (SELECT k.key_version FROM pruned_keys k
                                  WHERE k.stream = stream_name AND k.key = event_keys[n]),
                                0) AS version
                  FROM events e
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
         CROSS JOIN LATERAL (SELECT e.partition, e.position, e.id, e.key_version FROM events e
                              WHERE e.stream = stream_name
                                AND e.id >= event_ids[n] AND e.id <= event_ids[n]  -- as above
                              ORDER BY e.id LIMIT 1) AS e
         WHERE n <> ALL (event_ordinals);
    END IF;

    -- one notification per partition that received events; the channel is the schema's name
    PERFORM pg_notify(current_schema(),
                      json_build_object('stream', stream_name, 'partition', t.p,
                                        'head', t.old_head + t.c)::text)
       FROM unnest(touched, old_heads, touched_counts) AS t(p, old_head, c)
      WHERE t.c > 0;
END
$function$;;

UPDATE subengine.subengine_alembic_version SET version_num='0010' WHERE subengine.subengine_alembic_version.version_num = '0009';

-- Running upgrade 0010 -> 0011

-- Whether every element of `patterns` is a stream pattern: '*' (every stream), a stream
-- name (that stream), or a stream name followed by '*' (the streams it begins). Stream
-- names follow subengine.model._names.STREAM_NAME. NULL elements are not patterns.
CREATE FUNCTION valid_stream_patterns(patterns text[]) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN NOT EXISTS (
    SELECT FROM unnest(patterns) AS p
     WHERE p IS NULL OR p !~ '^(\*|[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}\*?)$'
);

CREATE TABLE gateway_keys (
    id           text PRIMARY KEY CHECK (id ~ '^[0-9a-f]{12}$'),
    name         text CHECK (char_length(name) BETWEEN 1 AND 200),
    secret_hash  bytea NOT NULL CHECK (octet_length(secret_hash) = 32),
    scopes       text[] NOT NULL CHECK (
                     cardinality(scopes) > 0
                     AND array_position(scopes, NULL) IS NULL
                     AND scopes <@ ARRAY['read', 'append', 'admin']),
    streams      text[] NOT NULL CHECK (
                     cardinality(streams) > 0 AND valid_stream_patterns(streams)),
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz CHECK (revoked_at >= created_at)
);
COMMENT ON TABLE gateway_keys IS
    'API keys of the HTTP gateway: the SHA-256 of each secret, never the secret.';
COMMENT ON COLUMN gateway_keys.secret_hash IS
    'SHA-256 of the secret part of the token sek_<id>_<secret>.';
COMMENT ON COLUMN gateway_keys.streams IS
    'Stream patterns: a stream name, a prefix ending in *, or * for every stream.';

CREATE TABLE gateway_secrets (
    name        text PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_]{0,62}$'),
    secret      bytea NOT NULL CHECK (octet_length(secret) >= 32),
    created_at  timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE gateway_secrets IS
    'Random secrets the gateway signs with (e.g. watch ids), shared by all its processes.';;

UPDATE subengine.subengine_alembic_version SET version_num='0011' WHERE subengine.subengine_alembic_version.version_num = '0010';

-- Running upgrade 0011 -> 0012

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
    'Each webhook subscription: state, last delivery, failed attempts and lag in events.';;

UPDATE subengine.subengine_alembic_version SET version_num='0012' WHERE subengine.subengine_alembic_version.version_num = '0011';

-- Running upgrade 0012 -> 0013

LOCK TABLE partitions IN SHARE MODE;

-- A row per key: its last version. Half of each page is left free, so that moving a
-- version stays on its page (a heap-only update: no index entry to add). No foreign key
-- to streams, as for events: its check would lock the stream's row from every append of
-- a new key, against delete_stream, which locks that row before the partitions'. Deleting
-- a stream deletes its keys before its row.
CREATE TABLE stream_keys (
    stream   text NOT NULL,
    key      text NOT NULL,
    version  bigint NOT NULL CHECK (version >= 0),
    PRIMARY KEY (stream, key)
) WITH (fillfactor = 50);
COMMENT ON TABLE stream_keys IS
    'The last key version of each key of a stream, also after retention removed its events.';

INSERT INTO stream_keys (stream, key, version)
SELECT k.stream, k.key, max(k.version)
  FROM (SELECT e.stream, e.key, max(e.key_version) AS version FROM events e GROUP BY 1, 2
        UNION ALL
        SELECT p.stream, p.key, p.key_version FROM pruned_keys p) AS k
 GROUP BY 1, 2;
ANALYZE stream_keys;

DROP TABLE pruned_keys;

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
$function$;;

UPDATE subengine.subengine_alembic_version SET version_num='0013' WHERE subengine.subengine_alembic_version.version_num = '0012';

COMMIT;

