"""What one claim and one settle cost per lane, and whether the ready lane's stay flat as it fills.

    .venv/bin/python tests/benchmarks/lane_calls.py [--cycles 3000] [--batch 1] [--fill 120000]

No broker and no relay: one connection commits `--batch` messages, a second claims them with the
relay's own claim_batch statement and settles them as archived with its settle statement, one
cycle after the other, timing each call as the relay sees it (round trip and commit included).
First with the ready lane off (every message in `messages`, the slow lane, as before migration
0015), then with it on: a warm-up on an empty ring (the plans the connection caches are made
then), the measured cycles, then `--fill` settled rows written into the segment the next ids go
to — as a ring looks a minute into heavy traffic, with autovacuum off and its partitions never
analyzed — and the same cycles again. A plan that reads the ring instead of looking rows up by
key shows as the second ready figure growing with `--fill`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from relay.core import model
from relay.postgres import rows, sql
from tests.support import services

SEGMENT = 131072  # ids per segment of the ring (sql/0015_ready_lane.sql, _seg)


class Cycle:
    """Enqueue, claim and settle on two connections, carrying the claim's window along."""

    def __init__(self, url: str, batch: int) -> None:
        self.queries = sql.load("outbox")
        self.producer = psycopg.connect(url, autocommit=True)
        self.relay = psycopg.connect(url, autocommit=True)
        self.batch = batch
        self.window: dict[str, Any] = {"prev": "1:1:", "hi": None, "xid": "0", "cursor": 0}
        self.ready_first = False

    def run(self, cycles: int) -> tuple[list[float], list[float]]:
        claims: list[float] = []
        settles: list[float] = []
        for _ in range(cycles):
            with self.producer.transaction():
                for _ in range(self.batch):
                    self.producer.execute(
                        "SELECT outbox.enqueue('bench', 'calls', %s::bytea)", (b"x" * 100,)
                    )
            claim_id = uuid.uuid4()
            started = time.perf_counter()
            ids = self._claim(claim_id)
            claimed = time.perf_counter()
            self._settle(claim_id, ids)
            claims.append(claimed - started)
            settles.append(time.perf_counter() - claimed)
        return claims, settles

    def _claim(self, claim_id: uuid.UUID) -> list[int]:
        self.ready_first = not self.ready_first
        cur = self.relay.cursor(row_factory=namedtuple_row)
        params = {
            "limit": 500,
            "max_bytes": 10_000_000,
            "claim_id": claim_id,
            "claimed_by": "lane_calls",
            "lease": 30.0,
            "ready_first": self.ready_first,
            "verify": False,
            **self.window,
        }
        cur.execute(self.queries.claim_batch, params)
        rows: list[Any] = cur.fetchall()
        trailer = rows.pop()
        if trailer.window_closed:
            self.window = {"prev": trailer.window_hi, "hi": None, "xid": "0", "cursor": 0}
        else:
            self.window = {
                **self.window,
                "hi": trailer.window_hi,
                "xid": str(trailer.window_xid),
                "cursor": trailer.window_id,
            }
        if len(rows) != self.batch:
            raise SystemExit(f"claimed {len(rows)} rows, not {self.batch}")
        return [row.id for row in rows]

    def _settle(self, claim_id: uuid.UUID, ids: list[int]) -> None:
        # The relay's own parameters for a settle that archives them all.
        params = rows.settle_params(claim_id, model.Settlement(archive=tuple(ids)), True)
        archived = self.relay.execute(self.queries.settle, params).fetchone()
        if archived is None or archived[0] != len(ids):
            raise SystemExit(f"settled {archived}, not {len(ids)}")


def fill(url: str, rows: int, reserve: int) -> int:
    """Write up to `rows` settled ready rows into the segment the next ids go to, leaving `reserve`
    ids of it for the cycles that follow, and move the id sequence past them (as the superuser:
    the relay's functions are not how these rows are made). Returns how many it wrote."""
    with psycopg.connect(url, autocommit=True) as conn:
        start = conn.execute("SELECT last_value + 1 FROM outbox.messages_id_seq").fetchone()
        assert start is not None
        first = start[0]
        rows = min(rows, SEGMENT - first % SEGMENT - reserve)
        if rows < 1:
            raise SystemExit(f"no room left in the segment of id {first}: fewer --cycles")
        span = {"first": first, "last": first + rows - 1}
        conn.execute(
            "INSERT INTO outbox.ready (seg, id, message_id, exchange, routing_key, body, headers,"
            " properties, created_at)"
            " SELECT outbox._seg(g), g, gen_random_uuid(), 'bench', 'calls', '\\x00'::bytea,"
            " '{}', '{}', now() FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g",
            span,
        )
        conn.execute(
            "INSERT INTO outbox.claims (seg, id, claim_id, claimed_by, until)"
            " SELECT outbox._seg(g), g, gen_random_uuid(), 'fill', now()"
            " FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g",
            span,
        )
        conn.execute(
            "INSERT INTO outbox.done (seg, id) SELECT outbox._seg(g), g"
            " FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g",
            span,
        )
        conn.execute("SELECT setval('outbox.messages_id_seq', %(last)s::bigint)", span)
        return rows


def report(label: str, claims: list[float], settles: list[float]) -> tuple[float, float]:
    def cut(xs: list[float]) -> list[float]:
        return sorted(xs[len(xs) // 10 :])  # the first tenth warms caches up

    c, s = cut(claims), cut(settles)
    p50c, p50s = statistics.median(c) * 1000, statistics.median(s) * 1000
    print(
        f"{label}: claim p50 {p50c:.3f} ms, p95 {c[int(len(c) * 0.95)] * 1000:.3f} ms; "
        f"settle p50 {p50s:.3f} ms, p95 {s[int(len(s) * 0.95)] * 1000:.3f} ms"
    )
    return p50c, p50s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--fill", type=int, default=120_000)
    args = parser.parse_args()
    with services.discover() as found:
        with found.scratch_database("outbox_calls") as url:
            slow = report(
                f"slow lane, {args.batch} per claim", *Cycle(url, args.batch).run(args.cycles)
            )
        with found.scratch_database("outbox_calls") as url:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SELECT outbox.use_fast_lane()")
            cycle = Cycle(url, args.batch)
            cycle.run(200)
            empty = report(
                f"ready lane, {args.batch} per claim, ring empty", *cycle.run(args.cycles)
            )
            filled = fill(url, args.fill, args.cycles * args.batch + 1000)
            full = report(
                f"ready lane, {args.batch} per claim, {filled:,} rows in the segment",
                *cycle.run(args.cycles),
            )
    print(
        f"ready / slow: claim {empty[0] / slow[0]:.2f}×, settle {empty[1] / slow[1]:.2f}×; "
        f"filled / empty: claim {full[0] / empty[0]:.2f}×, settle {full[1] / empty[1]:.2f}×"
    )


if __name__ == "__main__":
    main()
