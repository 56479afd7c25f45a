"""W3C trace context carried from an append to the handlers (docs/tracing.md).

OpenTelemetry is optional and never imported here on its own account. In an application's
process (appends, the worker) it is used only once something else loaded
`opentelemetry.trace`: no span can be current before that, so a process that does not
trace imports nothing and pays one dictionary look-up. The gateway, a process of its own
that only passes the context along, does so when OpenTelemetry is installed beside it.

An append puts the current span's `traceparent` (and `tracestate`) into each event's
metadata, unless the event brings its own. The worker runs each partition's batch
inside one consumer span, linked to every distinct context its events carry, and a
child of that context when there is just one.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

from subengine.model import _events

if TYPE_CHECKING:
    from subengine.model._events import Event

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# W3C Trace Context: version 00 has exactly these four fields; a later version may add
# more after them. Version ff, and all-zero trace or parent ids, are invalid.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
# tracestate: at most 32 list members; 512 characters is what every vendor must pass on
_TRACESTATE_LIMIT = 512
_VISIBLE_ASCII = re.compile(r"[\x20-\x7e]*")
# OpenTelemetry's default limit on a span's links
MAX_LINKS = 128


def _tracing_loaded() -> bool:
    return "opentelemetry.trace" in sys.modules


@cache
def tracing_installed() -> bool:
    """Whether OpenTelemetry is installed (found, not imported)."""
    try:
        return importlib.util.find_spec("opentelemetry") is not None
    except (ImportError, ValueError):  # blocked, or a module without a spec
        return False


def valid_traceparent(value: object) -> bool:
    """Whether `value` is a W3C traceparent a propagator would accept."""
    if not isinstance(value, str):
        return False
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return False
    version, trace_id, parent_id, _, rest = match.groups()
    return (
        version != "ff"
        and (version != "00" or rest is None)
        and trace_id != "0" * 32
        and parent_id != "0" * 16
    )


def valid_tracestate(value: object) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= _TRACESTATE_LIMIT
        and _VISIBLE_ASCII.fullmatch(value) is not None
    )


def carried_context(fields: Mapping[str, Any]) -> dict[str, str] | None:
    """The trace context `fields` (HTTP headers, an event's metadata) carry, as metadata
    keeps it, or None when they carry none that is valid; a tracestate that is not valid
    is left out, as a propagator would."""
    traceparent = fields.get(TRACEPARENT)
    if not isinstance(traceparent, str) or not valid_traceparent(traceparent):
        return None
    context: dict[str, str] = {TRACEPARENT: traceparent}
    tracestate = fields.get(TRACESTATE)
    if isinstance(tracestate, str) and valid_tracestate(tracestate):
        context[TRACESTATE] = tracestate
    return context


def current_context() -> dict[str, str] | None:
    """The current span's context as metadata keeps it, or None when no span is current
    (or the process does not trace)."""
    if not _tracing_loaded():
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier or None


def with_context(metadata: dict[str, Any] | None, context: Mapping[str, str]) -> dict[str, Any]:
    """`metadata` with `context` added, unless it carries a traceparent of its own."""
    if not metadata:
        return dict(context)
    if TRACEPARENT in metadata:
        return metadata
    return {**metadata, **context}


@contextmanager
def batch_span(
    subscription: str, stream: str, partition: int, events: Sequence[Event]
) -> Iterator[None]:
    """The span a partition's batch is handled in, current while the handlers run, when
    the process traces (else nothing at all)."""
    if not _tracing_loaded() or not events:
        yield
        return
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    # each distinct pair once, in order: the events of one append share theirs
    carried: dict[tuple[str, str | None], None] = {}
    for event in events:
        if _events.metadata_lacks(event, TRACEPARENT):
            continue  # no trace context: its metadata stays undecoded
        metadata = event.metadata
        if isinstance(metadata, dict) and isinstance(metadata.get(TRACEPARENT), str):
            state = metadata.get(TRACESTATE)
            carried[metadata[TRACEPARENT], state if isinstance(state, str) else None] = None
    links: dict[tuple[int, int], trace.SpanContext] = {}
    for traceparent, tracestate in carried:
        context = carried_context({TRACEPARENT: traceparent, TRACESTATE: tracestate})
        if context is None or len(links) >= MAX_LINKS:
            continue
        span_context = trace.get_current_span(propagator.extract(context)).get_span_context()
        if span_context.is_valid:
            links.setdefault((span_context.trace_id, span_context.span_id), span_context)
    parent = None
    if len(links) == 1:
        (only,) = links.values()
        parent = trace.set_span_in_context(trace.NonRecordingSpan(only))
    first, last = events[0].position, events[-1].position
    attributes: dict[str, str | int] = {
        "messaging.system": "subengine",
        "messaging.operation.type": "process",
        "messaging.destination.name": stream,
        "messaging.destination.partition.id": str(partition),
        "messaging.consumer.group.name": subscription,
        "messaging.batch.message_count": len(events),
        "subengine.subscription": subscription,
        "subengine.stream": stream,
        "subengine.partition": partition,
        "subengine.position.first": first,
        "subengine.position.last": last,
    }
    if len(events) == 1:
        attributes["messaging.message.id"] = str(events[0].id)
    tracer = trace.get_tracer("subengine")
    with tracer.start_as_current_span(
        f"process {subscription}",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        links=[trace.Link(span_context) for span_context in links.values()],
        attributes=attributes,
    ):
        yield
