"""The demo's app: a projection of the `orders` stream into the table `subengine_demo.orders`.

Both live in the demo's own schema, `subengine_demo`: its streams and subscriptions, and
the projection table beside them. `subengine demo` runs the app in two worker processes;
start another one yourself with

    subengine --schema subengine_demo worker --app subengine.cli.demo_app:app

Each handler writes on the worker's connection (never None: the subscription is
transactional), in the transaction that also moves the subscription's position, so every
event changes the projection exactly once. The statements check the key version they
expect: an event applied twice, or out of order, fails its batch instead of corrupting a
row.
"""

from __future__ import annotations

from typing import Any

import psycopg

import subengine

# The schema the demo creates, marks and writes into: nothing outside it.
SCHEMA = "subengine_demo"
STREAM = "orders"
SUBSCRIPTION = "order_projection"

# Integer cents keep the totals exact, so the demo can compare them for equality.
PROJECTION_DDL = """
CREATE TABLE IF NOT EXISTS subengine_demo.orders (
    order_key   text PRIMARY KEY,
    customer    text NOT NULL,
    state       text NOT NULL,
    items       integer NOT NULL,
    total_cents bigint NOT NULL,
    paid_cents  bigint NOT NULL,
    events      integer NOT NULL,
    version     bigint NOT NULL,
    updated_at  timestamptz NOT NULL
)
"""

app = subengine.App()
projection = app.subscription(SUBSCRIPTION, stream=STREAM, start="beginning", batch_size=100)


@projection.handler("OrderPlaced")
def placed(event: subengine.Event, conn: psycopg.Connection[Any] | None) -> None:
    lines = event.data["items"]
    _transaction(conn).execute(
        "INSERT INTO subengine_demo.orders (order_key, customer, state, items, total_cents,"
        " paid_cents, events, version, updated_at)"
        " VALUES (%s, %s, 'placed', %s, %s, 0, 1, %s, %s)",
        (
            event.key,
            event.data["customer"],
            sum(line["quantity"] for line in lines),
            sum(line["quantity"] * line["price_cents"] for line in lines),
            event.key_version,
            event.occurred_at,
        ),
    )


@projection.handler("ItemAdded")
def item_added(event: subengine.Event, conn: psycopg.Connection[Any] | None) -> None:
    quantity, price = event.data["quantity"], event.data["price_cents"]
    _update(
        conn,
        event,
        "UPDATE subengine_demo.orders SET items = items + %(quantity)s,"
        " total_cents = total_cents + %(amount)s, events = events + 1,"
        " version = %(version)s, updated_at = %(at)s"
        " WHERE order_key = %(key)s AND version = %(version)s - 1",
        {"quantity": quantity, "amount": quantity * price},
    )


@projection.handler("OrderPaid")
def paid(event: subengine.Event, conn: psycopg.Connection[Any] | None) -> None:
    _update(
        conn,
        event,
        "UPDATE subengine_demo.orders SET state = 'paid',"
        " paid_cents = paid_cents + %(amount)s, events = events + 1,"
        " version = %(version)s, updated_at = %(at)s"
        " WHERE order_key = %(key)s AND version = %(version)s - 1",
        {"amount": event.data["amount_cents"]},
    )


@projection.handler("OrderShipped")
def shipped(event: subengine.Event, conn: psycopg.Connection[Any] | None) -> None:
    _set_state(conn, event, "shipped")


@projection.handler("OrderCancelled")
def cancelled(event: subengine.Event, conn: psycopg.Connection[Any] | None) -> None:
    _set_state(conn, event, "cancelled")


def _set_state(conn: psycopg.Connection[Any] | None, event: subengine.Event, state: str) -> None:
    _update(
        conn,
        event,
        "UPDATE subengine_demo.orders SET state = %(state)s, events = events + 1,"
        " version = %(version)s, updated_at = %(at)s"
        " WHERE order_key = %(key)s AND version = %(version)s - 1",
        {"state": state},
    )


def _update(
    conn: psycopg.Connection[Any] | None,
    event: subengine.Event,
    statement: str,
    params: dict[str, Any],
) -> None:
    updated = (
        _transaction(conn)
        .execute(
            statement,
            {**params, "key": event.key, "version": event.key_version, "at": event.occurred_at},
        )
        .rowcount
    )
    if updated != 1:
        raise RuntimeError(
            f"{event.type} for {event.key} (version {event.key_version}) found no order at "
            f"version {event.key_version - 1} in the projection"
        )


def _transaction(conn: psycopg.Connection[Any] | None) -> psycopg.Connection[Any]:
    # the subscription is transactional, so the worker always passes its transaction
    if conn is None:
        raise RuntimeError("the projection's handlers need the worker's transaction")
    return conn
