"""An at_least_once batch's bounds are stored when it is first read (DESIGN.md, "A retry
is the same batch"): until its position commits, every read of the partition's next batch
is that batch again, though events were appended since; a commit or a reset ends it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

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
