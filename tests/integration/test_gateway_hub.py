"""The gateway's hub on a real PostgreSQL, in process: what a reader woken by an append
costs in statements. Every statement goes through the SQL layer (`SQL.run_async`), so
recording there counts them all; the hub's head poll, a timer of its own, is left out.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

import subengine
from subengine.db._sql import SQL, Query
from subengine.gateway._hub import Hub, Watcher
from subengine.gateway._reading import Reader, Selection
from subengine.model._errors import DatabaseUnavailable
from subengine.model._events import Tombstone
from subengine.model._gateway_cursor import StreamPosition

HEAD_POLL = "subengine-gateway-head-poll"


class Recorded:
    """The names of the statements a SQL layer runs, outside the hub's head poll, and
    whether each ran on its own (autocommit: no BEGIN and COMMIT round trips)."""

    def __init__(self, sql: SQL) -> None:
        self.names: list[str] = []
        self.alone: list[bool] = []
        self.on = False
        run = sql.run_async

        async def recording(conn: Any, query: Query[Any]) -> Any:
            task = asyncio.current_task()
            if self.on and (task is None or task.get_name() != HEAD_POLL):
                self.names.append(query.name)
                self.alone.append(conn.autocommit)
            return await run(conn, query)

        sql.run_async = recording  # type: ignore[method-assign]


@asynccontextmanager
async def opened_hub(dsn: str, **options: Any) -> AsyncIterator[Hub]:
    """A hub on engines of its own (its LISTEN and its reads), whose head poll runs once."""
    listen_engine, read_engine = subengine.AsyncEngine(dsn), subengine.AsyncEngine(dsn)
    await listen_engine.open()
    await read_engine.open()
    hub = Hub(listen_engine, read_engine, poll_interval=3600.0, **options)
    try:
        yield hub
    finally:
        await hub.close()
        await read_engine.close()
        await listen_engine.close()


async def following(hub: Hub, *watchers: Watcher) -> None:
    """Add `watchers` to the hub and wait until its first head poll has woken each (what
    it woke them for is taken): their next wake-up is an append's."""
    for watcher in watchers:
        hub.add(watcher)
    for watcher in watchers:
        await asyncio.wait_for(watcher.event.wait(), 30)
        watcher.take()


async def woken(engine: subengine.Engine, dsn: str, live: str) -> tuple[Recorded, list[Any]]:
    """A reader at the head of 'orders', woken by an append, reads what moved (`live`:
    "long-poll" or "sse"): the statements that cost, and the events' data it got."""
    async with opened_hub(dsn) as hub:
        read_engine = hub.read_engine
        recorded = Recorded(read_engine.sql)
        engine.append("orders", [subengine.NewEvent("a", "T", {"n": 0})])
        epoch, heads = (await read_engine.epochs_and_heads(["orders"]))["orders"]
        assert heads is not None
        start = {"orders": StreamPosition(epoch, tuple(heads))}
        reader = Reader(hub, {"orders": Selection("orders")}, start)
        watcher = Watcher({"orders": None})
        await following(hub, watcher)
        recorded.on = True
        engine.append("orders", [subengine.NewEvent("a", "T", {"n": 1})])
        await asyncio.wait_for(watcher.event.wait(), 30)
        changed, _ = watcher.take()
        partitions = [partition for _, partition in changed]
        if live == "long-poll":
            taken = await reader.live_page("orders", partitions, None, limit=100)
            events = [json.loads(text) for text in taken.events]
        else:
            for partition in partitions:
                await reader.live_frames("orders", partition)
            frames = [json.loads(f.data) for f in reader.take_frames() if f.kind == "events"]
            events = [event for frame in frames for event in frame["events"]]
        return recorded, [event["data"] for event in events]


@pytest.mark.parametrize("live", ["long-poll", "sse"])
def test_a_woken_reader_reads_events_and_their_epoch_in_one_statement(
    engine: subengine.Engine, dsn: str, orders: str, runner: asyncio.Runner, live: str
) -> None:
    """The shared read says which stream of the name its events are of (a stream deleted
    and created again has a new epoch and sends no notification): its one statement
    reads the epoch with the events, and no second one asks for it."""
    recorded, events = runner.run(woken(engine, dsn, live))
    assert recorded.names == ["read_after"]
    assert events == [{"n": 1}]


