-- The gateway's Durable Streams surface (docs/durable-streams.md): its catalog, producers,
-- the bytes of byte messages, and the engine streams left to delete. `{schema}` is
-- replaced by the configured schema, quoted as an identifier; values are bound. A part
-- (`-- part: ds_row`) is text several statements share: it stands where they write its
-- name in braces (`{ds_row}`).

-- part: ds_row
-- The columns of one Durable Streams stream (ds_stream, ds_lock_stream,
-- ds_stream_and_json; read by _durable_streams._stream_or_none), from ds_row_from.
SELECT d.path, d.stream, d.content_type, d.ttl_seconds, d.expires_at, d.deadline, d.tail,
       d.closed, d.closed_by_producer, d.closed_by_epoch, d.closed_by_seq, d.last_seq,
       s.epoch, p.floor, d.deadline IS NOT NULL AND d.deadline <= now() AS expired,
       d.deleted_at IS NOT NULL AS deleted, d.source, d.forked_from, d.fork_offset,
       d.fork_sub_offset, d.fork_point, inherited.streams, inherited.epochs,
       inherited.afters, inherited.uptos, inherited.cuts, inherited.floors

-- part: ds_row_from
-- A Durable Streams stream `d` with its engine stream `s`, partition `p` and, for a
-- fork, what it inherits (`inherited`): the FROM of ds_row; the statement adds its
-- WHERE.
  FROM {schema}.durable_streams d
  JOIN {schema}.streams s ON s.name = d.stream
  JOIN {schema}.partitions p ON p.stream = d.stream AND p.partition = 0
  -- a fork's inherited ranges, oldest first, with their engine streams' epochs and
  -- floors (NULL: that engine stream is gone)
  LEFT JOIN LATERAL (
      SELECT array_agg(i.source ORDER BY i.upto) AS streams,
             array_agg(si.epoch ORDER BY i.upto) AS epochs,
             array_agg(i.after ORDER BY i.upto) AS afters,
             array_agg(i.upto ORDER BY i.upto) AS uptos,
             array_agg(i.cut ORDER BY i.upto) AS cuts,
             array_agg(pi.floor ORDER BY i.upto) AS floors
        FROM {schema}.durable_stream_inherited i
        LEFT JOIN {schema}.streams si ON si.name = i.source
        LEFT JOIN {schema}.partitions pi ON pi.stream = i.source AND pi.partition = 0
       WHERE i.stream = d.stream AND d.source IS NOT NULL) AS inherited ON true

-- name: ds_stream
-- One Durable Streams stream by path, with its engine stream's epoch and floor, whether
-- it has expired (its deadline passed) or is deleted softly (forks still read it), and,
-- for a fork, what it inherits. With %(touch)s, a TTL stream that has not expired gets a
-- new deadline (a read or write resets the countdown); the row returned is the one
-- before that.
WITH touched AS (
    UPDATE {schema}.durable_streams
       SET deadline = now() + ttl_seconds * interval '1 second'
     WHERE path = %(path)s AND %(touch)s AND ttl_seconds IS NOT NULL AND deadline > now()
       AND deleted_at IS NULL
)
{ds_row}
{ds_row_from}
 WHERE d.path = %(path)s

