"""An app whose import blocks: it writes the file SLOW_IMPORT_MARKER, then sleeps for
SLOW_IMPORT_SECONDS before declaring anything, as a heavy application import would."""

import os
import time
from pathlib import Path
from typing import Any

import subengine

Path(os.environ["SLOW_IMPORT_MARKER"]).write_text(str(os.getpid()))
time.sleep(float(os.environ.get("SLOW_IMPORT_SECONDS", "600")))

app = subengine.App()
effects = app.subscription("effects", stream="orders")


@effects.handler()
def ignore(event: subengine.Event, conn: Any) -> None:
    pass
