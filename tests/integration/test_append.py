"""Append: dense positions, key versions, idempotency, expected versions, notifications."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
import sqlalchemy
from helpers import stored_events
from sqlalchemy.orm import Session

import subengine
from subengine import NewEvent


def events(*keys: str, type: str = "Happened") -> list[NewEvent]:
    return [NewEvent(key, type, {"n": n}) for n, key in enumerate(keys)]


def test_ids_left_out_become_time_ordered_uuids_and_given_ids_stay(
    engine: subengine.Engine, orders: str
) -> None:
    given = uuid.uuid4()
    before = datetime.now(UTC)
    stored = engine.append(
        orders,
        [NewEvent("a", "T", {}), NewEvent("b", "T", {}, id=given), *events("c", "d", "e")],
    )
    made = [a.id for n, a in enumerate(stored) if n != 1]
    assert stored[1].id == given
    assert len(set(made)) == 4 and given not in made
    for event_id in made:
        assert event_id.version == 7 and event_id.variant == uuid.RFC_4122
        millis = event_id.int >> 80  # UUIDv7: Unix milliseconds in the first 48 bits
        assert abs(millis / 1000 - before.timestamp()) < 60


def test_positions_are_dense_per_partition_and_versions_count_per_key(
    engine: subengine.Engine, orders: str
) -> None:
    keys = [f"order-{n % 7}" for n in range(60)]
    stored = engine.append(orders, events(*keys))
    by_partition: dict[int, list[int]] = {}
    for appended in stored:
        by_partition.setdefault(appended.partition, []).append(appended.position)
    for positions in by_partition.values():
        assert positions == list(range(1, len(positions) + 1))
    for key in set(keys):
        versions = [a.key_version for k, a in zip(keys, stored, strict=True) if k == key]
        assert versions == list(range(1, keys.count(key) + 1))
    assert engine.heads(orders) == {p: len(by_partition.get(p, [])) for p in range(4)}


def test_each_event_lands_in_the_partition_of_its_key(
    engine: subengine.Engine, orders: str
) -> None:
    stored = engine.append(orders, events(*[f"k{n}" for n in range(40)]))
    for n, appended in enumerate(stored):
        assert appended.partition == subengine.partition_for(f"k{n}", 4)


def test_partition_function_is_the_same_in_python_and_sql(sql: psycopg.Connection[Any]) -> None:
    keys = ["", "a", "order-123", "ünïcødé ключ", "🙂", "x" * 1000] + [f"k{n}" for n in range(200)]
    for partitions in (1, 2, 3, 8, 13, 4096):
        rows = sql.execute(
            "SELECT k, subengine.partition_for(k, %s) FROM unnest(%s::text[]) AS k",
            (partitions, keys),
        ).fetchall()
        assert {k: p for k, p in rows} == {k: subengine.partition_for(k, partitions) for k in keys}


def test_an_event_id_already_in_the_stream_is_not_stored_again(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    event_id = uuid.uuid4()
    first = engine.append(orders, [NewEvent("order-1", "Placed", {}, id=event_id)])
    again = engine.append(orders, [NewEvent("order-1", "Placed", {}, id=event_id)])
    assert (again[0].partition, again[0].position) == (first[0].partition, first[0].position)
    assert again[0].duplicate and not first[0].duplicate
    assert sql.execute("SELECT count(*) FROM subengine.events").fetchone()[0] == 1  # type: ignore[index]


def test_a_repeated_id_within_one_call_is_stored_once(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    event_id = uuid.uuid4()
    stored = engine.append(
        orders,
        [NewEvent("order-1", "A", {}, id=event_id), NewEvent("order-1", "A", {}, id=event_id)],
    )
    assert [a.duplicate for a in stored] == [False, True]
    assert stored[0].position == stored[1].position
    assert sql.execute("SELECT count(*) FROM subengine.events").fetchone()[0] == 1  # type: ignore[index]


def test_retrying_a_committed_append_with_expected_version_is_idempotent(
    engine: subengine.Engine, orders: str
) -> None:
    batch = [NewEvent("order-1", "Placed", {}, id=uuid.uuid4())]
    first = engine.append(orders, batch, expected_version=0)
    again = engine.append(orders, batch, expected_version=0)
    assert again[0].position == first[0].position and again[0].duplicate


def test_expected_version_is_checked_per_key(engine: subengine.Engine, orders: str) -> None:
    engine.append(orders, events("a", "a", "b"))
    stored = engine.append(orders, events("a", "b"), expected_version={"a": 2, "b": 1})
    assert [a.key_version for a in stored] == [3, 2]
    assert engine.append(orders, events("new"), expected_version=0)[0].key_version == 1


def test_wrong_expected_version_names_the_key_and_writes_nothing(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    engine.append(orders, events("a", "a", "b"))
    heads = engine.heads(orders)
    before = sql.execute("SELECT count(*) FROM subengine.events").fetchone()[0]  # type: ignore[index]
    with pytest.raises(subengine.WrongExpectedVersion) as caught:
        engine.append(orders, events("b", "a"), expected_version={"a": 2, "b": 0})
    assert (caught.value.key, caught.value.expected, caught.value.actual) == ("b", 0, 1)
    assert "'b'" in str(caught.value) and "version 1" in str(caught.value)
    assert sql.execute("SELECT count(*) FROM subengine.events").fetchone()[0] == before  # type: ignore[index]
    assert engine.heads(orders) == heads


def test_integer_expected_version_needs_a_single_key(engine: subengine.Engine, orders: str) -> None:
    with pytest.raises(subengine.InvalidInput, match="mapping"):
        engine.append(orders, events("a", "b"), expected_version=0)


def test_occurred_at_and_metadata_are_kept(engine: subengine.Engine, orders: str) -> None:
    when = datetime(2020, 5, 17, 12, 0, tzinfo=UTC)
    engine.append(orders, [NewEvent("k", "T", [1, 2], metadata={"by": "me"}, occurred_at=when)])
    [event] = stored_events(engine.read(orders, subengine.partition_for("k", 4)))
    assert (event.data, event.metadata, event.occurred_at) == ([1, 2], {"by": "me"}, when)
    assert event.recorded_at > when


def test_append_joins_the_callers_psycopg_transaction(
    engine: subengine.Engine, orders: str, dsn: str
) -> None:
    with psycopg.connect(dsn) as conn:
        subengine.append(conn, orders, events("k"))
        conn.execute("CREATE TABLE app_state (n int)")
        conn.rollback()
    assert engine.heads(orders) == {0: 0, 1: 0, 2: 0, 3: 0}
    with psycopg.connect(dsn) as conn:
        stored = subengine.append(conn, orders, events("k"))
        conn.commit()
    assert engine.heads(orders)[stored[0].partition] == 1


@pytest.fixture
def sa_engine(dsn: str) -> Iterator[sqlalchemy.Engine]:
    sa_engine = sqlalchemy.create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(dsn)
    )
    yield sa_engine
    sa_engine.dispose()


def test_append_joins_a_sqlalchemy_connection_transaction(
    engine: subengine.Engine, orders: str, sa_engine: sqlalchemy.Engine
) -> None:
    with sa_engine.connect() as conn:
        subengine.append(conn, orders, events("k"))
        conn.rollback()
    assert sum(engine.heads(orders).values()) == 0
    with sa_engine.connect() as conn:
        subengine.append(conn, orders, events("k"))
        conn.execute(sqlalchemy.text("CREATE TABLE app_state (n int)"))
        conn.commit()
    assert sum(engine.heads(orders).values()) == 1


def test_append_joins_a_sqlalchemy_session_transaction(
    engine: subengine.Engine, orders: str, sa_engine: sqlalchemy.Engine
) -> None:
    with Session(sa_engine) as session:
        subengine.append(session, orders, events("k"))
        session.rollback()
    assert sum(engine.heads(orders).values()) == 0
    with Session(sa_engine) as session:
        subengine.append(session, orders, events("k", "k"))
        session.commit()
    assert sum(engine.heads(orders).values()) == 2


def test_append_on_a_fresh_sqlalchemy_connection_commits_with_it(
    engine: subengine.Engine, orders: str, sa_engine: sqlalchemy.Engine
) -> None:
    # No statement ran before the append: SQLAlchemy had not begun a transaction yet,
    # and the caller's commit() must still commit the appended events.
    with sa_engine.connect() as conn:
        assert not conn.in_transaction()
        subengine.append(conn, orders, events("k"))
        conn.commit()
    assert sum(engine.heads(orders).values()) == 1


def test_plain_sql_can_append(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    row = sql.execute(
        "SELECT partition, position, key_version, duplicate FROM subengine.append("
        "'orders', 'order-9', 'Placed', '{\"total\": 3}')"
    ).fetchone()
    assert row == (subengine.partition_for("order-9", 4), 1, 1, False)
    with pytest.raises(psycopg.Error, match="expected version 0"):
        sql.execute(
            "SELECT * FROM subengine.append('orders', 'order-9', 'Paid', '{}', "
            "expected_version => 0)"
        )
    [event] = stored_events(engine.read(orders, row[0]))
    assert (event.key, event.type, event.data) == ("order-9", "Placed", {"total": 3})


@pytest.mark.parametrize("count", [1, 3])
def test_what_plain_sql_leaves_out_is_filled_in_alike_for_one_event_and_several(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any], count: int
) -> None:
    # append_events stores one event by a path of its own: it must fill in what the
    # caller left out (ids, metadata, occurred_at) as the path for several events does
    rows = sql.execute(
        "SELECT ordinal, partition, position, id, key_version, duplicate"
        " FROM subengine.append_events('orders', NULL, array_fill('k'::text, ARRAY[%(n)s]),"
        " array_fill('T'::text, ARRAY[%(n)s]), array_fill('{\"n\": 1}'::jsonb, ARRAY[%(n)s]))"
        " ORDER BY ordinal",
        {"n": count},
    ).fetchall()
    sql.commit()
    partition = subengine.partition_for("k", 4)
    assert [(r[0], r[1], r[2], r[4], r[5]) for r in rows] == [
        (n, partition, n, n, False) for n in range(1, count + 1)
    ]
    read = stored_events(engine.read(orders, partition))
    assert [e.id for e in read] == [r[3] for r in rows]
    assert all(e.id.version == 4 for e in read)  # gen_random_uuid()
    for event in read:
        assert (event.data, event.metadata) == ({"n": 1}, {})
        assert event.occurred_at == event.recorded_at
    assert len({e.recorded_at for e in read}) == 1  # the time the partition's lock was taken


def test_one_notification_per_partition_touched(
    engine: subengine.Engine, orders: str, dsn: str
) -> None:
    keys = [f"k{n}" for n in range(30)]
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute('LISTEN "subengine"')
        stored = engine.append(orders, events(*keys))
        received = [json.loads(n.payload) for n in listener.notifies(timeout=1.0, stop_after=10)]
    heads: dict[int, int] = {}
    for appended in stored:
        heads[appended.partition] = max(heads.get(appended.partition, 0), appended.position)
    assert sorted(received, key=lambda n: n["partition"]) == [
        {"stream": "orders", "partition": p, "head": h} for p, h in sorted(heads.items())
    ]


def test_appending_nothing_is_a_no_op(engine: subengine.Engine, orders: str) -> None:
    assert engine.append(orders, []) == []


def test_two_schemas_share_a_database(dsn: str) -> None:
    with subengine.Engine(dsn, schema="second") as other:
        other.migrate()
        other.create_stream("orders", partitions=2)
        other.append("orders", events("k"))
        assert sum(other.heads("orders").values()) == 1
    with subengine.Engine(dsn) as default:
        assert default.streams() == []


def test_a_retry_mixing_stored_and_new_events_stays_dense(
    engine: subengine.Engine, orders: str, dsn: str
) -> None:
    first = [NewEvent(f"k{n}", "First", {}, id=uuid.uuid4()) for n in range(6)]
    engine.append(orders, first)
    states_before = {s.partition: s for s in engine.partitions(orders)}
    fresh = [NewEvent(f"k{n}", "Second", {}, id=uuid.uuid4()) for n in (0, 1)]
    batch = [first[0], fresh[0], first[3], fresh[1], fresh[0], first[5]]
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute('LISTEN "subengine"')
        stored = engine.append(orders, batch)
        notified = {json.loads(n.payload)["partition"] for n in listener.notifies(timeout=0.5)}
    assert [a.duplicate for a in stored] == [True, False, True, False, True, True]
    assert stored[4].position == stored[1].position  # the repeat points at its first copy
    assert [a.key_version for a in stored] == [1, 2, 1, 2, 2, 1]
    new_partitions = {stored[1].partition, stored[3].partition}
    assert notified == new_partitions
    for state in engine.partitions(orders):
        before = states_before[state.partition]
        positions = [e.position for e in stored_events(engine.read(orders, state.partition))]
        assert positions == list(range(1, state.head + 1))
        if state.partition in new_partitions:
            assert state.head > before.head
        else:
            assert (state.head, state.head_time) == (before.head, before.head_time)


def test_an_append_of_only_stored_events_changes_nothing(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    first = [NewEvent(f"k{n}", "First", {}, id=uuid.uuid4()) for n in range(5)]
    engine.append(orders, first)
    before = engine.partitions(orders)
    again = engine.append(orders, first[::-1])
    assert all(a.duplicate for a in again)
    assert engine.partitions(orders) == before


def test_an_id_names_one_event(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    event_id = uuid.uuid4()
    engine.append(orders, [NewEvent("order-1", "Placed", {}, id=event_id)])
    before = sql.execute("SELECT count(*), max(position) FROM subengine.events").fetchone()
    for other in (
        NewEvent("order-2", "Placed", {}, id=event_id),
        NewEvent("order-1", "Paid", {}, id=event_id),
    ):
        with pytest.raises(
            subengine.EventIdConflict,
            match="stored in stream 'orders' already, the first for key 'order-1' and type 'Pl",
        ):
            engine.append(orders, [NewEvent("order-3", "Fine", {}), other])
    fresh = uuid.uuid4()
    with pytest.raises(subengine.EventIdConflict, match="two events of one append"):
        engine.append(orders, [NewEvent("a", "T", {}, id=fresh), NewEvent("b", "T", {}, id=fresh)])
    assert sql.execute("SELECT count(*), max(position) FROM subengine.events").fetchone() == before


def test_a_duplicate_retry_in_a_stream_of_many_partitions_stays_fast_and_dense(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # the retry path counts events per partition in one query, not once per partition
    engine.create_stream("wide", partitions=4096)
    first = [NewEvent(f"k{n}", "T", {}, id=uuid.uuid4()) for n in range(2000)]
    engine.append("wide", first[:1])
    stored = engine.append("wide", first)
    assert stored[0].duplicate and not any(a.duplicate for a in stored[1:])
    heads = engine.heads("wide")
    assert sum(heads.values()) == 2000
    rows = sql.execute(
        "SELECT partition, array_agg(position ORDER BY position) FROM subengine.events"
        " WHERE stream = 'wide' GROUP BY partition"
    ).fetchall()
    assert all(positions == list(range(1, heads[p] + 1)) for p, positions in rows)
