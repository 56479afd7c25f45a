"""Retention beside Durable Streams forks (docs/durable-streams.md, "Forks"): a fork reads
its source's events up to the fork point without copying them, so pruning never removes
an event a fork (not deleted softly) still reads, whatever the policy's limits, and a
fork being created while a pruning batch decides is seen by that batch.

The catalog rows are written here as the gateway writes them (migration 0019), so that
only retention is under test; tests/acceptance/test_durable_stream_forks.py does it
through HTTP."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
from helpers import wait_for

import subengine
from subengine import NewEvent, Retention

JOIN_SECONDS = 30.0


def ds_stream(sql: psycopg.Connection[Any], path: str, stream: str, tail: int) -> None:
    sql.execute(
        "INSERT INTO subengine.durable_streams (path, stream, content_type, tail)"
        " VALUES (%s, %s, 'application/json', %s)",
        (path, stream, tail),
    )


def fork(conn: psycopg.Connection[Any], path: str, stream: str, source: str, point: int) -> None:
    """A fork of `source` at `point` in the catalog, inheriting positions 1..point."""
    conn.execute(
        "INSERT INTO subengine.durable_streams (path, stream, content_type, tail, source,"
        " forked_from, fork_offset, fork_sub_offset, fork_point)"
        " VALUES (%s, %s, 'application/json', %s, %s, '/source', 'offset', 0, %s)",
        (path, stream, point, source, point),
    )
    conn.execute(
        "INSERT INTO subengine.durable_stream_inherited (stream, source, after, upto)"
        " VALUES (%s, %s, 0, %s)",
        (stream, source, point),
    )


def floor_of(sql: psycopg.Connection[Any], stream: str) -> int:
    row = sql.execute(
        "SELECT floor FROM subengine.partitions WHERE stream = %s AND partition = 0", (stream,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_retention_keeps_what_a_fork_reads_until_the_fork_is_deleted_softly(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # the hard limit too: what a fork reads is no event "unprocessed" for a while
    policy = Retention(max_events=2, keep_unprocessed=True, hard_max_events=2)
    engine.create_stream("source", 1, retention=policy)
    engine.append("source", [NewEvent("k", "t", {"n": n}) for n in range(10)])
    ds_stream(sql, "/source", "source", 10)
    fork(sql, "/fork", "fork", "source", 6)

    assert engine.run_retention(dry_run=True).removed == 0
    assert engine.run_retention().removed == 0
    assert floor_of(sql, "source") == 1

    # deleted softly, a fork reads nothing more: the policy applies again
    sql.execute("UPDATE subengine.durable_streams SET deleted_at = now() WHERE path = '/fork'")
    assert engine.run_retention().removed == 8
    assert floor_of(sql, "source") == 9


def test_a_fork_created_while_a_prune_batch_decides_is_seen_by_it(
    engine: subengine.Engine, sql: psycopg.Connection[Any], dsn: str
) -> None:
    engine.create_stream("source", 1, retention=Retention(max_events=1))
    engine.append("source", [NewEvent("k", "t", {"n": n}) for n in range(10)])
    ds_stream(sql, "/source", "source", 10)
    runs: list[subengine.RetentionRun] = []
    with psycopg.connect(dsn) as creating:
        # a fork's creation: the pin first, then its rows, uncommitted while the batch runs
        creating.execute("SELECT subengine.durable_stream_pin('source')")
        fork(creating, "/fork", "fork", "source", 4)
        pruner = threading.Thread(target=lambda: runs.append(engine.run_retention()))
        pruner.start()
        wait_for(
            lambda: _waiting_for_an_advisory_lock(sql),
            "the prune batch to wait for the fork's creation",
            timeout=JOIN_SECONDS,
        )
        creating.commit()
    pruner.join(JOIN_SECONDS)
    assert not pruner.is_alive()
    assert runs[0].removed == 0
    assert floor_of(sql, "source") == 1


def _waiting_for_an_advisory_lock(sql: psycopg.Connection[Any]) -> bool:
    row = sql.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    ).fetchone()
    return row is not None and row[0] > 0
