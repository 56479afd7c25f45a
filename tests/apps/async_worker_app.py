"""The app of the async worker-process tests: `subengine worker --app async_worker_app:app`.

Like worker_app.py, but its batch handler is `async def` and writes each event's effect
through a SQLAlchemy AsyncSession bound to the batch's AsyncConnection (table `effects`,
no unique constraint, so a duplicate would show). WORKER_APP_BATCH, WORKER_APP_SLEEP and
WORKER_APP_MARKS shape it as they do worker_app.py.
"""

import os
from collections.abc import Sequence
from typing import Any

from sqlalchemy import text

import subengine

app = subengine.App()
effects = app.subscription(
    "effects", stream="orders", batch_size=int(os.environ.get("WORKER_APP_BATCH", "20"))
)
_sleep = float(os.environ.get("WORKER_APP_SLEEP", "0"))
_marks = os.environ.get("WORKER_APP_MARKS")

_INSERT = text(
    "INSERT INTO effects (event_id, key, key_version, partition, position, seq)"
    " VALUES (:id, :key, :version, :partition, :position, nextval('effect_order'))"
)


@effects.batch_handler()
async def record(events: Sequence[subengine.Event], conn: Any) -> None:
    if _marks:
        with open(_marks, "a") as marks:
            first, last = events[0], events[-1]
            marks.write(f"{os.getpid()} {first.partition} {first.position} {last.position}\n")
    async with subengine.async_sqlalchemy_session(conn) as session:
        for event in events:
            if _sleep:
                await session.execute(text("SELECT pg_sleep(:s)"), {"s": _sleep})
            await session.execute(
                _INSERT,
                {
                    "id": event.id,
                    "key": event.key,
                    "version": event.key_version,
                    "partition": event.partition,
                    "position": event.position,
                },
            )
