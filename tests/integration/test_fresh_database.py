"""A fresh database: appends stay index lookups whatever statistics an early ANALYZE left.

append_events plans its statements once per session and keeps the plans. Planned right
after an ANALYZE of an empty or nearly empty database, a lookup by id or key could read
the whole events table (or the whole stream, through another index) on every call, and
each append would cost more as the table grew.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

import subengine
from subengine import NewEvent

TABLES = ("streams", "partitions", "events")


def reads(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, int]]:
    """Per table of subengine: the sequential scans, and the rows read by any scan, that
    this session counted and has not reported yet (it reports none inside a transaction)."""
    rows = conn.execute(
        "SELECT relname, seq_scan, seq_tup_read + idx_tup_fetch FROM pg_stat_xact_user_tables"
        " WHERE schemaname = 'subengine' AND relname = ANY (%s)",
        (list(TABLES),),
    ).fetchall()
    return {name: (scans, rows_read) for name, scans, rows_read in rows}


@pytest.mark.parametrize("early_events", [0, 5])
def test_appends_after_an_early_analyze_read_no_whole_table(
    dsn: str, orders: str, early_events: int
) -> None:
    appends = 300
    with psycopg.connect(dsn) as conn:
        for n in range(early_events):
            subengine.append(conn, orders, [NewEvent(f"order-{n}", "Placed", {})])
            conn.commit()
        # what autovacuum, or an operator, may do to a database this young
        conn.execute("ANALYZE subengine.streams, subengine.partitions, subengine.events")
        conn.commit()
        # then many appends in one session, each statement planned once, under those
        # statistics: with and without expected versions, and a retry of stored events
        before = reads(conn)
        for n in range(appends):
            key = f"order-{n % 50}"
            versions_before = n // 50 + (1 if n % 50 < early_events else 0)
            subengine.append(
                conn, orders, [NewEvent(key, "Paid", {})], expected_version=versions_before
            )
        stored = [NewEvent(f"order-{n}", "Shipped", {}, id=uuid.uuid4()) for n in range(3)]
        subengine.append(conn, orders, stored[:1])
        retried = subengine.append(conn, orders, stored)
        assert [a.duplicate for a in retried] == [True, False, False]
        after = reads(conn)
    scans = {table: after[table][0] - before[table][0] for table in TABLES}
    assert scans == dict.fromkeys(TABLES, 0)
    # An append of one event reads a few rows through the indexes (its key's latest
    # version, the stored id next to its own); one read of the table per append would
    # come to 150 rows per append on average.
    events_read = after["events"][1] - before["events"][1]
    assert events_read <= 10 * appends
