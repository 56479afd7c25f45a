"""The engine's reads for the gateway's status page (docs/status-page.md): its snapshot,
one statement on a pooled connection of the `AsyncEngine`."""

from __future__ import annotations

from subengine.engine._async_engine import AsyncEngine
from subengine.subscriptions._status_snapshot import status_snapshot


async def read_status_snapshot(engine: AsyncEngine) -> str:
    """Everything the status page shows, as one JSON document (see
    `subengine.subscriptions._status_snapshot.status_snapshot`). Read it on the primary:
    which worker holds a partition comes from the primary's locks."""
    async with engine.connection(autocommit=True) as conn:
        return await engine.sql.run_async(conn, status_snapshot())
