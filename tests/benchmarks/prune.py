"""Prune benchmark: does pruning the archive slow the live queue? (not part of the test suite)

    .venv/bin/python tests/benchmarks/prune.py [--archive 1000000] [--seconds 15] [--batch 5000]

It creates a scratch database, migrates it, and fills the archive with `--archive` rows published
30 days ago. Then a producer and a claimer run the relay's own cycle against it (enqueue 50
messages in one transaction, claim them, archive them), timing every claim query: first for
`--seconds` with nothing else running, then for as long as `outbox-relay archive prune
--older-than 7d` (the same API, same batch and pause) takes to delete the old rows. It prints the
claim latency percentiles of both phases, their ratio (the target is at most 2x), and what the
prune did. Services come from OUTBOX_TEST_DATABASE_URL (default: the local one).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import relay
from relay.core import model
from relay.postgres import admin
from relay.postgres.store import PgStore
from tests.support import services

PER_CYCLE = 50


def fill(url: str, rows: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for start in range(0, rows, 200_000):
            conn.execute(
                "INSERT INTO outbox.archive (message_id, exchange, routing_key, body, headers,"
                " properties, attempts, created_at, published_at)"
                " SELECT gen_random_uuid(), 'orders', 'order.created', convert_to(repeat('x', 200),"
                " 'UTF8'), '{}', '{}', 1, now() - interval '30 days', now() - interval '30 days'"
                " FROM generate_series(1, %s)",
                (min(200_000, rows - start),),
            )
        conn.execute("VACUUM ANALYZE outbox.archive")


async def cycles(url: str, until: threading.Event | float) -> list[float]:
    """Enqueue, claim (timed) and archive batches until `until` is set or that many seconds
    passed; the claim latencies in seconds."""
    store = await PgStore.open(url, "outbox", "bench", max_size=2)
    latencies: list[float] = []
    deadline = time.monotonic() + until if isinstance(until, float) else None
    try:
        async with await psycopg.AsyncConnection.connect(url) as producer:
            while True:
                if deadline is not None and time.monotonic() > deadline:
                    break
                if isinstance(until, threading.Event) and until.is_set():
                    break
                for _ in range(PER_CYCLE):
                    await relay.enqueue_async(producer, "orders", "order.created", b"x" * 200)
                await producer.commit()
                started = time.perf_counter()
                claim = await store.claim(model.Ask(PER_CYCLE, 30.0, 10))
                latencies.append(time.perf_counter() - started)
                ids = tuple(m.id for m in claim.messages)
                await store.settle(claim.claim_id, model.Settlement(archive=ids))
    finally:
        await store.close()
    return latencies


def percentiles(label: str, xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=100)
    figures = {"p50": q[49], "p95": q[94], "p99": q[98], "max": max(xs)}
    shown = "  ".join(f"{k} {v * 1000:7.2f} ms" for k, v in figures.items())
    print(f"{label:<16} {len(xs):6d} claims  {shown}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archive", type=int, default=1_000_000, help="old archived rows")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of the unloaded phase")
    parser.add_argument("--batch", type=int, default=1000, help="rows per prune transaction")
    parser.add_argument("--pause", type=float, default=0.05, help="seconds between batches")
    args = parser.parse_args()
    with services.discover() as svc, svc.scratch_database("outbox_bench_prune") as url:
        started = time.perf_counter()
        fill(url, args.archive)
        print(
            f"filled the archive with {args.archive:,} rows in {time.perf_counter() - started:.1f}s"
        )
        with admin.Admin.connect(url) as ops:
            size_before = ops.archive_stats().bytes
        quiet = asyncio.run(cycles(url, args.seconds))
        done = threading.Event()
        result: dict[str, float] = {}

        def prune() -> None:
            with admin.Admin.connect(url) as ops:
                began = time.perf_counter()
                deleted = ops.archive_prune(timedelta(days=7), batch=args.batch, pause=args.pause)
                result["deleted"] = float(deleted or 0)
                result["seconds"] = time.perf_counter() - began
            done.set()

        pruner = threading.Thread(target=prune)
        pruner.start()
        loaded = asyncio.run(cycles(url, done))
        pruner.join()
        with admin.Admin.connect(url) as ops:
            stats = ops.archive_stats(exact=True)
        print()
        a = percentiles("claim, unloaded", quiet)
        b = percentiles("claim, pruning", loaded)
        print()
        print(
            f"prune: {result['deleted']:,.0f} rows in {result['seconds']:.1f}s "
            f"({result['deleted'] / result['seconds']:,.0f} rows/s, batches of {args.batch}, "
            f"pause {args.pause:g}s); archive left {stats.exact_rows:,} rows, "
            f"{size_before / 2**20:,.0f} MiB before, {stats.bytes / 2**20:,.0f} MiB after "
            "(space is reused, not returned)"
        )
        print(
            f"ratio pruning/unloaded: p50 {b['p50'] / a['p50']:.2f}x  "
            f"p95 {b['p95'] / a['p95']:.2f}x  p99 {b['p99'] / a['p99']:.2f}x  (target <= 2x)"
        )


if __name__ == "__main__":
    main()
