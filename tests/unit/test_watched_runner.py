"""The suite's event loop watchdog (tests/helpers.py, `watched_runner`): a test whose
loop still runs after the limit fails, with the stack of each task, instead of hanging
the suite."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import watched_runner


async def stuck_forever() -> None:
    await asyncio.Event().wait()


def test_a_loop_that_runs_past_its_limit_prints_its_tasks_and_cancels_them(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with watched_runner(limit=0.5) as runner, pytest.raises(asyncio.CancelledError):
        runner.run(stuck_forever())
    err = capfd.readouterr().err
    assert "the test's event loop still ran after 0.5 s: its 1 tasks, then cancelled" in err
    assert "in stuck_forever" in err


def test_a_loop_that_ends_in_time_is_left_alone(capfd: pytest.CaptureFixture[str]) -> None:
    with watched_runner(limit=0.5) as runner:
        assert runner.run(asyncio.sleep(0, "done")) == "done"
        # the limit passes while the test's own code runs, with no loop running: the
        # watchdog waits for a run, and none comes before the runner closes
        time.sleep(0.8)
    assert capfd.readouterr().err == ""
