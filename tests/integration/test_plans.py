"""The ring's statements read what their work needs, whatever plan the session made of them
(migration 0024): each function is first called while the ring's partitions are empty and
analyzed so — as autovacuum leaves a segment after its TRUNCATE — so that its plans are made
then and kept for the session; then that segment fills with N settled rows, and the rows one
more call reads are counted (pg_stat_xact_user_tables, in the same session)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

#: Settled rows in the segment: a plan that reads a partition once per row reads ~N²/2.
N = 20_000
#: Rows the measured claim, settle or renewal works on.
BATCH = 100
SEGMENT = 131_072

Conn = psycopg.Connection[Any]


class Reads:
    """Rows this session read from the ring's partitions (scans and index fetches) since the last
    look: the backend's pending counts, which pg_stat_xact_user_tables shows until they are
    flushed, so each look takes the difference."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.last = self._now()

    def _now(self) -> dict[str, int]:
        rows = self.conn.execute(
            "SELECT relname, coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)"
            " FROM pg_stat_xact_user_tables"
            " WHERE schemaname = 'outbox' AND relname ~ '^(ready|claims|done)_[0-3]$'"
        ).fetchall()
        return {name: int(n) for name, n in rows}

    def since(self) -> int:
        now = self._now()
        read = sum(n - self.last.get(name, 0) for name, n in now.items())
        self.last = now
        return read


def enqueue(conn: Conn, n: int) -> None:
    conn.execute(
        "SELECT outbox.enqueue('x', 'k', convert_to(g::text, 'UTF8'))"
        " FROM generate_series(1, %s) AS g",
        [n],
    )


def claim(conn: Conn, n: int, verify: bool = False) -> tuple[uuid.UUID, list[int]]:
    """Commit n rows and claim them through a window that starts just before them, as a relay
    whose last window closed then."""
    (snapshot,) = conn.execute("SELECT pg_current_snapshot()::text").fetchone() or ("",)
    enqueue(conn, n)
    claim_id = uuid.uuid4()
    rows = conn.execute(
        "SELECT id FROM outbox.claim_batch(%s, 100000000, %s, 'p', 30, %s, NULL, '0', 0, true, %s)"
        " WHERE lane = 'ready'",
        [n, claim_id, snapshot, verify],
    ).fetchall()
    assert len(rows) == n
    return claim_id, [int(i) for (i,) in rows]


def settle(conn: Conn, claim_id: uuid.UUID, ids: list[int]) -> None:
    row = conn.execute(
        "SELECT archived FROM outbox.settle(%s, %s, '{}', '{}', '{}', '{}', '{}', '{}', '{}',"
        " '{}', '{}', true)",
        [claim_id, ids],
    ).fetchone()
    assert row == (len(ids),)


def a_claim(conn: Conn, reads: Reads) -> int:
    claim(conn, BATCH)
    return reads.since()


def a_verified_claim(conn: Conn, reads: Reads) -> int:
    claim(conn, BATCH, verify=True)
    return reads.since()


def a_settle(conn: Conn, reads: Reads) -> int:
    claim_id, ids = claim(conn, BATCH)
    reads.since()
    settle(conn, claim_id, ids)
    return reads.since()


def a_renewal(conn: Conn, reads: Reads) -> int:
    claim_id, ids = claim(conn, BATCH)
    reads.since()
    renewed = conn.execute("SELECT * FROM outbox.extend_leases(%s, %s, 30)", [claim_id, ids])
    assert len(renewed.fetchall()) == BATCH
    return reads.since()


def a_look_for_orphans(conn: Conn, reads: Reads) -> int:
    # Every claim of the fill ran out an hour ago, and every row is done: nothing to move, but
    # each expired claim is looked at once.
    row = conn.execute("SELECT looked FROM outbox.release_orphans(NULL, 100)").fetchone()
    assert row == (0,)
    return reads.since()


def the_gauges(conn: Conn, reads: Reads) -> int:
    conn.execute("SELECT * FROM outbox.lane_gauges()").fetchone()
    return reads.since()


def a_sweep(conn: Conn, reads: Reads) -> int:
    row = conn.execute(
        "SELECT * FROM outbox.sweep_stragglers(pg_current_snapshot()::text, 500)"
    ).fetchone()
    assert row == (0, 0)
    return reads.since()


def a_lane_start(conn: Conn, reads: Reads) -> int:
    row = conn.execute("SELECT id FROM outbox.lane_start()").fetchone()
    assert row == (None,)
    return reads.since()


#: Each operation, and the most rows it may read with N settled rows in each of two segments.
OPERATIONS: dict[str, tuple[Callable[[Conn, Reads], int], int]] = {
    # A claim of BATCH rows: each new row once, and each one's claims look-up.
    "claim": (a_claim, 4 * BATCH),
    "verified claim": (a_verified_claim, 6 * BATCH),
    "settle": (a_settle, 4 * BATCH),
    "renewal": (a_renewal, 4 * BATCH),
    # Set-based, or a walk over every expired or live claim: each row once, or twice.
    "look for orphans": (a_look_for_orphans, 6 * N),
    "gauges": (the_gauges, 6 * N),
    "straggler sweep": (a_sweep, 6 * N),
    "lane start": (a_lane_start, 6 * N),
}


@pytest.fixture
def conn(database_url: str) -> Iterator[Conn]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT outbox.use_fast_lane()")
        yield conn


