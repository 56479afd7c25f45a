"""Statistics older than a stream (DESIGN.md: hot queries must be safe with no, stale or
early statistics). A stream created after the last ANALYZE of `events` is unknown to the
planner, which then estimates its events at one row; a batch's read of the events after
a position must still walk the primary key from that position, and never read the whole
stream by another index to keep a few of its events."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from helpers import scans

import subengine
from subengine import NewEvent
from subengine.outside._webhooks import WebhookDefinition, WebhookStream, subscription_name


def scans_of_events(conn: psycopg.Connection[Any], text: bytes, params: dict[str, Any]) -> Any:
    """The plan of the statement `text` (its JSON), and its scans of `events`: (node type,
    index)."""
    with conn.transaction(force_rollback=True):
        row = conn.execute(b"EXPLAIN (FORMAT JSON) " + text, params).fetchone()
    assert row is not None
    plan = json.dumps(row[0])
    return plan, {(node, index) for node, relation, index in scans(plan) if relation == "events"}


@pytest.fixture
def new_stream(engine: subengine.Engine, sql: psycopg.Connection[Any]) -> str:
    """The stream `new` of 20,000 events, created after `events` was last analysed with
    three other streams of as many in it: the size at which the planner, on PostgreSQL
    16, found the time index cheaper than the primary key for it."""
    for stream in ("old-1", "old-2", "old-3", "new"):
        engine.create_stream(stream, partitions=8)
        for _ in range(4):
            engine.append(stream, [NewEvent(f"k{n % 50}", "T", {}) for n in range(5000)])
        if stream == "old-3":
            sql.execute("ANALYZE subengine.events")
    return "new"


def test_a_batch_of_a_stream_newer_than_the_statistics_reads_by_the_primary_key(
    engine: subengine.Engine, sql: psycopg.Connection[Any], new_stream: str
) -> None:
    engine.ensure_subscription(subengine.App().subscription("projection", stream=new_stream))
    params = {"name": "projection", "partition": 1, "stream": new_stream, "size": 100}
    plan, found = scans_of_events(sql, engine.sql.text("lock_batch"), params)
    assert found == {("Index Scan", "events_pkey")}, plan


def test_a_webhook_batch_of_a_stream_newer_than_the_statistics_reads_by_the_primary_key(
    engine: subengine.Engine, sql: psycopg.Connection[Any], new_stream: str
) -> None:
    definition = WebhookDefinition(
        "https://receiver.example/hook", (WebhookStream(new_stream, None),), True
    )
    engine.put_webhook("hook", definition, {new_stream: "beginning"})
    sql.execute("UPDATE subengine.webhooks SET state = 'active'")
    (serial,) = sql.execute("SELECT serial FROM subengine.webhooks").fetchone() or (0,)
    params = {
        "id": "hook",
        "name": subscription_name(serial, 0),
        "stream": new_stream,
        "partition": 1,
        "size": 100,
        "types": None,
        "keys": None,
    }
    plan, found = scans_of_events(sql, engine.sql.text("claim_webhook_batch"), params)
    assert found == {("Index Scan", "events_pkey")}, plan
