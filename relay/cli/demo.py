"""`outbox-relay demo`: a producer and a consumer around a live relay, to watch messages flow."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any
from uuid import UUID

import aio_pika
import aio_pika.abc
import psycopg

from relay import app
from relay.core import config
from relay.postgres import migrate, producer

EXCHANGE = "outbox-relay.demo"


class _Tally:
    def __init__(self) -> None:
        self.committed: dict[UUID, float] = {}
        self.rolled_back: set[UUID] = set()
        self.received: list[UUID] = []
        self.all_in = asyncio.Event()


async def run(
    settings: config.Settings, *, count: int | None, interval: float, echo: Callable[[str], None]
) -> bool:
    """Enqueue sample orders (one transaction in four rolled back), relay them, print what a
    consumer receives; stop after `count` committed messages arrive (or on Ctrl-C / SIGTERM).
    Returns True when every committed message arrived once and no rolled-back one did."""
    database_url = settings.database_url.get_secret_value()
    echo(f"database {_where(database_url)}, schema {settings.db_schema!r} (OUTBOX_DATABASE_URL)")
    await asyncio.to_thread(
        functools.partial(migrate.migrate, pooled=settings.transaction_pooler),
        database_url,
        settings.db_schema,
    )
    tally = _Tally()
    stop = asyncio.Event()
    async with app.components(settings) as parts, _consumer(settings, tally, count, echo):
        echo(f"relay {settings.relay_name} is running; producing to exchange {EXCHANGE!r}")
        relaying = asyncio.create_task(parts.relay.run(stop))
        producing = asyncio.create_task(
            _produce(database_url, settings.db_schema, tally, count, interval, echo)
        )
        with _stop_on_signals(tally.all_in):
            await tally.all_in.wait()
        producing.cancel()
        stop.set()
        await asyncio.gather(relaying, producing, return_exceptions=True)
    return _summary(tally, echo)


def _where(database_url: str) -> str:
    """host:port/database of a PostgreSQL URL, without its user or password."""
    parts = psycopg.conninfo.conninfo_to_dict(database_url)
    host = parts.get("host") or "localhost"
    return f"{host}:{parts.get('port') or 5432}/{parts.get('dbname') or parts.get('user')}"


@contextlib.asynccontextmanager
async def _consumer(
    settings: config.Settings, tally: _Tally, count: int | None, echo: Callable[[str], None]
) -> Any:
    connection = await aio_pika.connect(
        settings.amqp_url.get_secret_value(), ssl_context=app.amqp_tls(settings)
    )
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            EXCHANGE, aio_pika.ExchangeType.TOPIC, auto_delete=True
        )
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(exchange, "#")

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                message_id = UUID(str(message.message_id))
                tally.received.append(message_id)
                sent = tally.committed.get(message_id)
                after = f"{(time.monotonic() - sent) * 1000:.1f} ms after commit" if sent else ""
                echo(
                    f"  ← received {message.routing_key} {message.body.decode()} "
                    f"attempt={message.headers.get('x-outbox-attempt')!s} {after}"
                )
                if count is not None and len(set(tally.received) & set(tally.committed)) >= count:
                    tally.all_in.set()

        await queue.consume(on_message)
        yield
    finally:
        await connection.close()


async def _produce(
    database_url: str,
    schema: str,
    tally: _Tally,
    count: int | None,
    interval: float,
    echo: Callable[[str], None],
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        for n in itertools.count(1):
            if count is not None and len(tally.committed) >= count:
                return
            order = {"order": n, "total_cents": 1000 + 17 * n}
            keep = n % 4 != 0
            async with conn.transaction(force_rollback=not keep):
                message_id = await producer.enqueue_async(
                    conn,
                    EXCHANGE,
                    f"order.{n}.created",
                    order,
                    schema=schema,
                    headers={"source": "outbox-relay demo"},
                )
            if keep:
                tally.committed[message_id] = time.monotonic()
                echo(f"→ committed  order {n} (message_id {message_id})")
            else:
                tally.rolled_back.add(message_id)
                echo(f"✗ rolled back order {n}: this one must never arrive")
            await asyncio.sleep(interval)


@contextlib.contextmanager
def _stop_on_signals(event: asyncio.Event) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, event.set)
    try:
        yield
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def _summary(tally: _Tally, echo: Callable[[str], None]) -> bool:
    received = set(tally.received)
    missing = set(tally.committed) - received
    leaked = received & tally.rolled_back
    duplicates = len(tally.received) - len(received)
    echo(
        f"committed {len(tally.committed)}, rolled back {len(tally.rolled_back)}, "
        f"received {len(tally.received)} ({duplicates} duplicates), "
        f"missing {len(missing)}, from rolled-back transactions {len(leaked)}"
    )
    return not missing and not leaked