@pytest.mark.parametrize("live", ["long-poll", "sse"])
def test_a_woken_reader_reads_in_one_round_trip(
    engine: subengine.Engine, dsn: str, orders: str, runner: asyncio.Runner, live: str
) -> None:
    """Its one statement is a snapshot of its own: no BEGIN and COMMIT around it, each a
    round trip to PostgreSQL between the notification and the frame."""
    recorded, _ = runner.run(woken(engine, dsn, live))
    assert recorded.alone == [True]


def test_a_read_with_no_event_after_the_position_still_says_the_epoch(
    engine: subengine.Engine, dsn: str, runner: asyncio.Runner
) -> None:
    engine.create_stream("again", partitions=1)
    engine.delete_stream("again")
    engine.create_stream("again", partitions=1)
    epoch = engine.stream("again").epoch

    async def read() -> tuple[int, list[Any]]:
        async with subengine.AsyncEngine(dsn) as read_engine:
            return await read_engine.read_json("again", 0, 0, 10)

    assert runner.run(read()) == (epoch, [])


async def next_watcher(engine: subengine.Engine, dsn: str, linger: float) -> dict[str, Any]:
    """A watcher of 'orders' leaves and another comes: what the hub knows of the stream
    right when the second one arrives, and once `linger` seconds passed with none."""
    async with opened_hub(dsn, linger=linger) as hub:
        engine.append("orders", [subengine.NewEvent("a", "T", {"n": 0})])
        (partition,) = [p for p, head in engine.heads("orders").items() if head]
        first = Watcher({"orders": None})
        hub.add(first)
        await asyncio.wait_for(first.event.wait(), 30)  # the first head poll
        hub.remove(first)
        second = Watcher({"orders": None})
        hub.add(second)
        seen = {"head for the next watcher": hub.head("orders", partition)}
        hub.remove(second)
        for _ in range(200):
            if hub.head("orders", partition) == 0:
                break
            await asyncio.sleep(0.05)
        seen["head once no watcher came"] = hub.head("orders", partition)
        return seen


def test_the_next_watcher_of_a_stream_starts_from_the_heads_the_hub_knows(
    engine: subengine.Engine, dsn: str, orders: str, runner: asyncio.Runner
) -> None:
    """A long-poll client comes back right after each answer: what the hub knew of the
    stream outlives its last watcher for a while, so the next long-poll neither waits
    for a head poll nor reads its page twice (once more when the poll wakes it); a
    stream nobody comes back to is then no longer followed."""
    seen = runner.run(next_watcher(engine, dsn, linger=0.2))
    assert seen == {"head for the next watcher": 1, "head once no watcher came": 0}


async def woken_readers(engine: subengine.Engine, dsn: str) -> tuple[list[list[Any]], int]:
    """Five readers of 'orders' at its heads, woken by one append of two events: the
    first three read all of it, the fourth only type B, the fifth stands one event
    further back in another partition. Their frames, in order, and how many sets of
    frames the read kept."""
    async with opened_hub(dsn) as hub:
        read_engine = hub.read_engine
        engine.append("orders", [subengine.NewEvent(f"k{n}", "T", {"n": n}) for n in range(8)])
        epoch, heads = (await read_engine.epochs_and_heads(["orders"]))["orders"]
        assert heads is not None
        start = {"orders": StreamPosition(epoch, tuple(heads))}
        moved = engine.append(
            "orders",
            [subengine.NewEvent("a", "A", {"n": 10}), subengine.NewEvent("a", "B", {"n": 11})],
        )
        partition = moved[0].partition
        behind = list(heads)
        elsewhere = next(p for p, head in enumerate(heads) if head and p != partition)
        behind[elsewhere] -= 1
        readers = [
            Reader(hub, {"orders": Selection("orders")}, start),
            Reader(hub, {"orders": Selection("orders")}, start),
            Reader(hub, {"orders": Selection("orders")}, start),
            Reader(hub, {"orders": Selection("orders", types=frozenset({"B"}))}, start),
            Reader(
                hub,
                {"orders": Selection("orders")},
                {"orders": StreamPosition(epoch, tuple(behind))},
            ),
        ]
        watcher = Watcher({"orders": None})
        hub.add(watcher)
        await asyncio.wait_for(watcher.event.wait(), 30)  # the first head poll
        for reader in readers:
            await reader.live_frames("orders", partition)
        shared = await hub.read("orders", partition, heads[partition])
        kept = sum(frames is not None for frames in shared.frames.values())
        return [reader.take_frames() for reader in readers], kept


