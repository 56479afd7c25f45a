-- The queries of remote workers' leases (docs/remote-workers.md; migration 0020). A lease
-- holds a partition through its position row's retry_at, which every local worker's
-- look, poll and batch already wait for (see lock_batch): the leased partition is skipped
-- until the lease ends or its deadline passes.

-- name: remote_subscription
-- A subscription as remote workers consume it: its stream and the error policy and batch
-- size of remote_policies (the defaults of a local declaration when none is stored).
SELECT s.name, s.stream, coalesce(rp.on_error, 'stop'), coalesce(rp.max_attempts, 5),
       coalesce(rp.batch_size, 100)
  FROM {schema}.subscriptions s
  LEFT JOIN {schema}.remote_policies rp ON rp.subscription = s.name
 WHERE s.name = %(name)s

-- name: set_remote_policy
-- Store the error policy and batch size remote workers of a subscription follow.
INSERT INTO {schema}.remote_policies (subscription, on_error, max_attempts, batch_size)
VALUES (%(name)s, %(on_error)s, %(max_attempts)s, %(batch_size)s)
ON CONFLICT (subscription) DO UPDATE
   SET on_error = excluded.on_error, max_attempts = excluded.max_attempts,
       batch_size = excluded.batch_size, updated_at = now()
RETURNING subscription

-- name: remote_candidates
-- The partitions of a subscription a claim may take, oldest next event first (DESIGN.md
-- invariant 7): not stopped, not paused, not waiting for a retry or held by a live lease,
-- with events after the position. A partition no local look has marked yet (no
-- next_time while its head is past the position) gets its next event's time here; one
-- whose next event retention removed has none and comes first (its gap is older than
-- anything stored). Visits the subscription's position rows: the cost follows its
-- partitions, not its backlog.
SELECT sp.partition
  FROM {schema}.subscription_positions sp
  JOIN {schema}.subscriptions s ON s.name = sp.subscription AND NOT s.paused
  JOIN {schema}.partitions p ON p.stream = s.stream AND p.partition = sp.partition
 WHERE sp.subscription = %(name)s AND NOT sp.stopped
   AND (sp.retry_at IS NULL OR sp.retry_at <= now())
   AND (sp.next_time IS NOT NULL OR p.head > sp.position)
 ORDER BY coalesce(sp.next_time, {schema}.next_event_time(s.stream, sp.partition, sp.position))
          NULLS FIRST, sp.partition
 LIMIT %(limit)s

-- name: remote_lock_partition
-- A candidate's position row, locked for the claim unless a batch holds it (SKIP LOCKED:
-- a local batch in flight), with the partition lock of local workers taken for the
-- claim's transaction, in this order: a slot holding that lock (between batches, or
-- running an at_least_once batch's handlers) keeps its partition. Nothing when the row
-- is held, the lock is taken, or the partition can no longer be claimed.
WITH row AS MATERIALIZED (
    SELECT sp.position, sp.generation
      FROM {schema}.subscription_positions sp
      JOIN {schema}.subscriptions s ON s.name = sp.subscription
     WHERE sp.subscription = %(name)s AND sp.partition = %(partition)s
       AND NOT sp.stopped AND NOT s.paused
       AND (sp.retry_at IS NULL OR sp.retry_at <= now())
       FOR UPDATE OF sp SKIP LOCKED
)
SELECT position, generation FROM row WHERE pg_try_advisory_xact_lock(%(key)s)

