-- name: lock_webhook
-- A webhook subscription's row, locked for a change of it.
SELECT id, serial, callback, streams, include_data, max_events, secret, state, key_id,
       paused
  FROM {schema}.webhooks
 WHERE id = %(id)s
   FOR UPDATE

-- name: insert_webhook
-- A new webhook subscription, pending until its callback echoes the challenge. This and
-- every change of which webhooks are delivered notify the gateways (sql/listen.sql), whose
-- deliveries otherwise look only slowly.
INSERT INTO {schema}.webhooks
       (id, key_id, callback, streams, include_data, max_events, lease_seconds, secret,
        expires_at)
VALUES (%(id)s, %(key_id)s, %(callback)s, %(streams)s, %(include_data)s, %(max_events)s,
        %(lease_seconds)s, %(secret)s, now() + make_interval(secs => %(lease_seconds)s))
RETURNING serial, pg_notify((parse_ident('{schema}'))[1], 'gateway_webhooks')::text

-- name: renew_webhook
-- The same subscription asked for again: a new lease and, when a new secret is given, a
-- rotation (the old secret still signs until the overlap ends).
UPDATE {schema}.webhooks
   SET lease_seconds = %(lease_seconds)s,
       expires_at = now() + make_interval(secs => %(lease_seconds)s),
       previous_secret = CASE WHEN %(secret)s::text IS DISTINCT FROM secret
                              AND %(secret)s::text IS NOT NULL
                              THEN secret ELSE previous_secret END,
       previous_secret_until = CASE WHEN %(secret)s::text IS DISTINCT FROM secret
                                    AND %(secret)s::text IS NOT NULL
                                    THEN now() + make_interval(secs => %(overlap)s)
                                    ELSE previous_secret_until END,
       secret = coalesce(%(secret)s, secret)
 WHERE id = %(id)s

-- name: delete_webhook_row
DELETE FROM {schema}.webhooks WHERE id = %(id)s
RETURNING pg_notify((parse_ident('{schema}'))[1], 'gateway_webhooks')::text

-- name: webhook_subscription_names
-- The engine subscriptions of a webhook (webhook.<serial>.<index>).
SELECT name FROM {schema}.subscriptions
 WHERE name LIKE 'webhook.' || %(serial)s || '.%%'
 ORDER BY name

-- name: webhook_records
-- Webhook subscriptions as shown (never their secrets), one or all, oldest first.
SELECT w.id, w.key_id, w.state, w.callback, w.streams, w.include_data, w.max_events,
       w.lease_seconds, w.created_at, w.expires_at, w.state_changed_at, w.verified_at, w.last_attempt_at,
       w.last_success_at, w.failing_since, w.attempts, w.delivered, w.last_error, s.lag,
       w.paused
  FROM {schema}.webhooks w
  JOIN {schema}.webhook_status s ON s.id = w.id
 WHERE %(id)s::text IS NULL OR w.id = %(id)s
 ORDER BY w.created_at, w.id

-- name: deliverable_webhooks
-- The webhook subscriptions whose events are delivered now: active or failing, and not
-- paused.
SELECT w.id, w.serial, w.streams, w.max_events,
       ARRAY(SELECT s.start FROM {schema}.subscriptions s
              WHERE s.name LIKE 'webhook.' || w.serial || '.%%'
              ORDER BY split_part(s.name, '.', 3)::int)
  FROM {schema}.webhooks w
 WHERE w.state IN ('active', 'failing') AND NOT w.paused
 ORDER BY w.serial

-- name: delivery_context
-- What a delivery of one batch needs: the webhook's state, callback and secrets, the
-- engine subscription's generation and the stream's epoch and positions (for the cursor).
-- A paused webhook shows as state 'paused': nothing is sent.
SELECT CASE WHEN w.paused THEN 'paused' ELSE w.state END, w.callback, w.secret,
       CASE WHEN w.previous_secret_until > now() THEN w.previous_secret END,
       w.include_data, sub.generation, st.epoch,
       ARRAY(SELECT sp.position FROM {schema}.subscription_positions sp
              WHERE sp.subscription = sub.name ORDER BY sp.partition)
  FROM {schema}.webhooks w
  JOIN {schema}.subscriptions sub ON sub.name = %(name)s
  JOIN {schema}.streams st ON st.name = sub.stream
 WHERE w.id = %(id)s

