"""Trace context from append to handler (docs/tracing.md), with the real OpenTelemetry SDK
recording spans in memory: an append made inside a span carries its context in each
event's metadata, and a batch is handled inside a consumer span that continues it. Other
modules may run in this process: spans are recorded only where a test opens them, and
each test starts from an empty exporter."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from helpers import ROOT, count_json_decodes, stored_events
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import subengine
from subengine import NewEvent


class _WhileRecording(SimpleSpanProcessor):
    """Exports the spans that end while a test of this module runs, and drops the spans
    of other modules' tests run later in this process (their workers' batches)."""

    recording = False
    added = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.recording:
            super().on_end(span)


_EXPORTER = InMemorySpanExporter()
_PROCESSOR = _WhileRecording(_EXPORTER)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The spans this test records (the SDK is installed once per process: a tracer
    provider cannot be replaced)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if not _PROCESSOR.added:
        provider.add_span_processor(_PROCESSOR)
        _PROCESSOR.added = True
    _EXPORTER.clear()
    _PROCESSOR.recording = True
    yield _EXPORTER
    _PROCESSOR.recording = False
    _EXPORTER.clear()


def traceparent(span: trace.Span) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def batch_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == "process projector"]


def projector(engine: subengine.Engine, seen: list[str], fail: bool = False) -> Any:
    """Subscription 'projector' of stream 'orders' whose batch handler opens a span of
    its own per event (to show it is a child of the batch's span)."""
    app = subengine.App()
    sub = app.subscription("projector", stream="orders", batch_size=10)
    tracer = trace.get_tracer("test")

    @sub.batch_handler()
    def handle(events: Sequence[subengine.Event], conn: Any) -> None:
        for event in events:
            with tracer.start_as_current_span(f"apply {event.position}"):
                seen.append(event.key)
        if fail:
            raise ValueError("the projection is broken")

    subscription = app.subscriptions["projector"]
    engine.ensure_subscription(subscription)
    return subscription


def test_an_append_inside_a_span_carries_its_context_in_metadata(
    engine: subengine.Engine, spans: InMemorySpanExporter
) -> None:
    engine.create_stream("orders", partitions=1)
    tracer = trace.get_tracer("test")
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracer.start_as_current_span("checkout") as span:
        engine.append(
            "orders",
            [
                NewEvent("o-1", "Placed", {}),
                NewEvent("o-1", "Paid", {}, metadata={"user": "ann"}),
                NewEvent("o-1", "Sent", {}, metadata={"traceparent": own}),
            ],
        )
    engine.append("orders", [NewEvent("o-1", "Closed", {})])  # no span: nothing added
    metadata = [event.metadata for event in stored_events(engine.read("orders", 0))]
    assert metadata == [
        {"traceparent": traceparent(span)},
        {"user": "ann", "traceparent": traceparent(span)},
        {"traceparent": own},  # an event's own context is kept
        {},
    ]


def test_tracestate_goes_along(engine: subengine.Engine, spans: InMemorySpanExporter) -> None:
    engine.create_stream("orders", partitions=1)
    parent = trace.SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=trace.TraceFlags(1),
        trace_state=trace.TraceState([("vendor", "abc")]),
    )
    context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
    with trace.get_tracer("test").start_as_current_span("child", context=context) as span:
        engine.append("orders", [NewEvent("o-1", "Placed", {})])
    (event,) = stored_events(engine.read("orders", 0))
    assert event.metadata == {"traceparent": traceparent(span), "tracestate": "vendor=abc"}


def test_the_async_engine_carries_the_context_too(
    dsn: str, engine: subengine.Engine, spans: InMemorySpanExporter
) -> None:
    engine.create_stream("orders", partitions=1)

    async def append() -> str:
        async with subengine.AsyncEngine(dsn) as async_engine:
            with trace.get_tracer("test").start_as_current_span("checkout") as span:
                await async_engine.append("orders", [NewEvent("o-1", "Placed", {})])
        return traceparent(span)

    expected = asyncio.run(append())
    (event,) = stored_events(engine.read("orders", 0))
    assert event.metadata == {"traceparent": expected}


