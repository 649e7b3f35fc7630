"""A test's own RabbitMQ topology and consumer, under names no other test uses."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import aio_pika.abc


@dataclasses.dataclass
class Received:
    message_id: str
    routing_key: str
    body: bytes
    headers: dict[str, Any]
    properties: aio_pika.abc.AbstractIncomingMessage


class Broker:
    """Declares an exchange and a queue bound to it, and collects what arrives. Each operation
    opens its own connection, so a broker restart caused by a test does not break the helper."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.exchange = f"{prefix}.x"
        self.queue = f"{prefix}.q"

    @contextlib.asynccontextmanager
    async def channel(self) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
        async with await aio_pika.connect(self.url) as connection:
            yield await connection.channel()

    async def declare(
        self,
        *,
        binding: str = "#",
        durable: bool = False,
        queue_arguments: dict[str, Any] | None = None,
    ) -> None:
        async with self.channel() as channel:
            exchange = await channel.declare_exchange(
                self.exchange, aio_pika.ExchangeType.TOPIC, durable=durable
            )
            queue = await channel.declare_queue(
                self.queue, durable=durable, arguments=queue_arguments
            )
            await queue.bind(exchange, binding)

    async def delete(self) -> None:
        with contextlib.suppress(Exception):
            async with self.channel() as channel:
                await channel.queue_delete(self.queue)
                await channel.exchange_delete(self.exchange)

    async def collect(
        self, count: int, *, timeout: float = 30.0, settle: float = 0.0, distinct: bool = False
    ) -> list[Received]:
        """Consume until `count` messages arrived (`distinct`: messages with different ids), or
        AssertionError after `timeout`; then keep listening `settle` seconds more, so a test can
        see that nothing else arrives."""
        received: list[Received] = []
        ids: set[str] = set()
        enough = asyncio.Event()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await message.ack()
            message_id = str(message.message_id)
            received.append(
                Received(
                    message_id,
                    message.routing_key or "",
                    message.body,
                    dict(message.headers),
                    message,
                )
            )
            ids.add(message_id)
            if (len(ids) if distinct else len(received)) >= count:
                enough.set()

        async with self.channel() as channel:
            await channel.set_qos(prefetch_count=1000)
            queue = await channel.get_queue(self.queue, ensure=False)
            await queue.consume(on_message)
            if count:
                try:
                    await asyncio.wait_for(enough.wait(), timeout)
                except TimeoutError:
                    raise AssertionError(
                        f"received {len(received)} of {count} messages in {timeout:g}s"
                    ) from None
            if settle:
                # Deliberately a wait with no event: it checks that nothing more arrives.
                await asyncio.sleep(settle)
        return received


@contextlib.asynccontextmanager
async def broker(url: str) -> AsyncIterator[Broker]:
    b = Broker(url, f"outbox-test.{uuid.uuid4().hex[:10]}")
    try:
        yield b
    finally:
        await b.delete()
