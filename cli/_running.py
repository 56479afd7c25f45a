"""Running a worker from the command line: finding the app, and the signals.

`--app MODULE:ATTR` names a module importable from the current directory (as with
gunicorn or uvicorn) and an `App` in it. SIGTERM or SIGINT asks the worker to stop: the
current batches finish, the locks are released, the command exits 0. A second signal
exits at once; the database stays consistent (an unfinished batch rolls back).

The handlers are installed before anything slow (logging, the app's import, the embedded
server, waiting for PostgreSQL): a signal during that start-up ends it at once, and the
command still exits 0 (`StoppedBeforeStart`). Only the interpreter's own start-up and the
command's imports come before them.
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


class StoppedBeforeStart(BaseException):
    """A stop signal came while the worker was starting: it never ran, and exits 0.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way (an
    app's import, say) takes it for an error.
    """

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"{signal_name} before the worker started: it stopped without starting")


class StopSignals:
    """SIGTERM and SIGINT for the worker command, handled from the moment it is made.

    While starting, a signal raises StoppedBeforeStart wherever the start-up is (importing
    the app, waiting for PostgreSQL); `run` then hands the signals to the worker: the
    first sets its `stop`, a second exits at once.
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._starting = True
        self._previous = {s: signal.signal(s, self._on_signal) for s in _STOP_SIGNALS}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.stop.is_set():
            os.write(2, f"{name} again: exiting at once\n".encode())
            os._exit(128 + signum)
        self.stop.set()
        if self._starting:
            raise StoppedBeforeStart(name)
        os.write(
            2,
            f"{name}: finishing the current batches, then exiting "
            f"(send it again to exit at once)\n".encode(),
        )

    def run(self, run: Callable[[threading.Event], None]) -> None:
        """Call `run(stop)` with the signals setting `stop`; restore the handlers after."""
        self._starting = False
        try:
            run(self.stop)
        finally:
            for s, handler in self._previous.items():
                signal.signal(s, handler)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
