"""Producer throughput: `relay.enqueue` one call at a time against `relay.enqueue_many` (not part
of the test suite).

    .venv/bin/python tests/benchmarks/enqueue.py [--messages 20000] [--batch 1000]

In a scratch database on the local PostgreSQL (OUTBOX_TEST_DATABASE_URL), messages of 1 KiB, it
prints rows/s for: one enqueue per transaction; many enqueue calls in one transaction; and
enqueue_many in batches, each batch one transaction.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import relay
from tests.support import services

BODY = b"x" * 1024


def timed(label: str, n: int, work: Callable[[], None]) -> float:
    started = time.perf_counter()
    work()
    rate = n / (time.perf_counter() - started)
    print(f"{label}: {n:,} messages, {rate:,.0f} rows/s")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=1_000)
    args = parser.parse_args()
    n, size = args.messages, args.batch
    with (
        services.discover() as svc,
        svc.scratch_database("outbox_enqueue") as url,
        psycopg.connect(url) as conn,
    ):

        def one_per_transaction() -> None:
            for i in range(n):
                relay.enqueue(conn, "bench", f"k.{i}", BODY)
                conn.commit()

        def calls_in_one_transaction() -> None:
            for start in range(0, n, size):
                for i in range(start, min(start + size, n)):
                    relay.enqueue(conn, "bench", f"k.{i}", BODY)
                conn.commit()

        def batched() -> None:
            for start in range(0, n, size):
                relay.enqueue_many(
                    conn,
                    [
                        relay.Message("bench", f"k.{i}", BODY)
                        for i in range(start, min(start + size, n))
                    ],
                )
                conn.commit()

        single = timed("enqueue, one per transaction", n, one_per_transaction)
        calls = timed(f"enqueue, {size:,} calls per transaction", n, calls_in_one_transaction)
        many = timed(f"enqueue_many, {size:,} per call and transaction", n, batched)
    print(f"enqueue_many vs one per transaction: {many / single:.1f}x")
    print(f"enqueue_many vs {size:,} enqueue calls per transaction: {many / calls:.1f}x")


if __name__ == "__main__":
    main()
