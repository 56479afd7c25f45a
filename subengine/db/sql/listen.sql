-- Notifications. append_events notifies the channel named after the schema, once per
-- partition that received events, with {"stream", "partition", "head"} as the payload.
-- A change of the gateway's API keys (create_gateway_key, revoke_gateway_key) notifies
-- it with the payload gateway_keys: every gateway process drops its cached keys. A change
-- of which webhooks are delivered (sql/webhooks.sql) notifies it with the payload
-- gateway_webhooks: every gateway process's webhook deliveries look again at once.

-- name: listen
-- Start receiving the schema's notifications on this (autocommit) connection.
LISTEN {schema}
