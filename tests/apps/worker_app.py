"""The app the worker-process tests run: `subengine worker --app worker_app:app`.

It records every event's effect in the table `effects` (no unique constraint, so a
duplicate would show), in the batch's transaction. The environment shapes it:
WORKER_APP_BATCH (batch size), WORKER_APP_SLEEP (seconds of pg_sleep per event, to make
batches slow) and WORKER_APP_MARKS (a file where each batch notes, when it starts, its
process, partition and first and last positions; outside any transaction).
"""

import os
from collections.abc import Sequence
from typing import Any

import subengine

app = subengine.App()
effects = app.subscription(
    "effects", stream="orders", batch_size=int(os.environ.get("WORKER_APP_BATCH", "20"))
)
_sleep = float(os.environ.get("WORKER_APP_SLEEP", "0"))
_marks = os.environ.get("WORKER_APP_MARKS")


@effects.batch_handler()
def record(events: Sequence[subengine.Event], conn: Any) -> None:
    if _marks:
        with open(_marks, "a") as marks:
            first, last = events[0], events[-1]
            marks.write(f"{os.getpid()} {first.partition} {first.position} {last.position}\n")
    for event in events:
        if _sleep:
            conn.execute("SELECT pg_sleep(%s)", (_sleep,))
        conn.execute(
            "INSERT INTO effects (event_id, key, key_version, partition, position, seq)"
            " VALUES (%s, %s, %s, %s, %s, nextval('effect_order'))",
            (event.id, event.key, event.key_version, event.partition, event.position),
        )
