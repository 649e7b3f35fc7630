"""Trace context across the outbox: the consumer's span continues the producer's trace, and the
relay's publish spans link to it (real PostgreSQL, relay and RabbitMQ; the SDK keeps spans in
memory)."""

from __future__ import annotations

import psycopg
from opentelemetry import propagate, trace

import relay
from relay import app
from tests.support.amqp import Broker
from tests.support.inprocess import settings_for
from tests.support.tracing import recorded_spans


async def test_the_consumer_continues_the_producers_trace(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    spans = recorded_spans()
    spans.clear()
    await broker.declare(binding="order.#")
    tracer = trace.get_tracer("shop")
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        with tracer.start_as_current_span("place order") as producing:
            one = await relay.enqueue_async(conn, broker.exchange, "order.placed", {"n": 1})
            many = await relay.enqueue_many_async(
                conn,
                [
                    relay.Message(broker.exchange, "order.paid", {"n": 2}, ordering_key="o-1"),
                    relay.Message(broker.exchange, "nowhere", {"n": 3}),  # unroutable
                ],
            )
        untraced = await relay.enqueue_async(conn, broker.exchange, "order.other", {"n": 4})
        await conn.commit()
    producer = producing.get_span_context()
    traced = {str(one), str(many[0])}

    async with app.components(settings_for(database_url, amqp_url)) as parts:
        await parts.relay.run_until_empty()
    received = {r.message_id: r for r in await broker.collect(3)}
    assert set(received) == {*traced, str(untraced)}

    for message_id, message in received.items():
        context = propagate.extract(message.headers)
        with tracer.start_as_current_span(
            "handle", context=context, kind=trace.SpanKind.CONSUMER
        ) as consuming:
            pass
        consumer = consuming.get_span_context()
        if message_id in traced:
            assert consumer.trace_id == producer.trace_id
            assert consuming.parent is not None  # type: ignore[attr-defined]
            assert consuming.parent.span_id == producer.span_id  # type: ignore[attr-defined]
        else:
            assert "traceparent" not in message.headers
            assert consumer.trace_id != producer.trace_id
            assert consuming.parent is None  # type: ignore[attr-defined]

    publishing = [s for s in spans.get_finished_spans() if s.name == f"publish {broker.exchange}"]
    by_id = {str((s.attributes or {})["messaging.message.id"]): s for s in publishing}
    assert set(by_id) == {*traced, str(many[1])}  # the untraced message has none
    for span in publishing:
        assert span.kind is trace.SpanKind.PRODUCER
        assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [
            (producer.trace_id, producer.span_id)
        ]
    unroutable = by_id[str(many[1])]
    assert unroutable.status.status_code is trace.StatusCode.ERROR
    assert (unroutable.attributes or {})["outbox.outcome"] == "returned"
    assert (by_id[str(many[0])].attributes or {})["outbox.ordering_key"] == "o-1"
