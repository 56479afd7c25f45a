"""A Durable Streams append is one transaction (engine/_durable_streams.py): when its last
statements fail (the catalog's update, a binary stream's bytes), the append fails and
stores nothing, and the next one goes on from the same tail. An append of JSON messages
alone is one statement; every other append, and every one that statement does not take,
goes through the checks of the general path."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
import pytest

import subengine
from subengine.engine._durable_streams import Appended, BadMessage, DurableStreams, NewStream
from subengine.model._errors import StreamNotFound
from subengine.outside._durable_streams import Producer

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
    ("content_type", "table", "what", "seq"),
    [
        ("application/json", "durable_streams", "UPDATE", None),  # one statement
        ("application/json", "durable_streams", "UPDATE", "b"),  # the general path
        ("application/octet-stream", "durable_streams", "UPDATE", None),
        ("application/octet-stream", "durable_stream_bytes", "INSERT", None),
    ],
)
def test_an_append_whose_last_statements_fail_stores_nothing_and_raises(
    async_engine: subengine.AsyncEngine,
    runner: asyncio.Runner,
    sql: psycopg.Connection[Any],
    content_type: str,
    table: str,
    what: str,
    seq: str | None,
) -> None:
    store = DurableStreams(async_engine, max_page_bytes=1 << 20)
    body = json.dumps([{"n": 1}]).encode()
    runner.run(store.create("/a", NewStream(content_type, None, None, False)))
    runner.run(store.append("/a", content_type, body, close=False, seq="a", producer=None))
    before = stored(sql)
    sql.execute(FAIL_UPDATES.format(what=what, table=table))
    with pytest.raises(psycopg.errors.RaiseException, match="refused by the test"):
        runner.run(store.append("/a", content_type, body, close=False, seq=seq, producer=None))
    assert stored(sql) == before
    sql.execute(f"DROP TRIGGER refuse ON subengine.{table}")
    appended = runner.run(
        store.append("/a", content_type, body, close=False, seq=seq, producer=None)
    )
    assert appended.outcome == "appended" and appended.tail == before[1][0][1] + 1


class Statements:
    """The named statements a store runs, in order (the database is real; this only
    records which of them each call sends)."""

    def __init__(self, store: DurableStreams) -> None:
        self.names: list[str] = []
        run = store._run

        async def recorded(conn: psycopg.AsyncConnection[Any], query: Any) -> Any:
            self.names.append(query.name)
            return await run(conn, query)

        store._run = recorded  # type: ignore[method-assign]

    def taken(self) -> list[str]:
        names, self.names = self.names, []
        return names


def test_an_append_of_json_messages_alone_is_one_statement_and_the_rest_the_general_path(
    async_engine: subengine.AsyncEngine, runner: asyncio.Runner, sql: psycopg.Connection[Any]
) -> None:
    store = DurableStreams(async_engine, max_page_bytes=1 << 20)
    runner.run(store.create("/j", NewStream("application/json", None, None, False)))
    runner.run(store.create("/b", NewStream("text/plain", None, None, False)))
    runner.run(store.create("/p", NewStream("Application/JSON; charset=utf-8", None, None, False)))
    statements = Statements(store)

    def append(
        path: str, body: bytes, content_type: str = "application/json", **given: Any
    ) -> Appended:
        options = {"close": False, "seq": None, "producer": None, **given}
        return runner.run(store.append(path, content_type, body, **options))

    done = append("/j", b'[{"n": 1}, {"n": 2}]')
    assert (done.outcome, done.tail) == ("appended", 2)
    assert statements.taken() == ["ds_append_plain"]
    done = append("/j", b'{"n": 3}', "Application/JSON; charset=utf-8")
    assert (done.outcome, done.tail) == ("appended", 3)
    assert statements.taken() == ["ds_append_plain"]
    done = append("/p", b"[null, [1]]")
    assert (done.outcome, done.tail) == ("appended", 2)
    assert statements.taken() == ["ds_append_plain"]
    # what the plain statement does not take writes nothing there: the checks decide
    done = append("/b", b'{"n": 1}')
    assert done.outcome == "content_type"
    assert statements.taken() == ["ds_append_plain", "ds_lock_stream"]
    with pytest.raises(BadMessage):
        append("/j", b"[1, ")
    assert statements.taken() == ["ds_lock_stream"]
    done = append("/j", b'{"n": 4}', seq="a")
    assert (done.outcome, done.tail) == ("appended", 4)
    assert statements.taken()[0] == "ds_lock_stream"
    runner.run(store.append("/j", None, b"", close=True, seq=None, producer=None))
    statements.taken()
    done = append("/j", b'{"n": 5}')
    assert (done.outcome, done.tail) == ("closed", 4)
    assert statements.taken() == ["ds_append_plain", "ds_lock_stream"]
    with pytest.raises(StreamNotFound):
        append("/nothing", b'{"n": 1}')
    rows = sql.execute(
        "SELECT e.position, e.type, e.data FROM subengine.events e"
        " JOIN subengine.durable_streams d ON d.stream = e.stream"
        " WHERE d.path = '/j' ORDER BY e.position"
    ).fetchall()
    # the close marker, after the last message, is no message: the tail stays 4
    assert [(p, d) for p, _, d in rows] == [(n, {"n": n}) for n in (1, 2, 3, 4)] + [(5, {})]
    assert sql.execute(
        "SELECT tail FROM subengine.durable_streams WHERE path = '/j'"
    ).fetchone() == (4,)


def test_an_append_of_json_messages_alone_moves_a_ttl_streams_deadline(
    async_engine: subengine.AsyncEngine, runner: asyncio.Runner, sql: psycopg.Connection[Any]
) -> None:
    store = DurableStreams(async_engine, max_page_bytes=1 << 20)
    runner.run(store.create("/t", NewStream("application/json", 3600, None, False)))
    sql.execute(
        "UPDATE subengine.durable_streams SET deadline = now() + interval '1 minute'"
        " WHERE path = '/t'"
    )
    statements = Statements(store)
    runner.run(store.append("/t", "application/json", b"[1]", close=False, seq=None, producer=None))
    assert statements.taken() == ["ds_append_plain"]
    left = sql.execute(
        "SELECT deadline - now() FROM subengine.durable_streams WHERE path = '/t'"
    ).fetchone()
    assert left is not None and left[0].total_seconds() > 3000
    # an expired stream is the general path's: it is removed, and the append finds none
    sql.execute(
        "UPDATE subengine.durable_streams SET deadline = now() - interval '1 second'"
        " WHERE path = '/t'"
    )
    with pytest.raises(StreamNotFound):
        runner.run(
            store.append("/t", "application/json", b"[2]", close=False, seq=None, producer=None)
        )
    assert statements.taken()[:2] == ["ds_append_plain", "ds_lock_stream"]


def test_concurrent_appends_of_json_messages_and_of_producers_number_densely(
    async_engine: subengine.AsyncEngine, runner: asyncio.Runner, sql: psycopg.Connection[Any]
) -> None:
    store = DurableStreams(async_engine, max_page_bytes=1 << 20)
    runner.run(store.create("/c", NewStream("application/json", None, None, False)))

    async def appender(number: int) -> list[int]:
        tails = []
        for n in range(20):
            # every third appender is an idempotent producer: the general path, under the
            # same lock
            producer = Producer(f"p{number}", 0, n) if number % 3 == 0 else None
            body = json.dumps([{"by": number, "n": n}, {"by": number, "n": n}]).encode()
            done = await store.append(
                "/c", "application/json", body, close=False, seq=None, producer=producer
            )
            if done.outcome == "appended":
                tails.append(done.tail)
        return tails

    async def together() -> list[list[int]]:
        return list(await asyncio.gather(*(appender(number) for number in range(1, 7))))

    tails = runner.run(together())
    rows = sql.execute(
        "SELECT e.position, e.data FROM subengine.events e"
        " JOIN subengine.durable_streams d ON d.stream = e.stream"
        " WHERE d.path = '/c' ORDER BY e.position"
    ).fetchall()
    positions = [p for p, _ in rows]
    assert positions == list(range(1, len(rows) + 1))
    # each append's two messages are next to each other, and its tail is the second's
    for first, second in zip(rows[::2], rows[1::2], strict=True):
        assert first[1] == second[1]
    every_tail = sorted(t for each in tails for t in each)
    assert every_tail == positions[1::2]
    assert [len(each) for each in tails] == [20] * 6  # each one appended, either way
    assert sql.execute(
        "SELECT tail FROM subengine.durable_streams WHERE path = '/c'"
    ).fetchone() == (len(rows),)


CHANGES = {
    "closed": "UPDATE subengine.durable_streams SET closed = true WHERE path = '/w'",
    "deleted": "UPDATE subengine.durable_streams SET deleted_at = now() WHERE path = '/w'",
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_an_append_waiting_for_a_close_or_delete_finds_it_and_stores_nothing(
    async_engine: subengine.AsyncEngine,
    runner: asyncio.Runner,
    sql: psycopg.Connection[Any],
    dsn: str,
    change: str,
) -> None:
    store = DurableStreams(async_engine, max_page_bytes=1 << 20)
    runner.run(store.create("/w", NewStream("application/json", None, None, False)))
    runner.run(store.append("/w", "application/json", b"[1]", close=False, seq=None, producer=None))
    before = stored(sql)
    statements = Statements(store)

    async def append_while_locked() -> Appended:
        async with await psycopg.AsyncConnection.connect(dsn) as other:
            await other.execute(
                "SELECT 1 FROM subengine.durable_streams WHERE path = '/w' FOR UPDATE"
            )
            waiting = asyncio.create_task(
                store.append("/w", "application/json", b"[2]", close=False, seq=None, producer=None)
            )
            while not await _waits_for_a_lock(other):
                await asyncio.sleep(0.01)
            await other.execute(CHANGES[change])
            await other.commit()
            return await waiting

    done = runner.run(asyncio.wait_for(append_while_locked(), 30))
    assert done.outcome == change
    assert statements.taken()[0] == "ds_append_plain"
    assert stored(sql) == before


async def _waits_for_a_lock(conn: psycopg.AsyncConnection[Any]) -> bool:
    cursor = await conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
    )
    row = await cursor.fetchone()
    return row is not None and row[0] > 0
