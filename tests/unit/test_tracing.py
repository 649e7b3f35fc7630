"""relay.core.tracing: trace context into headers at enqueue, and the linked publish spans."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from relay.core import model, tracing
from tests.support.fakes import ScriptedPublisher

Outcome = model.Outcome
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


def message(headers: dict[str, Any] | None = None, **fields: Any) -> model.OutboxMessage:
    values: dict[str, Any] = {
        "id": 1,
        "message_id": uuid4(),
        "exchange": "orders",
        "routing_key": "order.placed",
        "body": b"{}",
        "headers": headers or {},
        "properties": {},
        "ordering_key": None,
        "created_at": datetime.now(UTC),
        "attempts": 1,
    }
    return model.OutboxMessage(**(values | fields))


def test_the_active_span_is_added_to_the_headers(provider: TracerProvider) -> None:
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("place order") as span:
        headers = tracing.with_trace_context({"tenant": "acme"})
    context = span.get_span_context()
    ids = f"{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    assert headers == {"tenant": "acme", "traceparent": f"00-{ids}"}


def test_no_active_span_leaves_the_headers_alone() -> None:
    headers = {"tenant": "acme"}
    assert tracing.with_trace_context(headers) is headers


def test_a_traceparent_the_caller_set_wins(provider: TracerProvider) -> None:
    with provider.get_tracer("test").start_as_current_span("place order"):
        headers = tracing.with_trace_context({"traceparent": TRACEPARENT})
    assert headers == {"traceparent": TRACEPARENT}


@pytest.mark.parametrize(
    "headers",
    [{}, {"traceparent": "not a traceparent"}, {"traceparent": 42}, {"traceparent": ["x"]}],
)
def test_missing_or_malformed_context_reads_as_none(headers: dict[str, Any]) -> None:
    assert tracing.producer_span_context(headers) is None


async def test_each_traced_message_gets_a_publish_span_linked_to_its_producer(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    def script(m: model.OutboxMessage) -> model.PublishResult:
        if m.routing_key == "nowhere":
            return model.PublishResult(Outcome.RETURNED, "returned by the broker: 312 NO_ROUTE")
        return model.PublishResult(Outcome.ACKED, seconds=0.0005)

    traced = message({"traceparent": TRACEPARENT}, ordering_key="customer-7", attempts=2)
    untraced = message()
    returned = message({"traceparent": TRACEPARENT}, routing_key="nowhere")
    unsampled = message({"traceparent": TRACEPARENT[:-2] + "00"})  # the producer recorded nothing
    inner = ScriptedPublisher(script)
    inner.gate = asyncio.Event()  # the confirms come 10 ms after the publish
    asyncio.get_running_loop().call_later(0.01, inner.gate.set)
    publisher = tracing.traced(inner, tracer_provider=provider)

    results = await publisher.publish([traced, untraced, returned, unsampled])

    outcomes = [r.outcome for r in results]
    assert outcomes == [Outcome.ACKED, Outcome.ACKED, Outcome.RETURNED, Outcome.ACKED]
    spans: dict[str, ReadableSpan] = {
        str(span.attributes["messaging.message.id"]): span  # type: ignore[index]
        for span in exporter.get_finished_spans()
    }
    assert set(spans) == {str(traced.message_id), str(returned.message_id)}
    ok, failed = spans[str(traced.message_id)], spans[str(returned.message_id)]
    assert ok.name == "publish orders"
    assert ok.kind is trace.SpanKind.PRODUCER
    (link,) = ok.links
    assert link.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert link.context.span_id == 0xB7AD6B7169203331
    assert ok.context is not None
    assert ok.context.trace_id != link.context.trace_id  # a trace of its own, linked
    assert dict(ok.attributes or {}) == {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": "orders",
        "messaging.rabbitmq.destination.routing_key": "order.placed",
        "messaging.message.id": str(traced.message_id),
        "messaging.message.body.size": 2,
        "outbox.attempt": 2,
        "outbox.outcome": "acked",
        "outbox.ordering_key": "customer-7",
    }
    assert ok.start_time is not None
    assert ok.end_time is not None
    assert ok.end_time - ok.start_time == 500_000  # ends at its confirm, not the batch's end
    assert failed.end_time is not None
    assert failed.end_time - ok.start_time >= 10_000_000
    assert ok.status.status_code is trace.StatusCode.UNSET
    assert failed.status.status_code is trace.StatusCode.ERROR
    assert failed.status.description == "returned by the broker: 312 NO_ROUTE"
    assert failed.attributes is not None
    assert failed.attributes["outbox.outcome"] == "returned"


async def test_the_wrapper_passes_the_rest_of_the_port_through(provider: TracerProvider) -> None:
    inner = ScriptedPublisher()
    publisher = tracing.traced(inner, tracer_provider=provider)
    inner.down = 1
    with pytest.raises(Exception, match="simulated broker outage"):
        await publisher.connect()
    inner.blocked = True
    assert publisher.blocked
    inner.unblocked.set()
    await publisher.until_unblocked()
    await publisher.close()


def test_without_opentelemetry_nothing_changes_and_nothing_fails() -> None:
    """With the `otel` extra missing (its import fails), enqueue's headers and the publisher pass
    through untouched."""
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from relay.core import tracing\n"
        "from tests.support.fakes import ScriptedPublisher\n"
        "headers = {'traceparent': 'x'}\n"
        "publisher = ScriptedPublisher()\n"
        "assert not tracing.available()\n"
        "assert tracing.with_trace_context(headers) is headers\n"
        "assert tracing.producer_span_context(headers) is None\n"
        "assert tracing.traced(publisher) is publisher\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.stdout == "ok\n", result.stderr
