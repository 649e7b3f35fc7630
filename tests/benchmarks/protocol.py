"""Protocol costs: what the guarantees of docs/decisions/0001–0003 cost per batch (not a test).

    .venv/bin/python tests/benchmarks/protocol.py [--rounds 30] [--batch 500]

In one scratch database, each figure the median of `--rounds` rounds:
- settle: archiving a claimed batch as one `settle(…)` call (migration 0013), against the
  statements relays ran before (archive_published, then _keys_settled, in one transaction);
  unkeyed, and keyed (100 keys);
- confirm: renewing a claimed batch's lease with `extend_leases … RETURNING id`, which a relay
  does before publishing a batch whose trust is short (a batch claimed ahead long ago);
- claim: a durable claim (it waits for the WAL flush, as every claim now does) against one that
  does not (as claims did with OUTBOX_SYNCHRONOUS_COMMIT=false);
- recheck: `release_stranded` with nothing queued, which every relay cycle now runs; and, for the
  option docs/decisions/0002 rejected, a sweep for gated rows whose predecessor is gone, over a
  hot key with `--gated` (100,000) rows waiting.
Services come from OUTBOX_TEST_DATABASE_URL (default: the local server).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from relay.postgres import migrate, sql
from relay.postgres.store import CHUNK
from tests.support import services

#: What relays ran to archive a batch before migration 0013 (relay/queries.sql at 21e837a).
OLD_ARCHIVE = """
WITH done AS (
    DELETE FROM outbox.messages
    WHERE id = ANY(%(ids)s::bigint[]) AND claim_id = %(claim_id)s
    RETURNING message_id, exchange, routing_key, body, headers, properties, ordering_key, seq,
              attempts, ambiguous, created_at, replays, replayed_at, replayed_from
)
INSERT INTO outbox.archive (message_id, exchange, routing_key, body, headers, properties,
                            ordering_key, seq, attempts, ambiguous, created_at, replays,
                            replayed_at, replayed_from)
SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key, seq,
       attempts, ambiguous, created_at, replays, replayed_at, replayed_from
FROM done
RETURNING message_id, ordering_key, seq, NULL::text AS reason
"""
OLD_KEYS_SETTLED = """
SELECT released, blocked
FROM outbox._keys_settled(%(keys)s::text[], %(seqs)s::bigint[], %(reasons)s::text[],
                          %(message_ids)s::uuid[])
