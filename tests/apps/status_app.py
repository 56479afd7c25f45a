"""The app of the status page's tests (tests/acceptance/test_status_page.py), which the
gateway loads with `subengine serve --app status_app:app` to retry dead letters.

Subscriptions `billing` and `shipping` of stream `orders` record each event in the table
`effects` (event_id, partition, position), and fail the events of every key the table
`poison` names at their first failure: billing's go to the dead letters, shipping parks
their keys.
"""

from typing import Any

import subengine

app = subengine.App()
billing = app.subscription("billing", stream="orders", on_error="dead_letter", max_attempts=1)
shipping = app.subscription("shipping", stream="orders", on_error="park", max_attempts=1)


@shipping.handler()
@billing.handler()
def record(event: subengine.Event, conn: Any) -> None:
    if conn.execute("SELECT 1 FROM poison WHERE key = %s", (event.key,)).fetchone():
        raise ValueError(f"order {event.key} is poisoned")
    conn.execute(
        "INSERT INTO effects VALUES (%s, %s, %s)", (event.id, event.partition, event.position)
    )
