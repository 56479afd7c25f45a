"""The suite's processes take SIGINT (Ctrl-C) however the suite was started."""

from __future__ import annotations

import signal
import subprocess


def _ignored(status: str) -> int:
    [line] = [line for line in status.splitlines() if line.startswith("SigIgn:")]
    return int(line.split()[1], 16)


def test_a_command_a_test_starts_takes_sigint() -> None:
    # started in the background by a non-interactive shell, the suite inherits SIGINT
    # ignored; conftest.py takes it back, so that a command stopped with SIGINT stops
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    status = subprocess.run(
        ["cat", "/proc/self/status"], capture_output=True, text=True, check=True
    ).stdout
    assert not _ignored(status) & (1 << (signal.SIGINT - 1))