-- name: delivery_succeeded
UPDATE {schema}.webhooks
   SET state = 'active',
       state_changed_at = CASE WHEN state = 'active' THEN state_changed_at ELSE now() END,
       last_attempt_at = now(), last_success_at = now(), failing_since = NULL,
       attempts = 0, last_error = NULL, delivered = delivered + %(events)s
 WHERE id = %(id)s AND state IN ('active', 'failing')

-- name: delivery_failed
-- A failed delivery: the webhook is failing (from now, if it was not); its failed attempts
-- so far.
UPDATE {schema}.webhooks
   SET state = 'failing',
       state_changed_at = CASE WHEN state = 'failing' THEN state_changed_at ELSE now() END,
       last_attempt_at = now(), failing_since = coalesce(failing_since, now()),
       attempts = attempts + 1, last_error = %(error)s
 WHERE id = %(id)s AND state IN ('active', 'failing')
RETURNING attempts

-- name: claim_challenges
-- Pending webhooks whose challenge is due, claimed for `hold` seconds (another gateway
-- process takes them after that, if this one died sending them).
UPDATE {schema}.webhooks w
   SET challenge_due = now() + make_interval(secs => %(hold)s)
  FROM (SELECT id FROM {schema}.webhooks
         WHERE state = 'pending' AND challenge_due <= now() AND NOT paused
         ORDER BY challenge_due
         LIMIT %(limit)s
           FOR UPDATE SKIP LOCKED) due
 WHERE w.id = due.id
RETURNING w.id, w.callback, w.secret, w.lease_seconds, w.attempts

-- name: challenge_passed
UPDATE {schema}.webhooks
   SET state = 'active', state_changed_at = now(), verified_at = now(), challenge_due = NULL,
       last_attempt_at = now(), attempts = 0, last_error = NULL
 WHERE id = %(id)s AND state = 'pending'
RETURNING pg_notify((parse_ident('{schema}'))[1], 'gateway_webhooks')::text

-- name: challenge_failed
-- A challenge that could not be sent or answered (not a refusal): asked again later.
UPDATE {schema}.webhooks
   SET challenge_due = now() + make_interval(secs => %(retry_in)s),
       last_attempt_at = now(), failing_since = coalesce(failing_since, now()),
       attempts = attempts + 1, last_error = %(error)s
 WHERE id = %(id)s AND state = 'pending'

-- name: webhooks_to_expire
-- Webhooks whose lease ran out, or that stayed pending or failing longer than the failure
-- timeout (a paused one waits for its resume), locked for the change.
SELECT id, serial, CASE WHEN expires_at <= now() THEN 'expired' ELSE 'failed' END
  FROM {schema}.webhooks
 WHERE (state <> 'expired' AND expires_at <= now())
    OR (state IN ('pending', 'failing') AND NOT paused
        AND failing_since <= now() - make_interval(secs => %(failure_timeout)s))
   FOR UPDATE SKIP LOCKED

-- name: set_webhook_state
UPDATE {schema}.webhooks
   SET state = %(state)s, state_changed_at = now(), challenge_due = NULL
 WHERE id = %(id)s
RETURNING pg_notify((parse_ident('{schema}'))[1], 'gateway_webhooks')::text

-- name: next_webhook_deadline
-- Seconds until the supervisor of deliveries must next look (None: nothing is due ever):
-- the first lease to run out, failure timeout to pass, challenge to fall due, or expired
-- webhook to be removed; the conditions of webhooks_to_expire, claim_challenges and
-- forget_expired_webhooks.
SELECT extract(epoch FROM min(due) - clock_timestamp())::float8
  FROM (SELECT CASE WHEN state = 'expired'
                    THEN state_changed_at + make_interval(secs => %(keep)s)
                    ELSE expires_at END
          FROM {schema}.webhooks
        UNION ALL
        SELECT failing_since + make_interval(secs => %(failure_timeout)s)
          FROM {schema}.webhooks
         WHERE state IN ('pending', 'failing') AND NOT paused
        UNION ALL
        SELECT challenge_due
          FROM {schema}.webhooks
         WHERE state = 'pending' AND NOT paused) deadlines (due)

