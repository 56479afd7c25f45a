"""Leases of remote workers, through the engine (docs/remote-workers.md): claims take the
oldest free partition, acks compare-and-set, stale leases change nothing, nacks follow
the remote error policy, gaps come as tombstones, and local batches skip leased
partitions."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

import subengine
from subengine import NewEvent, Retention, Subscription
from subengine.db._sql import Db
from subengine.model._errors import LeaseConflict, LeaseNotFound
from subengine.subscriptions._batches import process_batch


def _subscribe(engine: subengine.Engine, name: str = "remote", stream: str = "orders") -> None:
    engine.ensure_subscription(Subscription(name, stream))


def _positions(engine: subengine.Engine, name: str = "remote") -> dict[int, int]:
    return {p.partition: p.position for p in engine.subscription_positions(name)}


def test_a_claim_takes_the_partition_whose_next_event_is_oldest(
    engine: subengine.Engine, orders: str
) -> None:
    _subscribe(engine)
    first = engine.append(orders, [NewEvent("a", "T", {"n": 1})])[0]
    engine.append(orders, [NewEvent(k, "T", {}) for k in ("b", "c", "d", "e") if True])
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None
    assert lease.partition == first.partition
    assert lease.events[0].id == first.id
    assert lease.position == 0 and lease.through >= 1


def test_a_leased_partition_is_skipped_by_claims_and_local_batches(
    engine: subengine.Engine, orders: str
) -> None:
    _subscribe(engine)
    engine.append(orders, [NewEvent("a", "T", {})] * 1)
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None
    others = engine.claim_lease("remote", "w2")
    assert others is None or others.partition != lease.partition
    with psycopg.connect(engine.dsn) as conn:
        local = Db(conn, engine.sql)
        assert process_batch(local, Subscription("remote", orders), lease.partition) is None
    assert _positions(engine)[lease.partition] == 0


def test_an_ack_moves_the_position_and_a_second_ack_is_a_conflict(
    engine: subengine.Engine, orders: str
) -> None:
    _subscribe(engine)
    engine.append(orders, [NewEvent("a", "T", {"n": n}) for n in range(3)])
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None and len(lease.events) == 3
    assert engine.ack_lease("remote", lease.id) == 3
    assert _positions(engine)[lease.partition] == 3
    with pytest.raises(LeaseConflict, match="ended"):
        engine.ack_lease("remote", lease.id)
    assert _positions(engine)[lease.partition] == 3


def test_a_reset_during_a_lease_makes_its_ack_a_conflict(
    engine: subengine.Engine, orders: str
) -> None:
    _subscribe(engine)
    engine.append(orders, [NewEvent("a", "T", {"n": n}) for n in range(3)])
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None
    engine.reset_subscription("remote", "beginning")
    with pytest.raises(LeaseConflict, match="moved"):
        engine.ack_lease("remote", lease.id)
    assert _positions(engine)[lease.partition] == 0


def test_unknown_and_foreign_leases_are_not_found(engine: subengine.Engine, orders: str) -> None:
    _subscribe(engine)
    _subscribe(engine, "other")
    engine.append(orders, [NewEvent("a", "T", {})])
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None
    with pytest.raises(LeaseNotFound):
        engine.ack_lease("remote", uuid.uuid4())
    with pytest.raises(LeaseNotFound):
        engine.ack_lease("other", lease.id)
    assert _positions(engine)[lease.partition] == 0


def test_an_expired_lease_frees_its_partition_and_cannot_ack(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    _subscribe(engine)
    engine.append(orders, [NewEvent("a", "T", {})])
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None
    # its deadline passes (as if a second went by without a heartbeat)
    sql.execute("UPDATE subengine.remote_leases SET deadline = now() - interval '1 s'")
    sql.execute("UPDATE subengine.subscription_positions SET retry_at = now() - interval '1 s'")
    with pytest.raises(LeaseConflict, match="expired"):
        engine.extend_lease("remote", lease.id, 30)
    again = engine.claim_lease("remote", "w2")
    assert again is not None and again.partition == lease.partition
    assert [e.id for e in again.events] == [e.id for e in lease.events]
    with pytest.raises(LeaseConflict, match="ended"):
        engine.ack_lease("remote", lease.id)
    assert engine.ack_lease("remote", again.id) == 1


def test_a_release_frees_the_partition_at_once(engine: subengine.Engine, orders: str) -> None:
    _subscribe(engine)
    engine.append(orders, [NewEvent("a", "T", {})])
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None
    engine.release_lease("remote", lease.id)
    again = engine.claim_lease("remote", "w2")
    assert again is not None and again.partition == lease.partition


def test_nacks_count_attempts_toward_the_dead_letter_policy(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    _subscribe(engine)
    engine.set_remote_policy("remote", on_error="dead_letter", max_attempts=2)
    engine.append(orders, [NewEvent("a", "T", {"n": n}) for n in range(3)])
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None
    failure = engine.nack_lease("remote", lease.id, "boom", position=2, retry_after=0)
    assert failure.action == "retry"
    assert _positions(engine)[lease.partition] == 1  # the event before it, acknowledged
    again = engine.claim_lease("remote", "w1")
    assert again is not None and [e.position for e in again.events] == [2]  # one at a time
    assert engine.nack_lease("remote", again.id, "boom again", retry_after=0).action == (
        "dead_lettered"
    )
    assert _positions(engine)[lease.partition] == 2
    [letter] = engine.dead_letters("remote")
    assert letter.position == 2 and "boom again" in letter.error


def test_a_gap_comes_as_a_tombstone_to_ack_past(engine: subengine.Engine) -> None:
    engine.create_stream("single", partitions=1, retention=Retention(max_events=2))
    _subscribe(engine, stream="single")
    engine.append("single", [NewEvent("a", "T", {"n": n}) for n in range(5)])
    engine.run_retention()
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None and lease.gap is not None and not lease.events
    assert (lease.gap.gap_from, lease.gap.gap_to) == (1, 3)
    with pytest.raises(subengine.InvalidInput, match="whole"):
        engine.ack_lease("remote", lease.id, 2)
    assert engine.ack_lease("remote", lease.id) == 3
    after = engine.claim_lease("remote", "w1")
    assert after is not None and [e.position for e in after.events] == [4, 5]


def test_a_claim_skips_a_partition_whose_lock_a_local_slot_holds(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    from subengine.db._locks import lock_key

    _subscribe(engine)
    engine.append(orders, [NewEvent("a", "T", {})])
    [partition] = [p for p, head in engine.heads(orders).items() if head]
    sql.execute("SELECT pg_advisory_lock(%s)", [lock_key(engine.schema, "remote", partition)])
    assert engine.claim_lease("remote", "w1") is None
    sql.execute("SELECT pg_advisory_unlock_all()")
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None and lease.partition == partition


def test_an_expired_lease_leaves_its_partition_where_local_looks_find_it(
    engine: subengine.Engine, orders: str, sql: psycopg.Connection[Any]
) -> None:
    _subscribe(engine)
    engine.append(orders, [NewEvent("a", "T", {})])
    # no local worker looked: the row has no next event's time yet
    assert sql.execute(
        "SELECT count(*) FROM subengine.subscription_positions"
        " WHERE subscription = 'remote' AND next_time IS NOT NULL"
    ).fetchone() == (0,)
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None
    # when it expires, a local worker's look (next_time, retry_at due) takes the partition
    marked = sql.execute(
        "SELECT next_time IS NOT NULL FROM subengine.subscription_positions"
        " WHERE subscription = 'remote' AND partition = %s",
        [lease.partition],
    ).fetchone()
    assert marked == (True,)


def test_a_parked_key_s_later_events_are_left_out_of_leases_and_set_aside_on_ack(
    engine: subengine.Engine,
) -> None:
    engine.create_stream("single", partitions=1)
    _subscribe(engine, stream="single")
    engine.set_remote_policy("remote", on_error="park", max_attempts=1)
    engine.append("single", [NewEvent(key, "T", {"n": n}) for n, key in enumerate("abab")])
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None and [e.key for e in lease.events] == ["a", "b", "a", "b"]
    failure = engine.nack_lease("remote", lease.id, "poison", position=2)  # the first b
    assert (failure.action, failure.key) == ("parked", "b")
    after = engine.claim_lease("remote", "w1")
    assert after is not None
    assert [(e.key, e.position) for e in after.events] == [("a", 3)]  # b's 4 is set aside
    assert engine.ack_lease("remote", after.id) == 4
    [parked] = engine.parked_keys("remote")
    assert (parked.key, parked.position, parked.events) == ("b", 2, 2)


def test_a_nack_charges_the_lease_s_first_delivered_event_not_a_parked_one(
    engine: subengine.Engine,
) -> None:
    engine.create_stream("single", partitions=1)
    _subscribe(engine, stream="single")
    engine.set_remote_policy("remote", on_error="park", max_attempts=1)
    engine.append("single", [NewEvent(key, "T", {"n": n}) for n, key in enumerate("abba")])
    first = engine.claim_lease("remote", "w1")
    assert first is not None
    assert engine.nack_lease("remote", first.id, "poison", position=2).key == "b"
    lease = engine.claim_lease("remote", "w1")
    assert lease is not None
    assert [(e.key, e.position) for e in lease.events] == [("a", 4)]  # b's 3 is set aside
    with pytest.raises(subengine.InvalidInput, match="position 3 is an event of a parked key"):
        engine.nack_lease("remote", lease.id, "no", position=3)
    failure = engine.nack_lease("remote", lease.id, "poison too")  # no position: a's 4
    assert (failure.action, failure.key) == ("parked", "a")
    assert sorted((p.key, p.position) for p in engine.parked_keys("remote")) == [
        ("a", 4),
        ("b", 2),
    ]


def test_the_live_leases_of_a_subscription_are_listed(
    engine: subengine.Engine, orders: str
) -> None:
    _subscribe(engine)
    engine.append(orders, [NewEvent(k, "T", {}) for k in ("a", "b", "c", "d", "e", "f")])
    held = [engine.claim_lease("remote", f"w{n}") for n in range(2)]
    assert all(lease is not None for lease in held)
    engine.ack_lease("remote", held[0].id)  # type: ignore[union-attr]
    [live] = engine.remote_leases("remote")
    assert (live.id, live.worker) == (held[1].id, "w1")  # type: ignore[union-attr]
