"""The engines' contract, run over both twins (`Engine` and `AsyncEngine`, through the
`twin` fixture of twins.py): appends, reads, streams and their errors; connections, lost
and refused; schemas and limits. The async engine's own tests (it reads what the sync one
reads, append_async) are in test_async_engine.py.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from helpers import count_json_decodes, server_now, snapshot, stored_events
from psycopg.conninfo import make_conninfo
from twins import Twin, either_fixture, twin_fixture  # noqa: F401  (the fixtures)

import subengine
from subengine import NewEvent


def events(*keys: str, type: str = "Happened") -> list[NewEvent]:
    return [NewEvent(key, type, {"n": n}) for n, key in enumerate(keys)]


# appends and their errors


def test_appends_are_dense_and_read_back_in_order(either: Any, orders: str) -> None:
    stored = either.append(orders, events("a", "a", "b"))
    assert [s.key_version for s in stored] == [1, 2, 1]
    for partition in {s.partition for s in stored}:
        read = either.read(orders, partition)
        assert [e.position for e in read] == list(range(1, len(read) + 1))


def test_create_stream_twice_raises_stream_exists(either: Any) -> None:
    either.create_stream("letters", 3)
    with pytest.raises(subengine.StreamExists) as raised:
        either.create_stream("letters", 5)
    assert raised.value.partitions == 3


def test_a_missing_stream_raises_stream_not_found(either: Any) -> None:
    with pytest.raises(subengine.StreamNotFound):
        either.stream("nowhere")
    with pytest.raises(subengine.StreamNotFound):
        either.read("nowhere", 0)
    with pytest.raises(subengine.StreamNotFound):
        either.heads("nowhere")
    with pytest.raises(subengine.StreamNotFound):
        either.append("nowhere", events("k"))


def test_a_partition_outside_the_stream_raises_partition_not_found(
    either: Any, orders: str
) -> None:
    with pytest.raises(subengine.PartitionNotFound):
        either.read(orders, 4)


def test_a_wrong_expected_version_raises_and_writes_nothing(
    either: Any, orders: str, sql: psycopg.Connection[Any]
) -> None:
    either.append(orders, events("k"))
    before = snapshot(sql)
    with pytest.raises(subengine.WrongExpectedVersion) as raised:
        either.append(orders, events("k"), expected_version=0)
    assert (raised.value.expected, raised.value.actual) == (0, 1)
    assert snapshot(sql) == before


def test_a_bad_event_raises_invalid_event_and_writes_nothing(
    either: Any, orders: str, sql: psycopg.Connection[Any]
) -> None:
    before = snapshot(sql)
    with pytest.raises(subengine.InvalidEvent) as raised:
        either.append(orders, [NewEvent("k", "Ok", {}), NewEvent("k", "Bad", {1, 2})])
    assert raised.value.index == 1
    with pytest.raises(subengine.InvalidInput):
        either.read(orders, 0, limit=0)
    assert snapshot(sql) == before


def test_an_id_appended_twice_is_stored_once(either: Any, orders: str) -> None:
    event = NewEvent("k", "Once", {}, id=uuid.uuid4())
    first = either.append(orders, [event])
    again = either.append(orders, [event])
    assert again[0].duplicate and not first[0].duplicate
    assert again[0].position == first[0].position
    assert len(either.read(orders, first[0].partition)) == 1


# reads


def test_read_returns_events_after_a_position_in_order_up_to_the_limit(
    either: Any, orders: str
) -> None:
    either.append(orders, [NewEvent("k", "T", {"n": n}) for n in range(10)])
    partition = subengine.partition_for("k", 4)
    page = stored_events(either.read(orders, partition, after=3, limit=4))
    assert [e.position for e in page] == [4, 5, 6, 7]
    assert [e.data["n"] for e in page] == [3, 4, 5, 6]
    assert stored_events(either.read(orders, partition, after=10)) == []


def test_events_carry_every_field(either: Any, orders: str) -> None:
    [stored] = either.append(orders, [NewEvent("k", "Placed", {"a": 1}, metadata={"m": 2})])
    [event] = stored_events(either.read(orders, stored.partition))
    assert (event.id, event.stream, event.partition, event.position) == (
        stored.id,
        "orders",
        stored.partition,
        1,
    )
    assert (event.key, event.key_version, event.type) == ("k", 1, "Placed")
    assert (event.data, event.metadata) == ({"a": 1}, {"m": 2})
    assert event.occurred_at == event.recorded_at
    with pytest.raises(AttributeError):
        event.position = 5  # type: ignore[misc]


def test_reads_decode_data_and_metadata_only_when_they_are_read(
    either: Any, orders: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = server_now(either)
    [stored] = either.append(orders, [NewEvent("k", "Placed", {"a": 1}, metadata={"m": 2})])
    decoded = count_json_decodes(monkeypatch)
    [after] = stored_events(either.read(orders, stored.partition))
    [since] = stored_events(either.read_since(orders, start))
    assert decoded == []
    assert (after.data, since.metadata) == ({"a": 1}, {"m": 2})
    assert decoded == ['{"a": 1}', '{"m": 2}']


def test_read_since_spans_partitions_in_recorded_order(either: Any, orders: str) -> None:
    either.append(orders, [NewEvent(f"early-{n}", "T", {}) for n in range(5)])
    middle = server_now(either)
    later = either.append(orders, [NewEvent(f"late-{n}", "T", {}) for n in range(6)])
    either.append(orders, [NewEvent(f"last-{n}", "T", {}) for n in range(3)])
    events = stored_events(either.read_since(orders, middle))
    assert [e.id for e in events[:6]] == [
        a.id for a in sorted(later, key=lambda a: (a.partition, a.position))
    ]
    assert all(e.recorded_at >= middle for e in events)
    assert len(events) == 9
    times = [(e.recorded_at, e.partition, e.position) for e in events]
    assert times == sorted(times)
    assert len(stored_events(either.read_since(orders, middle, limit=2))) == 2
    assert stored_events(either.read_since(orders, server_now(either) + timedelta(hours=1))) == []


def test_heads_and_partitions(either: Any, orders: str) -> None:
    assert either.heads(orders) == {0: 0, 1: 0, 2: 0, 3: 0}
    stored = either.append(orders, [NewEvent("k", "T", {}), NewEvent("k", "T", {})])
    partition = stored[0].partition
    states = either.partitions(orders)
    assert [s.partition for s in states] == [0, 1, 2, 3]
    state = states[partition]
    assert (state.head, state.floor) == (2, 1)
    [_, last] = stored_events(either.read(orders, partition))
    assert state.head_time == last.recorded_at
    assert all(s.head_time is None for s in states if s.partition != partition)


def test_streams_are_listed_by_name(either: Any) -> None:
    either.create_stream("zeta", partitions=1)
    either.create_stream("alpha", partitions=3)
    assert [(s.name, s.partitions) for s in either.streams()] == [("alpha", 3), ("zeta", 1)]
    assert either.stream("alpha").partitions == 3


def test_deleting_a_stream_that_does_not_exist_says_so(either: Any) -> None:
    with pytest.raises(subengine.StreamNotFound, match="'nope' does not exist"):
        either.delete_stream("nope")


# connections, schemas and limits


def test_a_lost_pooled_connection_raises_database_unavailable_then_works(
    either: Any, orders: str, sql: psycopg.Connection[Any]
) -> None:
    with either.connection(), either.connection():
        pass
    terminated = sql.execute(  # type: ignore[index]
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'subengine'"
        " AND pid <> pg_backend_pid()"
    ).fetchone()[0]
    assert terminated >= 2
    with pytest.raises(subengine.DatabaseUnavailable) as raised:
        either.append(orders, events("k"))
    assert isinstance(raised.value.__cause__, psycopg.OperationalError)
    stored = either.append(orders, events("k"))
    assert len(either.read(orders, stored[0].partition)) == 1


def test_an_append_is_its_own_transaction_and_leaves_pooled_connections_in_transactions(
    twin: Twin, dsn: str, orders: str
) -> None:
    # One connection in the pool, so the append's is the one looked at afterwards.
    settings = subengine.Settings(dsn=dsn, pool_min_size=1, pool_max_size=1)
    with twin.engine(settings=settings) as engine:
        stored = engine.append(orders, events("k"))
        with pytest.raises(subengine.WrongExpectedVersion):
            engine.append(orders, events("k"), expected_version=0)
        with pytest.raises(subengine.StreamNotFound):
            engine.append("no-such-stream", events("k"))
        with engine.connection() as conn:
            conn.execute("SELECT 1")
            in_transaction = (False, psycopg.pq.TransactionStatus.INTRANS)
            assert (conn.autocommit, conn.info.transaction_status) == in_transaction
        assert stored[0].key_version == 1


def test_a_malformed_dsn_is_refused_without_quoting_its_password(twin: Twin) -> None:
    with pytest.raises(subengine.ConfigurationError) as raised:
        twin.engine("host=localhost password='s3cret port=x")
    assert "s3cret" not in str(raised.value)


# sslpassword is a secret that messages never show, and that this server never sees: as
# "xis", hiding it cuts the server's "does not exist" (which once made the engine wait)
@pytest.mark.parametrize("secret", [{}, {"sslpassword": "xis"}], ids=["plain", "cut"])
def test_an_unknown_database_fails_at_once(twin: Twin, dsn: str, secret: dict[str, str]) -> None:
    wrong = make_conninfo(dsn, dbname="no_such_database", **secret)
    # with a long connect timeout: a wrong database name is no reason to wait
    settings = subengine.Settings(dsn=wrong, connect_timeout=20)
    with (
        twin.engine(settings=settings) as engine,
        pytest.raises(subengine.ConfigurationError, match="no_such_database"),
    ):
        engine.streams()


def test_the_engine_uses_its_schema_and_limits(
    twin: Twin, dsn: str, sql: psycopg.Connection[Any]
) -> None:
    subengine.Engine(dsn, schema="second").migrate()
    settings = subengine.Settings(dsn=dsn, schema="second", max_event_bytes=100)
    with twin.engine(settings=settings) as engine:
        engine.create_stream("letters", 2)
        with pytest.raises(subengine.InvalidEvent, match="SUBENGINE_MAX_EVENT_BYTES"):
            engine.append("letters", [NewEvent("k", "Big", "x" * 200)])
        assert [s.name for s in engine.streams()] == ["letters"]
    assert sql.execute("SELECT count(*) FROM subengine.streams").fetchone()[0] == 0  # type: ignore[index]


# retention policies, subscriptions and workers as the engine reports them


def test_a_retention_policy_is_set_and_lifted(either: Any, orders: str) -> None:
    policy = subengine.Retention(max_events=5)
    changed = either.set_retention(orders, policy)
    assert changed.retention is not None
    assert subengine.Retention.from_json(changed.retention) == policy
    assert either.stream(orders) == changed
    assert either.set_retention(orders, None).retention is None
    with pytest.raises(subengine.StreamNotFound):
        either.set_retention("nowhere", policy)


def test_stored_subscriptions_and_their_positions_are_reported(
    either: Any, engine: subengine.Engine, orders: str
) -> None:
    assert (either.subscriptions(), either.dead_letters(), either.dead_letters("billing")) == (
        [],
        [],
        [],
    )
    engine.ensure_subscription(subengine.App().subscription("billing", stream=orders))
    [stored] = either.subscriptions()
    assert (stored.name, stored.stream) == ("billing", orders)
    assert either.subscriptions() == engine.subscriptions()
    positions = either.subscription_positions("billing")
    assert [(p.partition, p.position, p.stopped) for p in positions] == [
        (partition, 0, False) for partition in range(4)
    ]
    assert either.dead_letters(everything=True) == []


def test_parked_keys_are_reported(
    either: Any, engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    assert either.parked_keys() == []
    engine.ensure_subscription(subengine.App().subscription("billing", stream=orders))
    [stored] = engine.append(orders, [NewEvent("k4", "T", {})])
    sql.execute(
        "INSERT INTO subengine.parked_keys"
        " (subscription, partition, key, generation, position, event_id, error, attempts)"
        " VALUES ('billing', %s, 'k4', 1, %s, %s, 'ValueError: test', 5)",
        (stored.partition, stored.position, stored.id),
    )
    [parked] = either.parked_keys("billing")
    assert (parked.key, parked.partition, parked.position) == ("k4", stored.partition, 1)
    assert either.parked_keys("billing", "k4") == engine.parked_keys("billing", "k4")
    assert either.parked_keys("billing", "other") == []


def test_without_workers_there_are_none_to_report_or_prune(either: Any) -> None:
    assert either.workers() == []
    assert either.prune_workers() == []


def test_since_is_strictly_after_the_time(either: Any, orders: str) -> None:
    started = server_now(either)
    either.append(orders, [NewEvent(f"had-{n}", "T", {}) for n in range(6)])
    # a subscriber passes the time of the last event it has
    at = stored_events(either.read_since(orders, started))[-1].recorded_at
    heads = either.heads(orders)
    later = either.append(orders, [NewEvent(f"later-{n}", "T", {}) for n in range(3)])
    assert {e.id for e in stored_events(either.read_since(orders, at))} == {a.id for a in later}
    _, positions = either.positions_since(orders, at)
    assert dict(enumerate(positions)) == heads
    just_before = stored_events(either.read_since(orders, at - timedelta(microseconds=1)))
    assert just_before[0].recorded_at == at and len(just_before) > 3
