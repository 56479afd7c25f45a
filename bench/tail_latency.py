"""How soon a live tail delivers an event after its append commits, at 200 events/s: from
an append's return to the event reaching `Engine.tail`, `AsyncEngine.tail` and, as the
floor any push-based reader stands on, a bare LISTEN connection; rounds in rotating
order. Goals: the tails' p50 <= 2 ms and p99 <= 10 ms.

    .venv/bin/python bench/tail_latency.py            # about a minute
    .venv/bin/python bench/tail_latency.py --quick    # a few seconds, for a smoke test
    .venv/bin/python bench/tail_latency.py --dsn postgresql://...   # or set SUBENGINE_DSN

It works in a scratch schema (`--schema`, default `bench_tail_latency`), dropped and
migrated on every run (never one it did not make).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import _harness as bench
import psycopg
from _harness import percentile
from psycopg import sql

import subengine
from subengine import NewEvent

STREAM = "bench-tail"
GOAL_P50_MS = 2.0
GOAL_P99_MS = 10.0

clock = time.perf_counter


@dataclass
class Variant:
    name: str
    # called with (ready, stop, received) and runs until `stop`; sets `ready` once it listens
    run: Callable[[threading.Event, threading.Event, dict[str, float]], None]
    latencies: list[float] = field(default_factory=list)
    from_call: list[float] = field(default_factory=list)  # from the append's start
    round_p50: list[float] = field(default_factory=list)
    clamped: int = 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench.arguments("Append-to-tail delivery latency.", schema="bench_tail_latency")
    parser.add_argument("--seconds", type=float, help="seconds per round (8)")
    parser.add_argument("--rate", type=float, default=200.0, help="events per second (200)")
    args = bench.parse(parser, argv)
    seconds = bench.sized(args, "seconds", 2.0, 8.0)
    rounds = args.rounds
    started = time.perf_counter()

    with bench.scratch_engine(args, "bench/tail_latency.py") as engine:
        engine.create_stream(STREAM, 8)

        def sync_tail(ready: threading.Event, stop: threading.Event, got: dict[str, float]) -> None:
            with engine.tail(STREAM, after=subengine.Cursor.at(STREAM, engine.heads(STREAM))) as t:
                t.next_event(timeout=0.01)  # caught up, registered and listening
                ready.set()
                while not stop.is_set():
                    event = t.next_event(timeout=0.1)
                    if event is not None:
                        got[f"head-{event.position}"] = clock()

        def async_tail(
            ready: threading.Event, stop: threading.Event, got: dict[str, float]
        ) -> None:
            async def run() -> None:
                async with subengine.AsyncEngine(settings=engine.settings) as async_engine:
                    heads = await async_engine.heads(STREAM)
                    tail = async_engine.tail(STREAM, after=subengine.Cursor.at(STREAM, heads))
                    async with tail:
                        await tail.next_event(timeout=0.01)
                        ready.set()
                        while not stop.is_set():
                            event = await tail.next_event(timeout=0.1)
                            if event is not None:
                                got[f"head-{event.position}"] = clock()

            asyncio.run(run())

        def plain_listen(
            ready: threading.Event, stop: threading.Event, got: dict[str, float]
        ) -> None:
            with psycopg.connect(engine.dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(engine.schema)))
                ready.set()
                while not stop.is_set():
                    for notification in conn.notifies(timeout=0.1):
                        now = clock()
                        got[f"head-{json.loads(notification.payload)['head']}"] = now

        variants = [
            Variant("Engine.tail", sync_tail),
            Variant("AsyncEngine.tail", async_tail),
            Variant("plain LISTEN (notification only)", plain_listen),
        ]
        # every event to one key, so one partition: a position (a notification's head)
        # names one event for every reader
        key_of = "order-1"
        counter = 0

        def one_round(variant: Variant) -> None:
            nonlocal counter
            ready, stop = threading.Event(), threading.Event()
            received: dict[str, float] = {}
            reader = threading.Thread(target=variant.run, args=(ready, stop, received))
            reader.start()
            if not ready.wait(60):
                raise SystemExit(f"{variant.name} did not start")
            appended: dict[str, tuple[float, float]] = {}
            count = int(seconds * args.rate)
            first = clock()
            for n in range(count):
                delay = first + n / args.rate - clock()
                if delay > 0:
                    time.sleep(delay)
                counter += 1
                began = clock()
                [stored] = engine.append(STREAM, [NewEvent(key_of, "Tick", {"n": counter})])
                done = clock()
                appended[str(stored.position)] = (began, done)
            deadline = clock() + 10
            while len(received) < count and clock() < deadline:
                time.sleep(0.01)
            stop.set()
            reader.join(30)
            latencies = []
            for position, (began_at, at) in appended.items():
                arrived = received.get(f"head-{position}")
                if arrived is None:
                    raise SystemExit(f"{variant.name}: position {position} never arrived")
                if arrived < at:
                    variant.clamped += 1
                latencies.append(max(0.0, arrived - at))
                variant.from_call.append(arrived - began_at)
            variant.latencies += latencies
            variant.round_p50.append(percentile(latencies, 0.5))

        for number in range(rounds):
            for variant in bench.rotated(variants, number):
                one_round(variant)
            print(f"round {number + 1} of {rounds} done", file=sys.stderr)

    plain = variants[2]
    plain_p50 = percentile(plain.latencies, 0.5)
    print(
        f"{args.rate:g} events/s, 1 event per append, {rounds} rounds of {seconds:g} s "
        "in rotating order; latency from append returned to reader got it, in ms"
    )
    print()
    print(f"{'variant':<34} {'events':>7} {'p50':>7} {'p99':>7}   round p50s (min, max)  clamped")
    for variant in variants:
        p50 = percentile(variant.latencies, 0.5) * 1000
        p99 = percentile(variant.latencies, 0.99) * 1000
        low, high = min(variant.round_p50) * 1000, max(variant.round_p50) * 1000
        print(
            f"{variant.name:<34} {len(variant.latencies):>7} {p50:>7.3f} {p99:>7.3f}"
            f"   ({low:.3f}, {high:.3f})  {variant.clamped}"
        )
    print()
    print("the same from the start of the append call (an upper bound: it holds the append):")
    for variant in variants:
        p50 = percentile(variant.from_call, 0.5) * 1000
        p99 = percentile(variant.from_call, 0.99) * 1000
        print(f"{variant.name:<34} {len(variant.from_call):>7} {p50:>7.3f} {p99:>7.3f}")
    print()
    for variant in variants[:2]:
        p50 = percentile(variant.latencies, 0.5) * 1000
        p99 = percentile(variant.latencies, 0.99) * 1000
        ratio = percentile(variant.latencies, 0.5) / plain_p50 if plain_p50 else float("inf")
        verdict = bench.verdict(p50 <= GOAL_P50_MS and p99 <= GOAL_P99_MS)
        print(
            f"{variant.name}: p50 {p50:.3f} ms (goal <= {GOAL_P50_MS:g}), p99 {p99:.3f} ms "
            f"(goal <= {GOAL_P99_MS:g})  {verdict}; p50 / plain LISTEN p50 {ratio:.2f}"
        )
    print(f"run time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
