"""The worker's progress lines, computed from lag readings, with no database."""

from __future__ import annotations

from collections.abc import Collection

from subengine.subscriptions._inspection import PartitionLag
from subengine.worker._metrics import Progress


def reading(*lags: int, halted: Collection[int] = ()) -> list[PartitionLag]:
    return [
        PartitionLag("billing", partition, 100, 100 + lag, partition in halted)
        for partition, lag in enumerate(lags)
    ]


def test_progress_is_quiet_when_nothing_is_behind_and_nothing_was_done() -> None:
    progress = Progress(["billing"], now=0.0)
    assert progress.report(0.0, {"billing": 0}, reading(0, 0)) == []
    assert not progress.wants_reading({"billing": 0}, serving_metrics=False)
    assert progress.report(10.0, {"billing": 0}, reading(0, 0)) == []


def test_progress_counts_events_rate_remaining_and_eta() -> None:
    progress = Progress(["billing"], now=0.0)
    [first] = progress.report(0.0, {"billing": 0}, reading(600, 400))
    assert first.message() == "subscription billing: 1,000 events to catch up"
    assert progress.wants_reading({"billing": 0}, serving_metrics=False)  # still behind
    [line] = progress.report(10.0, {"billing": 500}, reading(300, 200))
    assert (line.events, line.rate, line.remaining, line.eta_seconds) == (500, 50.0, 500, 10.0)
    assert line.message() == (
        "subscription billing: 500 events in 10.0 s (50/s), 500 remaining, ETA 10 s"
    )
    # new appends outpace the worker: no ETA
    [line] = progress.report(20.0, {"billing": 600}, reading(400, 200))
    assert line.eta_seconds is None and line.message().endswith("not shrinking")
    [line] = progress.report(30.0, {"billing": 1200}, reading(0, 0))
    assert line.message().endswith("caught up")


def test_stopped_or_paused_partitions_are_not_remaining_work() -> None:
    progress = Progress(["billing"], now=0.0)
    assert progress.report(0.0, {"billing": 0}, reading(0, 50, halted={1})) == []
    assert not progress.wants_reading({"billing": 0}, serving_metrics=False)
    assert progress.wants_reading({"billing": 0}, serving_metrics=True)
    assert progress.wants_reading({"billing": 3}, serving_metrics=False)
