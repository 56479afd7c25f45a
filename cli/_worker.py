"""Running a worker from the command line: finding the app, and the signals.

`--app MODULE:ATTR` names a module importable from the current directory (as with
gunicorn or uvicorn) and an `App` in it. SIGTERM or SIGINT asks the worker to stop: the
current batches finish, the locks are released, the command exits 0. A second signal
exits at once; the database stays consistent (an unfinished batch rolls back).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

import click

import subengine


def load_app(spec: str) -> subengine.App:
    """The `App` named by `MODULE:ATTR`; ConfigurationError says what is wrong."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise click.BadParameter(
            f"{spec!r} is not MODULE:ATTR (e.g. myproject.consumers:app)", param_hint="--app"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # whatever the app's import raised, say so in one line
        raise subengine.ConfigurationError(
            f"--app {spec}: cannot import {module_name!r}: {type(error).__name__}: {error}"
        ) from None
    app = getattr(module, attribute, None)
    if app is None:
        raise subengine.ConfigurationError(
            f"--app {spec}: module {module_name!r} has no attribute {attribute!r}"
        )
    if not isinstance(app, subengine.App):
        raise subengine.ConfigurationError(
            f"--app {spec}: {attribute!r} is a {type(app).__name__}, not a subengine.App"
        )
    return app


def run_until_signalled(run: Callable[[threading.Event], None]) -> None:
    """Call `run(stop)`; the first SIGTERM/SIGINT sets `stop`, the second exits at once."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            os.write(2, f"{name} again: exiting at once\n".encode())
            os._exit(128 + signum)
        os.write(
            2,
            f"{name}: finishing the current batches, then exiting "
            f"(send it again to exit at once)\n".encode(),
        )
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        run(stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
