"""A Durable Streams append is one transaction (engine/_durable_streams.py): when its last
statements fail (the catalog's update, a binary stream's bytes), the append fails and
stores nothing, and the next one goes on from the same tail."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
import pytest

import subengine
from subengine.engine._durable_streams import DurableStreams, NewStream

FAIL_UPDATES = """
CREATE FUNCTION subengine.refuse() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$;
CREATE TRIGGER refuse BEFORE {what} ON subengine.{table}
    FOR EACH ROW EXECUTE FUNCTION subengine.refuse();
"""


def stored(sql: psycopg.Connection[Any]) -> tuple[Any, ...]:
    return (
        sql.execute("SELECT count(*) FROM subengine.events").fetchone(),
        sql.execute("SELECT path, tail FROM subengine.durable_streams").fetchall(),
        sql.execute("SELECT count(*) FROM subengine.durable_stream_bytes").fetchone(),
    )


@pytest.mark.parametrize(
    ("content_type", "table", "what"),
    [
        ("application/json", "durable_streams", "UPDATE"),
        ("application/octet-stream", "durable_streams", "UPDATE"),
        ("application/octet-stream", "durable_stream_bytes", "INSERT"),
    ],
)
def test_an_append_whose_last_statements_fail_stores_nothing_and_raises(
    async_engine: subengine.AsyncEngine,
    runner: asyncio.Runner,
    sql: psycopg.Connection[Any],
    content_type: str,
    table: str,
    what: str,
) -> None:
    store = DurableStreams(async_engine, max_page_bytes=1 << 20)
    body = json.dumps([{"n": 1}]).encode()
    runner.run(store.create("/a", NewStream(content_type, None, None, False)))
    runner.run(store.append("/a", content_type, body, close=False, seq=None, producer=None))
    before = stored(sql)
    sql.execute(FAIL_UPDATES.format(what=what, table=table))
    with pytest.raises(psycopg.errors.RaiseException, match="refused by the test"):
        runner.run(store.append("/a", content_type, body, close=False, seq=None, producer=None))
    assert stored(sql) == before
    sql.execute(f"DROP TRIGGER refuse ON subengine.{table}")
    appended = runner.run(
        store.append("/a", content_type, body, close=False, seq=None, producer=None)
    )
    assert appended.outcome == "appended" and appended.tail == before[1][0][1] + 1