def plan_on_empty_partitions(conn: Conn, behind: bool) -> None:
    """Every operation once, as a relay's session does while the ring turns: the segment behind
    (3) holds N rows (or, `behind` false, the whole ring is empty, as at a relay's start or after
    a quiet spell), the next ones' partitions (0 and 1) were analyzed empty, and the session's
    plans are made now — the claim's and the settle's on segment 0, the straggler sweep's and
    lane_start's once producers are in segment 1 and before the relay claimed there. The
    measured calls then work on segment 1."""
    if behind:
        conn.execute("SELECT setval('outbox.messages_id_seq', %s)", [3 * SEGMENT])
        fill(conn)
        # Autovacuum's work: the full segment vacuumed (its visibility map set).
        conn.execute("VACUUM outbox.ready_3, outbox.claims_3, outbox.done_3")
    conn.execute("SELECT setval('outbox.messages_id_seq', %s)", [4 * SEGMENT])
    conn.execute("ANALYZE outbox.ready, outbox.claims, outbox.done")
    claim_id, ids = claim(conn, 1, verify=True)
    conn.execute("SELECT * FROM outbox.extend_leases(%s, %s, 30)", [claim_id, ids]).fetchall()
    settle(conn, claim_id, ids)
    claim(conn, 1)
    conn.execute("SELECT * FROM outbox.release_orphans(NULL, 100)").fetchone()
    conn.execute("SELECT * FROM outbox.lane_gauges()").fetchone()
    conn.execute("SELECT setval('outbox.messages_id_seq', %s)", [5 * SEGMENT])
    enqueue(conn, N // 4)
    (passed,) = conn.execute("SELECT pg_current_snapshot()::text").fetchone() or ("",)
    conn.execute("SELECT * FROM outbox.sweep_stragglers(%s, 500)", [passed])
    conn.execute("SELECT * FROM outbox.lane_start()").fetchone()


def fill(conn: Conn) -> None:
    """N rows in the segment, each claimed (its lease ran out an hour ago) and done."""
    enqueue(conn, N)
    conn.execute(
        "INSERT INTO outbox.claims (seg, id, claim_id, claimed_by, until)"
        " SELECT r.seg, r.id, gen_random_uuid(), 'test', now() - interval '1 hour'"
        " FROM outbox.ready r ON CONFLICT DO NOTHING"
    )
    conn.execute(
        "INSERT INTO outbox.done (seg, id) SELECT r.seg, r.id FROM outbox.ready r"
        " ON CONFLICT DO NOTHING"
    )


@pytest.mark.parametrize("behind", [True, False], ids=["a segment behind", "an empty ring"])
@pytest.mark.parametrize("name", list(OPERATIONS))
def test_an_operation_planned_on_empty_partitions_reads_only_what_it_works_on(
    conn: Conn, name: str, behind: bool
) -> None:
    operation, most = OPERATIONS[name]
    plan_on_empty_partitions(conn, behind)
    fill(conn)
    reads = Reads(conn)
    read = operation(conn, reads)
    # Before 0024: a claim of 100 read ~40,000 rows (the whole of claims_0, materialized and
    # filtered per row); the sweep and lane_start ~N²/2.
    assert read <= most, f"{name}: read {read:,} rows, at most {most:,} expected ({N:,} in all)"


def test_a_reclaim_planned_on_an_empty_partition_reads_the_segment_once(conn: Conn) -> None:
    # A generic plan for every statement of the session (an operator's setting some poolers
    # want): reclaim_segment's checks are planned at their first run and kept.
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute("ANALYZE outbox.ready, outbox.claims, outbox.done")
    conn.execute("SELECT setval('outbox.messages_id_seq', %s)", [2 * SEGMENT])
    enqueue(conn, 1)
    conn.execute("SELECT setval('outbox.messages_id_seq', %s)", [4 * SEGMENT])
    # Segment 2 holds one row, not done: the check runs, planned on an empty done_2.
    assert conn.execute("SELECT outbox.reclaim_segment(2)").fetchone() == (False,)
    conn.execute("SELECT setval('outbox.messages_id_seq', %s)", [2 * SEGMENT + 1])
    fill(conn)
    conn.execute("SELECT setval('outbox.messages_id_seq', %s)", [4 * SEGMENT])
    reads = Reads(conn)
    assert conn.execute("SELECT outbox.reclaim_segment(2)").fetchone() == (True,)
    read = reads.since()
    assert conn.execute("SELECT count(*) FROM outbox.ready").fetchone() == (0,)
    # The segment's ready and done rows, read once by each of the two checks at most.
    assert read <= 4 * (N + 2), f"reclaim_segment read {read:,} rows ({N + 2:,} in the segment)"


def test_only_a_unique_index_can_answer_a_look_up_by_id(conn: Conn) -> None:
    # An index with id as a later column answers `id = …` by reading itself whole; a plan made on
    # an empty partition chose ready's (xid, id) index so for every look-up of the settle.
    later = conn.execute(
        "SELECT i.indexrelid::regclass::text FROM pg_index i"
        " JOIN pg_class c ON c.oid = i.indrelid"
        " JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'id'"
        " WHERE c.relnamespace = 'outbox'::regnamespace"
        "   AND c.relname ~ '^(ready|claims|done)(_[0-3])?$'"
        "   AND a.attnum = ANY((i.indkey::int2[])[1:])"
    ).fetchall()
    assert later == []
