"""`append_async`: `append` for asyncio applications, in the caller's transaction.

The validation (`prepare`), the statement (`append_events`), its conversion and its
errors are the sync append's; only the connection differs. `append_json_async` runs an
append of events given as JSON (`prepare_json`), the gateway's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psycopg

from subengine.db._connection import async_psycopg_connection
from subengine.db._sql import SQL
from subengine.model._events import Appended, NewEvent
from subengine.model._settings import Settings
from subengine.streams._append import ExpectedVersion, append_events, prepare
from subengine.streams._append_json import append_json


async def append_async(
    conn: object,
    stream: str,
    events: Iterable[NewEvent],
    expected_version: ExpectedVersion = None,
    *,
    schema: str | None = None,
    settings: Settings | None = None,
) -> list[Appended]:
    """Append `events` to `stream` inside the caller's open asyncio transaction.

    `conn` is a psycopg `AsyncConnection`, a SQLAlchemy `AsyncConnection` or a SQLAlchemy
    `AsyncSession` (on the psycopg driver); the events become visible when the caller
    commits. Arguments, result and errors are those of `subengine.append`.
    """
    settings = settings or Settings.from_env()
    if schema is not None:
        settings = settings.with_changes(schema=schema)
    params = prepare(stream, events, expected_version, settings)
    driver_connection = await async_psycopg_connection(conn)
    if not params["keys"]:
        return []
    return await SQL(settings.schema).run_async(driver_connection, append_events(params))


async def append_json_async(
    conn: psycopg.AsyncConnection[Any], params: dict[str, Any], settings: Settings
) -> list[Appended]:
    """The append of events that `prepare_json` checked, on `conn` in its transaction:
    where each is stored, as `append_async` says."""
    return await SQL(settings.schema).run_async(conn, append_json(params))
