"""The demo's check: the projection folded again from the events in Python,
independently of the handlers' SQL, and compared with the table, order by order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import subengine

from ..demo_app import SCHEMA, STREAM, SUBSCRIPTION
from .processes import WORKER_APP
from .schema import command_name

Say = Callable[[str], None]


def _events(engine: subengine.Engine) -> Iterator[subengine.Event]:
    for partition in range(engine.stream(STREAM).partitions):
        after = 0
        while batch := engine.read(STREAM, partition, after=after, limit=5000):
            for item in batch:
                if isinstance(item, subengine.Tombstone):  # the demo's stream keeps all
                    raise AssertionError(f"the demo's stream lost events: {item}")
                yield item
            after = batch[-1].position


def expected_orders(events: Iterator[subengine.Event]) -> tuple[dict[str, tuple[Any, ...]], int]:
    """What the projection must hold, folded from the events in Python, independently of
    the handlers' SQL: (customer, state, items, total, paid, events, version) per order,
    and the number of events folded."""
    orders: dict[str, list[Any]] = {}
    folded = 0
    for event in events:
        data = event.data
        if event.type == "OrderPlaced":
            lines = data["items"]
            items = sum(line["quantity"] for line in lines)
            total = sum(line["quantity"] * line["price_cents"] for line in lines)
            orders[event.key] = [data["customer"], "placed", items, total, 0, 0, 0]
        elif event.type == "ItemAdded":
            orders[event.key][2] += data["quantity"]
            orders[event.key][3] += data["quantity"] * data["price_cents"]
        elif event.type == "OrderPaid":
            orders[event.key][1] = "paid"
            orders[event.key][4] += data["amount_cents"]
        elif event.type in ("OrderShipped", "OrderCancelled"):
            orders[event.key][1] = "shipped" if event.type == "OrderShipped" else "cancelled"
        else:
            continue
        orders[event.key][5] += 1
        orders[event.key][6] = event.key_version
        folded += 1
    return {key: tuple(values) for key, values in orders.items()}, folded


def verify(engine: subengine.Engine, say: Say) -> bool:
    expected, folded = expected_orders(_events(engine))
    with engine.connection() as conn:
        projected = {
            key: tuple(values)
            for key, *values in conn.execute(
                "SELECT order_key, customer, state, items, total_cents, paid_cents, events,"
                " version FROM subengine_demo.orders"
            )
        }
    wrong = sorted(
        k for k in expected.keys() | projected.keys() if expected.get(k) != projected.get(k)
    )
    for key in wrong[:5]:
        say(
            f"MISMATCH {key}: the events say {expected.get(key)}, "
            f"the projection holds {projected.get(key)}"
        )
    applied = sum(row[5] for row in projected.values())
    states = Counter(values[1] for values in projected.values())
    say("")
    say(f"checked {folded:,} events against {len(projected):,} projected orders:")
    for state in ("placed", "paid", "shipped", "cancelled"):
        cents = sum(v[3] for v in projected.values() if v[1] == state)
        say(f"  {state:<10} {states[state]:>6,} orders  {cents / 100:>12,.2f} EUR")
    if wrong or applied != folded:
        say(
            f"FAILED: {len(wrong)} orders differ; the projection applied {applied:,} events, "
            f"the stream holds {folded:,}"
        )
        return False
    say(
        "check passed: every order's state, items, totals, event count and version equal "
        "what its events say (each event applied exactly once, in order)"
    )
    _next_steps(engine, say)
    return True


def _next_steps(engine: subengine.Engine, say: Say) -> None:
    command = command_name()
    demo = f"{command} --schema {SCHEMA}"  # the demo's schema, not SUBENGINE_SCHEMA's
    say("")
    say("Try next (the server keeps running; stop it with `" + command + " db stop`):")
    for line in (
        f"{demo} status --partitions   # positions, lag and state per partition",
        f"{demo} subscription show {SUBSCRIPTION}",
        # a line printed for the reader to run, not SQL this program runs
        f'psql "$({command} db url)" -c "SELECT * FROM {SCHEMA}.subscription_status"',  # noqa: S608
        f"{demo} worker --app {WORKER_APP}   # in two terminals;",
        f"    then append more, kill one with kill -9, and watch `{demo} status --watch`",
        f"{demo} append {STREAM} --key order-x --type OrderPlaced \\",
        '    --data \'{"customer": "you", "items": [{"sku": "mug", "quantity": 1, '
        '"price_cents": 899}]}\'',
    ):
        say(f"  {line}")
