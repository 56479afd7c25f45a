"""Long-polls per 1,000 events for a client that only long-polls, with and without a linger.

A real `subengine serve`; an appender adds one event at a time at a steady rate (200 a
second by default); a client long-polls from the cursor of the last answer until it has
every event. Plain long-polls answer as soon as anything is there (about one event per
reply at this rate); with `linger=S` a reply gathers what arrives for S seconds after the
first event (seed 003's batched replies). Rounds run in rotating order, a fresh stream per
run; the report gives the median, min and max of the polls per 1,000 events and their
ratio to plain long-polls. The goal: a linger of 0.1 s makes at most a fifth of the polls.

    .venv/bin/python bench/long_poll.py            # about 1 minute
    .venv/bin/python bench/long_poll.py --quick
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import _harness as bench
import httpx
from _harness import SCHEMA

import subengine

GOAL_RATIO = 0.2
WAIT = 30.0


@dataclass(frozen=True, slots=True)
class Run:
    polls: int
    events: int

    @property
    def per_thousand(self) -> float:
        return 1000 * self.polls / self.events


def append_steadily(engine: subengine.Engine, stream: str, count: int, rate: float) -> None:
    """`count` events, one per append, at `rate` a second (on a schedule, not a sleep
    after each: a slow append does not lower the rate)."""
    start = time.monotonic()
    for n in range(count):
        delay = start + n / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        engine.append(stream, [subengine.NewEvent(f"k{n % 64}", "Tick", {"n": n})])


def poll_until(url: str, cursor: str, count: int, linger: float | None) -> int:
    """Long-poll from `cursor` until `count` events came; the number of polls."""
    params = {"live": "long-poll", "wait": f"{WAIT:g}", "limit": "1000"}
    params["session"] = uuid.uuid4().hex
    if linger is not None:
        params["linger"] = f"{linger:g}"
    polls = received = 0
    with httpx.Client(timeout=WAIT + 30) as client:
        while received < count:
            answer = client.get(url, params={**params, "after": cursor})
            polls += 1
            if answer.status_code == 204:
                cursor = answer.headers["Subengine-Cursor"]
                continue
            answer.raise_for_status()
            body = answer.json()
            received += len(body["events"])
            cursor = body["cursor"]
    return polls


def one_run(
    engine: subengine.Engine,
    gateway: str,
    stream: str,
    count: int,
    rate: float,
    linger: float | None,
) -> Run:
    engine.create_stream(stream, partitions=4)
    cursor = httpx.get(f"{gateway}/v1/streams/{stream}", timeout=30).json()["cursor"]
    appender = threading.Thread(target=append_steadily, args=(engine, stream, count, rate))
    appender.start()
    polls = poll_until(f"{gateway}/v1/streams/{stream}/events", cursor, count, linger)
    appender.join()
    return Run(polls, count)


def main(argv: Sequence[str] | None = None) -> None:
    parser = bench.arguments(__doc__.splitlines()[0], quick="200 events a run")
    parser.add_argument("--events", type=int, help="events per run (1000; --quick 200)")
    parser.add_argument("--rate", type=float, default=200.0, help="events a second (200)")
    parser.add_argument("--linger", type=float, default=0.1, help="seconds (0.1)")
    args = bench.parse(parser, argv)
    count = bench.sized(args, "events", 200, 1000)
    variants: list[float | None] = [None, args.linger]
    load_before = os.getloadavg()[0]
    results: dict[float | None, list[Run]] = {variant: [] for variant in variants}
    with (
        bench.benchmark_database(bench.dsn_of(args), "bench_long_poll_", migrate=True) as db,
        tempfile.TemporaryDirectory() as logs,
        subengine.Engine(db.dsn, schema=SCHEMA) as engine,
    ):
        env = {**os.environ, "SUBENGINE_DSN": db.dsn, "SUBENGINE_SCHEMA": SCHEMA}
        server = bench.Child("gateway", bench.subengine_serve(), env, Path(logs)).started()
        try:
            for number, variant in bench.rotating(variants, args.rounds):
                name = "plain" if variant is None else f"linger={variant:g}"
                stream = f"poll-{number}-{'plain' if variant is None else 'linger'}"
                run = one_run(engine, server.url, stream, count, args.rate, variant)
                bench.progress(f"round {number + 1} {name}: {run.polls} polls, {count} events")
                results[variant].append(run)
        finally:
            server.stop()
        facts = bench.server_facts(db.dsn)
    plain = bench.Spread.of([run.per_thousand for run in results[None]])
    lingered = bench.Spread.of([run.per_thousand for run in results[args.linger]])
    ratio = lingered.median / plain.median
    print(f"long-polls per 1,000 events, {args.rate:g} events/s, {args.rounds} rounds:")
    print(f"  plain long-poll:  {plain.text()}")
    print(f"  linger={args.linger:g} s:    {lingered.text()}")
    print(
        f"  ratio (median):   {ratio:.3f}  goal <= {GOAL_RATIO:g}  "
        f"{bench.verdict(ratio <= GOAL_RATIO)}"
    )
    print(f"  {bench.machine(facts, load_before)}")


if __name__ == "__main__":
    main()