-- name: forget_expired_webhooks
-- Expired webhooks shown for `keep` seconds after they expired, then removed.
DELETE FROM {schema}.webhooks
 WHERE state = 'expired' AND state_changed_at <= now() - make_interval(secs => %(keep)s)

-- name: set_webhook_paused
-- Pause or resume a webhook subscription (its engine subscriptions are paused with it).
-- On resume, a failure timeout counts from now, and a pending one's challenge is due.
UPDATE {schema}.webhooks
   SET paused = %(paused)s,
       failing_since = CASE WHEN %(paused)s OR failing_since IS NULL THEN failing_since
                            ELSE now() END,
       challenge_due = CASE WHEN NOT %(paused)s AND state = 'pending' THEN now()
                            ELSE challenge_due END
 WHERE id = %(id)s
RETURNING pg_notify((parse_ident('{schema}'))[1], 'gateway_webhooks')::text

-- name: claim_webhook_batch
-- The next batch of one partition of a webhook's engine subscription, claimed for the
-- gateway's delivery in one statement (docs/webhooks.md, "Deliveries"): the position row
-- locked as lock_batch locks it, the wanted events' JSON as the delivery sends it, made
-- here and joined with commas in position order (events the filters leave out count in
-- the bounds), and what the delivery needs (the webhook's callback, secrets and state, the
-- subscription's generation, the stream's epoch and every partition's position, for the
-- cursor). `fast` is false, and nothing is written, unless the batch is plain: the
-- partition is not halted and retries no failure, has events after its position and holds
-- every one of them up to the batch's end, and the webhook is delivered (active or
-- failing, not paused); the engine's own batch handles the rest (gaps, missing events,
-- failures). No row when the subscription or the webhook is gone.
--
-- A retry is the same batch (DESIGN.md): a batch of fewer than %(size)s events has its
-- end stored (batch_through, as fix_batch stores it; it is not plain unless that write
-- happened), and the statement then commits durably before the batch is sent. A full
-- batch's end needs no storing: read again from the same position it is the same
-- %(size)s events, however many came since, and a stored end is never passed (the `take`
-- below, as lock_batch's). A statement that stored
-- nothing (it only locked the row) commits without waiting for its WAL to reach the disk
-- (synchronous_commit off for this transaction alone): losing it in a crash loses a row
-- lock, nothing else.
--
-- Times are written as Python's isoformat writes them (no fraction when it is zero), in
-- the session's time zone; a batch with a time before 1980 is not plain (some zones'
-- offsets had seconds then, which to_char does not write). The text stays under psycopg's
-- 4,096 bytes, or it would parse it again at every call.
WITH chosen AS (
    SELECT sp.position, sp.generation, sub.generation AS sub_generation, sp.batch_through,
           NOT (sp.stopped OR sub.paused OR coalesce(sp.retry_at > now(), false)
              OR sp.attempts > 0) AS runnable,
           greatest(0, least(p.head - sp.position, %(size)s::bigint,
                           CASE WHEN sp.batch_through > sp.position
                                THEN sp.batch_through - sp.position END))::bigint AS take,
           to_json(sub.stream)::text AS stream_json
      FROM {schema}.subscription_positions sp
      JOIN {schema}.subscriptions sub ON sub.name = sp.subscription
      JOIN {schema}.partitions p ON p.stream = sub.stream AND p.partition = sp.partition
     WHERE sp.subscription = %(name)s AND sp.partition = %(partition)s
       AND sub.stream = %(stream)s
       FOR UPDATE OF sp
),
hook AS (
    SELECT callback, secret, state, include_data,
           CASE WHEN previous_secret_until > now() THEN previous_secret END AS previous,
           state IN ('active', 'failing') AND NOT paused AS delivered
      FROM {schema}.webhooks WHERE id = %(id)s
),
read AS (
    SELECT e.*, e.position <= c.position + c.take AS inside, c.stream_json,
           (%(types)s::text[] IS NULL OR e.type = ANY(%(types)s))
           AND (%(keys)s::text[] IS NULL OR e.key = ANY(%(keys)s)) AS wanted,
           CASE WHEN h.include_data THEN ',"data":' || e.data::text ELSE '' END AS data_json
      FROM chosen c, hook h, LATERAL (
           SELECT * FROM {schema}.events e
            WHERE e.stream = %(stream)s AND e.partition = %(partition)s
              AND e.position > c.position
            ORDER BY e.position LIMIT c.take + 1) e
     WHERE c.runnable AND h.delivered AND c.take > 0
),
batch AS (
    SELECT count(*) FILTER (WHERE inside) AS found,
           max(position) FILTER (WHERE inside) AS last,
           min(least(occurred_at, recorded_at)) FILTER (WHERE inside) AS oldest,
           count(*) FILTER (WHERE inside AND wanted) AS wanted,
           min(occurred_at) FILTER (WHERE NOT inside) AS next_time,
           string_agg(
             '{{"id":"' || id::text || '","stream":' || stream_json
             || ',"partition":' || partition::text || ',"position":' || position::text
             || ',"type":' || to_json(type)::text || ',"key":' || to_json(key)::text
             || ',"key_version":' || key_version::text || ',"occurred_at":"'
             || replace(to_char(occurred_at, 'YYYY-MM-DD"T"HH24:MI:SS.USTZH:TZM'),
                        '.000000', '')
             || '","recorded_at":"'
             || replace(to_char(recorded_at, 'YYYY-MM-DD"T"HH24:MI:SS.USTZH:TZM'),
                        '.000000', '')
             || '","metadata":' || metadata::text || data_json || '}}',
             ',' ORDER BY position) FILTER (WHERE inside AND wanted) AS events
      FROM read
),
plain AS (
    SELECT c.take > 0 AND b.found = c.take AND b.last = c.position + c.take
           AND b.oldest >= '1980-01-01' AS fast,
           c.take < %(size)s AND c.batch_through IS DISTINCT FROM c.position + c.take
             AS unbounded
      FROM chosen c, batch b
),
fixed AS (
    UPDATE {schema}.subscription_positions sp
       SET batch_through = c.position + c.take
      FROM chosen c, plain
     WHERE plain.fast AND plain.unbounded
       AND sp.subscription = %(name)s AND sp.partition = %(partition)s
       AND sp.position = c.position AND sp.generation = c.generation
    RETURNING 1
)
SELECT plain.fast AND (NOT unbounded OR EXISTS (SELECT FROM fixed)), c.position,
       c.generation, c.take, b.events, b.wanted, b.next_time,
       h.callback, h.secret, h.previous, h.state, c.sub_generation, st.epoch,
       ARRAY(SELECT sp.position FROM {schema}.subscription_positions sp
              WHERE sp.subscription = %(name)s ORDER BY sp.partition),
       CASE WHEN NOT EXISTS (SELECT FROM fixed)
            THEN set_config('synchronous_commit', 'off', true) END
  FROM chosen c, hook h, batch b, plain, {schema}.streams st
 WHERE st.name = %(stream)s

-- name: commit_webhook_batch
-- The position of a delivered plain batch moved past it (move_position), committed
-- without waiting for its WAL to reach the disk (synchronous_commit off for this
-- transaction alone). A webhook is at_least_once: a crash of PostgreSQL may lose the
-- last moves, and the batches after the position that survived are then sent again, each
-- the same batch under the same webhook-id (unless retention removed some of its events
-- meanwhile: docs/webhooks.md). Not another one: a stored end is written by a claim that
-- commits durably, and so carries every move before it to the disk (the WAL is flushed
-- in order); a full batch's end needs no storing.
WITH moved AS (
{move_position})
SELECT partition, next_time, set_config('synchronous_commit', 'off', true) FROM moved