"""


def fill(conn: psycopg.Connection[Any], n: int, keys: int) -> None:
    """`n` due messages of 100 bytes; keyed over `keys` keys when `keys` > 0 (each key's first
    message ungated, as enqueue would leave them)."""
    conn.execute(
        "INSERT INTO outbox.messages (message_id, exchange, routing_key, body, ordering_key, seq,"
        " gated)"
        " SELECT gen_random_uuid(), 'x', 'k', repeat('x', 100)::bytea,"
        "        CASE WHEN %(keys)s > 0 THEN 'key-' || (i %% %(keys)s) END,"
        "        CASE WHEN %(keys)s > 0 THEN i / %(keys)s + 1 END,"
        "        %(keys)s > 0 AND i >= %(keys)s"
        " FROM generate_series(0, %(n)s - 1) AS i",
        {"n": n, "keys": keys},
    )
    if keys:
        conn.execute(
            "INSERT INTO outbox.keys (ordering_key, last_seq, concurrency, min_interval)"
            " SELECT ordering_key, max(seq), 1, '0' FROM outbox.messages"
            " WHERE ordering_key IS NOT NULL GROUP BY ordering_key"
            " ON CONFLICT (ordering_key) DO UPDATE SET last_seq = excluded.last_seq"
        )
    conn.execute("ANALYZE outbox.messages")


def claim(conn: psycopg.Connection[Any], batch: int) -> tuple[uuid.UUID, list[Any]]:
    claim_id = uuid.uuid4()
    rows = conn.execute(
        sql.load().claim_batch,
        {
            "limit": batch,
            "max_bytes": 1 << 30,
            "lease": 60,
            "claim_id": claim_id,
            "claimed_by": "bench",
        },
    ).fetchall()
    return claim_id, rows


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return (time.perf_counter() - started) * 1000


def settle_new(conn: psycopg.Connection[Any], claim_id: uuid.UUID, ids: list[int]) -> None:
    empty: list[Any] = []
    conn.execute(
        sql.load().settle,
        {
            "claim_id": claim_id,
            "archive": ids,
            "dead": empty,
            "reasons": empty,
            "details": empty,
            "retry": empty,
            "delays": empty,
            "errors": empty,
            "refunds": empty,
            "ambiguous": empty,
            "resent": empty,
            "durable": True,
        },
    )


def settle_old(conn: psycopg.Connection[Any], claim_id: uuid.UUID, ids: list[int]) -> None:
    with conn.transaction():
        done = conn.execute(OLD_ARCHIVE, {"ids": ids, "claim_id": claim_id}).fetchall()
        keyed = [r for r in done if r[1] is not None]
        if keyed:
            conn.execute(
                OLD_KEYS_SETTLED,
                {
                    "keys": [r[1] for r in keyed],
                    "seqs": [r[2] for r in keyed],
                    "reasons": [None] * len(keyed),
                    "message_ids": [r[0] for r in keyed],
                },
            )


def measure(url: str, rounds: int, batch: int, gated: int) -> dict[str, float]:
    figures: dict[str, list[float]] = {}

    def note(name: str, work: Callable[[], object]) -> None:
        figures.setdefault(name, []).append(timed(work))

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.load().relay_session)
        for keys, label in ((0, "unkeyed"), (100, "keyed")):
            for _ in range(rounds):
                conn.execute("TRUNCATE outbox.messages, outbox.archive, outbox.keys")
                fill(conn, batch * 4, keys)
                for settle, how in ((settle_old, "statements"), (settle_new, "settle()")):
                    claim_id, rows = claim(conn, batch)
                    ids = [r[0] for r in rows]
                    name = f"settle {label} {len(ids)} rows, {how}"
                    note(name, functools.partial(settle, conn, claim_id, ids))
        for _ in range(rounds):
            conn.execute("TRUNCATE outbox.messages, outbox.archive, outbox.keys")
            fill(conn, batch * 3, 0)
            claim_id, rows = claim(conn, batch)
            params = {"ids": [r[0] for r in rows], "lease": 60, "claim_id": claim_id}
            extend = functools.partial(conn.execute, sql.load().extend_leases, params)
            note(f"confirm {batch} rows (extend ... RETURNING id)", extend)
            for setting in ("on", "off"):
                conn.execute("SELECT set_config('synchronous_commit', %s, false)", [setting])
                note(f"claim {batch} rows, synchronous_commit={setting}",
                     functools.partial(claim, conn, batch))  # fmt: skip
            conn.execute("SELECT set_config('synchronous_commit', 'on', false)")
            recheck = functools.partial(conn.execute, sql.load().release_stranded, {"limit": CHUNK})
            note("release_stranded, nothing queued", recheck)
        conn.execute("TRUNCATE outbox.messages, outbox.archive, outbox.keys")
        fill(conn, gated, 1)  # one hot key: its head and `gated` - 1 rows behind it
        for _ in range(rounds):
            sweep = functools.partial(conn.execute, SWEEP)
            note(f"sweep for stranded rows, {gated:,} gated", sweep)
    return {name: statistics.median(values) for name, values in figures.items()}


#: The rejected alternative to rechecks: look at every gated row for one whose predecessor is gone.
SWEEP = """
SELECT count(*) FROM outbox.messages m
WHERE m.gated
  AND NOT EXISTS (SELECT 1 FROM outbox.messages p
                  WHERE p.ordering_key = m.ordering_key AND p.seq = m.seq - 1)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--gated", type=int, default=100_000)
    args = parser.parse_args()
    with services.discover() as svc:
        name = f"outbox_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(svc.database_url, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        try:
            url = svc.with_database(name)
            migrate.migrate(url, "outbox")
            figures = measure(url, args.rounds, args.batch, args.gated)
        finally:
            with psycopg.connect(svc.database_url, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    width = max(len(name) for name in figures)
    for name, ms in figures.items():
        print(f"{name:<{width}}  {ms:8.2f} ms (median of {args.rounds})")


if __name__ == "__main__":
    main()
