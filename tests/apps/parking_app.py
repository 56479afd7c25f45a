"""The app of the parking tests (`--app parking_app:app`): subscription `parking` of
stream `orders`, policy park after two attempts. Its batch handler records every event's
effect in the table `effects` (as tests/apps/worker_app.py does, in the batch's
transaction) and fails on events whose data says {"poison": true} until PARKING_FIXED is
set. WORKER_APP_BATCH sets the batch size."""

import os
from collections.abc import Sequence
from typing import Any

import subengine

app = subengine.App()
parking = app.subscription(
    "parking",
    stream="orders",
    on_error="park",
    max_attempts=2,
    batch_size=int(os.environ.get("WORKER_APP_BATCH", "20")),
)


@parking.batch_handler()
def record(events: Sequence[subengine.Event], conn: Any) -> None:
    for event in events:
        if event.data.get("poison") and not os.environ.get("PARKING_FIXED"):
            raise ValueError(f"cannot handle {event.key} version {event.key_version}")
        conn.execute(
            "INSERT INTO effects (event_id, key, key_version, partition, position, seq)"
            " VALUES (%s, %s, %s, %s, %s, nextval('effect_order'))",
            (event.id, event.key, event.key_version, event.partition, event.position),
        )
