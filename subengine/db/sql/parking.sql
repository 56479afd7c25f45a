-- Key-scoped parking (policy on_error='park'; docs/parking.md). Every statement here that
-- writes runs in a transaction holding the partition's position row lock: a batch's
-- (lock_batch, lock_companions), a failure's (record_failure), a reset's, or an
-- operator's (lock_position). So parking, passing the position and releasing a key
-- happen one after another per partition, never interleaved.

-- name: parked_among
-- The events of a batch whose key the subscription has parked in the generation the
-- batch read: an at_least_once batch asks before its handlers run, and checks at its
-- commit that park_events sets aside the same ones. Each distinct key is one exact probe
-- of the open keys' unique index (subscription, partition, key), whatever the statistics.
WITH parked AS MATERIALIZED (
    SELECT k.key, k.generation
      FROM (SELECT DISTINCT x.partition, x.key
              FROM unnest(%(partitions)s::integer[], %(keys)s::text[]) AS x(partition, key)) AS x
     CROSS JOIN LATERAL (
            SELECT k.key, k.generation FROM {schema}.parked_keys k
             WHERE k.subscription = %(name)s AND k.partition = x.partition
               AND k.key = x.key AND k.resolution IS NULL
             LIMIT 1) AS k
)
SELECT x.event_id
  FROM unnest(%(keys)s::text[], %(ids)s::uuid[], %(generations)s::bigint[])
       AS x(key, event_id, generation)
  JOIN parked p ON p.key = x.key AND p.generation = x.generation

-- name: park_events
-- Set aside the events of a batch whose key the subscription has parked in the
-- generation the batch read (under the batch's position row locks, so no key is parked or
-- released meanwhile): they are recorded under their parked key and not handled, and the
-- position moves past them with the rest of the batch, in the same transaction. Returns
-- their ids.
WITH parked AS MATERIALIZED (
    SELECT k.id, k.key, k.generation
      FROM (SELECT DISTINCT x.partition, x.key
              FROM unnest(%(partitions)s::integer[], %(keys)s::text[]) AS x(partition, key)) AS x
     CROSS JOIN LATERAL (
            SELECT k.id, k.key, k.generation FROM {schema}.parked_keys k
             WHERE k.subscription = %(name)s AND k.partition = x.partition
               AND k.key = x.key AND k.resolution IS NULL
             LIMIT 1) AS k
)
INSERT INTO {schema}.parked_events (parked_key, position, event_id)
SELECT p.id, x.position, x.event_id
  FROM unnest(%(keys)s::text[], %(positions)s::bigint[], %(ids)s::uuid[],
              %(generations)s::bigint[]) AS x(key, position, event_id, generation)
  JOIN parked p ON p.key = x.key AND p.generation = x.generation
RETURNING event_id

-- name: park_key
-- Park the key of the event after the position (policy park, its last attempt failed),
-- in the position's generation, with the error: the key, and the event as the first
-- parked under it. Runs after record_failure locked the position row, before skip_event
-- moves past the event. Returns the key, nothing when the event is no longer stored.
WITH failing AS (
    SELECT e.partition, e.position, e.id, e.key
      FROM {schema}.events e
     WHERE e.stream = %(stream)s AND e.partition = %(partition)s AND e.position = %(position)s
), parked AS (
    INSERT INTO {schema}.parked_keys
           (subscription, partition, key, generation, position, event_id, error, attempts)
    SELECT %(name)s, f.partition, f.key, %(generation)s, f.position, f.id, %(error)s,
           %(attempts)s
      FROM failing f
    RETURNING id, position, event_id, key
)
INSERT INTO {schema}.parked_events (parked_key, position, event_id)
SELECT id, position, event_id FROM parked
RETURNING (SELECT key FROM parked)

-- name: release_parked_keys
-- A reset releases the parked keys of the partitions it moves, with the events still
-- waiting under them ('superseded'), in its transaction: from the new positions on the
-- events are handled again in order (or skipped with everything else), and a key whose
-- event fails again is parked anew, in the new generation.
WITH released AS (
    UPDATE {schema}.parked_keys
       SET resolution = 'superseded', resolved_at = now()
     WHERE subscription = %(name)s AND partition = ANY (%(partitions)s::integer[])
       AND resolution IS NULL
    RETURNING id
)
UPDATE {schema}.parked_events pe
   SET resolution = 'superseded', resolved_at = now()
  FROM released r
 WHERE pe.parked_key = r.id AND pe.resolution IS NULL

-- name: find_parked_key
-- A subscription's open parking of a key, with the subscription's stream; not locked:
-- an operator's change locks the partition's position row first (lock_position), then
-- the key (lock_parked_key), as a batch would.
SELECT k.id, k.partition, s.stream
  FROM {schema}.parked_keys k
  JOIN {schema}.subscriptions s ON s.name = k.subscription
 WHERE k.subscription = %(name)s AND k.key = %(key)s AND k.resolution IS NULL

-- name: lock_position
-- A partition's position row, locked until the transaction ends (waiting for a batch that
-- holds it): where it stands and in which generation.
SELECT position, generation
  FROM {schema}.subscription_positions
 WHERE subscription = %(name)s AND partition = %(partition)s
   FOR UPDATE

-- name: lock_parked_key
-- A parked key, locked for a retry's step or a discard (in a mode that lets nothing else
-- wait on it: every writer holds the position row already); its generation and
-- resolution.
SELECT generation, resolution
  FROM {schema}.parked_keys
 WHERE id = %(id)s
   FOR NO KEY UPDATE

