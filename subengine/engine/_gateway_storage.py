"""The engine's methods for what the gateway keeps in PostgreSQL: API keys, signing
secrets and webhook subscriptions. `Engine` inherits them; each runs one function of
`outside/` in a transaction of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any

import psycopg

from subengine.db._sql import SQL, Db
from subengine.model._declarations import Start
from subengine.outside import _api_keys, _webhook_control, _webhooks
from subengine.outside._api_keys import ApiKey
from subengine.outside._webhooks import Put, Webhook, WebhookDefinition


class GatewayStorage:
    """API keys, signing secrets and webhook subscriptions, for `Engine`, which supplies
    `sql`, `connection()` and `db()`."""

    sql: SQL

    def connection(
        self, *, autocommit: bool = False
    ) -> AbstractContextManager[psycopg.Connection[Any]]:
        raise NotImplementedError

    def db(self) -> AbstractContextManager[Db]:
        raise NotImplementedError

    # the gateway's API keys and signing secrets

    def create_api_key(
        self, scopes: Iterable[str], streams: Iterable[str], name: str | None = None
    ) -> tuple[ApiKey, str]:
        """Create an API key of the gateway allowed `scopes` (read, append, admin) on the
        streams matching `streams` (a name, a prefix ending in '*', or '*'); the key and
        its token, "sek_<id>_<secret>", which nothing can show again: only its hash is
        stored."""
        query = _api_keys.create_key(name, scopes, streams)
        with self.connection() as conn:
            return self.sql.run(conn, query)

    def api_keys(self) -> list[ApiKey]:
        """Every API key, revoked ones included, oldest first (never their secrets)."""
        with self.connection() as conn:
            return self.sql.run(conn, _api_keys.list_keys())

    def revoke_api_key(self, id: str) -> ApiKey:
        """Revoke the API key `id` (revoking it again changes nothing); the key. Raises
        ApiKeyNotFound when there is none."""
        query = _api_keys.revoke_key(id)
        with self.connection() as conn:
            return self.sql.run(conn, query)

    def authenticate(self, token: str) -> ApiKey | None:
        """The API key of `token`, or None when the token is malformed, unknown, wrong or
        revoked. Never raises on a bad token."""
        query = _api_keys.authenticate(token)
        if query is None:
            return None
        with self.connection() as conn:
            return self.sql.run(conn, query)

    def any_active_api_key(self) -> bool:
        """Whether any API key is not revoked; without one the gateway runs open."""
        with self.connection() as conn:
            return self.sql.run(conn, _api_keys.any_active_key())

    def signing_secret(self, name: str) -> bytes:
        """The gateway's signing secret `name` (32 random bytes), made on first use and
        the same for every caller and process of the schema after."""
        query = _api_keys.signing_secret(name)
        with self.connection() as conn:
            return self.sql.run(conn, query)

    # webhook subscriptions (the gateway's push; docs/webhooks.md)

    def put_webhook(
        self,
        webhook_id: str,
        definition: WebhookDefinition,
        starts: Mapping[str, Start] | None = None,
        *,
        secret: str | None = None,
        replaces: str | None = None,
        key_id: str | None = None,
    ) -> Put:
        """Create the webhook subscription `webhook_id` (pending until its callback echoes
        the challenge; each stream starts at `starts[stream]`, default 'end'), or renew
        its lease when it exists with the same definition. See `_webhooks.put_webhook`."""
        with self.db() as db:
            return _webhooks.put_webhook(
                db,
                webhook_id,
                definition,
                starts or {},
                secret=secret,
                replaces=replaces,
                key_id=key_id,
            )

    def webhooks(self) -> list[Webhook]:
        """Every webhook subscription with its state and lag, oldest first."""
        with self.db() as db:
            return _webhooks.webhooks(db)

    def webhook(self, webhook_id: str) -> Webhook:
        """One webhook subscription; WebhookNotFound when there is none."""
        with self.db() as db:
            return _webhooks.webhook(db, webhook_id)

    def delete_webhook(self, webhook_id: str) -> None:
        """Delete a webhook subscription with its positions: nothing more is delivered
        under its id (a batch in flight commits nothing). WebhookNotFound if none."""
        with self.db() as db:
            _webhooks.delete_webhook(db, webhook_id)

    def webhook_starts(
        self, streams: Iterable[str], *, after: str | None = None, since: datetime | None = None
    ) -> dict[str, dict[int, int]]:
        """Where `streams` start from a gateway cursor or a time (for `put_webhook`)."""
        with self.db() as db:
            return _webhook_control.starts_from(db, streams, after=after, since=since)

    def pause_webhook(self, webhook_id: str, paused: bool = True) -> Webhook:
        """Pause a webhook subscription (nothing is delivered, its positions stay), or
        resume it with `paused=False`."""
        with self.db() as db:
            return _webhook_control.set_webhook_paused(db, webhook_id, paused)

    def replay_webhook(
        self, webhook_id: str, *, after: str | None = None, since: datetime | None = None
    ) -> dict[str, dict[int, int]]:
        """Deliver a webhook's events again from a gateway cursor or a time, through the
        engine's reset (a new generation: a batch in flight commits nothing); each
        stream's positions after it."""
        with self.db() as db:
            return _webhook_control.replay_webhook(db, webhook_id, after=after, since=since)
