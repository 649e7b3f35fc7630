"""The README's FastStream consumer, run for real: a message the relay sent and a redelivered copy
of it reach a FastStream handler; the inbox applies the effect once and the consumer's span
continues the producer's trace."""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika
import psycopg
from faststream.rabbit import RabbitBroker, RabbitMessage, RabbitQueue
from opentelemetry import propagate, trace

import relay
from relay import app
from relay.postgres.consumer import Inbox, SequenceChecker
from tests.support.amqp import Broker
from tests.support.inprocess import query, settings_for
from tests.support.tracing import recorded_spans


async def test_a_faststream_handler_applies_a_redelivered_message_once(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    recorded_spans()
    await broker.declare(binding="pay.#")
    inbox, order = Inbox(), SequenceChecker()
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        await conn.execute("CREATE TABLE balance (amount int NOT NULL)")
        await conn.execute("INSERT INTO balance VALUES (0)")
        await inbox.create(conn)
        tracer = trace.get_tracer("shop")
        with tracer.start_as_current_span("pay") as producing:
            message_id = await relay.enqueue_async(
                conn, broker.exchange, "pay.in", {"amount": 10}, ordering_key="acct-1"
            )
        await conn.commit()
    async with app.components(settings_for(database_url, amqp_url)) as parts:
        await parts.relay.run_until_empty()
    first = await broker_copy(amqp_url, broker)  # what the relay sent, twice in the queue

    handled: list[tuple[bool, Any, int]] = []
    both = asyncio.Event()
    fs = RabbitBroker(amqp_url)

    @fs.subscriber(RabbitQueue(broker.queue, declare=False))
    async def handle(body: dict[str, Any], msg: RabbitMessage) -> None:
        problem = order.observe(msg.raw_message)
        context = propagate.extract(msg.raw_message.headers)
        with tracer.start_as_current_span("handle", context=context) as consuming:
            async with (
                await psycopg.AsyncConnection.connect(database_url) as conn,
                conn.transaction(),
                inbox.handle(conn, msg.raw_message) as fresh,
            ):
                if fresh:
                    await conn.execute("UPDATE balance SET amount = amount + %s", [body["amount"]])
        handled.append((fresh, problem, consuming.get_span_context().trace_id))
        if len(handled) == 2:
            both.set()

    async with fs:
        await fs.start()
        await asyncio.wait_for(both.wait(), 30)
    assert first == str(message_id)
    producer = producing.get_span_context().trace_id
    # FastStream may hand both copies to the handler at once: which one finishes first is the
    # broker's and the scheduler's choice. The inbox lets exactly one of them through.
    assert sorted(handled) == [(False, None, producer), (True, None, producer)]
    assert await query(database_url, "SELECT amount FROM balance") == [(10,)]


async def broker_copy(amqp_url: str, broker: Broker) -> str:
    """Re-publish a copy of the message waiting in the test's queue (a redelivery stand-in),
    leaving the original in place; returns its message_id."""
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        queue = await channel.get_queue(broker.queue, ensure=False)
        message = await queue.get(timeout=10)
        assert message is not None
        copy = aio_pika.Message(
            message.body,
            headers=message.headers,
            message_id=message.message_id,
            content_type=message.content_type,
        )
        await channel.default_exchange.publish(copy, routing_key=broker.queue)
        await message.nack(requeue=True)
        return str(message.message_id)
