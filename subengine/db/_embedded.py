"""The embedded PostgreSQL: a server from the `pgserver` wheel in SUBENGINE_HOME.

Used when no DSN is configured, so subengine runs with nothing but Python installed. The
server keeps running after the process exits (the next command reuses it) until
`stop_embedded` (`subengine db stop`).
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from pathlib import Path

from subengine.model._errors import ConfigurationError

_STOP_TIMEOUT_SECONDS = 30.0


def data_directory(home: Path) -> Path:
    return home.expanduser().resolve() / "pgdata"


def embedded_url(home: Path) -> str:
    """Start (or reuse) the embedded server in `home` and return its connection URL."""
    home = home.expanduser().resolve()
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigurationError(
            f"cannot create SUBENGINE_HOME {str(home)!r}: {error.strerror}"
        ) from None
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); harmless here
        warnings.simplefilter("ignore")
        import pgserver

        server = pgserver.get_server(  # type: ignore[attr-defined]
            data_directory(home), cleanup_mode=None
        )
    url: str = server.get_uri()
    return url


def _postmaster_pid(pgdata: Path) -> int | None:
    """The pid of the server running on `pgdata`, if one is."""
    try:
        first_line = (pgdata / "postmaster.pid").read_text().splitlines()[0]
        pid = int(first_line)
    except (FileNotFoundError, IndexError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # the server runs as another user (pgserver does so when started by root)
    # A stale pid file can name a pid that another program has since been given.
    try:
        command_line = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return pid  # no /proc here: trust the pid file
    if not command_line or not command_line[0].endswith(b"postgres"):
        return None
    return pid


def is_running(home: Path) -> bool:
    return _postmaster_pid(data_directory(home)) is not None


def stop_embedded(home: Path) -> bool:
    """Stop the embedded server in `home` (fast shutdown); False if none was running."""
    pid = _postmaster_pid(data_directory(home))
    if pid is None:
        return False
    os.kill(pid, signal.SIGINT)  # PostgreSQL's "fast" shutdown: roll back and stop
    deadline = time.monotonic() + _STOP_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    raise ConfigurationError(f"the embedded PostgreSQL (pid {pid}) did not stop in time")