-- name: ds_lock_stream
-- One Durable Streams stream by path, as ds_stream, its row locked until the transaction
-- ends: every append, close, fork of it and delete takes it, so that they (and their
-- producers' checks) are serialised.
{ds_row}
{ds_row_from}
 WHERE d.path = %(path)s
   FOR UPDATE OF d

-- name: ds_stream_and_json
-- ds_stream (without touching it) and, in the same snapshot, what ds_read_json reads
-- of the JSON engine stream %(stream)s after %(after)s, up to the tail found: a live
-- reader's look after a wake-up, in one statement. The messages come as two arrays,
-- positions and JSON texts (NULL: none, or the path is another engine stream now).
{ds_row}, messages.positions, messages.texts
{ds_row_from}
  -- ds_read_json's page, bounded by the tail of this snapshot
  LEFT JOIN LATERAL (
      SELECT array_agg(page.position ORDER BY page.position) AS positions,
             array_agg(page.data::text ORDER BY page.position) AS texts
        FROM (SELECT e.position, e.data,
                     sum(pg_column_size(e.data)) OVER (ORDER BY e.position)
                       - pg_column_size(e.data) AS before
                FROM {schema}.events e
               WHERE e.stream = %(stream)s AND d.stream = %(stream)s AND e.partition = 0
                 AND e.position > %(after)s AND e.position <= d.tail
               ORDER BY e.position
               LIMIT %(limit)s) AS page
       WHERE page.before < %(max_bytes)s) AS messages ON true
 WHERE d.path = %(path)s

-- name: ds_insert_stream
-- Add a stream to the catalog; returns nothing when the path is taken.
INSERT INTO {schema}.durable_streams (path, stream, content_type, ttl_seconds, expires_at,
                                      deadline)
VALUES (%(path)s, %(stream)s, %(content_type)s, %(ttl_seconds)s::bigint,
        %(expires_at)s::timestamptz,
        coalesce(%(expires_at)s::timestamptz,
                 now() + %(ttl_seconds)s::bigint * interval '1 second'))
ON CONFLICT (path) DO NOTHING
RETURNING stream

-- name: ds_append_plain
-- The whole of an append of JSON messages (json_events) without Stream-Seq, producer or
-- close, in one statement: with the connection in autocommit, one transaction and one
-- round trip where the general path takes five (issue 26). The stream's row is locked as
-- ds_lock_stream locks it; when the stream takes such an append as it is (neither closed,
-- expired nor deleted, its Content-Type JSON), the messages are appended to its engine
-- stream as append_json appends them, and the new tail and a TTL stream's new deadline
-- are recorded as ds_appended records them. Returns the row as locked and the positions
-- appended, NULL when nothing was written: the general path decides then.
WITH found AS MATERIALIZED (
{ds_row}
{ds_row_from}
 WHERE d.path = %(path)s
   FOR UPDATE OF d
),
plain AS MATERIALIZED (
    SELECT f.stream FROM found f
     WHERE NOT f.closed AND NOT f.deleted AND NOT f.expired
       -- catalog.media_type's, for the content types HTTP carries (Latin-1: "C" lowers
       -- only ASCII letters, so no other letter becomes one of these)
       AND lower(btrim(split_part(f.content_type, ';', 1), E' \t') COLLATE "C")
           = 'application/json'
),
stored AS MATERIALIZED (
    SELECT a.position
      FROM plain p
     CROSS JOIN ({json_events}) AS x
     CROSS JOIN LATERAL {schema}.append_events(
            p.stream, x.ids, x.keys, x.types, x.data, x.metadata, x.occurred_at,
            NULL, NULL, x.generated_ids) AS a
),
recorded AS (
    UPDATE {schema}.durable_streams d
       SET tail = (SELECT max(s.position) FROM stored s),
           deadline = CASE WHEN d.ttl_seconds IS NOT NULL
                           THEN now() + d.ttl_seconds * interval '1 second' ELSE d.deadline END
     WHERE d.path = %(path)s AND EXISTS (SELECT FROM stored)
)
SELECT f.*, (SELECT array_agg(s.position ORDER BY s.position) FROM stored s) FROM found f

-- name: ds_appended
-- What an append changed of a stream: its tail, last Stream-Seq, closed state (and the
-- producer request that closed it), and a TTL stream's deadline.
UPDATE {schema}.durable_streams
   SET tail = %(tail)s,
       last_seq = coalesce(%(last_seq)s::text, last_seq),
       closed = closed OR %(closed)s::boolean,
       closed_by_producer = CASE WHEN %(closed)s::boolean AND NOT closed THEN %(producer)s::text
                                 ELSE closed_by_producer END,
       closed_by_epoch = CASE WHEN %(closed)s::boolean AND NOT closed THEN %(epoch)s::bigint
                              ELSE closed_by_epoch END,
       closed_by_seq = CASE WHEN %(closed)s::boolean AND NOT closed THEN %(seq)s::bigint
                            ELSE closed_by_seq END,
       deadline = CASE WHEN ttl_seconds IS NOT NULL
                       THEN now() + ttl_seconds * interval '1 second' ELSE deadline END
 WHERE path = %(path)s

-- name: ds_producer
-- A producer's epoch and last accepted sequence on a stream (no row: a new producer).
SELECT epoch, seq FROM {schema}.durable_stream_producers
 WHERE stream = %(stream)s AND producer = %(producer)s

-- name: ds_put_producer
-- A producer's epoch and last accepted sequence, after the append it accepted.
INSERT INTO {schema}.durable_stream_producers (stream, producer, epoch, seq)
VALUES (%(stream)s, %(producer)s, %(epoch)s, %(seq)s)
ON CONFLICT (stream, producer) DO UPDATE SET epoch = excluded.epoch, seq = excluded.seq

