"""The demo the README's first command runs: streams working end to end.

Migrates, creates an `orders` stream, appends a few hundred events of many order keys in
batches, reads every partition back and checks invariant 1 (dense positions) and key
order (versions 1..n in position order), then prints the partition heads.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable

import subengine

STREAM = "orders"
PARTITIONS = 4
KEYS = 24
BATCH = 50
LIFECYCLE = ("OrderPlaced", "ItemAdded", "ItemAdded", "OrderPaid", "OrderShipped")


def _events(count: int, rng: random.Random) -> list[subengine.NewEvent]:
    steps: dict[str, int] = defaultdict(int)
    events = []
    for _ in range(count):
        key = f"order-{rng.randrange(KEYS):03d}"
        step = steps[key]
        steps[key] += 1
        event_type = LIFECYCLE[step] if step < len(LIFECYCLE) else "ItemAdded"
        data = {"order": key, "sku": f"sku-{rng.randrange(100)}", "amount": rng.randrange(1, 500)}
        events.append(subengine.NewEvent(key, event_type, data))
    return events


def run(engine: subengine.Engine, count: int, say: Callable[[str], None]) -> bool:
    engine.migrate()
    say(f"migrated schema {engine.schema!r}")
    if STREAM not in {s.name for s in engine.streams()}:
        engine.create_stream(STREAM, PARTITIONS)
        say(f"created stream {STREAM!r} with {PARTITIONS} partitions")
    heads_before = engine.heads(STREAM)
    events = _events(count, random.Random())
    for start in range(0, count, BATCH):
        engine.append(STREAM, events[start : start + BATCH])
    say(f"appended {count} events of {KEYS} order keys in batches of {BATCH}")

    ok = True
    per_key: dict[str, list[int]] = defaultdict(list)
    for partition, head in sorted(engine.heads(STREAM).items()):
        positions = []
        after = 0
        while batch := engine.read(STREAM, partition, after=after, limit=500):
            positions += [e.position for e in batch]
            for event in batch:
                per_key[event.key].append(event.key_version)
            after = batch[-1].position
        if positions != list(range(1, head + 1)):
            say(f"partition {partition}: positions are not 1..{head}")
            ok = False
    for key, versions in per_key.items():
        if versions != list(range(1, len(versions) + 1)):
            say(f"key {key}: versions are not 1..{len(versions)} in position order")
            ok = False
    total_new = sum(engine.heads(STREAM).values()) - sum(heads_before.values())
    if total_new != count:
        say(f"expected {count} new events, found {total_new}")
        ok = False

    say("")
    say("partition  head  head_time")
    for state in engine.partitions(STREAM):
        when = "-" if state.head_time is None else state.head_time.isoformat(timespec="seconds")
        say(f"{state.partition:>9}  {state.head:>4}  {when}")
    say("")
    if ok:
        say(
            "check passed: every partition is dense (1..head) and every key's versions "
            "follow its positions"
        )
        say("try: subengine read orders --partition 0 --limit 5   |   subengine stream show orders")
    return ok
