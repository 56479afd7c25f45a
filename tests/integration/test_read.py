"""Reads by position, by time, and partition heads."""

from __future__ import annotations

from datetime import timedelta

import pytest
from helpers import count_json_decodes, server_now, stored_events

import subengine
from subengine import NewEvent


def test_read_returns_events_after_a_position_in_order_up_to_the_limit(
    engine: subengine.Engine, orders: str
) -> None:
    engine.append(orders, [NewEvent("k", "T", {"n": n}) for n in range(10)])
    partition = subengine.partition_for("k", 4)
    page = stored_events(engine.read(orders, partition, after=3, limit=4))
    assert [e.position for e in page] == [4, 5, 6, 7]
    assert [e.data["n"] for e in page] == [3, 4, 5, 6]
    assert stored_events(engine.read(orders, partition, after=10)) == []


def test_events_carry_every_field(engine: subengine.Engine, orders: str) -> None:
    [stored] = engine.append(orders, [NewEvent("k", "Placed", {"a": 1}, metadata={"m": 2})])
    [event] = stored_events(engine.read(orders, stored.partition))
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
    engine: subengine.Engine, orders: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = server_now(engine)
    [stored] = engine.append(orders, [NewEvent("k", "Placed", {"a": 1}, metadata={"m": 2})])
    decoded = count_json_decodes(monkeypatch)
    [after] = stored_events(engine.read(orders, stored.partition))
    [since] = stored_events(engine.read_since(orders, start))
    assert decoded == []
    assert (after.data, since.metadata) == ({"a": 1}, {"m": 2})
    assert decoded == ['{"a": 1}', '{"m": 2}']


def test_read_since_spans_partitions_in_recorded_order(
    engine: subengine.Engine, orders: str
) -> None:
    engine.append(orders, [NewEvent(f"early-{n}", "T", {}) for n in range(5)])
    middle = server_now(engine)
    later = engine.append(orders, [NewEvent(f"late-{n}", "T", {}) for n in range(6)])
    engine.append(orders, [NewEvent(f"last-{n}", "T", {}) for n in range(3)])
    events = stored_events(engine.read_since(orders, middle))
    assert [e.id for e in events[:6]] == [
        a.id for a in sorted(later, key=lambda a: (a.partition, a.position))
    ]
    assert all(e.recorded_at >= middle for e in events)
    assert len(events) == 9
    times = [(e.recorded_at, e.partition, e.position) for e in events]
    assert times == sorted(times)
    assert len(stored_events(engine.read_since(orders, middle, limit=2))) == 2
    assert stored_events(engine.read_since(orders, server_now(engine) + timedelta(hours=1))) == []


def test_heads_and_partitions(engine: subengine.Engine, orders: str) -> None:
    assert engine.heads(orders) == {0: 0, 1: 0, 2: 0, 3: 0}
    stored = engine.append(orders, [NewEvent("k", "T", {}), NewEvent("k", "T", {})])
    partition = stored[0].partition
    states = engine.partitions(orders)
    assert [s.partition for s in states] == [0, 1, 2, 3]
    state = states[partition]
    assert (state.head, state.floor) == (2, 1)
    [_, last] = stored_events(engine.read(orders, partition))
    assert state.head_time == last.recorded_at
    assert all(s.head_time is None for s in states if s.partition != partition)


def test_streams_are_listed_by_name(engine: subengine.Engine) -> None:
    engine.create_stream("zeta", partitions=1)
    engine.create_stream("alpha", partitions=3)
    assert [(s.name, s.partitions) for s in engine.streams()] == [("alpha", 3), ("zeta", 1)]
    assert engine.stream("alpha").partitions == 3