-- name: remote_end_stale_leases
-- The leases of a partition that a new claim replaces (their deadlines passed: a live
-- one holds the position row's retry_at), and leases of the subscription that ended a
-- day ago (kept until then so that a late ack is told it ended).
WITH purged AS (
    DELETE FROM {schema}.remote_leases
     WHERE subscription = %(name)s AND ended_at < now() - interval '1 day'
)
UPDATE {schema}.remote_leases SET ended_at = now(), ended = 'lost'
 WHERE subscription = %(name)s AND partition = %(partition)s AND ended_at IS NULL

-- name: remote_take_lease
-- Hold the partition until the deadline (its position row's retry_at), fix the batch's
-- bounds (a retry after the lease is lost, by any worker, is the same batch: DESIGN.md,
-- "A retry is the same batch"), and store the lease. Fenced like a position. A row no
-- local look has marked gets its next event's time, so that local workers' looks and
-- polls find the partition once the lease expires, without waiting for an append.
WITH held AS (
    UPDATE {schema}.subscription_positions
       SET retry_at = clock_timestamp() + make_interval(secs => %(seconds)s),
           batch_through = CASE WHEN %(gap)s::jsonb IS NULL THEN %(through)s::bigint
                                ELSE batch_through END,
           next_time = coalesce(next_time,
                                {schema}.next_event_time(%(stream)s, partition, position))
     WHERE subscription = %(name)s AND partition = %(partition)s
       AND position = %(position)s AND generation = %(generation)s
    RETURNING retry_at
)
INSERT INTO {schema}.remote_leases
       (id, subscription, partition, worker, generation, position, through, gap, parked,
        deadline)
SELECT %(id)s, %(name)s, %(partition)s, %(worker)s, %(generation)s, %(position)s,
       %(through)s, %(gap)s::jsonb, %(parked)s::uuid[], h.retry_at
  FROM held h
RETURNING deadline

-- name: remote_lease
-- A lease as stored, with whether its deadline has passed.
SELECT id, subscription, partition, worker, generation, position, through, gap, parked,
       deadline, ended, deadline <= clock_timestamp()
  FROM {schema}.remote_leases
 WHERE id = %(id)s

-- name: remote_lock_lease
-- The same, after its partition's position row (remote_lock_position: the order a claim
-- takes them in), locked until the transaction ends.
SELECT id, subscription, partition, worker, generation, position, through, gap, parked,
       deadline, ended, deadline <= clock_timestamp()
  FROM {schema}.remote_leases
 WHERE id = %(id)s
   FOR UPDATE

-- name: remote_lock_position
-- A lease's position row, locked (waiting for a batch that holds it), with its stream:
-- where the subscription stands now.
SELECT sp.position, sp.generation, s.stream
  FROM {schema}.subscription_positions sp
  JOIN {schema}.subscriptions s ON s.name = sp.subscription
 WHERE sp.subscription = %(name)s AND sp.partition = %(partition)s
   FOR UPDATE OF sp

-- name: remote_end_lease
-- End a lease (acked, released or nacked).
UPDATE {schema}.remote_leases SET ended_at = now(), ended = %(ended)s
 WHERE id = %(id)s AND ended_at IS NULL

-- name: remote_extend_lease
-- Move a live lease's deadline, and its position row's retry_at with it (fenced like a
-- position: the caller locked the row and checked it).
WITH lease AS (
    UPDATE {schema}.remote_leases
       SET deadline = clock_timestamp() + make_interval(secs => %(seconds)s)
     WHERE id = %(id)s AND ended_at IS NULL
    RETURNING subscription, partition, position, generation, deadline
)
UPDATE {schema}.subscription_positions sp
   SET retry_at = l.deadline
  FROM lease l
 WHERE sp.subscription = l.subscription AND sp.partition = l.partition
   AND sp.position = l.position AND sp.generation = l.generation
RETURNING l.deadline

-- name: remote_free_partition
-- A released lease gives its partition back at once (its retry_at was the lease's
-- deadline). Fenced like a position.
UPDATE {schema}.subscription_positions
   SET retry_at = NULL
 WHERE subscription = %(name)s AND partition = %(partition)s
   AND position = %(position)s AND generation = %(generation)s

-- name: remote_read_events
-- The events of a lease after its position, up to `through`, as stored (data and
-- metadata as JSON text): an ack checks the parked keys among those it acknowledges.
SELECT e.id, e.stream, e.partition, e.position, e.key, e.key_version, e.type, e.data::text,
       e.metadata::text, e.occurred_at, e.recorded_at
  FROM {schema}.events e
 WHERE e.stream = %(stream)s AND e.partition = %(partition)s
   AND e.position > %(after)s AND e.position <= %(through)s
 ORDER BY e.position

-- name: list_remote_leases
-- The live leases of a subscription (not ended, deadline not passed), by partition.
SELECT id, partition, worker, generation, position, through, deadline, created_at
  FROM {schema}.remote_leases
 WHERE subscription = %(name)s AND ended_at IS NULL AND deadline > clock_timestamp()
 ORDER BY partition
