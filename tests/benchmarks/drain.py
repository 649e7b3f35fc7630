"""Drain benchmark: how fast one `outbox-relay run` empties a backlog (not part of the test suite).

    .venv/bin/python tests/benchmarks/drain.py [--messages 20000] [--size 1024] [--replicas 1]
                                               [--keys 100]

It creates a scratch database, migrates it, enqueues the backlog in one transaction, declares a
durable queue bound to the exchange, then times `outbox-relay run --until-empty` from the moment
each relay is ready until the last one exits. Every message is persistent and confirmed.
Services come from OUTBOX_TEST_DATABASE_URL / OUTBOX_TEST_AMQP_URL (default: the local ones).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aio_pika
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support import services
from tests.support.processes import clean_env


async def declare(amqp_url: str, exchange: str, queue: str) -> None:
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        x = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
        q = await channel.declare_queue(queue, durable=True)
        await q.bind(x, "#")


async def delete(amqp_url: str, exchange: str, queue: str) -> int:
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        q = await channel.declare_queue(queue, durable=True, passive=True)
        depth = int(q.declaration_result.message_count or 0)
        await channel.queue_delete(queue)
        await channel.exchange_delete(exchange)
        return depth


def drain(database_url: str, amqp_url: str, replicas: int, batch_size: int) -> float:
    """Seconds from the moment every relay is ready until the last one reports an empty outbox
    (process start-up and exit are not part of the figure)."""
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_BATCH_SIZE=str(batch_size),
        OUTBOX_LOG_FORMAT="text",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "relay", "run", "--until-empty"],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(replicas)
    ]
    for proc in procs:  # start the clock when every relay is connected and ready
        if not _read_until(proc, " ready: schema="):
            raise SystemExit(f"relay failed to start (exit {proc.wait()})")
    started = time.perf_counter()
    for proc in procs:
        if not _read_until(proc, "no due rows left"):
            raise SystemExit(f"relay failed while draining (exit {proc.wait()})")
    elapsed = time.perf_counter() - started
    codes = [proc.wait() for proc in procs]
    if any(codes):
        raise SystemExit(f"relay exit codes {codes}")
    return elapsed


def _read_until(proc: subprocess.Popen[str], text: str) -> bool:
    assert proc.stderr is not None
    return any(text in line for line in proc.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=1024, help="body bytes")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument(
        "--keys",
        type=int,
        default=0,
        help="spread the messages over this many ordering keys (0: unkeyed)",
    )
    args = parser.parse_args()
    with services.discover() as svc, svc.scratch_database("outbox_bench") as url:
        exchange = queue = f"outbox-bench.{uuid.uuid4().hex[:8]}"
        asyncio.run(declare(svc.amqp_url, exchange, queue))
        with psycopg.connect(url) as conn:
            conn.execute(
                "SELECT outbox.enqueue(%s, 'bench.' || i, convert_to(repeat('x', %s), 'UTF8'),"
                " ordering_key => CASE WHEN %s > 0 THEN 'key-' || i %% %s END)"
                " FROM generate_series(1, %s) AS i",
                [exchange, args.size, args.keys, max(args.keys, 1), args.messages],
            )
            conn.commit()
        elapsed = drain(url, svc.amqp_url, args.replicas, args.batch_size)
        delivered = asyncio.run(delete(svc.amqp_url, exchange, queue))
        with psycopg.connect(url) as conn:
            archived = conn.execute("SELECT count(*) FROM outbox.archive").fetchone()
        print(
            f"drain: {args.messages} messages of {args.size} B"
            f"{f', {args.keys} keys' if args.keys else ''}, {args.replicas} replica(s), "
            f"batch {args.batch_size}: {elapsed:.2f}s = {args.messages / elapsed:,.0f} msg/s "
            f"(archived {archived[0] if archived else '?'}, in queue {delivered})"
        )


if __name__ == "__main__":
    main()
