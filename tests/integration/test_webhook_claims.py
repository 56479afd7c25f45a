"""A webhook batch claimed in one statement (outside/_webhook_batches.py): its events as
the delivery sends them, made by PostgreSQL from what is stored; its bounds, which a
retry keeps; what it leaves to the engine's batch; and the compare-and-set that moves the
position past it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

import subengine
from subengine import NewEvent
from subengine.db._sql import SQL, Db
from subengine.gateway._delivery_bodies import event_body
from subengine.outside._webhook_batches import ClaimedBatch, claim_batch, commit_batch
from subengine.outside._webhooks import WebhookDefinition, WebhookStream, subscription_name


@pytest.fixture
def claims(dsn: str, engine: subengine.Engine) -> Iterator[Db]:
    """A connection in autocommit, as the delivery worker claims on, in a time zone with
    a half-hour offset."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET TIME ZONE 'America/St_Johns'")
        yield Db(conn, engine.sql)


def webhook(
    engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    types: tuple[str, ...] | None = None,
    include_data: bool = True,
) -> str:
    """An active webhook 'hook' of stream 's' (one partition) from the beginning; the
    name of its engine subscription."""
    stream = WebhookStream("s", types)
    definition = WebhookDefinition("https://receiver.example/hook", (stream,), include_data)
    engine.put_webhook("hook", definition, {"s": "beginning"})
    sql.execute("UPDATE subengine.webhooks SET state = 'active'")
    (serial,) = sql.execute("SELECT serial FROM subengine.webhooks").fetchone() or (0,)
    return subscription_name(serial, 0)


def claim(
    db: Db, name: str, size: int = 100, types: tuple[str, ...] | None = None
) -> ClaimedBatch | None:
    return db.run(claim_batch("hook", name, "s", 0, size, types, None))


def stored_end(sql: psycopg.Connection[Any]) -> int | None:
    row = sql.execute("SELECT batch_through FROM subengine.subscription_positions").fetchone()
    assert row is not None
    return int(row[0]) if row[0] is not None else None


def append(engine: subengine.Engine, count: int, type: str = "T") -> None:
    engine.append("s", [NewEvent(f"k{n}", type, {"n": n}) for n in range(count)])


def test_a_batch_carries_its_events_as_sent_with_numbers_to_their_last_digit(
    engine: subengine.Engine, sql: psycopg.Connection[Any], claims: Db
) -> None:
    engine.create_stream("s", partitions=1)
    name = webhook(engine, sql)
    data = {"text": 'é ü \u2028 " \\ \n', "nested": {"list": [1, 2.5, None, True]}}
    engine.append(
        "s",
        [
            NewEvent(
                "k1",
                "T",
                data,
                metadata={"by": "ü"},
                occurred_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
            ),
            NewEvent(
                'k"2\\',
                "T\u00e9",
                {"n": 2},
                occurred_at=datetime(2026, 1, 2, 3, 4, 5, 500000, tzinfo=UTC),
            ),
            NewEvent("k3", "T", {"n": 3}),
        ],
    )
    # a number no float holds: decoding and encoding the data again would round it
    sql.execute(
        """UPDATE subengine.events SET data = '{"x": 0.10000000000000000000001}'
            WHERE position = 3"""
    )
    batch = claim(claims, name)
    assert batch is not None and batch.events is not None
    sent = json.loads("[" + batch.events + "]")
    stored = [e for e in engine.read("s", 0, 0, 10) if isinstance(e, subengine.Event)]
    assert [{**e, "data": None} for e in sent] == [
        {**event_body(e, True), "occurred_at": e_sent["occurred_at"],
         "recorded_at": e_sent["recorded_at"], "data": None}
        for e, e_sent in zip(stored, sent, strict=True)
    ]  # fmt: skip
    assert [e["data"] for e in sent[:2]] == [data, {"n": 2}]
    assert '"data":{"x": 0.10000000000000000000001}}' in batch.events
    # times as Python writes them, in the session's time zone (no fraction when it is 0)
    times = claims.conn.execute(
        "SELECT occurred_at, recorded_at FROM subengine.events ORDER BY position"
    ).fetchall()
    assert [(e["occurred_at"], e["recorded_at"]) for e in sent] == [
        (occurred.isoformat(), recorded.isoformat()) for occurred, recorded in times
    ]
    assert sent[0]["occurred_at"] == "2026-01-01T23:34:05-03:30"