def test_a_batch_of_one_context_is_handled_in_a_child_of_it(
    engine: subengine.Engine, spans: InMemorySpanExporter
) -> None:
    engine.create_stream("orders", partitions=1)
    seen: list[str] = []
    subscription = projector(engine, seen)
    with trace.get_tracer("test").start_as_current_span("checkout") as append_span:
        engine.append("orders", [NewEvent("o-1", "Placed", {}), NewEvent("o-1", "Paid", {})])
    engine.process_batch(subscription, 0)
    assert seen == ["o-1", "o-1"]
    (batch,) = batch_spans(spans)
    producer = append_span.get_span_context()
    assert batch.kind == SpanKind.CONSUMER
    assert batch.parent is not None and batch.parent.span_id == producer.span_id
    assert batch.context.trace_id == producer.trace_id
    assert [link.context.span_id for link in batch.links] == [producer.span_id]
    assert dict(batch.attributes or {}) == {
        "messaging.system": "subengine",
        "messaging.operation.type": "process",
        "messaging.destination.name": "orders",
        "messaging.destination.partition.id": "0",
        "messaging.consumer.group.name": "projector",
        "messaging.batch.message_count": 2,
        "subengine.subscription": "projector",
        "subengine.stream": "orders",
        "subengine.partition": 0,
        "subengine.position.first": 1,
        "subengine.position.last": 2,
    }
    applied = [s for s in spans.get_finished_spans() if s.name.startswith("apply")]
    assert [s.parent.span_id if s.parent else None for s in applied] == [batch.context.span_id] * 2


def test_a_batch_of_several_contexts_links_each_once(
    engine: subengine.Engine, spans: InMemorySpanExporter
) -> None:
    engine.create_stream("orders", partitions=1)
    subscription = projector(engine, [])
    tracer = trace.get_tracer("test")
    producers = []
    for key in ("o-1", "o-2"):
        with tracer.start_as_current_span(f"checkout {key}") as span:
            engine.append("orders", [NewEvent(key, "Placed", {}), NewEvent(key, "Paid", {})])
        producers.append(span.get_span_context())
    engine.append("orders", [NewEvent("o-3", "Placed", {})])  # no context
    engine.process_batch(subscription, 0)
    (batch,) = batch_spans(spans)
    assert batch.parent is None  # a root: no one context is the batch's cause
    assert [(link.context.trace_id, link.context.span_id) for link in batch.links] == [
        (p.trace_id, p.span_id) for p in producers
    ]
    assert batch.attributes is not None and batch.attributes["messaging.batch.message_count"] == 5


def test_a_failing_batch_is_an_error_span(
    engine: subengine.Engine, spans: InMemorySpanExporter
) -> None:
    engine.create_stream("orders", partitions=1)
    subscription = projector(engine, [], fail=True)
    with trace.get_tracer("test").start_as_current_span("checkout"):
        engine.append("orders", [NewEvent("o-1", "Placed", {})])
    with pytest.raises(ValueError, match="the projection is broken"):
        engine.process_batch(subscription, 0)
    (batch,) = batch_spans(spans)
    assert batch.status.status_code == StatusCode.ERROR
    assert [event.name for event in batch.events] == ["exception"]


def test_events_without_context_make_a_span_without_links(
    engine: subengine.Engine, spans: InMemorySpanExporter
) -> None:
    engine.create_stream("orders", partitions=1)
    subscription = projector(engine, [])
    engine.append(
        "orders",
        [
            NewEvent("o-1", "Placed", {}),
            NewEvent("o-1", "Paid", {}, metadata={"traceparent": "not a traceparent"}),
            NewEvent("o-1", "Sent", {}, metadata={"traceparent": 7}),
            NewEvent("o-1", "Noted", {}, metadata={"traceparent": ["a"], "tracestate": {}}),
        ],
    )
    engine.process_batch(subscription, 0)
    (batch,) = batch_spans(spans)
    assert batch.parent is None and list(batch.links) == []


