"""The test process's OpenTelemetry SDK: one global tracer provider that keeps spans in memory."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_exporter: InMemorySpanExporter | None = None


def recorded_spans() -> InMemorySpanExporter:
    """The exporter behind the global provider (installed on first use, as an application's
    start-up would: OpenTelemetry lets a process set it once). Clear it before a test uses it."""
    global _exporter
    if _exporter is None:
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _exporter = exporter
    return _exporter
