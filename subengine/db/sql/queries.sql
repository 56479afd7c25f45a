-- Every query subengine runs at run time, as named blocks. `{schema}` is replaced by the
-- configured schema, quoted as an identifier; values are always bound parameters.

-- name: append_events
-- Append a batch of events in the caller's transaction (see the append_events function).
-- Arrays go in binary: escaping JSON text into array literals costs more than the insert.
SELECT ordinal, partition, position, id, key_version, duplicate
  FROM {schema}.append_events(
        %(stream)s::text, %(ids)b::uuid[], %(keys)b::text[], %(types)b::text[],
        %(data)b::jsonb[], %(metadata)b::jsonb[], %(occurred_at)b::timestamptz[],
        %(expected_keys)b::text[], %(expected_versions)b::bigint[])

-- name: create_stream
-- Create a stream and its partitions, with a retention policy or none; returns nothing
-- when the name is taken.
WITH created AS (
    INSERT INTO {schema}.streams (name, partitions, retention)
    VALUES (%(stream)s, %(partitions)s, %(retention)s)
    ON CONFLICT (name) DO NOTHING
    RETURNING name, partitions, created_at, epoch, retention
), heads AS (
    INSERT INTO {schema}.partitions (stream, partition)
    SELECT created.name, p FROM created, generate_series(0, created.partitions - 1) AS p
)
SELECT name, partitions, created_at, epoch, retention FROM created

-- name: get_stream
-- One stream by name.
SELECT name, partitions, created_at, epoch, retention FROM {schema}.streams
 WHERE name = %(stream)s

-- name: list_streams
-- Every stream, by name.
SELECT name, partitions, created_at, epoch, retention FROM {schema}.streams ORDER BY name

-- name: set_retention
-- Change a stream's retention policy (NULL: keep every event from now on).
UPDATE {schema}.streams SET retention = %(retention)s WHERE name = %(stream)s
RETURNING name, partitions, created_at, epoch, retention

-- name: retention_lock
-- The pruner's lock: one pruner at a time per database and schema (DESIGN.md,
-- "Retention and gaps"). A session lock of the two-key form, which no partition lock
-- (one bigint key) can take.
SELECT pg_try_advisory_lock(hashtext('subengine retention'), hashtext(%(schema)s))

-- name: pruner_settings
-- The pruner's connection commits without waiting for the disk: a batch holds its
-- partition's row from its floor update to its commit, and a flush of the batch's WAL
-- there would make appends to the partition wait for it. A batch lost in a server crash
-- loses its deletes and its floor together (one transaction), and a later run prunes
-- again.
SELECT set_config('synchronous_commit', 'off', false)

-- name: retention_unlock
SELECT pg_advisory_unlock(hashtext('subengine retention'), hashtext(%(schema)s))

-- name: retention_plan
-- Where retention wants each partition's floor now (`cut`: positions below it go), for
-- the streams with a policy, or one stream. An event goes when it is older than max_age,
-- when more than max_events newer events follow it in its partition, or when it and the
-- newer events of its partition hold more than max_bytes (data and metadata as JSON
-- text); with
-- keep_unprocessed, an event a subscription of the stream has not handled stays unless
-- it passes hard_max_age or hard_max_events. recorded_at never decreases along a
-- partition, so every limit keeps a suffix of the partition: the cut is a position.
-- Never above the head: nothing not yet committed is touched; never above what a
-- Durable Streams fork still reads (retention_hold), whatever the limits.
WITH policies AS (
    SELECT s.name AS stream,
           (s.retention ->> 'max_events')::bigint AS max_events,
           (s.retention ->> 'max_bytes')::bigint AS max_bytes,
           -- ages are at most 100 years (subengine.Retention); a policy written by hand
           -- with more must not overflow the timestamps and stop every stream's pruning
           now() - make_interval(secs => least((s.retention ->> 'max_age')::double precision,
                                               3153600000)) AS cutoff,
           coalesce((s.retention ->> 'keep_unprocessed')::boolean, false) AS keep,
           (s.retention ->> 'hard_max_events')::bigint AS hard_max_events,
           now() - make_interval(
               secs => least((s.retention ->> 'hard_max_age')::double precision, 3153600000))
               AS hard_cutoff
      FROM {schema}.streams s
     WHERE s.retention IS NOT NULL
       AND (%(stream)s::text IS NULL OR s.name = %(stream)s)
), each_limit AS (
    SELECT p.stream, p.partition, p.floor, p.head, pol.keep,
           p.head - pol.max_events + 1 AS count_soft,
           {schema}.retention_age_cut(p.stream, p.partition, p.head, p.head_time,
                                      pol.cutoff) AS age_soft,
           -- past the newest events that hold max_bytes together: read from the head
           -- down, and no further than the first event over the limit
           CASE WHEN pol.max_bytes IS NOT NULL THEN (
               SELECT sized.position + 1
                 FROM (SELECT e.position,
                              sum(octet_length(e.data::text) + octet_length(e.metadata::text))
                                  OVER (ORDER BY e.position DESC ROWS UNBOUNDED PRECEDING)
                                  AS newer_bytes
                         FROM {schema}.events e
                        WHERE e.stream = p.stream AND e.partition = p.partition
                          AND e.position <= p.head
                        ORDER BY e.position DESC) sized
                WHERE sized.newer_bytes > pol.max_bytes
                LIMIT 1) END AS bytes_soft,
           p.head - pol.hard_max_events + 1 AS count_hard,
           {schema}.retention_age_cut(p.stream, p.partition, p.head, p.head_time,
                                      pol.hard_cutoff) AS age_hard,
           CASE WHEN pol.keep
                THEN {schema}.retention_unhandled(p.stream, p.partition) END AS unprocessed
      FROM policies pol
      JOIN {schema}.partitions p ON p.stream = pol.stream
), limits AS (
    SELECT *, greatest(count_soft, age_soft, bytes_soft) AS soft,
           greatest(count_hard, age_hard) AS hard
      FROM each_limit
)
SELECT stream, partition, floor, head,
       greatest(floor, least(head + 1,
                             CASE WHEN keep THEN greatest(least(soft, unprocessed), hard)
                                  ELSE soft END,
                             {schema}.retention_hold(stream, partition, false))) AS cut,
       keep, hard,
       -- positions below these the age limits, and the count limits, want gone
       coalesce(greatest(age_soft, age_hard), 0) AS aged,
       coalesce(greatest(count_soft, bytes_soft, count_hard), 0) AS capped
  FROM limits
 ORDER BY stream, partition

