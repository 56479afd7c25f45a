"""Pruning (DESIGN.md, "Retention and gaps"): what each policy removes, and that removing
it keeps positions dense, never removes a row twice and never holds appends up for long.

Concurrency here is real: threads with their own engines and connections, processes
started together, and locks observed in pg_locks / pg_stat_activity. Nothing asserts on
wall-clock durations; the timeouts below only bound how long a broken build can hang.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from helpers import PYTHON, Running, key_in, poisoned_app, wait_for

import subengine
from subengine import NewEvent, Retention, Subscription
from subengine.db._sql import Db
from subengine.streams import _retention

# How long a concurrent test may run before it stops adding load (a bound, not a claim).
LOAD_SECONDS = 20.0


def stored_positions(sql: psycopg.Connection[Any], stream: str) -> dict[int, list[int]]:
    rows = sql.execute(
        "SELECT partition, position FROM subengine.events WHERE stream = %s"
        " ORDER BY partition, position",
        (stream,),
    ).fetchall()
    positions: dict[int, list[int]] = {}
    for partition, position in rows:
        positions.setdefault(partition, []).append(position)
    return positions


def floors_and_heads(sql: psycopg.Connection[Any], stream: str) -> dict[int, tuple[int, int]]:
    rows = sql.execute(
        "SELECT partition, floor, head FROM subengine.partitions WHERE stream = %s",
        (stream,),
    ).fetchall()
    return {partition: (floor, head) for partition, floor, head in rows}


def holes(sql: psycopg.Connection[Any], stream: str) -> dict[int, str]:
    """Partitions whose stored positions are not exactly floor..head, in one snapshot."""
    with sql.transaction():
        sql.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        limits = floors_and_heads(sql, stream)
        stored = stored_positions(sql, stream)
    wrong: dict[int, str] = {}
    for partition, (floor, head) in limits.items():
        have = stored.get(partition, [])
        if have != list(range(floor, head + 1)):
            wrong[partition] = f"floor {floor}, head {head}, stored {have[:3]}..{have[-3:]}"
    return wrong


def events(count: int, prefix: str = "k", keys: int = 40) -> list[NewEvent]:
    return [NewEvent(f"{prefix}{n % keys}", "T", {"n": n}) for n in range(count)]


def backdate(sql: psycopg.Connection[Any], stream: str, by: timedelta) -> None:
    """Move every stored event of `stream` (and its partitions' head_time) `by` into the
    past. Retention by age compares recorded_at with now(), and append_events always
    records the time of the append: backdating is how a test gets old events without
    waiting for them to age. Shifting all of them keeps recorded_at non-decreasing along
    each partition, as the age cut requires."""
    sql.execute(
        "UPDATE subengine.events SET recorded_at = recorded_at - %s WHERE stream = %s",
        (by, stream),
    )
    sql.execute(
        "UPDATE subengine.partitions SET head_time = head_time - %s WHERE stream = %s",
        (by, stream),
    )


# concurrency


def test_pruning_during_appends_keeps_positions_dense(
    dsn: str, engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("busy", 4, retention=Retention(max_events=30))
    threads, appends_each = 8, 60
    deadline = time.monotonic() + LOAD_SECONDS
    failures: list[BaseException] = []
    appended = [0] * threads
    done = threading.Event()

    def append(number: int) -> None:
        try:
            with subengine.Engine(dsn) as own:
                for n in range(appends_each):
                    if time.monotonic() > deadline:
                        return
                    own.append("busy", events(3, prefix=f"t{number}-{n}-", keys=3))
                    appended[number] += 3
        except BaseException as error:
            failures.append(error)

    runs: list[subengine.RetentionRun] = []
    violations: list[str] = []

    def prune() -> None:
        last_floors: dict[int, int] = {}
        try:
            with psycopg.connect(dsn, autocommit=True) as look:
                while not done.is_set():
                    runs.append(engine.run_retention(batch=7))
                    for partition, (floor, _) in floors_and_heads(look, "busy").items():
                        if floor < last_floors.get(partition, 1):
                            violations.append(f"floor of {partition} went down to {floor}")
                        last_floors[partition] = floor
                    if wrong := holes(look, "busy"):
                        violations.append(f"holes during appends: {wrong}")
        except BaseException as error:
            failures.append(error)

    workers = [threading.Thread(target=append, args=(n,)) for n in range(threads)]
    pruner = threading.Thread(target=prune)
    pruner.start()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    runs_during_appends = len(runs)
    done.set()
    pruner.join()

    assert failures == []
    assert violations == []
    assert runs_during_appends >= 2, "the pruner should have run repeatedly during the appends"
    assert not any(run.locked for run in runs)
    assert holes(sql, "busy") == {}
    final = engine.run_retention("busy")
    assert holes(sql, "busy") == {}
    limits = floors_and_heads(sql, "busy")
    assert sum(head for _, head in limits.values()) == sum(appended)
    removed = sum(run.removed for run in [*runs, final])
    assert removed == sum(floor - 1 for floor, _ in limits.values())
    assert all(head - floor + 1 <= 30 for floor, head in limits.values())
    assert removed > 0


PRUNER = """
import json, sys
import subengine
with subengine.Engine(sys.argv[1]) as engine:
    print("ready", flush=True)
    sys.stdin.readline()
    run = engine.run_retention(batch=int(sys.argv[2]))
    print(json.dumps({"removed": run.removed, "locked": run.locked}), flush=True)
"""


def test_two_pruning_processes_remove_each_event_once(
    dsn: str, engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("shared", 4, retention=Retention(max_events=10))
    for _ in range(4):
        engine.append("shared", events(500))
    before = sql.execute("SELECT count(*) FROM subengine.events").fetchone()
    expected_gone = sum(head - 10 for _, head in floors_and_heads(sql, "shared").values())

    pruners = [
        subprocess.Popen(
            [PYTHON, "-c", PRUNER, dsn, "20"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for pruner in pruners:  # both connected and waiting: then let them go together
        assert pruner.stdout is not None
        assert pruner.stdout.readline().strip() == "ready"
    for pruner in pruners:
        assert pruner.stdin is not None
        pruner.stdin.write("go\n")
        pruner.stdin.flush()
    results = []
    for pruner in pruners:
        out, err = pruner.communicate(timeout=120)
        assert pruner.returncode == 0, err
        assert err == ""
        results.append(json.loads(out))

    after = sql.execute("SELECT count(*) FROM subengine.events").fetchone()
    assert before is not None and after is not None
    gone = before[0] - after[0]
    assert gone == expected_gone
    assert sum(result["removed"] for result in results) == gone
    # The cut is fixed (nothing is appended), so one run removed it all: the other one
    # either found the lock taken or, started after the first had finished, nothing left.
    assert sorted(result["removed"] for result in results)[0] == 0
    assert sum(result["locked"] for result in results) <= 1
    assert holes(sql, "shared") == {}


# policies


def test_max_events_keeps_the_newest_events_of_each_partition(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("counted", 2, retention=Retention(max_events=3))
    keys = [key_in(0, partitions=2), key_in(1, partitions=2)]
    engine.append("counted", [NewEvent(keys[0], "T", {"n": n}) for n in range(10)])
    engine.append("counted", [NewEvent(keys[1], "T", {"n": n}) for n in range(2)])

    run = engine.run_retention()

    assert run.removed == 7
    assert [(p.partition, p.first, p.last) for p in run.partitions] == [(0, 1, 7)]
    assert stored_positions(sql, "counted") == {0: [8, 9, 10], 1: [1, 2]}
    assert floors_and_heads(sql, "counted") == {0: (8, 10), 1: (1, 2)}


def test_max_age_removes_the_events_recorded_before_it(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("aged", 1, retention=Retention(max_age="1s"))
    engine.append("aged", events(5))
    backdate(sql, "aged", timedelta(hours=1))
    engine.append("aged", events(3))  # recorded now: younger than 1 s for a while

    run = engine.run_retention()

    assert run.removed == 5
    assert floors_and_heads(sql, "aged") == {0: (6, 8)}
    backdate(sql, "aged", timedelta(hours=1))  # now all of them are old
    assert engine.run_retention().removed == 3
    assert floors_and_heads(sql, "aged") == {0: (9, 8)}
    assert stored_positions(sql, "aged") == {}


def test_either_limit_removes_when_a_policy_has_both(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    both = Retention(max_events=4, max_age="1h")
    engine.create_stream("by-count", 1, retention=both)
    engine.create_stream("by-age", 1, retention=both)
    engine.append("by-count", events(10))  # young, but too many
    engine.append("by-age", events(3))  # few, but old
    backdate(sql, "by-age", timedelta(hours=2))
    engine.append("by-age", events(2))

    run = engine.run_retention()

    assert {p.stream: p.removed for p in run.partitions} == {"by-count": 6, "by-age": 3}
    assert floors_and_heads(sql, "by-count") == {0: (7, 10)}
    assert floors_and_heads(sql, "by-age") == {0: (4, 5)}


def test_keep_unprocessed_keeps_what_a_subscription_needs_until_the_hard_limit(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    policy = Retention(max_events=2, keep_unprocessed=True, hard_max_events=6)
    engine.create_stream("kept", 1, retention=policy)
    handled: list[int] = []
    reader = Subscription(
        "reader",
        "kept",
        batch_size=6,
        catch_all=lambda event, conn: handled.append(event.position),
    )
    engine.ensure_subscription(reader)
    engine.append("kept", events(10))
    engine.process_batch(reader, 0)
    assert handled == [1, 2, 3, 4, 5, 6]

    # max_events alone would keep 9 and 10; the reader still needs 7 and 8
    assert engine.run_retention().removed == 6
    assert floors_and_heads(sql, "kept") == {0: (7, 10)}

    # 4 more: the hard limit (6 events) now removes 7 and 8, unprocessed as they are
    engine.append("kept", events(4))
    assert engine.run_retention().removed == 2
    assert floors_and_heads(sql, "kept") == {0: (9, 14)}
    states = {row.partition: row.state for row in engine.subscription_status("reader")}
    assert states == {0: "gap"}


@pytest.mark.parametrize("on_error", ["dead_letter", "park"])
def test_keep_unprocessed_keeps_dead_lettered_and_parked_events_until_the_hard_limit(
    fast_engine: subengine.Engine, sql: psycopg.Connection[Any], on_error: str
) -> None:
    policy = Retention(max_events=1, keep_unprocessed=True, hard_max_events=8)
    fast_engine.create_stream("kept", 1, retention=policy)
    stored = fast_engine.append("kept", [NewEvent(f"k{n % 2}", "T", {"n": n}) for n in range(6)])
    app = poisoned_app("kept", stored[1], on_error=on_error, max_attempts=1)
    with Running(app, fast_engine):
        wait_for(
            lambda: [p.position for p in fast_engine.subscription_positions("billing")] == [6],
            "the worker to pass every event",
        )
    # the failed event (with park, also its key's later events) waits for a retry:
    # retention keeps it, as it keeps what a subscription has not reached
    fast_engine.run_retention()
    assert floors_and_heads(sql, "kept") == {0: (2, 6)}
    # the hard limit still bounds what is kept
    fast_engine.append("kept", events(4))
    fast_engine.run_retention()
    assert floors_and_heads(sql, "kept") == {0: (3, 10)}


def test_a_stream_without_a_policy_keeps_everything(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("forever", 2)
    engine.create_stream("pruned", 2, retention=Retention(max_events=1))
    engine.append("forever", events(20))
    engine.append("pruned", events(20))
    backdate(sql, "forever", timedelta(days=3650))

    run = engine.run_retention()

    assert {p.stream for p in run.partitions} == {"pruned"}
    assert sum(len(p) for p in stored_positions(sql, "forever").values()) == 20
    with pytest.raises(subengine.InvalidInput, match="no retention policy"):
        engine.run_retention("forever")


def test_dry_run_removes_nothing_and_reports_what_a_run_then_removes(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("planned", 4, retention=Retention(max_events=5, max_age="1h"))
    engine.append("planned", events(30))
    backdate(sql, "planned", timedelta(hours=2))
    engine.append("planned", events(40, prefix="j"))
    before = stored_positions(sql, "planned"), floors_and_heads(sql, "planned")

    dry = engine.run_retention(dry_run=True)

    assert dry.dry_run and dry.removed > 0
    assert (stored_positions(sql, "planned"), floors_and_heads(sql, "planned")) == before
    real = engine.run_retention(batch=4)
    assert real.partitions == dry.partitions
    assert real.removed == dry.removed


# appends beside a prune batch


def test_an_append_is_not_blocked_while_a_prune_batch_deletes(
    dsn: str, engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("live", 1, retention=Retention(max_events=5))
    engine.append("live", events(50))
    # A row lock on event 20 stops the pruner's DELETE in the middle of its (only) batch:
    # positions 1..19 are deleted in its open transaction, the floor not raised.
    blocker = psycopg.connect(dsn)
    blocker.execute(
        "SELECT 1 FROM subengine.events WHERE stream = 'live' AND position = 20 FOR UPDATE"
    )
    pruning_engine = subengine.Engine(dsn)
    outcome: list[subengine.RetentionRun | BaseException] = []

    def prune() -> None:
        try:
            outcome.append(pruning_engine.run_retention(batch=1000))
        except BaseException as error:
            outcome.append(error)

    # The pruner's backend is the one that is new once it runs.
    with psycopg.connect(dsn, autocommit=True) as look:
        others = {row[0] for row in look.execute("SELECT pid FROM pg_stat_activity").fetchall()}
        # (other tests' backends, in other databases, come and go: the query names ours)
    pruner = threading.Thread(target=prune)
    pruner.start()
    try:
        waiting: list[tuple[int, str]] = []

        def pruner_waits() -> bool:
            rows = sql.execute(
                "SELECT pid, query FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE %s AND datname = current_database()",
                ("%DELETE FROM%",),
            ).fetchall()
            waiting[:] = [(pid, query) for pid, query in rows if pid not in others]
            return bool(waiting)

        wait_for(pruner_waits, "the prune batch to wait inside its DELETE", timeout=30)
        pid, query = waiting[0]
        assert query.startswith("WITH bound AS")  # the batch is the one prune_range statement
        blockers = sql.execute("SELECT pg_blocking_pids(%s)", (pid,)).fetchone()
        assert blockers is not None and blockers[0] == [blocker.info.backend_pid]

        # Mid-batch, the partition row is free: no lock on it, and an append passes.
        with psycopg.connect(dsn) as appender:
            appender.execute("SET lock_timeout = '10s'")  # fail, not hang, if it were held
            appender.execute(
                "SELECT 1 FROM subengine.partitions WHERE stream = 'live' FOR UPDATE NOWAIT"
            )
            appender.rollback()
            appender.execute("SET lock_timeout = '10s'")
            row = appender.execute(
                "SELECT position FROM subengine.append('live', 'k-new', 'T', '{}')"
            ).fetchone()
            appender.commit()
        assert row == (51,)
        assert floors_and_heads(sql, "live") == {0: (1, 51)}  # the batch has not committed
    finally:
        blocker.rollback()
        blocker.close()
        pruner.join(timeout=60)
        pruning_engine.close()

    assert len(outcome) == 1 and isinstance(outcome[0], subengine.RetentionRun)
    assert outcome[0].removed == 45  # the cut planned before the append: 50 - 5
    assert holes(sql, "live") == {}
    assert floors_and_heads(sql, "live") == {0: (46, 51)}


def test_a_prune_batch_holds_the_partition_only_from_its_update_to_its_commit(
    dsn: str, engine: subengine.Engine
) -> None:
    """What run_retention's autocommit avoids: the statement's final UPDATE locks the
    partition row until the transaction ends, so an append waits for that commit."""
    engine.create_stream("held", 1, retention=Retention(max_events=5))
    engine.append("held", events(50))
    with engine.db() as db:
        (cut,) = db.run(_retention.retention_plan("held"))
    with psycopg.connect(dsn) as pruning, psycopg.connect(dsn) as appender:
        pruned = Db(pruning, engine.sql).run(_retention._prune_range(cut, 1, 20))
        assert pruned == (19, 20)
        appender.execute("SET lock_timeout = '200ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            appender.execute("SELECT * FROM subengine.append('held', 'k-new', 'T', '{}')")
        appender.rollback()
        pruning.commit()
        appender.execute("SET lock_timeout = '10s'")
        row = appender.execute(
            "SELECT position FROM subengine.append('held', 'k-new', 'T', '{}')"
        ).fetchone()
        appender.commit()
    assert row == (51,)


def test_key_versions_go_on_after_a_key_was_pruned(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("versions", 1, retention=Retention(max_events=1))
    engine.append("versions", [NewEvent("order-1", "T", {}), NewEvent("order-1", "T", {})])
    engine.append("versions", [NewEvent("order-2", "T", {})])
    assert engine.run_retention().removed == 2  # both events of order-1 are gone

    with pytest.raises(subengine.WrongExpectedVersion, match="is at version 2"):
        engine.append("versions", [NewEvent("order-1", "T", {})], expected_version=0)
    (appended,) = engine.append("versions", [NewEvent("order-1", "T", {})], expected_version=2)
    assert appended.key_version == 3
    (again,) = engine.append("versions", [NewEvent("order-1", "T", {})])
    assert again.key_version == 4  # the stored event's version wins from here on
    assert sql.execute(
        "SELECT key, version FROM subengine.stream_keys WHERE stream = 'versions' ORDER BY key"
    ).fetchall() == [("order-1", 4), ("order-2", 1)]


def test_the_age_cut_is_the_first_position_recorded_at_or_after_the_cutoff(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # 40 events in one partition; appends of 1 to 4 events share their recorded_at
    engine.create_stream("aged", 1)
    for n in range(16):
        engine.append("aged", events(n % 4 + 1, prefix=f"a{n}-"))
    times = sql.execute(
        "SELECT position, recorded_at FROM subengine.events WHERE stream = 'aged' ORDER BY position"
    ).fetchall()
    head, head_time = len(times), times[-1][1]
    # a floor above 1 (as after pruning), and every distinct time as a cutoff, and around
    sql.execute("DELETE FROM subengine.events WHERE stream = 'aged' AND position < 4")
    sql.execute("UPDATE subengine.partitions SET floor = 4 WHERE stream = 'aged'")
    stored = [(p, t) for p, t in times if p >= 4]
    cutoffs = sorted({t for _, t in stored})
    cutoffs += [cutoffs[0] - timedelta(seconds=1), head_time + timedelta(seconds=1)]
    for cutoff in cutoffs:
        expected = next((p for p, t in stored if t >= cutoff), head + 1)
        [(cut,)] = sql.execute(
            "SELECT subengine.retention_age_cut('aged', 0, %s, %s, %s)",
            (head, head_time, cutoff),
        ).fetchall()
        assert cut == expected, cutoff


def test_an_age_too_long_for_timestamps_is_refused_and_one_written_by_hand_prunes_nothing(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    with pytest.raises(subengine.InvalidInput, match="from a second to 100 years"):
        Retention(max_age="99999999w")
    engine.create_stream("capped", 1, retention=Retention(max_events=2))
    engine.create_stream("forever", 1, retention=Retention(max_age="1d"))
    engine.append("capped", events(5))
    engine.append("forever", events(5))
    # a policy written in SQL, past what Retention accepts: the other streams still prune
    sql.execute(
        "UPDATE subengine.streams SET retention = '{\"max_age\": 1e15}' WHERE name = 'forever'"
    )
    run = engine.run_retention()
    assert [(p.stream, p.removed) for p in run.partitions] == [("capped", 3)]


def test_keep_unprocessed_protects_a_subscription_stored_while_a_run_is_under_way(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    policy = Retention(max_events=1, keep_unprocessed=True, hard_max_events=1000)
    engine.create_stream("kept", 1, retention=policy)
    engine.append("kept", events(10))

    def store_a_subscription(cuts: Any) -> None:
        # after the run planned to remove 1..9: a subscription from the beginning (the
        # floor's eve, 0) needs them all
        assert [cut.cut for cut in cuts] == [10]
        engine.ensure_subscription(subengine.Subscription("late", "kept"))

    run = engine.run_retention(batch=3, plan=store_a_subscription)
    assert run.removed == 0 and run.partitions == []
    assert floors_and_heads(sql, "kept") == {0: (1, 10)}
    # with it handled up to 4, the next run removes 1..4 only
    engine.reset_subscription("late", {0: 4})
    assert [(p.first, p.last) for p in engine.run_retention(batch=3).partitions] == [(1, 4)]


def test_a_stream_deleted_during_a_run_is_left_to_the_delete(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("going", 2, retention=Retention(max_events=1))
    engine.append("going", events(20))

    def start_deleting(cuts: Any) -> None:  # as `stream delete` does first
        sql.execute("DELETE FROM subengine.partitions WHERE stream = 'going'")

    run = engine.run_retention(batch=3, plan=start_deleting)
    assert run.partitions == []
    left = sql.execute("SELECT count(*) FROM subengine.events WHERE stream = 'going'").fetchone()
    assert left == (20,)  # the delete removes them, and the stream


def test_max_bytes_keeps_the_newest_events_that_fit_in_each_partition(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # sizes as PostgreSQL writes data and metadata as text: {"s": "…"} is 9 bytes and the
    # text's, no metadata {} 2 more
    engine.create_stream("sized", 2, retention=Retention(max_bytes=100))
    keys = [key_in(0, partitions=2), key_in(1, partitions=2)]
    sizes = [60, 12, 30, 40, 20]  # each event's, newest last
    engine.append("sized", [NewEvent(keys[0], "T", {"s": "x" * (n - 11)}) for n in sizes])
    engine.append("sized", [NewEvent(keys[1], "T", {"s": "x"}) for _ in range(3)])

    run = engine.run_retention()

    # 20, 40 and 30 bytes fit in 100; with 12 more they would not
    assert stored_positions(sql, "sized") == {0: [3, 4, 5], 1: [1, 2, 3]}
    assert [(p.partition, p.first, p.last) for p in run.partitions] == [(0, 1, 2)]
    [gap] = [item for item in engine.read("sized", 0) if isinstance(item, subengine.Tombstone)]
    assert (gap.gap_from, gap.gap_to, gap.reason, gap.head) == (1, 2, "cap", 5)
    assert Retention.from_json(Retention(max_bytes=100).to_json()) == Retention(max_bytes=100)