def test_readers_that_stand_at_the_same_cursor_share_the_frames_of_a_read(
    engine: subengine.Engine, dsn: str, orders: str, runner: asyncio.Runner
) -> None:
    """The frames the second reader at a cursor made, with a selection, are the frames
    of every later one (issue 26: 1,000 watchers of a stream each made the same frame);
    a reader elsewhere, or with other filters, gets its own. The first reader at a
    cursor keeps none: readers whose cursors all differ would keep a set each."""
    (same, twin, third, only_b, behind), kept = runner.run(woken_readers(engine, dsn))
    assert len(same) == 1 and same[0].kind == "events"
    assert third[0] is twin[0] and twin[0] == same[0]
    assert kept == 1
    assert [e["data"] for e in json.loads(same[0].data)["events"]] == [{"n": 10}, {"n": 11}]
    assert [e["data"] for e in json.loads(only_b[0].data)["events"]] == [{"n": 11}]
    assert behind[0].data == same[0].data and behind[0].cursor != same[0].cursor
    for frames in (same, only_b, behind):
        assert (
            frames[0].wire
            == f"id: {frames[0].cursor}\nevent: events\ndata: {frames[0].data}\n\n".encode()
        )


async def read_made_when_woken(engine: subengine.Engine, dsn: str) -> Any:
    """A watcher at the head of 'orders' is woken by an append: the read from where it
    stands, if made by then (else None)."""
    async with opened_hub(dsn) as hub:
        engine.append("orders", [subengine.NewEvent("a", "T", {"n": 0})])
        watcher = Watcher({"orders": None}, shared_reads=True)
        await following(hub, watcher)
        (moved,) = engine.append("orders", [subengine.NewEvent("a", "T", {"n": 1})])
        await asyncio.wait_for(watcher.event.wait(), 30)
        read = hub.read("orders", moved.partition, moved.position - 1)
        try:
            read.send(None)
        except StopIteration as done:
            return done.value
        read.close()
        return None


def test_a_watcher_woken_by_an_append_finds_its_read_made(
    engine: subengine.Engine, dsn: str, orders: str, runner: asyncio.Runner
) -> None:
    """The hub starts the read from the previous head as it learns of the new one, and
    wakes the watchers once it is done: each takes it without waiting (issue 26: 1,000
    watchers each waited on it, a second switch to every watcher's task)."""
    shared = runner.run(read_made_when_woken(engine, dsn))
    assert shared is not None
    assert [json.loads(event.data) for event in shared.items] == [{"n": 1}]


async def reads_when_woken(engine: subengine.Engine, dsn: str) -> int:
    """A watcher that reads otherwise than through the hub (a remote worker's claim, a
    Durable Streams reader) is woken by an append: the reads the hub made by then."""
    async with opened_hub(dsn) as hub:
        watcher = Watcher({"orders": None})
        await following(hub, watcher)
        engine.append("orders", [subengine.NewEvent("a", "T", {"n": 1})])
        await asyncio.wait_for(watcher.event.wait(), 30)
        return hub.reads


def test_a_watcher_that_reads_otherwise_is_woken_at_once(
    engine: subengine.Engine, dsn: str, orders: str, runner: asyncio.Runner
) -> None:
    """Only watchers that read through the hub wait for its read (and cost it)."""
    assert runner.run(reads_when_woken(engine, dsn)) == 0


async def woken_after_a_failed_read(engine: subengine.Engine, dsn: str) -> bool:
    """An event stream's watcher of 'orders', whose hub's read fails (PostgreSQL out of
    reach of the read engine): whether the append still wakes it."""
    async with opened_hub(dsn) as hub:
        engine.append("orders", [subengine.NewEvent("a", "T", {"n": 0})])
        watcher = Watcher({"orders": None}, shared_reads=True)
        await following(hub, watcher)

        async def unreachable(*args: Any, **options: Any) -> Any:
            raise DatabaseUnavailable("the read engine lost PostgreSQL")

        hub.read_engine.read_json = unreachable  # type: ignore[method-assign]
        engine.append("orders", [subengine.NewEvent("a", "T", {"n": 1})])
        try:
            await asyncio.wait_for(watcher.event.wait(), 30)
        except TimeoutError:
            return False
        changed, _ = watcher.take()
        return len(changed) == 1


def test_a_failed_read_still_wakes_the_watchers_that_waited_for_it(
    engine: subengine.Engine, dsn: str, orders: str, runner: asyncio.Runner
) -> None:
    """Nothing silent (DESIGN.md, the gateway): a watcher the hub woke only after its
    read is woken when the read fails too, and meets the failure in its own read."""
    assert runner.run(woken_after_a_failed_read(engine, dsn))