def test_without_data_an_event_keeps_its_metadata(
    engine: subengine.Engine, sql: psycopg.Connection[Any], claims: Db
) -> None:
    engine.create_stream("s", partitions=1)
    name = webhook(engine, sql, include_data=False)
    engine.append("s", [NewEvent("k", "T", {"n": 1}, metadata={"m": 1})])
    batch = claim(claims, name)
    assert batch is not None and batch.events is not None
    (sent,) = json.loads("[" + batch.events + "]")
    assert "data" not in sent and sent["metadata"] == {"m": 1}


def test_a_full_batch_is_the_same_again_without_storing_its_end(
    engine: subengine.Engine, sql: psycopg.Connection[Any], claims: Db
) -> None:
    engine.create_stream("s", partitions=1)
    name = webhook(engine, sql)
    append(engine, 5)
    first = claim(claims, name, size=3)
    assert first is not None and (first.position, first.through) == (0, 3)
    assert stored_end(sql) is None
    # its commit did not wait for the disk, and the setting was its transaction's alone
    assert claims.conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    append(engine, 5)
    again = claim(claims, name, size=3)
    assert again is not None and (again.position, again.through, again.events) == (
        0, 3, first.events,
    )  # fmt: skip


ALONE_ON_ITS_SERVER = pytest.mark.skipif(
    bool(os.environ.get("SUBENGINE_TEST_DSN")),
    reason="on a shared server other tests' commits flush this one's WAL too, so it may "
    "never be seen unflushed (the embedded run has a server per worker)",
)


@ALONE_ON_ITS_SERVER
def test_moving_the_position_past_a_delivered_batch_does_not_wait_for_the_disk(
    engine: subengine.Engine, sql: psycopg.Connection[Any], claims: Db
) -> None:
    engine.create_stream("s", partitions=1)
    name = webhook(engine, sql)
    append(engine, 30)
    unflushed = 0
    for _ in range(10):
        batch = claim(claims, name, size=3)
        assert batch is not None
        with claims.conn.transaction():
            assert claims.run(commit_batch(name, "s", 0, batch))[0]
            # the commit's own record comes after this
            written = claims.conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
        assert written is not None
        # A commit that waited has flushed past `written`; one that did not leaves its
        # WAL to the WAL writer's next round (every 200 ms), so some are seen unflushed.
        row = claims.conn.execute("SELECT pg_current_wal_flush_lsn() < %s", written).fetchone()
        unflushed += bool(row and row[0])
        assert claims.conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    assert unflushed > 0
    assert sql.execute("SELECT position FROM subengine.subscription_positions").fetchone() == (30,)


def test_a_claim_that_stores_an_end_carries_the_moves_before_it_to_the_disk(
    engine: subengine.Engine, sql: psycopg.Connection[Any], claims: Db
) -> None:
    # What makes a move that does not wait safe: after a crash, no stored end survives
    # without the moves before it, so a batch sent again is the same batch (DESIGN.md).
    engine.create_stream("s", partitions=1)
    name = webhook(engine, sql)
    append(engine, 7)
    for _ in range(2):
        batch = claim(claims, name, size=3)
        assert batch is not None and batch.through - batch.position == 3
        assert claims.run(commit_batch(name, "s", 0, batch))[0]
    with claims.conn.transaction():
        partial = claim(claims, name, size=3)
        # the commit's own record comes after this: a commit that waits flushes past it,
        # whatever else the server writes meanwhile (the next test database's clone...)
        written = claims.conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
    assert partial is not None and (partial.position, partial.through) == (6, 7)
    assert stored_end(sql) == 7
    assert written is not None
    row = claims.conn.execute("SELECT pg_current_wal_flush_lsn() >= %s", written).fetchone()
    assert row == (True,), "the claim that stored an end did not wait for the disk"


