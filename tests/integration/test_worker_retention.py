"""Workers apply the streams' retention policies every retention_interval."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from helpers import Running, count, record, wait_for

import subengine
from subengine import NewEvent, Retention


def test_a_worker_prunes_every_interval_and_says_what_it_removed(
    dsn: str, sql: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    settings = subengine.Settings(dsn=dsn, poll_interval=0.2, retention_interval=0.2)
    app = subengine.App()
    app.subscription("billing", stream="capped").handler()(record)
    caplog.set_level(logging.INFO, logger="subengine.worker")
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("capped", partitions=2, retention=Retention(max_events=3))
        engine.create_stream("kept", partitions=1)
        with Running(app, engine):
            for n in range(20):
                engine.append("capped", [NewEvent(f"k{n}", "T", {})])
                engine.append("kept", [NewEvent(f"k{n}", "T", {})])
            wait_for(lambda: count(sql) == 20)  # handled before or after pruning, once each
            wait_for(lambda: sum(p.head - p.floor + 1 for p in engine.partitions("capped")) == 6)
        assert [p.floor for p in engine.partitions("kept")] == [1]
    assert any("retention removed" in r.getMessage() for r in caplog.records)


def test_a_worker_with_retention_interval_zero_never_prunes(
    dsn: str, sql: psycopg.Connection[Any]
) -> None:
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    settings = subengine.Settings(dsn=dsn, poll_interval=0.2, retention_interval=0)
    app = subengine.App()
    app.subscription("billing", stream="capped").handler()(record)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("capped", partitions=1, retention=Retention(max_events=3))
        engine.append("capped", [NewEvent(f"k{n}", "T", {}) for n in range(10)])
        with Running(app, engine):
            wait_for(lambda: count(sql) == 10)
            applied = engine.run_retention(dry_run=True)
        assert applied.removed == 7  # what a pruner would remove: the worker left it
        assert [p.floor for p in engine.partitions("capped")] == [1]
