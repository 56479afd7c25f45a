"""Declaring subscriptions and handlers: what is accepted and what is refused, with no database."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from helpers import async_handler, generator_handler

import subengine


def test_handlers_are_dispatched_by_type_with_a_catch_all() -> None:
    app = subengine.App()
    sub = app.subscription("billing", stream="orders")
    seen = []
    sub.handler("Placed")(lambda event, conn: seen.append(("placed", event)))
    sub.handler()(lambda event, conn: seen.append(("other", event)))
    events = [_event("Placed", 1), _event("Paid", 2)]
    sub.handle(events, conn=None)
    assert [(kind, e.position) for kind, e in seen] == [("placed", 1), ("other", 2)]


def test_events_without_a_handler_are_skipped() -> None:
    app = subengine.App()
    sub = app.subscription("billing", stream="orders")
    seen = []
    sub.handler("Placed")(lambda event, conn: seen.append(event.position))
    sub.handle([_event("Paid", 1), _event("Placed", 2)], conn=None)
    assert seen == [2]


def test_a_batch_handler_gets_the_whole_batch_and_must_be_alone() -> None:
    app = subengine.App()
    sub = app.subscription("projection", stream="orders")
    batches = []
    sub.batch_handler()(lambda events, conn: batches.append([e.position for e in events]))
    sub.handle([_event("A", 1), _event("B", 2)], conn=None)
    assert batches == [[1, 2]]
    with pytest.raises(subengine.InvalidInput, match="batch handler"):
        sub.handler("A")(lambda event, conn: None)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"ack": "maybe"}, "ack must be one of"),
        ({"on_error": "ignore"}, "on_error must be one of"),
        ({"start": "middle"}, "start must be"),
        ({"start": datetime(2026, 1, 1)}, "time zone"),
        ({"start": {0: -1}}, "start position"),
        ({"stream": "bad name"}, "invalid stream name"),
    ],
)
def test_invalid_declarations_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(subengine.InvalidInput, match=message):
        subengine.App().subscription("billing", **{"stream": "orders", **options})


async def async_generator_handler(event: subengine.Event, conn: Any) -> AsyncIterator[None]:
    yield


class AsyncCallable:
    async def __call__(self, event: subengine.Event, conn: Any) -> None:
        pass


def registrations(sub: subengine.Subscription) -> dict[str, Callable[[], Any]]:
    return {
        "handler": lambda: sub.handler("OrderPlaced"),
        "catch-all": lambda: sub.handler(),
        "batch handler": lambda: sub.batch_handler(),
    }


@pytest.mark.parametrize(
    "function",
    [async_handler, AsyncCallable(), functools.partial(async_handler)],
    ids=["async def", "async __call__", "partial of async def"],
)
@pytest.mark.parametrize("register", ["handler", "catch-all", "batch handler"])
def test_an_async_handler_makes_an_async_subscription(function: Any, register: str) -> None:
    sub = subengine.App().subscription("billing", stream="orders")
    assert not sub.is_async
    registrations(sub)[register]()(function)
    assert sub.is_async


@pytest.mark.parametrize("register", ["handler", "catch-all", "batch handler"])
def test_an_async_generator_handler_is_refused_when_registered(register: str) -> None:
    sub = subengine.App().subscription("billing", stream="orders")
    with pytest.raises(
        subengine.InvalidInput, match=r"is an async generator function .* async def that returns"
    ):
        registrations(sub)[register]()(async_generator_handler)
    assert (sub.handlers, sub.catch_all, sub.batch, sub.is_async) == ({}, None, None, False)


@pytest.mark.parametrize("first", ["plain", "async"])
def test_plain_and_async_handlers_are_refused_in_one_subscription(first: str) -> None:
    # one batch's transaction runs on one connection: a Connection or an AsyncConnection
    sub = subengine.App().subscription("billing", stream="orders")

    def plain(event: subengine.Event, conn: Any) -> None:
        pass

    functions: list[Any] = [plain, async_handler] if first == "plain" else [async_handler, plain]
    sub.handler("A")(functions[0])
    with pytest.raises(subengine.InvalidInput, match=r"cannot share their batches' transaction"):
        sub.handler("B")(functions[1])
    with pytest.raises(subengine.InvalidInput, match=r"cannot share their batches' transaction"):
        sub.gap_handler()(functions[1])
    assert list(sub.handlers) == ["A"] and sub.gap is None
    assert sub.is_async == (first == "async")


def test_a_plain_call_of_async_handlers_is_refused() -> None:
    sub = subengine.App().subscription("billing", stream="orders")
    sub.handler()(async_handler)
    with pytest.raises(subengine.InvalidInput, match=r"only the worker can run"):
        sub.handle([_event("T", 1)], None)


def test_async_handlers_are_awaited_by_type_in_position_order() -> None:
    sub = subengine.App().subscription("billing", stream="orders")
    seen: list[tuple[str, int]] = []

    @sub.handler("A")
    async def on_a(event: subengine.Event, conn: Any) -> None:
        await asyncio.sleep(0)
        seen.append(("A", event.position))

    @sub.handler()
    async def on_other(event: subengine.Event, conn: Any) -> None:
        seen.append(("other", event.position))

    events = [_event("A", 1), _event("B", 2), _event("A", 3)]
    asyncio.run(sub.handle_async(events, None))
    assert seen == [("A", 1), ("other", 2), ("A", 3)]


@pytest.mark.parametrize(
    "function",
    [lambda: None, lambda event: None, lambda event, conn, extra: None, lambda e, *, conn: None],
    ids=["no argument", "one argument", "three arguments", "keyword-only conn"],
)
def test_a_handler_that_cannot_take_event_and_conn_is_refused(function: Any) -> None:
    sub = subengine.App().subscription("billing", stream="orders")
    with pytest.raises(subengine.InvalidInput, match=r"cannot be called as handler\(event, conn\)"):
        sub.handler("OrderPlaced")(function)
    with pytest.raises(
        subengine.InvalidInput, match=r"cannot be called as handler\(events, conn\)"
    ):
        sub.batch_handler()(function)
    with pytest.raises(subengine.InvalidInput, match="must be callable"):
        sub.handler()("not a function")  # type: ignore[arg-type]
    assert (sub.handlers, sub.catch_all, sub.batch) == ({}, None, None)


@pytest.mark.parametrize(
    "function",
    [
        lambda event, conn: None,
        lambda *args: None,
        lambda event, conn, extra=1: None,
        functools.partial(lambda prefix, event, conn: None, "x"),
        print,
    ],
    ids=["two arguments", "varargs", "a default", "partial", "a builtin"],
)
def test_handlers_that_take_event_and_conn_are_accepted(function: Any) -> None:
    sub = subengine.App().subscription("billing", stream="orders")
    sub.handler("OrderPlaced")(function)
    assert sub.handlers == {"OrderPlaced": function}


def test_a_generator_handler_is_refused_when_registered() -> None:
    sub = subengine.App().subscription("billing", stream="orders")
    with pytest.raises(subengine.InvalidInput, match="is a generator function"):
        sub.handler()(generator_handler)
    with pytest.raises(subengine.InvalidInput, match="is a generator function"):
        sub.batch_handler()(generator_handler)  # type: ignore[arg-type]
    assert (sub.handlers, sub.catch_all, sub.batch) == ({}, None, None)


def test_a_name_is_declared_once_and_a_type_handled_once() -> None:
    app = subengine.App()
    sub = app.subscription("billing", stream="orders")
    with pytest.raises(subengine.InvalidInput, match="twice"):
        app.subscription("billing", stream="orders")
    sub.handler("A")(lambda event, conn: None)
    with pytest.raises(subengine.InvalidInput, match="already"):
        sub.handler("A")(lambda event, conn: None)


def _event(event_type: str, position: int) -> subengine.Event:
    now = datetime.now(UTC)
    return subengine.Event(
        id=None,  # type: ignore[arg-type]
        stream="orders",
        partition=0,
        position=position,
        key="k",
        key_version=position,
        type=event_type,
        data={},
        metadata={},
        occurred_at=now,
        recorded_at=now,
    )