-- name: prune_range
-- Remove positions %(from)s up to (not including) %(to)s of a partition and raise its
-- floor to the end of what went, in one statement: a reader's snapshot sees the events or
-- the new floor, never neither. With %(keep)s (keep_unprocessed), the end is also kept
-- below the next event of every subscription of the stream as they stand now (one
-- stored or reset since the run planned included), unless the hard limit's cut
-- %(hard)s is past it. Key versions stay as they are (stream_keys): a key left with no
-- event goes on at the version after its last one. The partition row is locked only by
-- the final UPDATE, after the deletes (it needs `summary`), so an append to the
-- partition waits at most for that UPDATE and the commit. `floor_time` becomes the time
-- of the last event removed; `aged_through` and `capped_through` the last position
-- removed below %(aged)s and %(capped)s, the cuts of the age and count limits (why it
-- went: a tombstone's reason). A partition whose row is gone (its stream being deleted)
-- loses nothing here and returns no row. Returns how many rows went and the floor. What
-- a Durable Streams fork still reads stays, whatever the limits: retention_hold waits
-- for a fork being created from the stream, and sees it.
WITH bound AS (
    SELECT least(CASE WHEN %(keep)s
                      THEN least(%(to)s::bigint,
                                 greatest({schema}.retention_unhandled(%(stream)s,
                                                                       %(partition)s),
                                          %(hard)s::bigint))
                      ELSE %(to)s::bigint END,
                 {schema}.retention_hold(%(stream)s, %(partition)s, true)) AS upto
      FROM {schema}.partitions
     WHERE stream = %(stream)s AND partition = %(partition)s
), gone AS (
    DELETE FROM {schema}.events
     WHERE stream = %(stream)s AND partition = %(partition)s
       AND position >= %(from)s AND position < (SELECT upto FROM bound)
    RETURNING position, recorded_at
), summary AS (
    SELECT count(*) AS removed, max(recorded_at) AS last_time FROM gone
)
UPDATE {schema}.partitions p
   SET floor = greatest(p.floor, bound.upto),
       floor_time = coalesce(
           CASE WHEN p.floor < bound.upto THEN summary.last_time END, p.floor_time),
       aged_through = CASE WHEN p.floor < bound.upto
                           THEN greatest(p.aged_through, least(%(aged)s::bigint, bound.upto) - 1)
                           ELSE p.aged_through END,
       capped_through = CASE WHEN p.floor < bound.upto
                             THEN greatest(p.capped_through,
                                           least(%(capped)s::bigint, bound.upto) - 1)
                             ELSE p.capped_through END
  FROM summary, bound
 WHERE p.stream = %(stream)s AND p.partition = %(partition)s
RETURNING summary.removed, p.floor

-- name: lock_gap
-- A subscription's position row in one partition, locked (waiting for a batch that holds
-- it), with its stream and the partition's floor, head and what its age and count limits
-- removed (the gap's reason): an operator is about to accept a gap.
SELECT sp.position, sp.generation, s.stream, p.floor, p.head, p.aged_through,
       p.capped_through
  FROM {schema}.subscription_positions sp
  JOIN {schema}.subscriptions s ON s.name = sp.subscription
  JOIN {schema}.partitions p ON p.stream = s.stream AND p.partition = sp.partition
 WHERE sp.subscription = %(name)s AND sp.partition = %(partition)s
   FOR UPDATE OF sp

-- name: accept_gap
-- Move a position past an accepted gap and restart the partition (same transaction as
-- the gap's record).
UPDATE {schema}.subscription_positions
   SET position = %(position)s,
       next_time = {schema}.next_event_time(%(stream)s, partition, %(position)s),
       stopped = false, attempts = 0, last_error = NULL, retry_at = NULL, updated_at = now()
 WHERE subscription = %(name)s AND partition = %(partition)s

-- name: partition_floor
-- A partition's floor, read after its events were found missing (it may have risen), and
-- the bounds a retried batch of the subscription's partition keeps (see fix_batch); with
-- its head and what its age and count limits removed (a gap's reason).
SELECT p.floor, sp.batch_through, p.head, p.aged_through, p.capped_through
  FROM {schema}.partitions p
  LEFT JOIN {schema}.subscription_positions sp
    ON sp.subscription = %(name)s AND sp.partition = p.partition
 WHERE p.stream = %(stream)s AND p.partition = %(partition)s

-- name: record_gap
-- A gap a subscription passes (policy skip, a gap handler, or an operator accepting it),
-- recorded in the transaction that moves its position past it.
INSERT INTO {schema}.gaps
       (subscription, stream, partition, generation, gap_from, gap_to, floor, reason, action)
VALUES (%(name)s, %(stream)s, %(partition)s, %(generation)s, %(gap_from)s, %(gap_to)s,
        %(floor)s, %(reason)s, %(action)s)

-- name: read_after
-- Up to `limit` events of one partition after a position, in position order, with the
-- stream's epoch and partition count (a stream with no such row does not exist) and the
-- partition's floor, read in the same snapshot as the events: positions below it are no
-- longer stored, and a read from before it meets their gap; the epoch says which stream
-- of the name the events are of. With no event after the position, one row of the
-- stream alone. Data and metadata come as JSON text: the gateway relays them as they
-- are, and the engine decodes them when they are read.
SELECT s.epoch, s.partitions, p.floor, p.head, p.aged_through, p.capped_through, e.id,
       e.stream, e.partition, e.position, e.key, e.key_version, e.type, e.data::text,
       e.metadata::text, e.occurred_at, e.recorded_at
  FROM {schema}.streams s
  LEFT JOIN {schema}.partitions p ON p.stream = s.name AND p.partition = %(partition)s
  LEFT JOIN LATERAL (
        SELECT * FROM {schema}.events e
         WHERE e.stream = s.name AND e.partition = %(partition)s AND e.position > %(after)s
         ORDER BY e.position
         LIMIT %(limit)s) e ON true
 WHERE s.name = %(stream)s
 ORDER BY e.position

-- name: read_since
-- Up to `limit` events of every partition recorded at or after a time, in recorded order
-- (ties by partition and position), with the stream's partition count and, in the same
-- snapshot, the partitions from which retention removed events recorded at or after the
-- time (their floor_time is not older), with their floors. Data and metadata come as JSON
-- text, which the engine decodes when they are read.
SELECT s.partitions, g.partitions, g.floors, g.heads, g.aged, g.capped, e.id, e.stream,
       e.partition, e.position, e.key, e.key_version, e.type, e.data::text,
       e.metadata::text, e.occurred_at, e.recorded_at
  FROM {schema}.streams s
  CROSS JOIN LATERAL (
        SELECT array_agg(p.partition ORDER BY p.partition) AS partitions,
               array_agg(p.floor ORDER BY p.partition) AS floors,
               array_agg(p.head ORDER BY p.partition) AS heads,
               array_agg(p.aged_through ORDER BY p.partition) AS aged,
               array_agg(p.capped_through ORDER BY p.partition) AS capped
          FROM {schema}.partitions p
         WHERE p.stream = s.name AND p.floor_time >= %(since)s) g
  LEFT JOIN LATERAL (
        SELECT * FROM {schema}.events e
         WHERE e.stream = s.name AND e.recorded_at >= %(since)s
         ORDER BY e.recorded_at, e.partition, e.position
         LIMIT %(limit)s) e ON true
 WHERE s.name = %(stream)s
 ORDER BY e.recorded_at, e.partition, e.position

-- name: read_page
-- A page of a stream after a cursor: up to `limit` events of the partitions whose head is
-- past the cursor's position for them (`positions`, partition order; missing: 0), oldest
-- first across partitions (recorded order, ties by partition and position, so each
-- partition's events come in position order), with the stream's epoch, partition count,
-- heads and floors read in the same snapshot as the events. Data and metadata come as
-- JSON text, which the gateway relays without decoding.
SELECT s.epoch, s.partitions, h.heads, h.floors, h.aged, h.capped, e.id, e.stream,
       e.partition, e.position, e.key, e.key_version, e.type, e.data::text,
       e.metadata::text, e.occurred_at, e.recorded_at
  FROM {schema}.streams s
  CROSS JOIN LATERAL (
        SELECT array_agg(p.head ORDER BY p.partition) AS heads,
               array_agg(p.floor ORDER BY p.partition) AS floors,
               array_agg(p.aged_through ORDER BY p.partition) AS aged,
               array_agg(p.capped_through ORDER BY p.partition) AS capped
          FROM {schema}.partitions p
         WHERE p.stream = s.name) h
  LEFT JOIN LATERAL (
        SELECT e.*
          FROM {schema}.partitions p
         CROSS JOIN LATERAL (
               SELECT * FROM {schema}.events e
                WHERE e.stream = p.stream AND e.partition = p.partition
                  AND e.position > coalesce((%(positions)s::bigint[])[p.partition + 1], 0)
                ORDER BY e.position
                LIMIT %(limit)s) e
         WHERE p.stream = s.name
           AND p.head > coalesce((%(positions)s::bigint[])[p.partition + 1], 0)
         ORDER BY e.recorded_at, e.partition, e.position
         LIMIT %(limit)s) e ON true
 WHERE s.name = %(stream)s
 ORDER BY e.recorded_at, e.partition, e.position

-- part: page_event_size
-- About how many bytes an event takes in a page of read_page_json (0 when the `keys` and
-- `types` filters pass over it): `overhead` (what its fixed parts take), its key and type
-- when they are sent, and its data and metadata when they are sent: their stored size, or
-- four times that when PostgreSQL compressed them (known without reading a TOASTed value).
CASE WHEN (%(keys)s::text[] IS NULL OR e.key = ANY (%(keys)s::text[]))
      AND (%(types)s::text[] IS NULL OR e.type = ANY (%(types)s::text[]))
     THEN %(overhead)s::int
          + CASE WHEN %(with_key)s::boolean THEN octet_length(e.key) ELSE 0 END
          + CASE WHEN %(with_type)s::boolean THEN octet_length(e.type) ELSE 0 END
          + CASE WHEN NOT %(with_metadata)s::boolean THEN 0
                 WHEN pg_column_compression(e.metadata) IS NULL THEN pg_column_size(e.metadata)
                 ELSE 4 * pg_column_size(e.metadata) END
          + CASE WHEN NOT %(with_data)s::boolean THEN 0
                 WHEN pg_column_compression(e.data) IS NULL THEN pg_column_size(e.data)
                 ELSE 4 * pg_column_size(e.data) END
     ELSE 0 END

-- name: read_page_json
-- read_page as the gateway sends it: the same page (up to `limit` events after the cursor
-- `positions`, oldest first across partitions, in one snapshot), a row per event with its
-- partition, its position and its JSON text, made here; NULL for an event that the `keys`
-- and `types` filters (NULL: all) pass over. The text is byte for byte what the gateway's
-- `event_json` writes (docs/gateway.md, "Reading events"): the same keys in the same
-- order, no spaces but those in data and metadata (jsonb's text), times as Python's
-- isoformat writes them in the session's time zone (a fraction only when there are
-- microseconds, an offset's seconds only when it has some), and of the fields only those
-- whose `with_<field>` is true (partition and position always). The stream's epoch,
-- partition count, heads and floors and what removed their gaps come on the first row
-- only (NULL on the others: decoded once). Positions that are not one per partition of
-- the stream read no events.
--
-- Bytes: the page also ends before the first event that would take the estimated size of
-- the kept events past `max_bytes` (the first event always comes), so that a page of
-- large events makes and sends about `max_bytes` of JSON, whatever its `limit`
-- (page_event_size; values that compress more than fourfold make more); `full` says, on
-- each row, whether the estimate reaches `max_bytes` with it. The caller cuts the page
-- exactly.
--
-- Which rows: the page is the first `limit` rows after the cursor in (recorded_at,
-- partition, position) order. For any time T, the first `limit` of the rows recorded at
-- or before T (and within `limit` of each partition's cursor) are a prefix of that order,
-- because recorded_at never decreases along a partition; they are the page itself when
-- there are at least `limit` of them. So rather than `limit` rows of every partition, it
-- reads up to T: probes at about 26% steps after each partition's cursor (positions are
-- dense from the floor to the head) tell, per candidate T, at least how many rows each
-- partition has by then, and about how many bytes (each probe's size for the rows since
-- the one before); T is the first probed time by which they add up to `limit` or to
-- `max_bytes` (none: no bound), and each partition is read up to its first probe after T.
-- With one partition and no `max_bytes` nothing is probed. The candidates are read
-- narrow (ctid, recorded_at, position, size); only the chosen rows are read whole, by
-- ctid, in the same snapshot: sorting the candidates whole, or writing JSON past the
-- bytes, took 2 to 5 times as long for events of 1.5 KB. Each probe and each
-- chosen row is a lateral lookup kept apart by `OFFSET 0`, so that its position (or
-- ctid) is the index's condition whatever the planner believes of the table: right
-- after a bulk append, before autovacuum's analyze, a join made it read every row of a
-- partition per probe (2.7 s for a page of a stream of 50,000 events). `OFFSET 0` also
-- keeps each event's recorded_at text a value made once: without it the planner writes
-- its expression into both places that use it.
SELECT CASE WHEN c.n IS NULL OR c.n = 1 THEN s.epoch END AS epoch,
       CASE WHEN c.n IS NULL OR c.n = 1 THEN s.partitions END AS partitions,
       CASE WHEN c.n IS NULL OR c.n = 1 THEN h.heads END AS heads,
       CASE WHEN c.n IS NULL OR c.n = 1 THEN h.floors END AS floors,
       CASE WHEN c.n IS NULL OR c.n = 1 THEN h.aged END AS aged,
       CASE WHEN c.n IS NULL OR c.n = 1 THEN h.capped END AS capped,
       c.partition, c.position, j.json, c.full
  FROM {schema}.streams s
  CROSS JOIN LATERAL (
        SELECT array_agg(p.head ORDER BY p.partition) AS heads,
               array_agg(p.floor ORDER BY p.partition) AS floors,
               array_agg(p.aged_through ORDER BY p.partition) AS aged,
               array_agg(p.capped_through ORDER BY p.partition) AS capped,
               CASE WHEN %(with_stream)s::boolean
                    THEN '{{"stream":' || to_json(s.name)::text || ',"partition":'
                    ELSE '{{"partition":' END AS prefix
          FROM {schema}.partitions p
         WHERE p.stream = s.name) h
  LEFT JOIN LATERAL (
        WITH cursor AS (
            SELECT p.partition, f.lo, least(p.head - f.lo, %(limit)s) AS n
              FROM {schema}.partitions p
             CROSS JOIN LATERAL (
                   SELECT greatest(coalesce((%(positions)s::bigint[])[p.partition + 1], 0),
                                   p.floor - 1) AS lo) f
             WHERE p.stream = s.name
               AND p.head > coalesce((%(positions)s::bigint[])[p.partition + 1], 0)
               AND coalesce(cardinality(%(positions)s::bigint[]), 0) IN (0, s.partitions)
        ), probe AS (
            SELECT c.partition, o.step, e.recorded_at AS at, e.size,
                   o.step - coalesce(lag(o.step) OVER (PARTITION BY c.partition ORDER BY o.step),
                                     0) AS gain
              FROM cursor c
             CROSS JOIN LATERAL (
                   SELECT DISTINCT least(round(power(10.0::float8, g / 10.0))::bigint, c.n) AS step
                     FROM generate_series(0, least(ceil(10 * log(%(limit)s::float8))::int, 180)) g) o
             CROSS JOIN LATERAL (
                   SELECT e.recorded_at, {page_event_size} AS size FROM {schema}.events e
                    WHERE e.stream = s.name AND e.partition = c.partition
                      AND e.position = c.lo + o.step
                   OFFSET 0) e
             WHERE (SELECT count(*) FROM cursor) > 1 OR %(bytes_bound)s::boolean
        ), bound AS (
            SELECT min(r.at) AS at
              FROM (SELECT probe.at, sum(probe.gain) OVER w AS reach,
                           sum(probe.gain * probe.size) OVER w AS bytes
                      FROM probe
                    WINDOW w AS (ORDER BY probe.at)) r
             WHERE r.reach >= %(limit)s OR r.bytes >= %(max_bytes)s
        ), span AS (
            SELECT c.partition, c.lo, b.at,
                   c.lo + coalesce((SELECT min(pr.step) - 1 FROM probe pr
                                     WHERE pr.partition = c.partition AND pr.at > b.at), c.n) AS hi
              FROM cursor c CROSS JOIN bound b
        )
        SELECT x.at, x.partition, x.position, x.n, x.before + x.size >= %(max_bytes)s AS full
          FROM (
                SELECT x.*, row_number() OVER w AS n, sum(x.size) OVER w - x.size AS before
                  FROM (
                        SELECT x.*
                          FROM span d
                         CROSS JOIN LATERAL (
                               SELECT e.ctid AS at, e.recorded_at, e.partition, e.position,
                                      {page_event_size} AS size
                                 FROM {schema}.events e
                                WHERE e.stream = s.name AND e.partition = d.partition
                                  AND e.position > d.lo AND e.position <= d.hi
                                  AND (d.at IS NULL OR e.recorded_at <= d.at)
                                ORDER BY e.position) x
                         ORDER BY x.recorded_at, x.partition, x.position
                         LIMIT %(limit)s) x
                WINDOW w AS (ORDER BY x.recorded_at, x.partition, x.position
                             ROWS UNBOUNDED PRECEDING)) x
         WHERE x.before < %(max_bytes)s OR x.n = 1) c ON true
  LEFT JOIN LATERAL (SELECT * FROM {schema}.events e WHERE e.ctid = c.at OFFSET 0) e ON true
  LEFT JOIN LATERAL (
        SELECT CASE WHEN %(with_occurred_at)s::boolean OR %(with_recorded_at)s::boolean THEN
               to_char(e.recorded_at,
                       CASE WHEN date_trunc('second', e.recorded_at) = e.recorded_at
                            THEN 'YYYY-MM-DD"T"HH24:MI:SSTZH:TZM'
                            ELSE 'YYYY-MM-DD"T"HH24:MI:SS.USTZH:TZM' END)
               || CASE WHEN extract(timezone FROM e.recorded_at)::int %% 60 = 0 THEN ''
                       ELSE ':' || lpad((abs(extract(timezone FROM e.recorded_at)::int) %% 60)::text,
                                        2, '0') END
               END AS recorded
        OFFSET 0) t ON true
  LEFT JOIN LATERAL (
        SELECT CASE WHEN (%(keys)s::text[] IS NULL OR e.key = ANY (%(keys)s::text[]))
                     AND (%(types)s::text[] IS NULL OR e.type = ANY (%(types)s::text[]))
               THEN h.prefix || e.partition
                    || ',"position":' || e.position
                    || CASE WHEN %(with_id)s::boolean THEN ',"id":"' || e.id || '"' ELSE '' END
                    || CASE WHEN %(with_key)s::boolean THEN ',"key":' || to_json(e.key)::text
                            ELSE '' END
                    || CASE WHEN %(with_key_version)s::boolean THEN ',"key_version":' || e.key_version
                            ELSE '' END
                    || CASE WHEN %(with_type)s::boolean THEN ',"type":' || to_json(e.type)::text
                            ELSE '' END
                    || CASE WHEN %(with_metadata)s::boolean THEN ',"metadata":' || e.metadata::text
                            ELSE '' END
                    || CASE WHEN NOT %(with_occurred_at)s::boolean THEN ''
                            WHEN e.occurred_at = e.recorded_at THEN ',"occurred_at":"' || t.recorded || '"'
                            ELSE ',"occurred_at":"'
                                 || to_char(e.occurred_at,
                                            CASE WHEN date_trunc('second', e.occurred_at) = e.occurred_at
                                                 THEN 'YYYY-MM-DD"T"HH24:MI:SSTZH:TZM'
                                                 ELSE 'YYYY-MM-DD"T"HH24:MI:SS.USTZH:TZM' END)
                                 || CASE WHEN extract(timezone FROM e.occurred_at)::int %% 60 = 0
                                         THEN ''
                                         ELSE ':' || lpad((abs(extract(timezone FROM e.occurred_at)::int)
                                                           %% 60)::text, 2, '0') END
                                 || '"'
                       END
                    || CASE WHEN %(with_recorded_at)s::boolean THEN ',"recorded_at":"' || t.recorded || '"'
                            ELSE '' END
                    || CASE WHEN %(with_data)s::boolean THEN ',"data":' || e.data::text ELSE '' END
                    || '}}'
               END AS json) j ON true
 WHERE s.name = %(stream)s
 ORDER BY c.n

-- name: positions_since
-- Where a reader of every partition stands just before the first event recorded at or
-- after a time, exactly (recorded_at never decreases along a partition): the position
-- before it, the head when there is none, and 0 when retention removed events recorded
-- at or after the time (a read then starts with their gap). With the stream's epoch.
SELECT s.epoch,
       array_agg(CASE WHEN p.floor_time >= %(since)s THEN 0
                      ELSE {schema}.retention_age_cut(p.stream, p.partition, p.head,
                                                      p.head_time, %(since)s) - 1
                 END ORDER BY p.partition)
  FROM {schema}.streams s
  JOIN {schema}.partitions p ON p.stream = s.name
 WHERE s.name = %(stream)s
 GROUP BY s.epoch

-- name: epochs_and_heads
-- The epoch and the head of every partition of some streams (a stream being deleted,
-- whose partitions are gone, has no heads).
SELECT s.name, s.epoch, array_agg(p.head ORDER BY p.partition) FILTER (WHERE p.head IS NOT NULL)
  FROM {schema}.streams s
  LEFT JOIN {schema}.partitions p ON p.stream = s.name
 WHERE s.name = ANY (%(streams)s::text[])
 GROUP BY s.name, s.epoch

-- name: partitions
-- Head, head time and floor of every partition of a stream.
SELECT stream, partition, head, head_time, floor
  FROM {schema}.partitions
 WHERE stream = %(stream)s
 ORDER BY partition

-- name: stream_name_taken
-- Why create_stream found a name taken: the stream's partition count, and whether it is
-- being deleted (its partitions are gone, its row not yet).
SELECT s.partitions, NOT EXISTS (SELECT FROM {schema}.partitions p WHERE p.stream = s.name)
  FROM {schema}.streams s
 WHERE s.name = %(stream)s

-- name: lock_stream_for_delete
-- A stream, its row locked until the transaction ends: a subscription of it being stored
-- (its foreign key takes a KEY SHARE lock on the row) commits before, and is seen, or
-- waits and then finds the stream's partitions gone.
SELECT name, partitions, created_at, epoch, retention FROM {schema}.streams
 WHERE name = %(stream)s
   FOR UPDATE

-- name: stream_durable_path
-- The Durable Streams path a stream holds, if any: that of the live stream, else of a
-- deleted one whose forks still read it.
SELECT path FROM {schema}.durable_streams
 WHERE stream = %(stream)s
 ORDER BY deleted_at NULLS FIRST
 LIMIT 1

-- name: stream_subscriptions
-- The names of the stored subscriptions of a stream.
SELECT name FROM {schema}.subscriptions WHERE stream = %(stream)s ORDER BY name

-- name: delete_partitions
-- A stream's partition rows, locked in ascending partition order as appends lock them
-- (so the two never deadlock): this waits for the appends in flight, and from its
-- commit every append to the stream fails (SE404, being deleted).
WITH locked AS (
    SELECT partition FROM {schema}.partitions
     WHERE stream = %(stream)s
     ORDER BY partition
       FOR UPDATE
)
DELETE FROM {schema}.partitions p USING locked l
 WHERE p.stream = %(stream)s AND p.partition = l.partition

-- name: delete_events_batch
-- Up to %(batch)s events of a partition of a stream being deleted, after position
-- %(after)s, by the primary key; how many went and the last position among them.
WITH gone AS (
    DELETE FROM {schema}.events e
     WHERE e.stream = %(stream)s AND e.partition = %(partition)s
       AND e.position IN (SELECT position FROM {schema}.events
                           WHERE stream = %(stream)s AND partition = %(partition)s
                             AND position > %(after)s
                           ORDER BY position
                           LIMIT %(batch)s)
    RETURNING e.position
)
SELECT count(*), coalesce(max(position), %(after)s) FROM gone

-- name: delete_keys_batch
-- Up to %(batch)s key rows (last versions) of a stream being deleted; how many went.
WITH gone AS (
    DELETE FROM {schema}.stream_keys k
     WHERE k.stream = %(stream)s
       AND k.key IN (SELECT key FROM {schema}.stream_keys WHERE stream = %(stream)s
                      ORDER BY key LIMIT %(batch)s)
    RETURNING 1
)
SELECT count(*) FROM gone

-- name: delete_stream
-- A stream's row, last, and only once nothing else of it is left (no partition, no
-- event, no key); its epoch.
DELETE FROM {schema}.streams s
 WHERE s.name = %(stream)s
   AND NOT EXISTS (SELECT FROM {schema}.partitions p WHERE p.stream = s.name)
   AND NOT EXISTS (SELECT FROM {schema}.events e WHERE e.stream = s.name)
   AND NOT EXISTS (SELECT FROM {schema}.stream_keys k WHERE k.stream = s.name)
RETURNING s.epoch

-- name: create_subscription
-- Store a subscription on first use; returns nothing when the name is taken.
INSERT INTO {schema}.subscriptions (name, stream, start)
VALUES (%(name)s, %(stream)s, %(start)s)
ON CONFLICT (name) DO NOTHING
RETURNING name

-- name: get_subscription
-- A stored subscription.
SELECT name, stream, start, generation, paused FROM {schema}.subscriptions WHERE name = %(name)s

-- name: write_positions
-- Set the partitions' positions of a subscription, as of generation %(generation)s: the
-- floor's eve (from the beginning: the oldest event stored), the head (from the end: the next event appended), the last
-- position recorded before a time, or the given one; and with each its next event's time.
-- Used on creation (a partition a position map does not name starts at 0) and by reset,
-- which also clears the failure state and, with %(only_named)s, moves only the partitions
-- a position map names.
INSERT INTO {schema}.subscription_positions AS sp
       (subscription, partition, position, generation, next_time)
SELECT %(name)s, w.partition, w.position, %(generation)s,
       {schema}.next_event_time(w.stream, w.partition, w.position)
  FROM (SELECT p.stream, p.partition,
               CASE %(kind)s
                 WHEN 'beginning' THEN p.floor - 1
                 WHEN 'end' THEN p.head
                 WHEN 'time' THEN (
                     SELECT coalesce(max(e.position),
                                     -- none stored from before: if retention removed
                                     -- events since the time, the subscription meets
                                     -- their gap; if not, it starts at the floor
                                     CASE WHEN p.floor_time >= %(time)s::timestamptz THEN 0
                                          ELSE p.floor - 1 END)
                       FROM {schema}.events e
                      WHERE e.stream = p.stream AND e.partition = p.partition
                        AND e.recorded_at < %(time)s::timestamptz)
                 ELSE coalesce((%(positions)s::jsonb ->> p.partition::text)::bigint, 0)
               END AS position
          FROM {schema}.partitions p
         WHERE p.stream = %(stream)s
           AND (%(kind)s <> 'positions' OR NOT %(only_named)s
                OR %(positions)s::jsonb ? p.partition::text)) AS w
ON CONFLICT (subscription, partition) DO UPDATE
   SET position = excluded.position, generation = excluded.generation,
       next_time = excluded.next_time, attempts = 0, last_error = NULL, stopped = false,
       retry_at = NULL, batch_through = NULL, updated_at = now()
RETURNING sp.partition, sp.position

-- name: lock_subscription
-- A stored subscription, locked until the transaction ends against resets and other
-- deletes; in a mode that still lets a failing batch record its dead letter (whose
-- foreign key takes a KEY SHARE lock on the row), so the two never deadlock.
SELECT name, stream FROM {schema}.subscriptions WHERE name = %(name)s FOR NO KEY UPDATE

-- name: workers_running
-- The connected workers that run a subscription (from their registration, and the
-- connections named after them) or hold one of its partitions.
SELECT w.host, w.pid
  FROM {schema}.workers_status w
 WHERE w.connected
   AND (%(name)s = ANY (w.subscriptions)
        OR EXISTS (SELECT FROM {schema}.partition_holders h
                    WHERE h.worker_id = w.id
                      AND h.lock_class = {schema}.lock_class(%(name)s)))
 ORDER BY w.started_at

-- name: delete_positions
-- A subscription's positions, first: this waits for its batches in flight (they hold
-- their position rows) before the subscription's row is locked for the delete.
DELETE FROM {schema}.subscription_positions WHERE subscription = %(name)s

-- name: delete_dead_letters
DELETE FROM {schema}.dead_letters WHERE subscription = %(name)s

-- name: delete_subscription
DELETE FROM {schema}.subscriptions WHERE name = %(name)s RETURNING stream

-- name: bump_generation
-- Start a new generation of a subscription (reset): every compare-and-set of the old one
-- fails from now on (DESIGN.md invariant 3).
UPDATE {schema}.subscriptions SET generation = generation + 1
 WHERE name = %(name)s
RETURNING stream, generation

-- name: lock_batch
-- A batch's chosen partition, in one statement at the start of its transaction (DESIGN.md,
-- Consume flow): its position row, locked until the transaction ends (waiting for a
-- batch that holds it), its head (events up to it are committed, so a partition that
-- shows fewer is missing some), the number of events the batch takes from it (its share:
-- at most %(size)s, one while it retries a failure, and never past the bounds an
-- at_least_once batch stored when it was first read) and those events plus one (the next
-- event's time). A paused subscription, or a partition whose retry is not due yet, counts
-- as halted: no events (a batch is the only way to run them, so the wait is kept here,
-- whoever asks). The events'
-- snapshot may be older than a row lock that waited, never newer than the head read
-- with it: positions are dense, so no event up to that head is invisible. Nothing when
-- the subscription is not stored for this stream (deleted, perhaps declared anew). Data
-- and metadata come as JSON text, which the engine decodes when a handler reads them.
WITH chosen AS MATERIALIZED (
    SELECT sp.partition, sp.position, sp.generation,
           sp.stopped OR s.paused OR coalesce(sp.retry_at > now(), false) AS halted,
           sp.attempts, p.head,
           greatest(0, least(p.head - sp.position,
                             CASE WHEN sp.attempts > 0 THEN 1 ELSE %(size)s END,
                             -- a batch read before and not committed: the same again
                             CASE WHEN sp.batch_through > sp.position
                                  THEN sp.batch_through - sp.position END))::bigint
               AS take
      FROM {schema}.subscription_positions sp
      JOIN {schema}.subscriptions s ON s.name = sp.subscription
      JOIN {schema}.partitions p ON p.stream = s.stream AND p.partition = sp.partition
     WHERE sp.subscription = %(name)s AND sp.partition = %(partition)s
       AND s.stream = %(stream)s
       FOR UPDATE OF sp
)
SELECT c.partition, c.position, c.generation, c.halted, c.attempts, c.head, c.take,
       e.id, e.stream, e.partition, e.position, e.key, e.key_version, e.type, e.data::text,
       e.metadata::text, e.occurred_at, e.recorded_at
  FROM chosen c
  LEFT JOIN LATERAL (
        SELECT * FROM {schema}.events e
         WHERE e.stream = %(stream)s AND e.partition = c.partition
           AND e.position > c.position AND NOT c.halted
         ORDER BY e.position
         LIMIT c.take + 1) e ON true
 ORDER BY e.position

-- name: lock_companions
-- The other partitions a transactional batch carries when its chosen partition left
-- room: the function lock_companions (migration 0008) says how. The same columns as
-- lock_batch, a partition after the other (data and metadata as JSON text).
SELECT part, part_position, part_generation, halted, attempts, head, take, id, stream,
       partition, position, key, key_version, type, data::text, metadata::text,
       occurred_at, recorded_at
  FROM {schema}.lock_companions(%(name)s, %(stream)s, %(partition)s, %(room)s, %(companions)s)

-- part: move_position
-- Compare-and-set the position of a batch of one partition (DESIGN.md invariant 3):
-- matches no row when another worker moved it or a reset bumped the generation. The
-- batch read the next event's time if there was one; if not, events committed since may
-- have brought one. Placed by commit_position and commit_webhook_batch.
UPDATE {schema}.subscription_positions
   SET position = %(new)s,
       next_time = coalesce(%(next_time)s::timestamptz,
                            {schema}.next_event_time(%(stream)s, %(partition)s, %(new)s)),
       attempts = 0, last_error = NULL, retry_at = NULL, batch_through = NULL,
       updated_at = now()
 WHERE subscription = %(name)s AND partition = %(partition)s
   AND position = %(old)s AND generation = %(generation)s
RETURNING partition, next_time

-- name: commit_position
-- The position of a batch of one partition moved past it (move_position).
{move_position}

-- name: fix_batch
-- Store the bounds of an at_least_once batch when it is first read, before its handlers
-- run (a retry, from any process, is then the same batch: see lock_batch). Writes only
-- when they are not stored yet. Fenced like the position.
UPDATE {schema}.subscription_positions
   SET batch_through = %(through)s
 WHERE subscription = %(name)s AND partition = %(partition)s
   AND position = %(position)s AND generation = %(generation)s
   AND batch_through IS DISTINCT FROM %(through)s

-- name: commit_positions
-- The same for a batch of several partitions, in one statement (the function
-- commit_positions, migration 0008): a row another worker moved, or whose generation a
-- reset bumped, matches nothing, and the caller rolls the whole batch back.
SELECT * FROM {schema}.commit_positions(
    %(name)s, %(stream)s, %(partitions)s::integer[], %(old)s::bigint[], %(new)s::bigint[],
    %(generations)s::bigint[], %(next_times)s::timestamptz[])

-- name: subscription_positions
-- Every partition's position of a subscription.
SELECT partition, position, generation, next_time, attempts, last_error, stopped
  FROM {schema}.subscription_positions
 WHERE subscription = %(name)s
 ORDER BY partition

-- name: look_for_work
-- A worker's look for work among its subscriptions (DESIGN.md invariant 7), in one
-- statement on a slot's lock connection:
-- 1. The suspects: partitions that grew since the worker last looked (every partition of
--    the subscriptions in %(whole)s, and the pairs in %(names)s × %(partitions)s). Those
--    whose position row has no next_time while the head is past the position get it now;
--    rows a batch holds are left to the next look (returned as 'deferred'): the batch may
--    commit before seeing the appends that made them suspects. A row whose batch has not
--    committed yet may still show its old next_time here, and is then neither marked nor
--    deferred: the worker whose batch it is makes it a suspect again when its partition
--    grew during the batch (_Board.grew_since). A suspect's head is read by the whole
--    key of its partition row, in a subquery of its own, and the `whole` subscriptions'
--    rows by their subscription, apart (OFFSET 0): joined with the rest, a plan made
--    without statistics (a new database, a new stream) read every partition of the
--    stream for each suspect, 6 s a look at 1,024 partitions by 100 subscriptions.
-- 2. The partitions with work, oldest next event first: per subscription, the first rows
--    of the index of rows with work, so the cost follows the work and not the number of
--    partitions, and the plan needs no statistics.
WITH suspect AS MATERIALIZED (
    SELECT sp.subscription, sp.partition
      FROM unnest(%(names)s::text[], %(partitions)s::integer[]) AS x(name, partition)
      JOIN {schema}.subscription_positions sp
        ON sp.subscription = x.name AND sp.partition = x.partition
      JOIN {schema}.subscriptions s ON s.name = sp.subscription
     WHERE sp.next_time IS NULL
       AND sp.position < (SELECT p.head FROM {schema}.partitions p
                           WHERE p.stream = s.stream AND p.partition = sp.partition)
    UNION
    SELECT sp.subscription, sp.partition
      FROM unnest(%(whole)s::text[]) AS x(name)
      JOIN {schema}.subscriptions s ON s.name = x.name
     CROSS JOIN LATERAL (
            SELECT sp.subscription, sp.partition
              FROM {schema}.subscription_positions sp
             WHERE sp.subscription = s.name AND sp.next_time IS NULL
               AND sp.position < (SELECT p.head FROM {schema}.partitions p
                                   WHERE p.stream = s.stream AND p.partition = sp.partition)
            OFFSET 0) AS sp
), marked AS (
    UPDATE {schema}.subscription_positions sp
       SET next_time = {schema}.next_event_time(s.stream, sp.partition, sp.position)
      FROM {schema}.subscriptions s
     WHERE s.name = sp.subscription
       AND (sp.subscription, sp.partition) IN (
            SELECT l.subscription, l.partition
              FROM {schema}.subscription_positions l
              JOIN suspect x ON x.subscription = l.subscription AND x.partition = l.partition
             WHERE l.next_time IS NULL
               FOR UPDATE OF l SKIP LOCKED)
    RETURNING sp.subscription, sp.partition, sp.next_time, sp.stopped OR s.paused AS halted,
              sp.retry_at
), work AS (
    SELECT m.subscription, m.partition, m.next_time
      FROM marked m
     WHERE m.next_time IS NOT NULL AND NOT m.halted
       AND (m.retry_at IS NULL OR m.retry_at <= now())
    UNION ALL
    SELECT w.subscription, w.partition, w.next_time
      FROM unnest(%(serving)s::text[]) AS n(name)
      JOIN {schema}.subscriptions s ON s.name = n.name AND NOT s.paused
     CROSS JOIN LATERAL (
            SELECT sp.subscription, sp.partition, sp.next_time
              FROM {schema}.subscription_positions sp
             WHERE sp.subscription = n.name AND sp.next_time IS NOT NULL AND NOT sp.stopped
               AND (sp.retry_at IS NULL OR sp.retry_at <= now())
             ORDER BY sp.next_time
             LIMIT %(limit)s) AS w
)
(SELECT subscription, partition, next_time, false AS deferred
   FROM work
  ORDER BY next_time, subscription, partition
  LIMIT %(limit)s)
UNION ALL
SELECT x.subscription, x.partition, NULL, true
  FROM suspect x
 WHERE NOT EXISTS (SELECT FROM marked m
                    WHERE m.subscription = x.subscription AND m.partition = x.partition)

-- name: poll_for_work
-- A worker's poll, once per poll interval whoever of its slots is idle: the sum of the
-- heads of each stream it reads (a notification lost or not yet seen shows as a sum that
-- differs from the heads the worker knows: heads only grow) and whether any of its
-- subscriptions has work it could take (a reset, a retry that is due, a partition another
-- worker left). With %(beat)s it is also the worker's heartbeat.
WITH beat AS (
    INSERT INTO {schema}.workers (id, host, pid, subscriptions, serves_metrics)
    SELECT %(id)s, %(host)s, %(pid)s, %(serving)s, %(serves_metrics)s
     WHERE %(beat)s
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()
)
SELECT (SELECT coalesce(jsonb_object_agg(t.stream, t.total), '{{}}')
          FROM (SELECT p.stream, sum(p.head) AS total
                  FROM {schema}.partitions p
                 WHERE p.stream = ANY (%(streams)s::text[])
                 GROUP BY p.stream) AS t),
       EXISTS (SELECT FROM unnest(%(serving)s::text[]) AS n(name)
                 JOIN {schema}.subscriptions s ON s.name = n.name AND NOT s.paused
                WHERE EXISTS (
                      SELECT FROM {schema}.subscription_positions sp
                       WHERE sp.subscription = n.name AND sp.next_time IS NOT NULL
                         AND NOT sp.stopped
                         AND (sp.retry_at IS NULL OR sp.retry_at <= now())))

-- name: stream_heads
-- The head of every partition of some streams.
SELECT stream, partition, head FROM {schema}.partitions WHERE stream = ANY (%(streams)s::text[])

-- name: lock_partition
-- A worker slot takes the advisory lock of a (subscription, partition) on its lock
-- connection and, only if it got it, releases the one it held (NULL: none), in one round
-- trip. Session locks: they live as long as the connection, so a slot whose connection
-- ends has lost them (correctness never rests on them: DESIGN.md invariant 3).
WITH try AS MATERIALIZED (SELECT pg_try_advisory_lock(%(key)s) AS got)
SELECT got, CASE WHEN got THEN pg_advisory_unlock(%(held)s) END FROM try

-- name: serving_backend_pid
-- The process id of the server session serving this statement. On a direct connection it
-- is the one libpq was given at start-up; behind a transaction-mode pooler it is not
-- (db/_connection.py: prepared statements are then off).
SELECT pg_backend_pid()

-- name: worker_connection_settings
-- The worker's own connections (each slot's lock connection and the poller's) run only
-- the worker's statements: the look, the lock statements, the poll, the heads. Their
-- plans need no statistics and no parameter values (the index of rows with work, keys),
-- and re-planning them for their values on every call cost more than running them
-- (measured: a look planned in 1.1 ms and ran in 0.7 ms at 1,024 partitions), so their
-- prepared statements keep one plan. They commit without waiting for the disk: their
-- only writes are a look's next_time marks, which a look after a server crash makes
-- again, and the heartbeat, which is for inspection only.
SELECT set_config('synchronous_commit', 'off', false),
       set_config('plan_cache_mode', 'force_generic_plan', false)

-- name: unlock_partition
-- A worker slot gives a partition's lock back.
SELECT pg_advisory_unlock(%(key)s)

-- name: subscription_lag
-- Position and head of every partition of some subscriptions, whether it is halted
-- (stopped or paused), and whether this worker reports the subscription's lag: of the
-- connected workers running it that serve metrics, the one of lowest id does, so that
-- summing the gauges over workers counts each partition once (worked out once a
-- subscription: MATERIALIZED, or the planner may ask pg_stat_activity once a partition
-- row, 102,400 times at 1,024 partitions by 100 subscriptions). For the worker's lag
-- gauges and progress lines; unlike the subscription_status view it reads neither
-- pg_locks nor the events.
WITH reporters AS MATERIALIZED (
    SELECT name, (SELECT min(w.id::text) FROM {schema}.workers w
                   WHERE name = ANY (w.subscriptions) AND w.serves_metrics
                     AND EXISTS (SELECT FROM pg_stat_activity a
                                  WHERE a.application_name = 'subengine worker ' || w.id::text))
                 AS reporter
      FROM unnest(%(names)s::text[]) AS name
)
SELECT sp.subscription, sp.partition, sp.position, p.head, sp.stopped OR s.paused,
       coalesce(r.reporter = %(worker)s::text, true)
  FROM {schema}.subscription_positions sp
  JOIN {schema}.subscriptions s ON s.name = sp.subscription
  JOIN {schema}.partitions p ON p.stream = s.stream AND p.partition = sp.partition
  JOIN reporters r ON r.name = sp.subscription
 WHERE sp.subscription = ANY (%(names)s)
 ORDER BY 1, 2

-- name: record_failure
-- Count a failed attempt of a partition's next batch, with its error; it is tried again
-- after `delay` seconds, doubled for every earlier failure, at most `delay_max`. Fenced
-- like the position itself (DESIGN.md invariant 3): matches no row when a reset or
-- another worker moved the position since the batch read it.
UPDATE {schema}.subscription_positions
   SET attempts = attempts + 1, last_error = %(error)s, updated_at = now(),
       retry_at = clock_timestamp()
                  + make_interval(secs => least(%(delay)s * 2 ^ attempts, %(delay_max)s))
 WHERE subscription = %(name)s AND partition = %(partition)s
   AND position = %(position)s AND generation = %(generation)s
RETURNING attempts

-- name: postpone_batch
-- A handler asked to handle the partition's next batch again later (RetryLater): keep
-- its reason and make every worker wait `seconds`. No attempt is counted (that would
-- make the next batch a single event, to find a failing one). The batch's bounds are
-- kept (a gap's too, which no read stored): the retry is the same batch. Fenced like the
-- position.
UPDATE {schema}.subscription_positions
   SET last_error = %(error)s, updated_at = now(),
       retry_at = clock_timestamp() + make_interval(secs => %(seconds)s),
       batch_through = CASE WHEN %(through)s::bigint > position THEN %(through)s::bigint
                            ELSE batch_through END
 WHERE subscription = %(name)s AND partition = %(partition)s
   AND position = %(position)s AND generation = %(generation)s
RETURNING position

-- name: skip_event
-- Move past a dead-lettered event (same transaction as its dead_letters row); its error
-- now lives there, so the position row's failure state is cleared. Fenced.
UPDATE {schema}.subscription_positions
   SET position = position + 1,
       next_time = {schema}.next_event_time(
           (SELECT s.stream FROM {schema}.subscriptions s WHERE s.name = %(name)s),
           partition, position + 1),
       attempts = 0, last_error = NULL, retry_at = NULL, updated_at = now()
 WHERE subscription = %(name)s AND partition = %(partition)s
   AND position = %(position)s AND generation = %(generation)s

-- name: stop_partition
-- Halt a partition: after its last allowed attempt (policy `stop`), or before events that
-- are no longer stored (then with the error that says so). Fenced.
UPDATE {schema}.subscription_positions
   SET stopped = true, retry_at = NULL, last_error = coalesce(%(error)s, last_error),
       updated_at = now()
 WHERE subscription = %(name)s AND partition = %(partition)s
   AND position = %(position)s AND generation = %(generation)s

-- name: supersede_dead_letters
-- An event about to be dead-lettered again (a reset replayed it): its open dead letters
-- of earlier generations are closed, so only the newest is open.
UPDATE {schema}.dead_letters
   SET resolution = 'superseded', resolved_at = now()
 WHERE subscription = %(name)s AND partition = %(partition)s AND position = %(position)s
   AND resolution IS NULL

-- name: dead_letter
-- Record the event after the position as dead (policy `dead_letter`), in the position's
-- generation; returns nothing when the event is no longer stored.
INSERT INTO {schema}.dead_letters
       (subscription, partition, position, generation, event_id, error, attempts)
SELECT %(name)s, e.partition, e.position, %(generation)s, e.id, %(error)s, %(attempts)s
  FROM {schema}.events e
 WHERE e.stream = %(stream)s AND e.partition = %(partition)s AND e.position = %(position)s
RETURNING position

-- name: register_worker
-- A worker, for inspection.
INSERT INTO {schema}.workers (id, host, pid, subscriptions, serves_metrics)
VALUES (%(id)s, %(host)s, %(pid)s, %(names)s, %(serves_metrics)s)

-- name: prune_workers
-- Remove the registrations of workers that are gone: none of their connections is open
-- (they are named after the worker) and they have not beaten for %(grace)s seconds (a
-- worker that has just registered may not have opened its own connections yet).
DELETE FROM {schema}.workers w
 WHERE w.heartbeat_at < now() - make_interval(secs => %(grace)s)
   AND NOT EXISTS (SELECT FROM pg_stat_activity a
                    WHERE a.application_name = 'subengine worker ' || w.id::text)
RETURNING w.id, w.host, w.pid, w.subscriptions, w.started_at, w.heartbeat_at

-- name: unregister_worker
DELETE FROM {schema}.workers WHERE id = %(id)s

-- name: list_subscriptions
-- Every stored subscription.
SELECT name, stream, start, generation, paused, created_at
  FROM {schema}.subscriptions
 ORDER BY name

-- name: subscription_summary
-- One row per subscription: its partitions' lag in events and seconds, their states, how
-- many connected workers run it, and its parked keys with the events waiting under them.
SELECT subscription, stream, count(*) AS partitions, sum(lag) AS lag,
       max(lag_seconds) AS lag_seconds, max(generation) AS generation,
       count(*) FILTER (WHERE state = 'ok') AS ok,
       count(*) FILTER (WHERE state = 'idle') AS idle,
       count(*) FILTER (WHERE state = 'retrying') AS retrying,
       count(*) FILTER (WHERE state = 'stopped') AS stopped,
       count(*) FILTER (WHERE state = 'paused') AS paused,
       (SELECT count(*) FROM {schema}.workers_status w
         WHERE w.connected AND subscription = ANY (w.subscriptions)) AS workers,
       count(*) FILTER (WHERE state = 'gap') AS gap,
       sum(parked_keys)::bigint AS parked_keys, sum(parked_events)::bigint AS parked_events
  FROM {schema}.subscription_status
 WHERE %(name)s::text IS NULL OR subscription = %(name)s
 GROUP BY subscription, stream
 ORDER BY subscription

-- name: subscription_status
-- The status view's rows of one subscription, or of all.
SELECT subscription, stream, partition, position, head, lag, next_event_at, lag_seconds,
       state, attempts, last_error, retry_at, generation, worker_id, worker_host, worker_pid,
       updated_at, floor, gap_from, gap_to, parked_keys, parked_events
  FROM {schema}.subscription_status
 WHERE %(name)s::text IS NULL OR subscription = %(name)s
 ORDER BY subscription, partition

-- name: set_paused
-- Pause or resume a subscription; resuming also restarts its stopped partitions.
WITH s AS (
    UPDATE {schema}.subscriptions SET paused = %(paused)s WHERE name = %(name)s RETURNING name
)
UPDATE {schema}.subscription_positions sp
   SET stopped = false, attempts = 0, retry_at = NULL, updated_at = now()
  FROM s
 WHERE sp.subscription = s.name AND NOT %(paused)s AND sp.stopped
RETURNING sp.partition

-- name: subscription_exists
SELECT 1 FROM {schema}.subscriptions WHERE name = %(name)s

-- name: workers_status
SELECT id, host, pid, subscriptions, started_at, heartbeat_at, seconds_since_heartbeat,
       connected, partitions_held
  FROM {schema}.workers_status
 ORDER BY started_at

-- name: list_dead_letters
-- Dead letters, unresolved ones only unless %(all)s.
SELECT d.subscription, s.stream, d.partition, d.position, d.generation, d.event_id, e.key,
       e.type, d.error, d.attempts, d.retries, d.resolution, d.created_at, d.resolved_at
  FROM {schema}.dead_letters d
  JOIN {schema}.subscriptions s ON s.name = d.subscription
  LEFT JOIN {schema}.events e
    ON e.stream = s.stream AND e.partition = d.partition AND e.position = d.position
 WHERE (%(name)s::text IS NULL OR d.subscription = %(name)s)
   AND (%(all)s OR d.resolution IS NULL)
 ORDER BY d.created_at, d.subscription, d.partition, d.position

-- name: lock_dead_letter
-- An unresolved dead letter, locked for its retry or discard.
SELECT d.event_id, s.stream
  FROM {schema}.dead_letters d
  JOIN {schema}.subscriptions s ON s.name = d.subscription
 WHERE d.subscription = %(name)s AND d.partition = %(partition)s
   AND d.position = %(position)s AND d.resolution IS NULL
   FOR UPDATE OF d

-- name: resolve_dead_letter
-- Resolve the open dead letter of an event (there is at most one).
UPDATE {schema}.dead_letters
   SET resolution = %(resolution)s, resolved_at = now(),
       retries = retries + CASE WHEN %(resolution)s = 'retried' THEN 1 ELSE 0 END
 WHERE subscription = %(name)s AND partition = %(partition)s AND position = %(position)s
   AND resolution IS NULL

-- name: dead_letter_retry_failed
UPDATE {schema}.dead_letters
   SET retries = retries + 1, error = %(error)s
 WHERE subscription = %(name)s AND partition = %(partition)s AND position = %(position)s
   AND resolution IS NULL

-- name: create_gateway_key
-- Store a new API key of the gateway (the SHA-256 of its secret, never the secret);
-- returns nothing when the id drawn for it is taken already. Notifies the gateways, in
-- the same transaction, that their cached keys are stale (sql/listen.sql).
INSERT INTO {schema}.gateway_keys (id, name, secret_hash, scopes, streams)
VALUES (%(id)s, %(name)s, %(secret_hash)s, %(scopes)s, %(streams)s)
ON CONFLICT (id) DO NOTHING
RETURNING id, name, scopes, streams, created_at, revoked_at,
          pg_notify((parse_ident('{schema}'))[1], 'gateway_keys')::text

-- name: list_gateway_keys
-- Every API key, revoked ones included, oldest first (no hashes).
SELECT id, name, scopes, streams, created_at, revoked_at FROM {schema}.gateway_keys
 ORDER BY created_at, id

-- name: revoke_gateway_key
-- Revoke an API key; a key revoked already keeps the time it was first revoked. The
-- clock, not the transaction's start, so that it never precedes created_at. Notifies
-- the gateways, in the same transaction, that their cached keys are stale.
UPDATE {schema}.gateway_keys SET revoked_at = coalesce(revoked_at, clock_timestamp())
 WHERE id = %(id)s
RETURNING id, name, scopes, streams, created_at, revoked_at,
          pg_notify((parse_ident('{schema}'))[1], 'gateway_keys')::text

-- name: gateway_key_for_token
-- The API key a token names by its id, with the hash its secret must have.
SELECT id, name, scopes, streams, created_at, revoked_at, secret_hash
  FROM {schema}.gateway_keys WHERE id = %(id)s

-- name: any_active_gateway_key
-- Whether any API key is not revoked (without one, the gateway is open, on loopback only).
SELECT EXISTS (SELECT FROM {schema}.gateway_keys WHERE revoked_at IS NULL)

-- name: gateway_signing_secret
-- The secret named %(name)s, stored as %(secret)s by the first caller: every caller gets
-- the same one. A stored secret is read without a write. Two first callers at once both
-- insert; the second waits for the first to commit, and then its DO UPDATE (which, unlike
-- DO NOTHING, sees a row committed after the statement began) returns the first one's
-- secret unchanged. A SELECT after DO NOTHING would miss that row in this statement.
WITH stored AS (
    SELECT secret FROM {schema}.gateway_secrets WHERE name = %(name)s
), created AS (
    INSERT INTO {schema}.gateway_secrets AS s (name, secret)
    SELECT %(name)s, %(secret)s WHERE NOT EXISTS (SELECT FROM stored)
    ON CONFLICT (name) DO UPDATE SET secret = s.secret
    RETURNING s.secret
)
SELECT secret FROM stored
UNION ALL
SELECT secret FROM created

-- name: spark_read_plan
-- For the rest of a range read's transaction: walk the primary key, which yields positions
-- in order, rather than sort a bitmap scan's rows (measured: about twice as fast), and
-- leave the cores to Spark's own parallel tasks.
SELECT set_config('enable_sort', 'off', true),
       set_config('max_parallel_workers_per_gather', '0', true)

-- name: spark_read_range
-- The events of one partition in positions (after, upto], in position order, in the binary
-- COPY format, which spark/_binary_copy.py decodes: nothing to escape or parse, times as
-- integers. The fixed-width columns first, so that they lie at the same place in every
-- row; stream and partition are constant and added by the reader.
COPY (
    SELECT e.position, e.key_version, e.occurred_at, e.recorded_at, e.id,
           e.key, e.type, e.data, e.metadata
      FROM {schema}.events e
     WHERE e.stream = %(stream)s AND e.partition = %(partition)s
       AND e.position > %(after)s AND e.position <= %(upto)s
       AND e.recorded_at >= %(since)s AND e.recorded_at < %(until)s
     ORDER BY e.position
) TO STDOUT (FORMAT binary)

-- name: spark_subscription
-- The stream a subscription reads and its position in every partition.
SELECT s.stream, sp.partition, sp.position
  FROM {schema}.subscriptions s
  LEFT JOIN {schema}.subscription_positions sp ON sp.subscription = s.name
 WHERE s.name = %(name)s
 ORDER BY sp.partition

-- name: spark_advance_subscription
-- Move a subscription forward to the end of a committed Spark micro-batch, so that lag and
-- retention see Spark's progress. Never moves a position back; the generation is kept.
UPDATE {schema}.subscription_positions sp
   SET position = x.position, next_time = {schema}.next_event_time(s.stream, sp.partition, x.position),
       attempts = 0, last_error = NULL, retry_at = NULL, updated_at = now()
  FROM unnest(%(partitions)s::integer[], %(positions)s::bigint[]) AS x(partition, position),
       {schema}.subscriptions s
 WHERE sp.subscription = %(name)s AND sp.partition = x.partition AND sp.position < x.position
   AND s.name = sp.subscription

-- name: spark_stage
-- A Spark write task's rows, staged under its attempt until the write commits.
COPY {schema}.spark_staged_events (
    write_id, batch, attempt, row_number, spark_partition, content, occurrence, id, key, type,
    data, metadata, occurred_at, expected_version
) FROM STDIN

-- name: spark_staged_counts
-- How many rows each of these attempts of a write has staged.
SELECT s.attempt, count(*)
  FROM {schema}.spark_staged_events s
 WHERE s.write_id = %(write_id)s AND s.batch = %(batch)s AND s.attempt = ANY (%(attempts)s)
 GROUP BY s.attempt

-- name: spark_lock_partitions
-- Take the append locks of the partitions a write's commit appends to, in ascending order
-- as append_events does, before its first append: the commit appends in chunks, and
-- chunks taking the locks one after another could deadlock with another commit.
SELECT p.partition
  FROM {schema}.partitions p
 WHERE p.stream = %(stream)s AND p.partition = ANY (%(partitions)s)
 ORDER BY p.partition
   FOR NO KEY UPDATE

-- name: spark_plan_by_hashing
-- For the next statement of a commit, which joins a write's staged rows with themselves:
-- no nested loops. The staging table's statistics say little about the write at hand (its
-- rows came in after the last analyze), and a nested loop over rows estimated as a few
-- costs the square of the write's size; hashing costs its size. Returns the setting to
-- restore with spark_plan_restore.
SELECT current_setting('enable_nestloop'), set_config('enable_nestloop', 'off', true)

-- name: spark_plan_restore
SELECT set_config('enable_nestloop', %(setting)s, true)

-- name: spark_number_shared_rows
-- Number the identical rows of a write's committed attempts: a row's occurrence, staged
-- as its number among the identical rows of its attempt, becomes its number among those
-- of the whole write, counted in the order of the Spark partitions and of the rows in
-- each, so that each row of a content has a number of its own whichever task held it.
-- Rows with an id of their own need none. Updates only rows whose content other
-- attempts hold too.
UPDATE {schema}.spark_staged_events s
   SET occurrence = n.numbered
  FROM (SELECT attempt, row_number, occurrence,
               row_number() OVER (PARTITION BY content ORDER BY spark_partition, row_number) - 1
               AS numbered
          FROM {schema}.spark_staged_events
         WHERE write_id = %(write_id)s AND batch = %(batch)s AND attempt = ANY (%(attempts)s)
           AND id IS NULL) AS n
 WHERE s.write_id = %(write_id)s AND s.batch = %(batch)s AND s.attempt = n.attempt
   AND s.row_number = n.row_number AND n.numbered <> n.occurrence

-- name: spark_expected_versions
-- A key whose rows in a write disagree on expected_version (low <> high), or whose version
-- is not the expected one unless the write stored its rows already (it is run again after
-- it committed: its first row of the key with an expected version is stored); nothing
-- when every key is as expected. One pass over the write's rows with an expected version,
-- then a lookup of each key's row. Run under the append locks, after spark_number_shared_rows.
WITH firsts AS (
    SELECT DISTINCT ON (s.key) s.key,
           coalesce(s.id, {schema}.spark_event_id(s.content, s.occurrence)) AS first_id,
           min(s.expected_version) OVER per_key AS low,
           max(s.expected_version) OVER per_key AS high
      FROM {schema}.spark_staged_events s
     WHERE s.write_id = %(write_id)s AND s.batch = %(batch)s AND s.attempt = ANY (%(attempts)s)
       AND s.expected_version IS NOT NULL
    WINDOW per_key AS (PARTITION BY s.key)
     ORDER BY s.key, s.spark_partition, s.row_number
)
SELECT f.key, f.low, f.high, coalesce(k.version, 0)
  FROM firsts f
  LEFT JOIN {schema}.stream_keys k ON k.stream = %(stream)s AND k.key = f.key
 WHERE f.low <> f.high
    OR (coalesce(k.version, 0) <> f.low
        AND NOT EXISTS (SELECT 1 FROM {schema}.events e
                         WHERE e.stream = %(stream)s AND e.id = f.first_id))
 LIMIT 1

-- name: spark_append_staged
-- Append rows (after, upto] of one staged attempt with append_events, ids derived from
-- each row's content and number in the write; returns the events stored and the rows
-- whose id was stored already.
WITH chunk AS (
    SELECT array_agg(coalesce(s.id, {schema}.spark_event_id(s.content, s.occurrence))
                     ORDER BY s.row_number) AS ids,
           array_agg(s.key ORDER BY s.row_number) AS keys,
           array_agg(s.type ORDER BY s.row_number) AS types,
           array_agg(s.data ORDER BY s.row_number) AS data,
           array_agg(s.metadata ORDER BY s.row_number) AS metadata,
           array_agg(s.occurred_at ORDER BY s.row_number) AS occurred_at
      FROM {schema}.spark_staged_events s
     WHERE s.write_id = %(write_id)s AND s.batch = %(batch)s AND s.attempt = %(attempt)s
       AND s.row_number > %(after)s AND s.row_number <= %(upto)s
)
SELECT count(*) FILTER (WHERE NOT a.duplicate), count(*) FILTER (WHERE a.duplicate)
  FROM chunk
 CROSS JOIN LATERAL {schema}.append_events(
        %(stream)s::text, chunk.ids, chunk.keys, chunk.types, chunk.data, chunk.metadata,
        chunk.occurred_at) AS a

-- name: spark_discard_staged
-- Delete the staged rows of a write, of every attempt: after its commit or abort, and for
-- a streaming query those of its earlier micro-batches too.
DELETE FROM {schema}.spark_staged_events
 WHERE write_id = %(write_id)s AND batch <= %(batch)s
