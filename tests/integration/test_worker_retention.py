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


@pytest.mark.parametrize("ended_by", ["stop", "terminated backend"])
def test_a_run_ended_midway_still_says_what_it_removed(
    dsn: str, sql: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture, ended_by: str
) -> None:
    """Each batch of a pruning run commits on its own: when a stop or a lost connection
    ends the run between two of them, what the committed batches removed is logged all
    the same."""
    settings = subengine.Settings(dsn=dsn, poll_interval=0.2, retention_interval=0.2)
    app = subengine.App()
    app.subscription("billing", stream="capped").handler()(lambda event, conn: None)
    caplog.set_level(logging.INFO, logger="subengine.worker")
    waiting = (
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND datname = current_database()"
    )
    # waits for the backend to end (PostgreSQL 14+): the lock is given back only after it
    terminate = (
        "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND datname = current_database()"
    )

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "retention removed" in r.getMessage()]

    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("capped", partitions=2, retention=Retention(max_events=3))
        engine.append("capped", [NewEvent(f"k{n}", "T", {}) for n in range(20)])
        heads = [p.head for p in engine.partitions("capped")]
        assert min(heads) > 3, heads  # both partitions have something to remove
        # the first run prunes partition 0, then waits for the rows of partition 1 held here
        blocker = psycopg.connect(dsn)
        blocker.execute(
            "SELECT 1 FROM subengine.events WHERE stream = 'capped' AND partition = 1 FOR UPDATE"
        )
        with blocker, Running(app, engine) as running:
            wait_for(lambda: len(sql.execute(waiting).fetchall()) == 1)
            assert [p.floor for p in engine.partitions("capped")] == [heads[0] - 2, 1]
            if ended_by == "stop":  # partition 1's batch goes, then the run sees the stop
                running.stop.set()
            else:  # partition 1's batch is lost; the next run removes it
                sql.execute(terminate)
            blocker.rollback()
            wait_for(lambda: engine.partitions("capped")[1].floor == heads[1] - 2)
            wait_for(lambda: len(lines()) == (1 if ended_by == "stop" else 2), "the log lines")
        assert [p.floor for p in engine.partitions("capped")] == [heads[0] - 2, heads[1] - 2]
    if ended_by == "stop":
        assert lines() == [
            f"retention removed {sum(heads) - 6} event(s) from 2 partition(s)"
            " before the worker stopped"
        ]
    else:
        assert lines() == [
            f"retention removed {heads[0] - 3} event(s) from 1 partition(s) before the run failed",
            f"retention removed {heads[1] - 3} event(s) from 1 partition(s)",
        ]


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
