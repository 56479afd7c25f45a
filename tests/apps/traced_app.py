"""The app of the worker tracing test (`--app traced_app:app`): an application that
traces, as docs/tracing.md shows, its SDK exporting each finished span as a line of JSON
to the file TRACED_APP_SPANS. Subscription `traced` of stream `orders` handles each
event inside a span of its own."""

import os
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import subengine


class FileExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self._path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self._path, "a", encoding="utf-8") as file:
            for span in spans:
                file.write(span.to_json(indent=None) + "\n")
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(FileExporter(os.environ["TRACED_APP_SPANS"])))
trace.set_tracer_provider(provider)
tracer = trace.get_tracer("traced_app")

app = subengine.App()
traced = app.subscription("traced", stream="orders")


@traced.handler()
def apply(event: subengine.Event, conn: Any) -> None:
    with tracer.start_as_current_span(f"apply {event.key}"):
        conn.execute("SELECT 1")
