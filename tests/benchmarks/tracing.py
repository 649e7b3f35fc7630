"""What OpenTelemetry costs the producer and the relay (not part of the test suite).

    .venv/bin/python tests/benchmarks/tracing.py [--messages 20000]

Prints microseconds per message for the tracing code alone — `with_trace_context` at enqueue
(without OpenTelemetry installed, installed with no span active, inside a recording span) and the
relay's publish span (a fake publisher, the SDK with a batch processor and an exporter that drops
spans) — and, on the local PostgreSQL, enqueue rows/s with and without an active span.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from uuid import uuid4

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import relay
from relay.core import model, tracing
from tests.support import services
from tests.support.fakes import ScriptedPublisher

HEADERS = {"tenant": "acme", "kind": "order"}
BODY = b"x" * 1024
WITHOUT_OTEL = """
import sys, time
sys.modules["opentelemetry"] = None
from relay.core import tracing
headers, n = {"tenant": "acme", "kind": "order"}, %d
started = time.perf_counter()
for _ in range(n):
    tracing.with_trace_context(headers)
print((time.perf_counter() - started) / n * 1e6)
"""


class Dropped(SpanExporter):
    def export(self, spans: Sequence[object]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def per_call(n: int, work: Callable[[], object]) -> float:
    started = time.perf_counter()
    for _ in range(n):
        work()
    return (time.perf_counter() - started) / n * 1e6


def message(traceparent: str | None) -> model.OutboxMessage:
    return model.OutboxMessage(
        id=1,
        message_id=uuid4(),
        exchange="orders",
        routing_key="order.placed",
        body=BODY,
        headers={"traceparent": traceparent} if traceparent else {},
        properties={},
        ordering_key=None,
        created_at=datetime.now(UTC),
        attempts=1,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    n: int = parser.parse_args().messages
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)
    tracer = trace.get_tracer("bench")

    absent = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL % n],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    print(f"with_trace_context, OpenTelemetry not installed: {float(absent.stdout):.2f} µs")
    idle = per_call(n, lambda: tracing.with_trace_context(HEADERS))
    print(f"with_trace_context, installed, no span active:   {idle:.2f} µs")
    with tracer.start_as_current_span("producer") as span:
        active = per_call(n, lambda: tracing.with_trace_context(HEADERS))
        context = span.get_span_context()
    print(f"with_trace_context, inside a recording span:     {active:.2f} µs")

    traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-01"

    async def relay_side(header: str | None, wrapped: bool = True) -> float:
        publisher = ScriptedPublisher()
        if wrapped:
            publisher = tracing.traced(publisher, tracer_provider=provider)  # type: ignore[assignment]
        batch = [message(header) for _ in range(500)]
        started = time.perf_counter()
        for _ in range(n // 500):
            await publisher.publish(batch)
        return (time.perf_counter() - started) / (n // 500 * 500) * 1e6

    bare = asyncio.run(relay_side(None, wrapped=False))
    print(f"relay publish, the fake publisher unwrapped:      {bare:.2f} µs per message")
    plain = asyncio.run(relay_side(None))
    traced = asyncio.run(relay_side(traceparent))
    unsampled = asyncio.run(relay_side(traceparent[:-2] + "00"))
    print(f"relay publish wrapper, messages without context:  {plain:.2f} µs per message")
    print(f"relay publish wrapper, a span per traced message: {traced:.2f} µs per message")
    print(f"relay publish wrapper, producer's trace unsampled: {unsampled:.2f} µs per message")

    with (
        services.discover() as svc,
        svc.scratch_database("outbox_tracing") as url,
        psycopg.connect(url) as conn,
    ):

        def enqueue_rate(label: str) -> float:
            started = time.perf_counter()
            for start in range(0, n, 1000):
                for i in range(start, min(start + 1000, n)):
                    relay.enqueue(conn, "bench", f"k.{i}", BODY, headers=HEADERS)
                conn.commit()
            rate = n / (time.perf_counter() - started)
            print(f"enqueue, 1,000 per transaction, {label}: {rate:,.0f} rows/s")
            return rate

        enqueue_rate("no span")  # warm-up of the same size, so both runs find the same table
        without = enqueue_rate("no span")
        with tracer.start_as_current_span("producer"):
            within = enqueue_rate("inside a span")
    print(f"enqueue inside a span vs none: {within / without:.2f}x")
    provider.shutdown()


if __name__ == "__main__":
    main()
