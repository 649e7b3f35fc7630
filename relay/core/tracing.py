"""The OpenTelemetry adapter: trace context into a message's headers, and the relay's publish spans.

Everything here does nothing, at the cost of one `is None` test, when `opentelemetry-api` is
not installed (it is the `otel` extra). With it installed:

- `with_trace_context(headers)` (called by `relay.enqueue`) adds the active span's context as
  the configured propagators write it (W3C `traceparent`/`tracestate` by default) to the headers
  stored with the message, so they are published with it and the consumer's span continues the
  producer's trace across the outbox;
- `traced(publisher)` (called by the composition root) wraps a publisher so that each published
  message whose producer's span was sampled gets a PRODUCER span of its own, linked to that span
  (a link, not a parent: the relay publishes long after, in a trace of its own). The spans go to
  whatever tracer provider the process configured, e.g. `opentelemetry-instrument outbox-relay run`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relay.core import model, ports

try:
    from opentelemetry import propagate, trace
    from opentelemetry.propagators.textmap import Getter

    _INSTALLED = True
except ImportError:  # the `otel` extra is not installed: tracing is off
    _INSTALLED = False

#: The instrumentation scope the relay's spans carry.
SCOPE = "outbox-relay"


def available() -> bool:
    """Whether the OpenTelemetry API is installed."""
    return _INSTALLED


def with_trace_context(headers: Mapping[str, Any]) -> Mapping[str, Any]:
    """`headers` plus the active span's trace context; `headers` itself when OpenTelemetry is
    missing or no valid span is active. Names the caller set already are left as they are."""
    if not _INSTALLED or not trace.get_current_span().get_span_context().is_valid:
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    added = {name: value for name, value in carrier.items() if name not in headers}
    return {**headers, **added} if added else headers


def producer_span_context(headers: Mapping[str, Any]) -> Any:
    """The producer's SpanContext stored in a message's headers, or None (also when malformed)."""
    if not _INSTALLED or not headers or propagate.get_global_textmap().fields.isdisjoint(headers):
        return None
    context = propagate.extract(headers, getter=_TEXT_HEADERS)
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


if _INSTALLED:

    class _TextHeaders(Getter[Mapping[str, Any]]):
        """Reads propagation fields from stored headers, where a value may be any JSON type."""

        def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
            value = carrier.get(key)
            return [value] if isinstance(value, str) else None

        def keys(self, carrier: Mapping[str, Any]) -> list[str]:
            return [key for key, value in carrier.items() if isinstance(value, str)]

    _TEXT_HEADERS = _TextHeaders()


def traced(publisher: ports.Publisher, tracer_provider: Any = None) -> ports.Publisher:
    """`publisher`, with publish spans when OpenTelemetry is installed; else `publisher` itself.
    `tracer_provider` defaults to the global one (set by the SDK or `opentelemetry-instrument`)."""
    if not _INSTALLED:
        return publisher
    return TracedPublisher(publisher, trace.get_tracer(SCOPE, tracer_provider=tracer_provider))


class TracedPublisher:
    """ports.Publisher that records a span for each published message whose producer's span was
    sampled (an unsampled trace is not recorded anywhere, so a span linked to it would be noise)."""

    def __init__(self, inner: ports.Publisher, tracer: Any) -> None:
        self._inner = inner
        self._tracer = tracer

    @property
    def blocked(self) -> bool:
        return self._inner.blocked

    async def connect(self) -> None:
        await self._inner.connect()

    async def until_unblocked(self) -> None:
        await self._inner.until_unblocked()

    async def close(self) -> None:
        await self._inner.close()

    async def publish(
        self,
        messages: Sequence[model.OutboxMessage],
        abort: asyncio.Event | None = None,
        still_held: Callable[[], bool] | None = None,
    ) -> list[model.PublishResult]:
        started = time.time_ns()
        results = await self._inner.publish(messages, abort, still_held)
        ended = time.time_ns()
        for message, result in zip(messages, results, strict=True):
            parent = producer_span_context(message.headers)
            if parent is not None and parent.trace_flags.sampled:
                self._record(message, result, parent, started, ended)
        return results

    def _record(
        self,
        message: model.OutboxMessage,
        result: model.PublishResult,
        producer: Any,
        started: int,
        ended: int,
    ) -> None:
        """One span from the batch's start to this message's confirm (or the batch's end)."""
        exchange = message.exchange or "amq.default"
        attributes: dict[str, Any] = {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.destination.name": exchange,
            "messaging.rabbitmq.destination.routing_key": message.routing_key,
            "messaging.message.id": str(message.message_id),
            "messaging.message.body.size": len(message.body),
            "outbox.attempt": message.attempts,
            "outbox.outcome": result.outcome.value,
        }
        if message.ordering_key is not None:
            attributes["outbox.ordering_key"] = message.ordering_key
        span = self._tracer.start_span(
            f"publish {exchange}",
            kind=trace.SpanKind.PRODUCER,
            links=[trace.Link(producer)],
            attributes=attributes,
            start_time=started,
        )
        if result.outcome is not model.Outcome.ACKED:
            span.set_status(trace.Status(trace.StatusCode.ERROR, result.detail or None))
        end = ended
        if result.seconds is not None:
            end = min(ended, started + int(result.seconds * 1e9))
        span.end(end_time=end)
