-- name: status_page_snapshot
-- Everything the gateway's status page shows (docs/status-page.md), read in one
-- statement as one JSON document, so that one read feeds every open page of a gateway
-- process: each stream with its heads and floors summed up, each subscription and its
-- partitions as the subscription_status view has them, the workers, the webhooks, and
-- the newest %(dead_letters)s unresolved dead letters of each subscription with the
-- count of all of them, and the same of the keys parked now (on_error="park"). Seconds the views round stay text ('1.250'), as the command line
-- prints them; long error texts are cut at %(error_chars)s characters.
SELECT json_build_object(
    'taken_at', clock_timestamp(),
    'streams', (
        SELECT coalesce(json_agg(json_build_object(
                   'name', s.name, 'partitions', s.partitions, 'epoch', s.epoch,
                   'retention', s.retention, 'created_at', s.created_at,
                   'appended', p.appended, 'stored', p.stored, 'floor', p.floor,
                   'last_append', p.last_append) ORDER BY s.name), '[]'::json)
          FROM {schema}.streams s
          LEFT JOIN LATERAL (
              SELECT sum(head) AS appended, sum(greatest(head - floor + 1, 0)) AS stored,
                     min(floor) AS floor, max(head_time) AS last_append
                FROM {schema}.partitions
               WHERE stream = s.name
          ) p ON true),
    'subscriptions', (
        SELECT coalesce(json_agg(json_build_object(
                   'name', name, 'stream', stream, 'generation', generation,
                   'paused', paused, 'created_at', created_at) ORDER BY name), '[]'::json)
          FROM {schema}.subscriptions),
    'partitions', (
        SELECT coalesce(json_agg(json_build_object(
                   'subscription', subscription, 'partition', partition,
                   'position', position, 'head', head, 'floor', floor, 'lag', lag,
                   'lag_seconds', lag_seconds::text, 'next_event_at', next_event_at,
                   'state', state, 'gap_from', gap_from, 'gap_to', gap_to,
                   'attempts', attempts, 'last_error', left(last_error, %(error_chars)s),
                   'retry_at', retry_at, 'generation', generation,
                   'worker_id', worker_id, 'worker_pid', worker_pid,
                   'worker_host', worker_host, 'updated_at', updated_at,
                   'parked_keys', parked_keys, 'parked_events', parked_events)
                   ORDER BY subscription, partition), '[]'::json)
          FROM {schema}.subscription_status),
    'workers', (
        SELECT coalesce(json_agg(json_build_object(
                   'id', id, 'host', host, 'pid', pid, 'subscriptions', subscriptions,
                   'started_at', started_at, 'heartbeat_at', heartbeat_at,
                   'seconds_since_heartbeat', seconds_since_heartbeat::text,
                   'connected', connected, 'partitions_held', partitions_held)
                   ORDER BY started_at), '[]'::json)
          FROM {schema}.workers_status),
    'webhooks', (
        SELECT coalesce(json_agg(json_build_object(
                   'id', id, 'state', state, 'paused', paused, 'callback', callback,
                   'streams', streams, 'lag', lag, 'attempts', attempts,
                   'delivered', delivered, 'last_attempt_at', last_attempt_at,
                   'last_success_at', last_success_at, 'failing_since', failing_since,
                   'last_error', left(last_error, %(error_chars)s),
                   'expires_at', expires_at) ORDER BY created_at), '[]'::json)
          FROM {schema}.webhook_status),
    'dead_letters', (
        SELECT coalesce(json_agg(json_build_object(
                   'subscription', d.subscription, 'partition', d.partition,
                   'position', d.position, 'event_id', d.event_id, 'key', e.key,
                   'type', e.type, 'error', left(d.error, %(error_chars)s),
                   'attempts', d.attempts, 'retries', d.retries,
                   'created_at', d.created_at)
                   ORDER BY d.subscription, d.created_at DESC, d.partition, d.position),
                   '[]'::json)
          FROM (SELECT *, row_number() OVER (PARTITION BY subscription
                                             ORDER BY created_at DESC) AS newest
                  FROM {schema}.dead_letters
                 WHERE resolution IS NULL) d
          JOIN {schema}.subscriptions s ON s.name = d.subscription
          LEFT JOIN {schema}.events e
            ON e.stream = s.stream AND e.partition = d.partition AND e.position = d.position
         WHERE d.newest <= %(dead_letters)s),
    'dead_letter_counts', (
        SELECT coalesce(json_object_agg(subscription, n), '{{}}'::json)
          FROM (SELECT subscription, count(*) AS n
                  FROM {schema}.dead_letters
                 WHERE resolution IS NULL
                 GROUP BY subscription) c),
    'parked', (
        SELECT coalesce(json_agg(json_build_object(
                   'subscription', k.subscription, 'partition', k.partition, 'key', k.key,
                   'position', k.position, 'event_id', k.event_id,
                   'error', left(k.error, %(error_chars)s), 'attempts', k.attempts,
                   'retries', k.retries, 'created_at', k.created_at,
                   'events', (SELECT count(*) FROM {schema}.parked_events e
                               WHERE e.parked_key = k.id AND e.resolution IS NULL))
                   ORDER BY k.subscription, k.created_at DESC, k.id DESC), '[]'::json)
          FROM (SELECT *, row_number() OVER (PARTITION BY subscription
                                             ORDER BY created_at DESC, id DESC) AS newest
                  FROM {schema}.parked_keys
                 WHERE resolution IS NULL) k
         WHERE k.newest <= %(dead_letters)s),
    'parked_counts', (
        SELECT coalesce(json_object_agg(subscription, n), '{{}}'::json)
          FROM (SELECT subscription, count(*) AS n
                  FROM {schema}.parked_keys
                 WHERE resolution IS NULL
                 GROUP BY subscription) c)
)::text
