-- name: lock_webhook
-- A webhook subscription's row, locked for a change of it.
SELECT id, serial, callback, streams, include_data, max_events, secret, state, key_id,
       paused
  FROM {schema}.webhooks
 WHERE id = %(id)s
   FOR UPDATE

-- name: insert_webhook
-- A new webhook subscription, pending until its callback echoes the challenge.
INSERT INTO {schema}.webhooks
       (id, key_id, callback, streams, include_data, max_events, lease_seconds, secret,
        expires_at)
VALUES (%(id)s, %(key_id)s, %(callback)s, %(streams)s, %(include_data)s, %(max_events)s,
        %(lease_seconds)s, %(secret)s, now() + make_interval(secs => %(lease_seconds)s))
RETURNING serial

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