-- name: parked_events_gone
-- The waiting events of a parked key that are no longer stored (retention removed them).
SELECT pe.position
  FROM {schema}.parked_events pe
 WHERE pe.parked_key = %(id)s AND pe.resolution IS NULL
   AND NOT EXISTS (SELECT FROM {schema}.events e
                    WHERE e.stream = %(stream)s AND e.partition = %(partition)s
                      AND e.position = pe.position)
 ORDER BY pe.position

-- name: parked_events_to_replay
-- The next %(limit)s waiting events of a parked key, in position order, with their
-- positions, then the events' columns (NULL for one no longer stored; data and metadata
-- as JSON text).
SELECT pe.position, e.id, e.stream, e.partition, e.position, e.key, e.key_version, e.type,
       e.data::text, e.metadata::text, e.occurred_at, e.recorded_at
  FROM {schema}.parked_events pe
  LEFT JOIN {schema}.events e
    ON e.stream = %(stream)s AND e.partition = %(partition)s AND e.position = pe.position
 WHERE pe.parked_key = %(id)s AND pe.resolution IS NULL
 ORDER BY pe.position
 LIMIT %(limit)s

-- name: replayed_parked_events
-- Mark events of a parked key replayed, in the transaction of their handlers' writes;
-- whether any other event of the key still waits.
WITH marked AS (
    UPDATE {schema}.parked_events
       SET resolution = 'retried', resolved_at = now()
     WHERE parked_key = %(id)s AND position = ANY (%(positions)s::bigint[])
       AND resolution IS NULL
    RETURNING position
)
SELECT (SELECT count(*) FROM marked),
       EXISTS (SELECT FROM {schema}.parked_events
                WHERE parked_key = %(id)s AND resolution IS NULL
                  AND position <> ALL (%(positions)s::bigint[]))

-- name: confirm_position
-- The fence of a retry's step, before it commits: the partition's position row is still
-- where the step locked it, in the generation the key was checked against (a batch's
-- commit_position compares the same two). It compares without writing: the position
-- does not move, and a new row version would make a reset waiting for the row start over
-- behind the retry's next step.
SELECT 1
  FROM {schema}.subscription_positions
 WHERE subscription = %(name)s AND partition = %(partition)s
   AND position = %(position)s AND generation = %(generation)s
   FOR UPDATE

-- name: resolve_parked_key
-- Close a parked key as retried or discarded, with the events still waiting under it;
-- how many events were closed.
WITH closed AS (
    UPDATE {schema}.parked_keys
       SET resolution = %(resolution)s, resolved_at = now(),
           retries = retries + CASE WHEN %(resolution)s = 'retried' THEN 1 ELSE 0 END
     WHERE id = %(id)s AND resolution IS NULL
    RETURNING id
)
UPDATE {schema}.parked_events pe
   SET resolution = %(resolution)s, resolved_at = now()
  FROM closed c
 WHERE pe.parked_key = c.id AND pe.resolution IS NULL

-- name: parked_key_retry_failed
-- A retry's handlers failed again: count it, and keep its error as the key's.
UPDATE {schema}.parked_keys
   SET retries = retries + 1, error = %(error)s
 WHERE id = %(id)s AND resolution IS NULL

-- name: list_parked_keys
-- Parked keys (of one subscription, one key, or all; open ones only unless %(all)s),
-- oldest first, with the failing event's type, how many events were parked under each,
-- how many still wait, the first waiting position and the last parked one.
SELECT k.subscription, s.stream, k.partition, k.key, k.generation, k.position, k.event_id,
       e.type, c.events, c.waiting, c.next_position, c.last_position, k.error, k.attempts,
       k.retries, k.resolution, k.created_at, k.resolved_at
  FROM {schema}.parked_keys k
  JOIN {schema}.subscriptions s ON s.name = k.subscription
  LEFT JOIN {schema}.events e
    ON e.stream = s.stream AND e.partition = k.partition AND e.position = k.position
 CROSS JOIN LATERAL (
        SELECT count(*) AS events,
               count(*) FILTER (WHERE pe.resolution IS NULL) AS waiting,
               min(pe.position) FILTER (WHERE pe.resolution IS NULL) AS next_position,
               max(pe.position) AS last_position
          FROM {schema}.parked_events pe
         WHERE pe.parked_key = k.id) AS c
 WHERE (%(name)s::text IS NULL OR k.subscription = %(name)s)
   AND (%(key)s::text IS NULL OR k.key = %(key)s)
   AND (%(all)s OR k.resolution IS NULL)
 ORDER BY k.created_at, k.id

-- name: list_parked_events
-- The events parked under a subscription's key, of its open parking or else of its
-- latest, in position order, with their types (NULL once no longer stored).
SELECT k.subscription, s.stream, k.partition, k.key, pe.position, pe.event_id, e.type,
       pe.resolution, pe.parked_at, pe.resolved_at
  FROM {schema}.parked_keys k
  JOIN {schema}.subscriptions s ON s.name = k.subscription
  JOIN {schema}.parked_events pe ON pe.parked_key = k.id
  LEFT JOIN {schema}.events e
    ON e.stream = s.stream AND e.partition = k.partition AND e.position = pe.position
 WHERE k.id = (SELECT l.id FROM {schema}.parked_keys l
                WHERE l.subscription = %(name)s AND l.key = %(key)s
                ORDER BY l.resolution IS NULL DESC, l.id DESC
                LIMIT 1)
 ORDER BY pe.position

-- name: parked_counts
-- How many keys each of some subscriptions has parked now, and how many events wait
-- under them (the worker's gauges).
SELECT k.subscription, count(*),
       sum((SELECT count(*) FROM {schema}.parked_events pe
             WHERE pe.parked_key = k.id AND pe.resolution IS NULL))::bigint
  FROM {schema}.parked_keys k
 WHERE k.subscription = ANY (%(names)s::text[]) AND k.resolution IS NULL
 GROUP BY k.subscription
