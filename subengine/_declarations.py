"""Declarations: a `Subscription` (a named consumer of one stream, its start point,
policies and handlers) and the types of its parts.

    billing = subengine.Subscription("billing", "orders", start="beginning")

    @billing.handler("OrderPlaced")
    def placed(event, conn): ...

Handlers are dispatched by event type; a catch-all handler takes the other types, and
events of a type with no handler are skipped (their position still advances). A batch
handler instead receives, per partition of a batch, that partition's events in position
order.
Vocabulary: it knows nothing of connections' owners, the engine or the worker.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import psycopg

from subengine._errors import InvalidInput
from subengine._events import Event
from subengine._names import (
    BIGINT_MAX,
    INTEGER_MAX,
    shown_value,
    validate_stream_name,
    validate_type,
    validate_whole_number,
)

# The connection is the worker's, inside the batch's transaction; None for at-least-once
# subscriptions, whose handlers run outside it.
EventHandler = Callable[[Event, psycopg.Connection[Any] | None], object]
BatchHandler = Callable[[Sequence[Event], psycopg.Connection[Any] | None], object]
Start = Literal["beginning", "end"] | datetime | Mapping[int, int]
Ack = Literal["transactional", "at_least_once"]
OnError = Literal["stop", "dead_letter"]

ACK_MODES = ("transactional", "at_least_once")
ERROR_POLICIES = ("stop", "dead_letter")
MAX_BATCH_SIZE = 10_000


def start_to_json(start: Start) -> dict[str, Any]:
    """The stored form of a start point; raises InvalidInput for anything else."""
    if start in ("beginning", "end"):
        return {"kind": start}
    if isinstance(start, datetime):
        if start.tzinfo is None:
            raise InvalidInput("a start time must carry a time zone")
        return {"kind": "time", "time": start.isoformat()}
    if isinstance(start, Mapping):
        positions = {}
        for partition, position in start.items():
            validate_whole_number(partition, "a start partition", 0, INTEGER_MAX)
            validate_whole_number(
                position, f"the start position of partition {partition}", 0, BIGINT_MAX
            )
            positions[str(partition)] = position
        return {"kind": "positions", "positions": dict(sorted(positions.items()))}
    raise InvalidInput(
        f"start must be 'beginning', 'end', a datetime with a time zone or a mapping of "
        f"partition to position, not {shown_value(start)}"
    )


def describe_start(stored: Mapping[str, Any]) -> str:
    """A start point as people write it."""
    if stored["kind"] == "time":
        return str(stored["time"])
    if stored["kind"] == "positions":
        return json.dumps(stored["positions"])
    return str(stored["kind"])


@dataclass
class Subscription:
    """A named consumer of one stream: its start point, policies and handlers."""

    name: str
    stream: str
    start: Start = "beginning"
    batch_size: int = 100
    ack: Ack = "transactional"
    on_error: OnError = "stop"
    max_attempts: int = 5
    handlers: dict[str, EventHandler] = field(default_factory=dict)
    catch_all: EventHandler | None = None
    batch: BatchHandler | None = None

    def __post_init__(self) -> None:
        validate_stream_name(self.name)
        validate_stream_name(self.stream)
        self.start_json = start_to_json(self.start)
        validate_whole_number(self.batch_size, "batch_size", 1, MAX_BATCH_SIZE)
        validate_whole_number(self.max_attempts, "max_attempts", 1, 1000)
        if self.ack not in ACK_MODES:
            raise InvalidInput(
                f"ack must be one of {', '.join(ACK_MODES)}, not {shown_value(self.ack)}"
            )
        if self.on_error not in ERROR_POLICIES:
            raise InvalidInput(
                f"on_error must be one of {', '.join(ERROR_POLICIES)}, "
                f"not {shown_value(self.on_error)}"
            )

    def handler(
        self, event_type: str | None = None, *, payload: Callable[..., Any] | None = None
    ) -> Callable[[EventHandler], EventHandler]:
        """Register `handler(event, conn)` for one event type, or for all others.

        With `payload=SomeClass` the handler finds `SomeClass(**event.data)` in
        `event.payload` (`SomeClass.model_validate(event.data)` for pydantic models);
        data that does not fit fails the batch like a raising handler.
        """

        def register(function: EventHandler) -> EventHandler:
            _check_runnable(function, "(event, conn)", f"subscription {self.name!r}")
            registered = function if payload is None else _with_payload(function, payload)
            if self.batch is not None:
                raise InvalidInput(
                    f"subscription {self.name!r} has a batch handler: it takes every event"
                )
            if event_type is None:
                if self.catch_all is not None:
                    raise InvalidInput(f"subscription {self.name!r} has a catch-all handler")
                self.catch_all = registered
            else:
                validate_type(event_type)
                if event_type in self.handlers:
                    raise InvalidInput(
                        f"subscription {self.name!r} has a handler for {event_type!r} already"
                    )
                self.handlers[event_type] = registered
            return function

        return register

    def batch_handler(self) -> Callable[[BatchHandler], BatchHandler]:
        """Register `handler(events, conn)`, called once per batch with all its events."""

        def register(function: BatchHandler) -> BatchHandler:
            _check_runnable(function, "(events, conn)", f"subscription {self.name!r}")
            if self.handlers or self.catch_all is not None or self.batch is not None:
                raise InvalidInput(
                    f"subscription {self.name!r} has handlers already: a batch handler "
                    "must be its only one"
                )
            self.batch = function
            return function

        return register

    def handle(self, events: Sequence[Event], conn: psycopg.Connection[Any] | None) -> None:
        """Run the handlers for a batch, in position order (nothing for an empty one)."""
        if not events:
            return
        if self.batch is not None:
            _returned(self.batch, self.batch(events, conn))
            return
        for event in events:
            function = self.handlers.get(event.type, self.catch_all)
            if function is not None:
                _returned(function, function(event, conn))


def _check_runnable(function: object, arguments: str, owner: str) -> None:
    """Refuse, when it is registered, a handler the worker cannot run correctly
    (DESIGN.md invariant 8): not callable, an `async def`, or one that cannot be called
    with two positional arguments."""
    name = getattr(function, "__qualname__", None) or repr(function)
    if not callable(function):
        raise InvalidInput(f"{owner}: a handler must be callable, not {type(function).__name__}")
    if _is_async(function):
        raise InvalidInput(
            f"{owner}: handler {name} is an async function; the worker calls handlers "
            "synchronously in the batch's transaction, so it would never run: make it a "
            "plain def"
        )
    if inspect.isgeneratorfunction(function):
        raise InvalidInput(
            f"{owner}: handler {name} is a generator function (it yields), so calling it "
            "would never run its body: make it a plain def that returns"
        )
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins have none to read: trust them
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise InvalidInput(
            f"{owner}: handler {name}{signature} cannot be called as handler{arguments}"
        ) from None


def _is_async(function: object) -> bool:
    call = getattr(function, "__call__", None)  # noqa: B004 - an object with async __call__
    return (
        inspect.iscoroutinefunction(function)
        or inspect.isasyncgenfunction(function)
        or (not inspect.isroutine(function) and inspect.iscoroutinefunction(call))
    )


def _returned(function: object, value: object) -> None:
    """A handler that returned an awaitable or a generator did not do its work: fail the
    batch."""
    if inspect.isawaitable(value) or inspect.isgenerator(value):
        close = getattr(value, "close", None)
        if close is not None:
            close()  # no "never awaited" warning: the error says it
        name = getattr(function, "__qualname__", None) or repr(function)
        raise InvalidInput(
            f"handler {name} returned {type(value).__name__} instead of doing its work; "
            "the worker runs handlers synchronously"
        )


def _with_payload(function: EventHandler, payload: Callable[..., Any]) -> EventHandler:
    validate = getattr(payload, "model_validate", None)

    def typed(event: Event, conn: psycopg.Connection[Any] | None) -> object:
        if validate is not None:
            value = validate(event.data)
        elif isinstance(event.data, dict):
            value = payload(**event.data)
        else:
            raise InvalidInput(
                f"event {event.id} has {type(event.data).__name__} data; "
                f"{getattr(payload, '__name__', payload)} needs a JSON object"
            )
        return function(dataclasses.replace(event, payload=value), conn)

    return typed
