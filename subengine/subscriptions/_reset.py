"""Resetting a subscription inside the caller's own transaction.

`Engine.reset_subscription` resets in a transaction of its own. A rebuild of a
projection needs the reset and the projection's own changes (a truncation, say) to commit
together: `reset_subscription` here runs on the caller's connection, as `append` does.
"""

from __future__ import annotations

from subengine.db._connection import psycopg_connection
from subengine.db._sql import SQL, Db
from subengine.model._declarations import Start
from subengine.model._settings import Settings
from subengine.subscriptions._subscriptions import reset_subscription as reset_positions


def reset_subscription(
    conn: object,
    name: str,
    to: Start,
    *,
    schema: str | None = None,
    settings: Settings | None = None,
) -> dict[int, int]:
    """Move every position of subscription `name` to `to` in a new generation, inside the
    caller's open transaction; the new positions by partition.

    `conn` is a psycopg connection, a SQLAlchemy Connection or a SQLAlchemy Session, as
    for `append`; `to` is 'beginning', 'end', a time or a map of partition to position.
    The reset takes effect when the caller commits, together with the caller's other
    writes; workers then fail the compare-and-set of any batch that read the old
    generation. A failed reset (an unknown subscription, a position past a head) leaves
    the caller's transaction usable. `schema` (default: SUBENGINE_SCHEMA) or `settings`
    (such as `engine.settings`) picks the schema.
    """
    settings = settings or Settings.from_env()
    if schema is not None:
        settings = settings.with_changes(schema=schema)
    target = psycopg_connection(
        conn,
        alone="the reset would commit on its own",
        instead="engine.reset_subscription()",
    )
    return reset_positions(Db(target, SQL(settings.schema)), name, to)
