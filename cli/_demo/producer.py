"""The demo's producer: a few thousand order events over many order keys (placed, items
added, paid, shipped, cancelled), appended in small transactions at a steady rate, each
key at the version it must have."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import subengine

from ..demo_app import STREAM

APPEND_BATCH = 20  # events per producer transaction

CATALOGUE = (
    ("kettle", 3499),
    ("teapot", 2450),
    ("mug", 899),
    ("grinder", 5900),
    ("filter-papers", 399),
    ("scale", 2999),
    ("beans-1kg", 2350),
    ("tea-loose-250g", 1290),
    ("french-press", 3150),
    ("milk-frother", 4475),
)
PAYMENT_METHODS = ("card", "paypal", "invoice")
CARRIERS = ("dhl", "ups", "postnl", "dpd")
CANCEL_REASONS = ("customer request", "payment declined", "out of stock")


@dataclass
class _Order:
    state: str
    version: int
    total_cents: int


class Producer(threading.Thread):
    """Appends `count` order events at about `rate` per second, APPEND_BATCH events per
    transaction, with each key's current version as its expected version."""

    def __init__(self, engine: subengine.Engine, count: int, rate: float) -> None:
        super().__init__(name="demo producer", daemon=True)
        self.engine = engine
        self.count = count
        self.rate = rate
        self.appended = 0
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self._rng = random.Random()
        self._run = f"{self._rng.getrandbits(24):06x}"  # keys of earlier runs stay distinct
        self._orders: dict[str, _Order] = {}
        self._open: list[str] = []

    def run(self) -> None:
        started = time.monotonic()
        try:
            while self.appended < self.count and not self.stopping.is_set():
                events, expected = self._batch(min(APPEND_BATCH, self.count - self.appended))
                self.engine.append(STREAM, events, expected_version=expected)
                self.appended += len(events)
                self.stopping.wait(started + self.appended / self.rate - time.monotonic())
        except BaseException as error:  # reported by the demo, which then fails
            self.error = error

    def _batch(self, size: int) -> tuple[list[subengine.NewEvent], dict[str, int]]:
        events: list[subengine.NewEvent] = []
        expected: dict[str, int] = {}
        for _ in range(size):
            key, event_type, data = self._next()
            order = self._orders[key]
            expected.setdefault(key, order.version)
            order.version += 1
            events.append(subengine.NewEvent(key, event_type, data))
        return events, expected

    def _next(self) -> tuple[str, str, dict[str, Any]]:
        rng = self._rng
        if not self._open or rng.random() < 0.3:
            key = f"order-{self._run}-{len(self._orders) + 1:05d}"
            chosen = [
                (sku, rng.randint(1, 3), price)
                for sku, price in rng.sample(CATALOGUE, rng.randint(1, 4))
            ]
            lines = [
                {"sku": sku, "quantity": quantity, "price_cents": price}
                for sku, quantity, price in chosen
            ]
            total = sum(quantity * price for _sku, quantity, price in chosen)
            self._orders[key] = _Order("placed", 0, total)
            self._open.append(key)
            customer = f"customer-{rng.randrange(500):03d}"
            data = {"customer": customer, "items": lines, "currency": "EUR", "total": total / 100}
            return key, "OrderPlaced", data
        key = rng.choice(self._open)
        order = self._orders[key]
        roll = rng.random()
        if order.state == "placed" and roll < 0.3:
            sku, price = rng.choice(CATALOGUE)
            quantity = rng.randint(1, 2)
            order.total_cents += quantity * price
            return key, "ItemAdded", {"sku": sku, "quantity": quantity, "price_cents": price}
        if order.state == "placed" and roll < 0.85:
            order.state = "paid"
            method = rng.choice(PAYMENT_METHODS)
            return key, "OrderPaid", {"amount_cents": order.total_cents, "method": method}
        self._open.remove(key)
        if order.state == "paid" and roll < 0.85:
            order.state = "shipped"
            carrier = rng.choice(CARRIERS)
            tracking = f"{carrier.upper()}{rng.randrange(10**9):09d}"
            return key, "OrderShipped", {"carrier": carrier, "tracking": tracking}
        order.state = "cancelled"
        return key, "OrderCancelled", {"reason": rng.choice(CANCEL_REASONS)}
