"""Replay benchmark: how fast `dead list`, `count` and `replay` are on a big dead table (not part
of the test suite).

    .venv/bin/python tests/benchmarks/replay.py [--dead 200000]

It creates a scratch database with `--dead` dead rows, half of them `unroutable`, then times
listing 50 of those, counting them, and replaying all of them (batches of 500, one transaction
each). Services come from OUTBOX_TEST_DATABASE_URL (default: the local one).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from relay.core.filters import DeadFilter
from relay.postgres import admin
from tests.support import services


def fill(url: str, rows: int) -> None:
    with psycopg.connect(url) as conn:
        conn.execute("ALTER TABLE outbox.dead DISABLE TRIGGER USER")  # no WARNING per row
        conn.execute(
            "INSERT INTO outbox.dead (message_id, exchange, routing_key, body, headers,"
            " properties, attempts, reason, detail, created_at)"
            " SELECT gen_random_uuid(), 'orders', 'order.' || (i %% 100), '', '{}', '{}', 1,"
            " CASE WHEN i %% 2 = 0 THEN 'unroutable' ELSE 'rejected' END, '', now()"
            " FROM generate_series(1, %s) AS i",
            (rows,),
        )
        conn.execute("ALTER TABLE outbox.dead ENABLE TRIGGER USER")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE outbox.dead")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dead", type=int, default=200_000, help="dead rows")
    args = parser.parse_args()
    where = DeadFilter.build(reasons=["unroutable"])
    with services.discover() as svc, svc.scratch_database("outbox_bench_replay") as url:
        fill(url, args.dead)
        with admin.Admin.connect(url) as ops:
            started = time.perf_counter()
            ops.dead_list(where, 50)
            listed = time.perf_counter() - started
            started = time.perf_counter()
            count = ops.dead_count(where)
            counted = time.perf_counter() - started
            started = time.perf_counter()
            moved = ops.dead_replay(where)
            replayed = time.perf_counter() - started
    print(f"dead rows {args.dead:,}, of them unroutable {count:,}")
    print(f"list 50: {listed * 1000:.1f} ms   count: {counted * 1000:.1f} ms")
    print(f"replay: {moved:,} rows in {replayed:.1f}s = {moved / replayed:,.0f} rows/s")


if __name__ == "__main__":
    main()