def test_a_batch_decodes_no_metadata_without_a_trace_context_while_tracing(
    engine: subengine.Engine, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.create_stream("orders", partitions=1)
    engine.append("orders", [NewEvent(f"o-{n}", "Placed", {}, metadata={"m": n}) for n in range(3)])
    app = subengine.App()
    sub = app.subscription("quiet", stream="orders")
    sub.handler()(lambda event, conn: None)
    engine.ensure_subscription(app.subscriptions["quiet"])
    decoded = count_json_decodes(monkeypatch)
    engine.process_batch(app.subscriptions["quiet"], 0)
    assert [s.name for s in spans.get_finished_spans()] == ["process quiet"]
    assert decoded == []  # the handler read neither data nor metadata; nor did the span


# A process that appends, handles batches with a worker and reads, and then names every
# module of OpenTelemetry it holds.
_UNTRACED = textwrap.dedent(
    """
    import asyncio, sys, threading
    {block}
    import subengine
    from subengine import NewEvent

    dsn = sys.argv[1]
    handled = []
    app = subengine.App()
    sub = app.subscription("untraced", stream="orders")
    sub.handler()(lambda event, conn: handled.append(event.position))
    with subengine.Engine(dsn) as engine:
        engine.create_stream("orders", partitions=2)
        engine.append("orders", [NewEvent(f"k{{i}}", "T", {{}}) for i in range(6)])

        async def append_async():
            async with subengine.AsyncEngine(dsn) as async_engine:
                await async_engine.append("orders", [NewEvent("k", "T", {{}})])

        asyncio.run(append_async())
        stop = threading.Event()
        worker = threading.Thread(target=app.run_worker, args=(engine,), kwargs={{"stop": stop}})
        worker.start()
        for _ in range(600):
            if len(handled) == 7:
                break
            stop.wait(0.05)
        stop.set()
        worker.join()
        assert len(handled) == 7, handled
        for partition in (0, 1):
            for event in engine.read("orders", partition):
                assert event.metadata == {{}}, event
    print(sorted(name for name in sys.modules if name.startswith("opentelemetry")))
    """
)

_BLOCKED = textwrap.dedent(
    """
    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "opentelemetry":
                raise ImportError(f"{name} is not installed here")
            return None
    sys.meta_path.insert(0, Blocked())
    """
)


@pytest.mark.parametrize("block", ["installed", "blocked"])
def test_a_process_that_does_not_trace_never_imports_opentelemetry(dsn: str, block: str) -> None:
    script = _UNTRACED.format(block=_BLOCKED if block == "blocked" else "")
    result = subprocess.run(
        [sys.executable, "-c", script, dsn],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_an_async_handler_runs_inside_the_batchs_span(
    engine: subengine.Engine, spans: InMemorySpanExporter
) -> None:
    # awaited on an event loop of another thread, it still sees the batch's span current
    engine.create_stream("orders", partitions=1)
    sub = subengine.Subscription("projector", "orders")
    tracer = trace.get_tracer("test")

    @sub.batch_handler()
    async def handle(events: Sequence[subengine.Event], conn: Any) -> None:
        with tracer.start_as_current_span("apply"):
            await asyncio.sleep(0)

    engine.ensure_subscription(sub)
    engine.append("orders", [NewEvent("o-1", "Placed", {})])
    engine.process_batch(sub, 0)
    (batch,) = batch_spans(spans)
    (applied,) = [s for s in spans.get_finished_spans() if s.name == "apply"]
    assert applied.parent is not None and applied.parent.span_id == batch.context.span_id
