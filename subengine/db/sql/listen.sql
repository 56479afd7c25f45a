-- Notifications. append_events notifies the channel named after the schema, once per
-- partition that received events, with {"stream", "partition", "head"} as the payload.

-- name: listen
-- Start receiving the schema's notifications on this (autocommit) connection.
LISTEN {schema}
