"""Declarations: a `Subscription` (a named consumer of one stream, its start point,
policies and handlers) and the types of its parts.

    billing = subengine.Subscription("billing", "orders", start="beginning")

    @billing.handler("OrderPlaced")
    def placed(event, conn): ...

Handlers are dispatched by event type; a catch-all handler takes the other types, and
events of a type with no handler are skipped (their position still advances). A batch
handler instead receives, per partition of a batch, that partition's events in position
order. A subscription's handlers are all plain functions, called with a psycopg
`Connection`, or all `async def`, awaited with an `AsyncConnection` (docs/async-workers.md).
Vocabulary: it knows nothing of connections' owners, the engine or the worker.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, cast

import psycopg

from subengine.model._errors import InvalidInput
from subengine.model._events import Event, Tombstone
from subengine.model._names import (
    BIGINT_MAX,
    INTEGER_MAX,
    shown_value,
    validate_stream_name,
    validate_type,
    validate_whole_number,
)

_DURATION = re.compile(r"([0-9]{1,9})([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
MAX_EVENTS_LIMIT = 10**15


def parse_duration(text: object, what: str = "a duration") -> timedelta:
    """'45s', '30m', '12h', '7d' or '2w' as a timedelta; InvalidInput for anything else."""
    match = _DURATION.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or int(match.group(1)) == 0:
        raise InvalidInput(
            f"{what} must be a whole number above 0 and a unit (s, m, h, d or w), such as "
            f"7d or 12h, not {shown_value(text)}"
        )
    return timedelta(seconds=int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def describe_duration(duration: timedelta) -> str:
    """A duration in the largest unit that writes it whole ('7d', '90m')."""
    seconds = int(duration.total_seconds())
    for unit in ("d", "h", "m"):
        if seconds % _UNIT_SECONDS[unit] == 0:
            return f"{seconds // _UNIT_SECONDS[unit]}{unit}"
    return f"{seconds}s"


# Longer ages keep everything a stream can have held; far longer ones overflow
# PostgreSQL's timestamps when the pruner subtracts them from now.
MAX_AGE = timedelta(days=100 * 365)


def _age(value: object, what: str) -> timedelta | None:
    if value is None:
        return None
    age = parse_duration(value, what) if isinstance(value, str) else value
    if not isinstance(age, timedelta) or not timedelta(seconds=1) <= age <= MAX_AGE:
        raise InvalidInput(
            f"{what} must be from a second to 100 years (36500d), as a timedelta or like "
            f"'7d', not {shown_value(value)}"
        )
    return age


# A policy's limits, in the order they are stored and shown
_LIMITS = ("max_age", "max_events", "max_bytes", "hard_max_age", "hard_max_events")


@dataclass(frozen=True)
class Retention:
    """A stream's retention policy (DESIGN.md, "Retention and gaps").

    An event is removed when it is older than `max_age` (by the time it was recorded),
    when its partition holds more than `max_events` newer events, or when it and the
    newer events of its partition hold more than `max_bytes` bytes of data and metadata
    (as PostgreSQL writes them as JSON text): any limit removes it. With
    `keep_unprocessed`, an event a subscription of the stream has not handled yet is
    kept despite them, until it passes a hard limit (`hard_max_age`, `hard_max_events`,
    at least one required): a slow consumer loses nothing, a dead one cannot fill the
    disk. Ages are timedeltas or strings like '7d'.
    """

    max_age: timedelta | str | None = None
    max_events: int | None = None
    keep_unprocessed: bool = False
    hard_max_age: timedelta | str | None = None
    hard_max_events: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_age", "hard_max_age"):
            object.__setattr__(self, name, _age(getattr(self, name), name))
        for name in ("max_events", "hard_max_events", "max_bytes"):
            if getattr(self, name) is not None:
                validate_whole_number(getattr(self, name), name, 1, MAX_EVENTS_LIMIT)
        if not isinstance(self.keep_unprocessed, bool):
            raise InvalidInput("keep_unprocessed must be True or False")
        if self.max_age is None and self.max_events is None and self.max_bytes is None:
            raise InvalidInput("a retention policy needs max_age, max_events or max_bytes")
        hard = self.hard_max_age is not None or self.hard_max_events is not None
        if self.keep_unprocessed and not hard:
            raise InvalidInput(
                "keep_unprocessed needs a hard limit (hard_max_age, hard_max_events or "
                "both), so that a subscription that stopped cannot fill the disk"
            )
        if hard and not self.keep_unprocessed:
            raise InvalidInput(
                "hard_max_age and hard_max_events bound keep_unprocessed; without it, "
                "max_age and max_events are the limits"
            )
        for soft, limit in (("max_age", "hard_max_age"), ("max_events", "hard_max_events")):
            if None not in (getattr(self, soft), getattr(self, limit)) and (
                getattr(self, limit) < getattr(self, soft)
            ):
                raise InvalidInput(f"{limit} must not be below {soft}")

    def to_json(self) -> dict[str, Any]:
        """The stored form: ages in whole seconds, unset limits left out."""
        stored: dict[str, Any] = {}
        for name in _LIMITS:
            value = getattr(self, name)
            if isinstance(value, timedelta):
                value = int(value.total_seconds())
            if value is not None:
                stored[name] = value
        if self.keep_unprocessed:
            stored["keep_unprocessed"] = True
        return stored

    @classmethod
    def from_json(cls, stored: Mapping[str, Any]) -> Retention:
        """The policy `to_json` stored."""
        ages = {
            name: timedelta(seconds=stored[name])
            for name in ("max_age", "hard_max_age")
            if name in stored
        }
        return cls(
            max_events=stored.get("max_events"),
            hard_max_events=stored.get("hard_max_events"),
            max_bytes=stored.get("max_bytes"),
            keep_unprocessed=bool(stored.get("keep_unprocessed", False)),
            **ages,
        )

    def __str__(self) -> str:
        parts = []
        for name in _LIMITS:
            value = getattr(self, name)
            if value is not None:
                shown = describe_duration(value) if isinstance(value, timedelta) else value
                parts.append(f"{name.replace('_', '-')} {shown}")
        if self.keep_unprocessed:
            parts.append("keep-unprocessed")
        return ", ".join(parts)


# The connection is the worker's, inside the batch's transaction; None for at-least-once
# subscriptions, whose handlers run outside it. An async handler gets the AsyncConnection
# the batch runs on.
_Conn = psycopg.Connection[Any] | None
_AsyncConn = psycopg.AsyncConnection[Any] | None
EventHandler = Callable[[Event, _Conn], object] | Callable[[Event, _AsyncConn], Awaitable[object]]
BatchHandler = (
    Callable[[Sequence[Event], _Conn], object]
    | Callable[[Sequence[Event], _AsyncConn], Awaitable[object]]
)
Start = Literal["beginning", "end"] | datetime | Mapping[int, int]
Ack = Literal["transactional", "at_least_once"]
OnError = Literal["stop", "dead_letter", "park"]
OnGap = Literal["stop", "skip", "handler"]
GapHandler = (
    Callable[[Tombstone, _Conn], object] | Callable[[Tombstone, _AsyncConn], Awaitable[object]]
)

ACK_MODES = ("transactional", "at_least_once")
ERROR_POLICIES = ("stop", "dead_letter", "park")
GAP_POLICIES = ("stop", "skip", "handler")
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


def start_from_json(stored: Mapping[str, Any]) -> Start:
    """The start point of its stored form (`start_to_json`'s inverse)."""
    if stored["kind"] == "time":
        return datetime.fromisoformat(stored["time"])
    if stored["kind"] == "positions":
        return {
            int(partition): int(position) for partition, position in stored["positions"].items()
        }
    return "beginning" if stored["kind"] == "beginning" else "end"


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
    on_gap: OnGap = "stop"
    gap: GapHandler | None = None
    # whether its handlers are async def (None until one is registered)
    _async: bool | None = field(default=None, init=False, repr=False, compare=False)

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
        if self.on_gap not in ("stop", "skip") and not (
            self.on_gap == "handler" and self.gap is not None
        ):
            raise InvalidInput(
                f"on_gap must be 'stop' or 'skip' (or register a gap handler with "
                f"@subscription.gap_handler()), not {shown_value(self.on_gap)}"
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
            self._check_kind(_check_runnable(function, "(event, conn)", self._owner))
            registered = function if payload is None else _with_payload(function, payload)
            if self.batch is not None:
                raise InvalidInput(
                    f"subscription {self.name!r} has a batch handler: it takes every event"
                )
            if event_type is None:
                if self.catch_all is not None:
                    raise InvalidInput(f"subscription {self.name!r} has a catch-all handler")
                self.catch_all = registered
                self._async = _is_async(function)
            else:
                validate_type(event_type)
                if event_type in self.handlers:
                    raise InvalidInput(
                        f"subscription {self.name!r} has a handler for {event_type!r} already"
                    )
                self.handlers[event_type] = registered
            self._async = _is_async(function)
            return function

        return register

    def batch_handler(self) -> Callable[[BatchHandler], BatchHandler]:
        """Register `handler(events, conn)`, called once per batch with all its events."""

        def register(function: BatchHandler) -> BatchHandler:
            self._check_kind(_check_runnable(function, "(events, conn)", self._owner))
            if self.handlers or self.catch_all is not None or self.batch is not None:
                raise InvalidInput(
                    f"subscription {self.name!r} has handlers already: a batch handler "
                    "must be its only one"
                )
            self.batch = function
            self._async = _is_async(function)
            return function

        return register

    def gap_handler(self) -> Callable[[GapHandler], GapHandler]:
        """Register `handler(tombstone, conn)`, called when retention removed events this
        subscription had not handled (policy `on_gap='handler'`). It runs inside the
        transaction that moves the position past the gap and records it in the gaps
        table, so what it writes (a projection marking itself incomplete, say) happens
        exactly once; if it raises, nothing moves and the gap is tried again like a
        failed event."""

        def register(function: GapHandler) -> GapHandler:
            self._check_kind(_check_runnable(function, "(tombstone, conn)", self._owner))
            if self.gap is not None:
                raise InvalidInput(f"subscription {self.name!r} has a gap handler already")
            if self.on_gap == "skip":
                raise InvalidInput(
                    f"subscription {self.name!r} skips gaps (on_gap='skip'): a gap handler "
                    "would never run; leave on_gap at its default"
                )
            self.gap = function
            self.on_gap = "handler"
            self._async = _is_async(function)
            return function

        return register

    @property
    def is_async(self) -> bool:
        """Whether its handlers are `async def`: the worker then awaits them on its event
        loop, with the batch's transaction on an `AsyncConnection`."""
        return bool(self._async)

    @property
    def _owner(self) -> str:
        return f"subscription {self.name!r}"

    def _check_kind(self, is_async: bool) -> None:
        """Refuse a handler of the other kind: one batch's transaction runs on one
        connection, a `Connection` for plain handlers or an `AsyncConnection` for async
        ones, so a subscription cannot have both."""
        if self._async is None or self._async == is_async:
            return
        have, new = ("async def", "a plain def") if self._async else ("plain def", "an async def")
        raise InvalidInput(
            f"{self._owner} has {have} handlers; {new} handler cannot share their "
            f"batches' transaction: make them all async def or all plain def"
        )

    def _refuse_async(self) -> None:
        if self.is_async:
            raise InvalidInput(
                f"{self._owner} has async handlers, which only the worker can run "
                "(subengine worker, App.run_worker, AsyncWorker): this call runs handlers "
                "synchronously"
            )

    def handle_gap(self, gap: Tombstone, conn: psycopg.Connection[Any] | None) -> None:
        """Run the gap handler, if there is one, for a gap the subscription passes."""
        self._refuse_async()
        if self.gap is not None:
            _returned(self.gap, cast(Callable[..., object], self.gap)(gap, conn))

    def handle(self, events: Sequence[Event], conn: psycopg.Connection[Any] | None) -> None:
        """Run the handlers for a batch, in position order (nothing for an empty one)."""
        if not events:
            return
        self._refuse_async()
        if self.batch is not None:
            _returned(self.batch, cast(Callable[..., object], self.batch)(events, conn))
            return
        handlers, catch_all = self.handlers, self.catch_all
        for event in events:
            function = cast(Callable[..., object] | None, handlers.get(event.type, catch_all))
            if function is not None:
                value = function(event, conn)
                if value is not None:  # the common case, checked without a call
                    _returned(function, value)

    async def handle_gap_async(
        self, gap: Tombstone, conn: psycopg.AsyncConnection[Any] | None
    ) -> None:
        """`handle_gap` for async handlers: awaited with the batch's AsyncConnection."""
        if self.gap is not None:
            await _awaited(self.gap, gap, conn)

    async def handle_async(
        self, events: Sequence[Event], conn: psycopg.AsyncConnection[Any] | None
    ) -> None:
        """`handle` for async handlers: each awaited in turn, in position order."""
        if not events:
            return
        if self.batch is not None:
            await _awaited(self.batch, events, conn)
            return
        handlers, catch_all = self.handlers, self.catch_all
        for event in events:
            function = handlers.get(event.type, catch_all)
            if function is not None:
                await _awaited(function, event, conn)


async def _awaited(function: object, *arguments: Any) -> None:
    """Await an async handler; one that gave back no awaitable (a plain function behind
    an object that only looked async) fails the batch rather than pass it unhandled."""
    value = cast(Callable[..., object], function)(*arguments)
    if not inspect.isawaitable(value):
        name = getattr(function, "__qualname__", None) or repr(function)
        raise InvalidInput(
            f"async handler {name} returned {type(value).__name__}, not an awaitable"
        )
    _returned(function, await value)


def _check_runnable(function: object, arguments: str, owner: str) -> bool:
    """Refuse, when it is registered, a handler the worker cannot run correctly
    (DESIGN.md invariant 8): not callable, a generator (sync or async, its body would
    never run), or one that cannot be called with two positional arguments. Whether it is
    async (awaited by the worker)."""
    name = getattr(function, "__qualname__", None) or repr(function)
    if not callable(function):
        raise InvalidInput(f"{owner}: a handler must be callable, not {type(function).__name__}")
    if inspect.isasyncgenfunction(function):
        raise InvalidInput(
            f"{owner}: handler {name} is an async generator function (it yields), so "
            "awaiting it would never run its body: make it an async def that returns"
        )
    if inspect.isgeneratorfunction(function):
        raise InvalidInput(
            f"{owner}: handler {name} is a generator function (it yields), so calling it "
            "would never run its body: make it a plain def that returns"
        )
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins have none to read: trust them
        return _is_async(function)
    try:
        signature.bind(None, None)
    except TypeError:
        raise InvalidInput(
            f"{owner}: handler {name}{signature} cannot be called as handler{arguments}"
        ) from None
    return _is_async(function)


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
            "the worker calls a plain def handler without awaiting it: make it an async def"
        )


def _with_payload(function: EventHandler, payload: Callable[..., Any]) -> EventHandler:
    validate = getattr(payload, "model_validate", None)
    call = cast(Callable[..., Any], function)

    def typed_event(event: Event) -> Event:
        if validate is not None:
            value = validate(event.data)
        elif isinstance(event.data, dict):
            value = payload(**event.data)
        else:
            raise InvalidInput(
                f"event {event.id} has {type(event.data).__name__} data; "
                f"{getattr(payload, '__name__', payload)} needs a JSON object"
            )
        return dataclasses.replace(event, payload=value)

    if _is_async(function):

        async def typed_async(event: Event, conn: psycopg.AsyncConnection[Any] | None) -> object:
            return await call(typed_event(event), conn)

        return typed_async

    def typed(event: Event, conn: psycopg.Connection[Any] | None) -> object:
        return call(typed_event(event), conn)

    return typed
