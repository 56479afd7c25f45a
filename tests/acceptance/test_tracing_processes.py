"""Trace context across processes (docs/tracing.md): a `subengine worker` whose
application traces continues the trace of the append that stored the event; a gateway
stores an append request's `traceparent` header, shows it in reads, and sends each
delivery's context on to the webhook callback."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import web
from helpers import APPS, GatewayProcess, Receiver, start_subengine, wait_for
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

import subengine
from subengine import NewEvent

GOOD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
OTHER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def tracer() -> trace.Tracer:
    """A tracer whose spans are valid (the SDK's; installed once per process)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    return trace.get_tracer("test")


@pytest.fixture
def worker(cli_env: dict[str, str], tmp_path: Path) -> Iterator[Path]:
    """`subengine worker --app traced_app:app`; the file its spans are written to."""
    spans = tmp_path / "spans.jsonl"
    spans.touch()
    env = dict(cli_env, TRACED_APP_SPANS=str(spans), SUBENGINE_POLL_INTERVAL="0.5")
    with open(tmp_path / "worker.log", "wb") as log:
        process = start_subengine(
            "worker",
            "--app",
            "traced_app:app",
            cwd=APPS,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    yield spans
    process.kill()
    process.wait()


def finished(spans: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in spans.read_text().splitlines()]


def test_a_worker_process_continues_the_trace_of_the_append(
    engine: subengine.Engine, tracer: trace.Tracer, worker: Path
) -> None:
    engine.create_stream("orders", partitions=2)
    spans = worker
    with tracer.start_as_current_span("checkout") as checkout:
        engine.append("orders", [NewEvent("o-1", "Placed", {})])
    producer = checkout.get_span_context()

    def handled() -> bool:
        return any(span["name"] == "apply o-1" for span in finished(spans))

    wait_for(handled, "the worker's spans", timeout=60)
    by_name = {span["name"]: span for span in finished(spans)}
    batch, applied = by_name["process traced"], by_name["apply o-1"]
    assert batch["kind"] == "SpanKind.CONSUMER"
    assert batch["context"]["trace_id"] == f"0x{producer.trace_id:032x}"
    assert batch["parent_id"] == f"0x{producer.span_id:016x}"
    assert [link["context"]["span_id"] for link in batch["links"]] == [f"0x{producer.span_id:016x}"]
    assert batch["attributes"]["subengine.subscription"] == "traced"
    assert batch["attributes"]["subengine.stream"] == "orders"
    assert batch["attributes"]["subengine.position.first"] == 1
    assert applied["parent_id"] == batch["context"]["span_id"]


def append_over_http(gateway: GatewayProcess, events: list[Any], **headers: str) -> None:
    answer = web.post(
        f"{gateway.url}/v1/streams/orders/events", json=events, headers=headers, timeout=30
    )
    assert answer.status_code == 201, answer.text


def test_an_http_append_stores_the_request_context_and_reads_show_it(
    engine: subengine.Engine, gateway: GatewayProcess
) -> None:
    engine.create_stream("orders", partitions=1)
    append_over_http(
        gateway,
        [
            {"key": "o-1", "type": "Placed", "data": {}},
            {"key": "o-1", "type": "Paid", "data": {}, "metadata": {"traceparent": OTHER}},
        ],
        traceparent=GOOD,
        tracestate="shop=1",
    )
    # the general path (a literal backslash-u0000 in data sends it there) does the same
    append_over_http(
        gateway,
        [{"key": "o-1", "type": "Noted", "data": {"text": "\\u0000"}, "metadata": {"a": 1}}],
        traceparent=GOOD,
    )
    append_over_http(gateway, [{"key": "o-1", "type": "Sent", "data": {}}], traceparent="junk")
    page = web.get(f"{gateway.url}/v1/streams/orders/events?after=beginning", timeout=30)
    assert [event["metadata"] for event in page.json()["events"]] == [
        {"traceparent": GOOD, "tracestate": "shop=1"},
        {"traceparent": OTHER},  # its own
        {"a": 1, "traceparent": GOOD},
        {},  # a header that is no traceparent is ignored
    ]


def test_webhook_deliveries_carry_the_context_of_their_events(
    engine: subengine.Engine, hooks: GatewayProcess, receiver: Receiver
) -> None:
    engine.create_stream("orders", partitions=1)
    body = {"callback": receiver.url, "streams": ["orders"], "max_events": 1}
    answer = web.put(f"{hooks.url}/v1/webhooks/traced", json=body, timeout=30)
    assert answer.status_code == 202, answer.text
    wait_for(lambda: receiver.of_type("challenge") != [], "the consent")
    long_ago = datetime(1975, 1, 1, tzinfo=UTC)  # not a plain batch: the engine's batch sends it
    engine.append(
        "orders",
        [
            NewEvent("o-1", "Placed", {}, metadata={"traceparent": GOOD, "tracestate": "a=1"}),
            NewEvent("o-1", "Paid", {}, metadata={"traceparent": OTHER}, occurred_at=long_ago),
            NewEvent("o-1", "Sent", {}),
        ],
    )
    wait_for(lambda: len(receiver.of_type("events")) >= 3, "three deliveries", timeout=60)
    sent = {
        d.json()["through"]: (d.headers.get("traceparent"), d.headers.get("tracestate"))
        for d in receiver.of_type("events")
    }
    assert sent == {1: (GOOD, "a=1"), 2: (OTHER, None), 3: (None, None)}
