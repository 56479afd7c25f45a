-- Forks of Durable Streams streams (docs/durable-streams.md, "Forks"): creating one, the
-- reads that stitch what it inherits to its own messages, and deleting softly a stream
-- that forks still read. `{schema}` is replaced by the configured schema, quoted as an
-- identifier; values are bound.

-- name: ds_insert_fork
-- Add a fork to the catalog: its own messages follow position %(fork_point)s, so that
-- is its tail until it has some; returns nothing when the path is taken.
INSERT INTO {schema}.durable_streams (path, stream, content_type, ttl_seconds, expires_at,
                                      deadline, tail, source, forked_from, fork_offset,
                                      fork_sub_offset, fork_point)
VALUES (%(path)s, %(stream)s, %(content_type)s, %(ttl_seconds)s::bigint,
        %(expires_at)s::timestamptz,
        coalesce(%(expires_at)s::timestamptz,
                 now() + %(ttl_seconds)s::bigint * interval '1 second'),
        %(fork_point)s, %(source)s, %(forked_from)s, %(fork_offset)s, %(fork_sub_offset)s,
        %(fork_point)s)
ON CONFLICT (path) DO NOTHING
RETURNING stream

-- name: ds_insert_inherited
-- The ranges a fork reads from other engine streams: positions after..upto of each,
-- the last one's message cut to %(cuts)s bytes where that is not NULL.
INSERT INTO {schema}.durable_stream_inherited (stream, source, after, upto, cut)
SELECT %(stream)s, i.source, i.after, i.upto, i.cut
  FROM unnest(%(sources)s::text[], %(afters)s::bigint[], %(uptos)s::bigint[],
              %(cuts)s::bigint[]) AS i(source, after, upto, cut)

-- name: ds_number_from
-- A fork's engine stream numbers its events on from the fork point: its partition's
-- head is the fork point and its floor the position after it (the positions up to it
-- are its source's). Only a new, empty partition.
UPDATE {schema}.partitions
   SET head = %(fork_point)s, floor = %(fork_point)s + 1
 WHERE stream = %(stream)s AND partition = 0 AND head = 0

-- name: ds_pin_sources
-- Retention of these engine streams waits for this transaction (a shared lock that each
-- pruning batch asks for exclusively before it reads what forks hold): a fork's
-- inherited ranges are either committed before a batch decides, or the batch that
-- decided without them committed before the fork read its sources' floors.
SELECT {schema}.durable_stream_pin(pinned.stream)
  FROM unnest(%(streams)s::text[]) AS pinned(stream)
 ORDER BY pinned.stream

-- name: ds_message_size
-- How many bytes the byte message at a position of an engine stream has (no row: none).
SELECT octet_length(body) FROM {schema}.durable_stream_bytes
 WHERE stream = %(stream)s AND "position" = %(position)s

-- name: ds_forks_of
-- How many forks (deleted softly ones included) read an engine stream as their source.
SELECT count(*) FROM {schema}.durable_streams WHERE source = %(stream)s

-- name: ds_soft_delete
-- Delete a stream softly: forks still read it, so its row (blocking its path) and its
-- engine stream stay until the last of them is gone. It no longer expires.
UPDATE {schema}.durable_streams
   SET deleted_at = now(), deadline = NULL
 WHERE path = %(path)s AND stream = %(stream)s AND deleted_at IS NULL

-- name: ds_lock_source
-- The catalog row of an engine stream, locked: a fork of it just went.
SELECT stream FROM {schema}.durable_streams WHERE stream = %(stream)s FOR UPDATE

-- name: ds_release_source
-- A source deleted softly whose last fork just went goes too (its engine stream to the
-- sweeper); returns it and its own source (the next to look at), or nothing. Run after
-- ds_lock_source, in a statement of its own: its snapshot then sees every fork deleted
-- by a transaction that held that lock before.
WITH gone AS (
    DELETE FROM {schema}.durable_streams d
     WHERE d.stream = %(stream)s AND d.deleted_at IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM {schema}.durable_streams f WHERE f.source = d.stream)
    RETURNING d.stream, d.source
), garbage AS (
    INSERT INTO {schema}.durable_stream_garbage (stream)
    SELECT stream FROM gone
    ON CONFLICT (stream) DO NOTHING
)
SELECT stream, source FROM gone

-- name: ds_read_bytes_stitched
-- The messages of a byte stream that is a fork, after a position: its ranges (each an
-- engine stream's positions after..upto, the last message cut to `cut` bytes where that
-- is not NULL; its own last) read in position order, as many as fit in %(max_bytes)s,
-- and at least one.
SELECT page.position, page.body
  FROM (SELECT m.position, m.body,
               sum(octet_length(m.body)) OVER (ORDER BY m.position)
                 - octet_length(m.body) AS before
          FROM unnest(%(streams)s::text[], %(afters)s::bigint[], %(uptos)s::bigint[],
                      %(cuts)s::bigint[]) AS r(stream, after, upto, cut)
         CROSS JOIN LATERAL (
             SELECT b.position,
                    CASE WHEN b.position = r.upto AND r.cut IS NOT NULL
                         THEN substring(b.body FROM 1 FOR r.cut::integer)
                         ELSE b.body END AS body
               FROM {schema}.durable_stream_bytes b
              WHERE b.stream = r.stream AND b.position > greatest(r.after, %(after)s)
                AND b.position <= r.upto
              ORDER BY b.position
              LIMIT %(limit)s) AS m
         ORDER BY m.position
         LIMIT %(limit)s) AS page
 WHERE page.before < %(max_bytes)s
 ORDER BY page.position

-- name: ds_read_json_stitched
-- The messages of a JSON stream that is a fork, after a position, as JSON text: its
-- ranges (each an engine stream's positions after..upto; its own last) read in position
-- order, as many as fit in about %(max_bytes)s (their stored size), and at least one.
SELECT page.position, page.data
  FROM (SELECT m.position, m.data,
               sum(m.size) OVER (ORDER BY m.position) - m.size AS before
          FROM unnest(%(streams)s::text[], %(afters)s::bigint[], %(uptos)s::bigint[])
               AS r(stream, after, upto)
         CROSS JOIN LATERAL (
             SELECT e.position, e.data::text AS data, pg_column_size(e.data) AS size
               FROM {schema}.events e
              WHERE e.stream = r.stream AND e.partition = 0
                AND e.position > greatest(r.after, %(after)s) AND e.position <= r.upto
              ORDER BY e.position
              LIMIT %(limit)s) AS m
         ORDER BY m.position
         LIMIT %(limit)s) AS page
 WHERE page.before < %(max_bytes)s
 ORDER BY page.position