-- name: ds_insert_bytes
-- The bytes of the messages of an append to a byte stream, at their events' positions.
INSERT INTO {schema}.durable_stream_bytes (stream, "position", body)
SELECT %(stream)s, m.position, m.body
  FROM unnest(%(positions)s::bigint[], %(bodies)s::bytea[]) AS m(position, body)

-- name: ds_read_bytes
-- The messages of a byte stream after a position, up to its tail, in position order: as
-- many as fit in %(max_bytes)s, and at least one.
SELECT page.position, page.body
  FROM (SELECT b.position, b.body,
               sum(octet_length(b.body)) OVER (ORDER BY b.position)
                 - octet_length(b.body) AS before
          FROM {schema}.durable_stream_bytes b
         WHERE b.stream = %(stream)s AND b.position > %(after)s AND b.position <= %(tail)s
         ORDER BY b.position
         LIMIT %(limit)s) AS page
 WHERE page.before < %(max_bytes)s
 ORDER BY page.position

-- name: ds_read_json
-- The messages of a JSON stream after a position, up to its tail, in position order, as
-- JSON text: as many as fit in about %(max_bytes)s (their stored size), and at least one.
-- Only the rows kept are written as text (the inner query reads up to `limit` rows).
SELECT page.position, page.data::text
  FROM (SELECT e.position, e.data,
               sum(pg_column_size(e.data)) OVER (ORDER BY e.position)
                 - pg_column_size(e.data) AS before
          FROM {schema}.events e
         WHERE e.stream = %(stream)s AND e.partition = 0
           AND e.position > %(after)s AND e.position <= %(tail)s
         ORDER BY e.position
         LIMIT %(limit)s) AS page
 WHERE page.before < %(max_bytes)s
 ORDER BY page.position

-- name: ds_delete_stream
-- Remove a stream from the catalog (its producers go with it) and leave its engine
-- stream to delete; returns that engine stream, or nothing when there was no such row.
-- With %(stream)s, only that incarnation of the path (an expired one, say).
WITH gone AS (
    DELETE FROM {schema}.durable_streams
     WHERE path = %(path)s AND (%(stream)s::text IS NULL OR stream = %(stream)s::text)
    RETURNING stream
), garbage AS (
    INSERT INTO {schema}.durable_stream_garbage (stream)
    SELECT stream FROM gone
    ON CONFLICT (stream) DO NOTHING
)
SELECT stream FROM gone

-- name: ds_expired
-- Streams whose deadline has passed, the longest expired first (a stream deleted softly
-- has no deadline).
SELECT path, stream FROM {schema}.durable_streams
 WHERE deadline <= now()
 ORDER BY deadline
 LIMIT %(limit)s

-- name: ds_garbage
-- Engine streams of deleted Durable Streams streams, still to delete, oldest first; not
-- those a subscription consumes (they wait until it is deleted).
SELECT g.stream FROM {schema}.durable_stream_garbage g
 WHERE NOT EXISTS (SELECT 1 FROM {schema}.subscriptions s WHERE s.stream = g.stream)
 ORDER BY g.created_at, g.stream
 LIMIT %(limit)s

-- name: ds_delete_bytes
-- Up to %(batch)s byte messages of a deleted stream; how many went.
DELETE FROM {schema}.durable_stream_bytes
 WHERE stream = %(stream)s
   AND "position" IN (SELECT b.position FROM {schema}.durable_stream_bytes b
                       WHERE b.stream = %(stream)s
                       ORDER BY b.position LIMIT %(batch)s)

-- name: ds_prune_bytes
-- Up to %(batch)s byte messages below their engine stream's floor (retention removed
-- their events, so nothing reads them); how many went.
DELETE FROM {schema}.durable_stream_bytes b
 USING (SELECT p.stream, below.position
          FROM {schema}.durable_streams d
          JOIN {schema}.partitions p ON p.stream = d.stream AND p.partition = 0
         CROSS JOIN LATERAL (
               SELECT x.position FROM {schema}.durable_stream_bytes x
                WHERE x.stream = p.stream AND x.position < p.floor
                ORDER BY x.position LIMIT %(batch)s) below
         WHERE p.floor > 1
         LIMIT %(batch)s) gone
 WHERE b.stream = gone.stream AND b.position = gone.position

-- name: ds_forget_garbage
-- A deleted stream's engine stream and bytes are gone.
DELETE FROM {schema}.durable_stream_garbage WHERE stream = %(stream)s

-- name: ds_subscriptions_of
-- How many subscriptions consume an engine stream.
SELECT count(*) FROM {schema}.subscriptions WHERE stream = %(stream)s
