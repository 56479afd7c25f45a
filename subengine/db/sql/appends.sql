-- Appends of events given as JSON (the gateway's POST .../events). The append itself is
-- the append_events function's, as for every other append.

-- part: json_events
-- The events of %(events)s, a jsonb array of objects with "key", "type" and "data", and
-- maybe "metadata", "id" and "occurred_at" (a time that PostgreSQL reads as Python's
-- isoformat writes it), which the caller checked as NewEvent.from_json and prepare do:
-- one row of append_events' arrays. PostgreSQL reads each event's data from the array,
-- so nothing encodes it on its own. A JSON null as data is stored as JSON null
-- (jsonb_to_recordset makes it an SQL NULL). %(new_ids)s holds 16 bytes per event: event
-- n's id when it has none, new (see append_events' generated_ids).
SELECT array_agg(e.id ORDER BY e.n) AS ids,
       array_agg(e.key ORDER BY e.n) AS keys,
       array_agg(e.type ORDER BY e.n) AS types,
       array_agg(coalesce(e.data, 'null'::jsonb) ORDER BY e.n) AS data,
       array_agg(e.metadata ORDER BY e.n) AS metadata,
       array_agg(e.occurred_at ORDER BY e.n) AS occurred_at,
       array_agg(CASE WHEN e.id IS NULL THEN
                     encode(substring(%(new_ids)b::bytea FROM 16 * e.n::integer - 15 FOR 16),
                            'hex')::uuid
                 END ORDER BY e.n) AS generated_ids
  FROM ROWS FROM (jsonb_to_recordset(%(events)b::jsonb)
                  AS (key text, type text, data jsonb, metadata jsonb, id uuid,
                      occurred_at timestamptz))
       WITH ORDINALITY AS e(key, type, data, metadata, id, occurred_at, n)

-- name: append_json
-- Append the events of json_events.
SELECT a.ordinal, a.partition, a.position, a.id, a.key_version, a.duplicate
  FROM ({json_events}) AS x
 CROSS JOIN LATERAL {schema}.append_events(
        %(stream)s::text, x.ids, x.keys, x.types, x.data, x.metadata, x.occurred_at,
        %(expected_keys)b::text[], %(expected_versions)b::bigint[], x.generated_ids) AS a
