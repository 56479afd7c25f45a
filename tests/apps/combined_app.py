"""The app of the combined-transaction tests: `subengine worker --app combined_app:app`.

Subscription `effects` of `orders` records every event's effect in the table `effects`
with the id of the transaction that made it (a column the tests add), in the batch's
transaction. An event whose data holds `poison` raises; one whose data holds `gate` waits
for the transaction-level advisory lock of that number, which a test holds to keep a batch
open. Each handler call first notes, in the file COMBINED_APP_MARKS (outside any
transaction), its process, partition, first and last positions, event count and
transaction id. COMBINED_APP_BATCH is the batch size; COMBINED_APP_ON_ERROR the policy.
"""

import os
from collections.abc import Sequence
from typing import Any

import subengine

app = subengine.App()
effects = app.subscription(
    "effects",
    stream="orders",
    batch_size=int(os.environ.get("COMBINED_APP_BATCH", "5")),
    on_error=os.environ.get("COMBINED_APP_ON_ERROR", "stop"),  # type: ignore[arg-type]
    max_attempts=1,
)
_marks = os.environ["COMBINED_APP_MARKS"]


@effects.batch_handler()
def record(events: Sequence[subengine.Event], conn: Any) -> None:
    (txid,) = conn.execute("SELECT txid_current()").fetchone()
    with open(_marks, "a") as marks:
        first, last = events[0], events[-1]
        marks.write(
            f"{os.getpid()} {first.partition} {first.position} {last.position} "
            f"{len(events)} {txid}\n"
        )
    for event in events:
        if "gate" in event.data:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (event.data["gate"],))
        if "poison" in event.data:
            raise ValueError(f"poison at partition {event.partition} position {event.position}")
        conn.execute(
            "INSERT INTO effects (event_id, key, key_version, partition, position, seq, txid)"
            " VALUES (%s, %s, %s, %s, %s, nextval('effect_order'), %s)",
            (event.id, event.key, event.key_version, event.partition, event.position, txid),
        )