def test_a_partial_batch_stores_its_end_and_a_retry_keeps_it(
    engine: subengine.Engine, sql: psycopg.Connection[Any], claims: Db
) -> None:
    engine.create_stream("s", partitions=1)
    name = webhook(engine, sql)
    append(engine, 2)
    first = claim(claims, name, size=3)
    assert first is not None and (first.position, first.through) == (0, 2)
    assert stored_end(sql) == 2
    append(engine, 5)
    again = claim(claims, name, size=3)
    assert again is not None and (again.through, again.events) == (2, first.events)
    assert claims.run(commit_batch(name, "s", 0, again)) == (True, again.next_time)
    assert stored_end(sql) is None
    after = claim(claims, name, size=3)
    assert after is not None and (after.position, after.through) == (2, 5)


def test_filters_leave_events_out_of_a_batch_but_not_out_of_its_bounds(
    engine: subengine.Engine, sql: psycopg.Connection[Any], claims: Db
) -> None:
    engine.create_stream("s", partitions=1)
    name = webhook(engine, sql, types=("Wanted",))
    append(engine, 2, "Other")
    append(engine, 1, "Wanted")
    batch = claim(claims, name, types=("Wanted",))
    assert batch is not None and batch.through == 3 and batch.wanted == 1
    assert [e["position"] for e in json.loads("[" + (batch.events or "") + "]")] == [3]
    append(engine, 1, "Other")
    assert claims.run(commit_batch(name, "s", 0, batch))[0]
    none_wanted = claim(claims, name, types=("Wanted",))
    assert none_wanted is not None and none_wanted.through == 4
    assert (none_wanted.wanted, none_wanted.events) == (0, None)


@pytest.mark.parametrize(
    "change",
    [
        "UPDATE subengine.webhooks SET state = 'pending'",
        "UPDATE subengine.webhooks SET paused = true",
        "UPDATE subengine.subscription_positions SET attempts = 1",
        "UPDATE subengine.subscription_positions SET retry_at = now() + interval '1 hour'",
        "UPDATE subengine.subscription_positions SET stopped = true",
        "DELETE FROM subengine.events WHERE position = 2",
        "UPDATE subengine.events SET occurred_at = '1970-01-01T00:00:00Z'",
    ],
)
def test_a_batch_that_is_not_plain_is_left_to_the_engine_and_nothing_is_written(
    engine: subengine.Engine, sql: psycopg.Connection[Any], claims: Db, change: str
) -> None:
    engine.create_stream("s", partitions=1)
    name = webhook(engine, sql)
    append(engine, 3)
    sql.execute(change)
    before = sql.execute("SELECT * FROM subengine.subscription_positions").fetchall()
    assert claim(claims, name) is None
    assert sql.execute("SELECT * FROM subengine.subscription_positions").fetchall() == before


def test_nothing_is_claimed_for_a_webhook_that_is_gone(
    engine: subengine.Engine, sql: psycopg.Connection[Any], claims: Db
) -> None:
    engine.create_stream("s", partitions=1)
    name = webhook(engine, sql)
    append(engine, 3)
    engine.delete_webhook("hook")
    assert claim(claims, name) is None


def test_moving_the_position_past_a_batch_is_compared_and_set(
    engine: subengine.Engine, sql: psycopg.Connection[Any], claims: Db
) -> None:
    engine.create_stream("s", partitions=1)
    name = webhook(engine, sql)
    append(engine, 4)
    batch = claim(claims, name, size=2)
    assert batch is not None
    moved, next_time = claims.run(commit_batch(name, "s", 0, batch))
    assert moved and next_time is not None  # events 3 and 4 wait
    assert claims.run(commit_batch(name, "s", 0, batch)) == (False, None)
    later = claim(claims, name, size=2)
    assert later is not None
    engine.reset_subscription(name, {0: 0})  # a new generation: the batch is fenced
    assert claims.run(commit_batch(name, "s", 0, later)) == (False, None)
    assert sql.execute("SELECT position FROM subengine.subscription_positions").fetchone() == (0,)


def test_the_claim_is_short_enough_for_psycopg_to_keep_it_parsed() -> None:
    # longer statements are parsed again at every call (measured: a sixth of the
    # delivery worker's time)
    assert len(SQL("subengine").text("claim_webhook_batch")) <= MAX_CACHED_STATEMENT_LENGTH
