"""An at_least_once batch's bounds are stored when it is first read (DESIGN.md, "A retry
is the same batch"): until its position commits, every read of the partition's next batch
is that batch again, though events were appended since; a commit or a reset ends it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from helpers import Running, wait_for

import subengine
from subengine import NewEvent


def pusher(fail: list[bool], seen: list[list[int]]) -> subengine.Subscription:
    """An at_least_once subscription of stream 'one' whose handler records each batch's
    positions and raises RetryLater while `fail[0]` is true."""
    app = subengine.App()
    sub = app.subscription("pusher", stream="one", ack="at_least_once", batch_size=50)

    @sub.batch_handler()
    def push(events: Sequence[subengine.Event], conn: Any) -> None:
        seen.append([event.position for event in events])
        if fail[0]:
            raise subengine.RetryLater(0, "callback down")

    return app.subscriptions["pusher"]


def append(engine: subengine.Engine, count: int) -> None:
    engine.append("one", [NewEvent("k", "T", {}) for _ in range(count)])


def test_a_retry_reads_the_batch_it_read_first_though_events_came_since(
    engine: subengine.Engine,
) -> None:
    engine.create_stream("one", partitions=1)
    fail, seen = [True], list[list[int]]()
    subscription = pusher(fail, seen)
    engine.ensure_subscription(subscription)
    append(engine, 3)
    with pytest.raises(subengine.RetryLater):
        engine.process_batch(subscription, 0)
    append(engine, 5)
    with pytest.raises(subengine.RetryLater):
        engine.process_batch(subscription, 0)
    fail[0] = False
    engine.process_batch(subscription, 0)
    engine.process_batch(subscription, 0)  # only after it succeeded, the next batch
    assert seen == [[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 5, 6, 7, 8]]


def test_a_reset_ends_the_stored_batch(engine: subengine.Engine) -> None:
    engine.create_stream("one", partitions=1)
    fail, seen = [True], list[list[int]]()
    subscription = pusher(fail, seen)
    engine.ensure_subscription(subscription)
    append(engine, 3)
    with pytest.raises(subengine.RetryLater):
        engine.process_batch(subscription, 0)
    append(engine, 5)
    engine.reset_subscription("pusher", {0: 1})
    fail[0] = False
    engine.process_batch(subscription, 0)
    assert seen == [[1, 2, 3], [2, 3, 4, 5, 6, 7, 8]]


def test_a_gap_retried_later_keeps_its_bounds_though_retention_removed_more(
    fast_engine: subengine.Engine,
) -> None:
    fast_engine.create_stream("one", partitions=1, retention=subengine.Retention(max_events=4))
    gaps: list[tuple[int, int]] = []
    handled: list[int] = []
    app = subengine.App()
    sub = app.subscription("pusher", stream="one", ack="at_least_once", batch_size=50)
    sub.handler()(lambda event, conn: handled.append(event.position))

    @sub.gap_handler()
    def push_gap(gap: subengine.Tombstone, conn: Any) -> None:
        gaps.append((gap.gap_from, gap.gap_to))
        if len(gaps) == 1:  # retention removes more before the retry
            append(fast_engine, 3)
            fast_engine.run_retention()  # floor 10
            raise subengine.RetryLater(0.2, "callback down")

    fast_engine.ensure_subscription(sub)
    for _ in range(10):
        append(fast_engine, 1)
    assert fast_engine.run_retention().removed == 6  # floor 7: positions 1 to 6 are a gap
    with Running(app, fast_engine):
        wait_for(lambda: handled == [10, 11, 12, 13], "the events after the gaps")
    assert gaps == [(1, 6), (1, 6), (7, 9)]


def test_a_gap_whose_handler_died_keeps_its_bounds_too(engine: subengine.Engine) -> None:
    # The bounds of an at_least_once gap are committed before its handler runs, so a
    # handler that never returns (its process killed; here, an error that rolls its
    # transaction back) leaves them for the next attempt.
    engine.create_stream("one", partitions=1, retention=subengine.Retention(max_events=4))
    gaps: list[tuple[int, int]] = []
    app = subengine.App()
    sub = app.subscription("pusher", stream="one", ack="at_least_once")
    sub.handler()(lambda event, conn: None)

    @sub.gap_handler()
    def push_gap(gap: subengine.Tombstone, conn: Any) -> None:
        gaps.append((gap.gap_from, gap.gap_to))
        if len(gaps) == 1:
            append(engine, 3)
            engine.run_retention()  # floor 10
            raise KeyboardInterrupt  # as a kill: nothing after it runs

    declared = app.subscriptions["pusher"]
    engine.ensure_subscription(declared)
    for _ in range(10):
        append(engine, 1)
    engine.run_retention()  # floor 7
    with pytest.raises(KeyboardInterrupt):
        engine.process_batch(declared, 0)
    engine.process_batch(declared, 0)
    engine.process_batch(declared, 0)
    assert gaps == [(1, 6), (1, 6), (7, 9)]