async def sent_or_woken(engine: subengine.Engine, dsn: str) -> dict[str, Any]:
    """Five event streams' watchers of 'orders' wait when an append comes: one takes the
    frames from the hub (its `direct` says True), one cannot take them (False), one fails
    to (raises), one is busy (no `direct`), one waits but was woken already. What each
    saw."""
    async with opened_hub(dsn) as hub:
        engine.append("orders", [subengine.NewEvent("a", "T", {"n": 0})])
        names = ["takes", "cannot", "fails", "busy", "woken already"]
        watchers = {name: Watcher({"orders": None}, shared_reads=True) for name in names}
        offered: dict[str, list[Any]] = {name: [] for name in names}
        await following(hub, *watchers.values())

        def offer(name: str, answer: bool | None) -> Any:
            def direct(shared: Any) -> bool:
                offered[name].append(shared)
                if answer is None:
                    raise RuntimeError("a stream's frames could not be made")
                return answer

            return direct

        watchers["takes"].direct = offer("takes", True)
        watchers["cannot"].direct = offer("cannot", False)
        watchers["fails"].direct = offer("fails", None)
        watchers["woken already"].direct = offer("woken already", True)
        watchers["woken already"].wake_all()
        (moved,) = engine.append("orders", [subengine.NewEvent("a", "T", {"n": 1})])
        await asyncio.wait_for(watchers["busy"].event.wait(), 30)
        return {
            name: (
                watcher.event.is_set(),
                [(s.partition, s.after, len(s.items)) for s in offered[name]],
            )
            for name, watcher in watchers.items()
        } | {"moved": (moved.partition, moved.position - 1, 1)}


def test_a_waiting_event_stream_is_sent_the_read_and_the_others_are_woken(
    engine: subengine.Engine, dsn: str, orders: str, runner: asyncio.Runner
) -> None:
    """Once its read is done, the hub offers it to each event stream that waits with
    nothing else to do, and wakes the others, and those that could not take it or
    failed to (issue 26: no switch to each stream's task for a frame every one of them
    sends)."""
    seen = runner.run(sent_or_woken(engine, dsn))
    read = seen.pop("moved")
    assert seen == {
        "takes": (False, [read]),
        "cannot": (True, [read]),
        "fails": (True, [read]),  # woken all the same, and the others are served
        "busy": (True, []),
        "woken already": (True, []),
    }


async def after_a_failed_follow(dsn: str) -> tuple[int, bool]:
    """A watcher added to a hub whose listener is closed (its engine closed first): the
    streams the hub still follows, and whether the hub then closes."""
    async with opened_hub(dsn) as hub:
        await hub.listen_engine.close()
        with pytest.raises(DatabaseUnavailable):
            hub.add(Watcher({"orders": None}))
        followed = hub.watched() + len(hub._feeds)
        await hub.close()
        return followed, True


def test_a_stream_the_hub_could_not_follow_leaves_nothing_behind(
    dsn: str, orders: str, runner: asyncio.Runner
) -> None:
    """A failed LISTEN registration keeps no half-made feed, which the next watcher of
    the stream would take as followed, and on which the hub's close would fail."""
    assert runner.run(after_a_failed_follow(dsn)) == (0, True)


async def long_poll_woken(engine: subengine.Engine, dsn: str) -> tuple[int, int, Any]:
    """A long-poll's watcher of 'orders', woken by an append: the reads the hub had
    started when it woke, those once the long-poll read the moved partition, and what
    that read found."""
    async with opened_hub(dsn) as hub:
        engine.append("orders", [subengine.NewEvent("a", "T", {"n": 0})])
        watcher = Watcher({"orders": None}, page_reads=True)
        await following(hub, watcher)
        (moved,) = engine.append("orders", [subengine.NewEvent("a", "T", {"n": 1})])
        await asyncio.wait_for(watcher.event.wait(), 30)
        started = hub.reads
        shared = await hub.read("orders", moved.partition, moved.position - 1)
        events = [json.loads(e.data) for e in shared.items if not isinstance(e, Tombstone)]
        return started, hub.reads, events


def test_a_long_poll_is_woken_at_once_with_its_read_under_way(
    engine: subengine.Engine, dsn: str, orders: str, runner: asyncio.Runner
) -> None:
    """A long-poll is woken as soon as the hub hears of an append (it answers with every
    partition an append moved), and the hub starts the read from the previous head then,
    the one the long-poll asks for next: one read, begun a few loop rounds sooner."""
    assert runner.run(long_poll_woken(engine, dsn)) == (1, 1, [{"n": 1}])
