"""An app whose handler fails on events with {"poison": true} until LETTERS_FIXED is set:
dead letters to look at, retry and discard (`--app letters_app:app`)."""

import os
from typing import Any

import subengine

app = subengine.App()
letters = app.subscription("letters", stream="orders", on_error="dead_letter", max_attempts=1)


@letters.handler()
def handle(event: subengine.Event, conn: Any) -> None:
    if event.data.get("poison") and not os.environ.get("LETTERS_FIXED"):
        raise ValueError(f"cannot handle {event.key}")
    conn.execute(
        "INSERT INTO effects VALUES (%s, %s, %s)", (event.id, event.partition, event.position)
    )
