"""What a pinned vacuum horizon costs a claim (docs/decisions/0004): every row settled since the
pin leaves dead index entries that no scan can skip until vacuum runs, so a claim that starts from
the beginning reads all of them. A relay's claim starts at its cursor, less a second: it reads
the dead rows of that second and nothing older, however long the pin. What one claim reads is
counted as the index entries its scans returned, dead or alive (pg_stat_user_indexes, flushed
after the claim)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest

from relay.core import model
from relay.postgres import sql
from relay.postgres.store import PgStore
from tests.support.inprocess import query
from tests.support.wait import until_async

#: Rows settled behind the cursor while the horizon is pinned.
N = 20_000

Conn = psycopg.Connection[Any]


@pytest.fixture
def pinned(database_url: str) -> Iterator[None]:
    """A session idle in a transaction that holds an xid: vacuum can remove nothing after it."""
    with psycopg.connect(database_url) as pin:
        pin.execute("SELECT pg_current_xact_id()")
        yield


def claim(
    conn: Conn, limit: int, due_from: tuple[datetime, int] | None
) -> tuple[list[int], tuple[datetime, int], int]:
    """One claim from `due_from` (None: from the start): its ids, where the next one starts,
    and how many rows of messages it read."""
    before = _reads(conn)
    row = conn.execute(
        "SELECT ids, due_at, due_id FROM outbox.claim(ROW(gen_random_uuid(), 'plans', 30, %s,"
        " 67108864, 10, %s, %s, NULL, NULL)::outbox.claim_request)",
        [limit, *(due_from or (None, None))],
    ).fetchone()
    read = _reads(conn) - before
    assert row is not None
    return [int(i) for i in row[0]], (row[1], row[2]), read


def settle(conn: Conn, ids: list[int]) -> None:
    conn.execute(
        "SELECT outbox.settle((SELECT claim_id FROM outbox.messages WHERE id = %s), %s,"
        " array_fill('archive'::text, ARRAY[%s]), NULL, NULL, NULL, '{}', false, NULL)",
        [ids[0], ids, len(ids)],
    )


def _reads(conn: Conn) -> int:
    """Index entries read from messages' indexes so far, by every session: this session's
    pending counts are flushed first (the statement before this one ended its transaction)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SET stats_fetch_consistency = none")
    row = conn.execute(
        "SELECT sum(idx_tup_read) FROM pg_stat_user_indexes"
        " WHERE relid = 'outbox.messages'::regclass"
    ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


# Slow (out of the fast tier): it leaves thousands of dead rows behind the cursor, as a pinned
# horizon does.
@pytest.mark.slow
def test_a_claim_reads_none_of_the_dead_rows_behind_its_cursor(
    database_url: str, pinned: None
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        # N rows that went through while the horizon was pinned, placed a minute back: older
        # than any claim's look-back.
        conn.execute(
            "SELECT outbox.enqueue('x', 'k', '',"
            " available_at => clock_timestamp() - interval '1 minute')"
            " FROM generate_series(1, %s)",
            [N],
        )
        ids, cursor, _ = claim(conn, N, None)
        assert len(ids) == N
        settle(conn, ids)
        conn.execute("SELECT outbox.enqueue('x', 'k', '') FROM generate_series(1, 100)")
        fresh, _, read = claim(conn, 100, cursor)
        assert len(fresh) == 100
        # From the start, the same claim would wade through every dead row.
        conn.execute("SELECT outbox.enqueue('x', 'k', '') FROM generate_series(1, 100)")
        again, _, from_start = claim(conn, 100, None)
    assert len(again) == 100
    assert from_start >= N, f"the pin kept only {from_start} dead rows: it does not pin"
    assert read <= 4 * 100, f"a claim of 100 rows from its cursor read {read} rows"


# Slow (out of the fast tier): it fills thousands of leased rows, for the plans to differ.
@pytest.mark.slow
def test_a_claims_own_rows_are_found_by_id_not_by_the_leases(
    database_url: str, pinned: None
) -> None:
    # Migration 0028: renewing, fetching and settling a claim read its rows through the primary
    # key. Written `claim_id = $1`, they let the planner walk messages_leased_idx, where every
    # leased version the pin keeps stays: N of them here.
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT outbox.enqueue('x', 'k', '') FROM generate_series(1, %s)", [N])
        ids, cursor, _ = claim(conn, N, None)
        settle(conn, ids)
        conn.execute("ANALYZE outbox.messages")  # as autovacuum would: few rows live, N dead
        conn.execute("SELECT outbox.enqueue('x', 'k', '') FROM generate_series(1, 100)")
        fresh, _, _ = claim(conn, 100, cursor)
        assert len(fresh) == 100
        claim_id = conn.execute(
            "SELECT claim_id FROM outbox.messages WHERE id = %s", [fresh[0]]
        ).fetchone()
        assert claim_id is not None
        before = _reads(conn)
        renewed = conn.execute(
            "SELECT count(*) FROM outbox.extend_leases(%s, %s, 30)", [claim_id[0], fresh]
        ).fetchone()
        fetched = conn.execute(
            sql.load("outbox").fetch, {"ids": fresh, "claim_id": claim_id[0]}
        ).fetchall()
        settle(conn, fresh)
        read = _reads(conn) - before
    assert renewed == (100,)
    assert len(fetched) == 100
    # About 16 entries a row (each row's three versions, by three statements), whatever the pin;
    # before 0028 these three read 181,303 for the N = 20,000 leased versions the pin kept.
    assert read <= 20 * 100, f"renewing, fetching and settling 100 rows read {read} entries"


async def test_the_rescue_moves_the_cursor_back_to_a_row_left_behind(
    database_url: str,
) -> None:
    """A row that commits long after its insert is placed behind every claim's cursor and its
    look-back; the rescue finds it, and the next claim takes it."""
    store = await PgStore.open(database_url, "outbox", "rescue")
    try:
        assert (await store.claim(model.Ask(10, 30, 10))).messages == ()  # cursors: now
        assert await store.rescue() == 0
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "SELECT outbox.enqueue('x', 'late', '', available_at => now() - interval '1 hour')"
            )
        assert (await store.claim(model.Ask(10, 30, 10))).messages == ()  # behind: unseen
        assert await store.rescue() == 1
        (late,) = (await store.claim(model.Ask(10, 30, 10))).messages
        assert late.routing_key == "late"
    finally:
        await store.close()


async def test_a_claim_in_flight_during_the_rescue_does_not_undo_its_find(
    database_url: str,
) -> None:
    """A claim that began before the rescue looked ends after it, moving the cursors on from
    where it began: the rescue's find must survive it (it once did not, and a backlog committed
    in one long transaction waited until a producer committed again)."""
    store = await PgStore.open(database_url, "outbox", "rescue")
    try:
        assert (await store.claim(model.Ask(10, 30, 10))).messages == ()  # cursors: now
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "SELECT outbox.enqueue('x', 'late', '', available_at => now() - interval '1 hour')"
            )
        with psycopg.connect(database_url) as holder:
            # The claim waits on this lock (it looks at key_checks first); the rescue does not.
            holder.execute("LOCK outbox.key_checks IN ACCESS EXCLUSIVE MODE")
            in_flight = asyncio.create_task(store.claim(model.Ask(10, 30, 10)))
            waiting = (
                "SELECT count(*) FROM pg_locks WHERE NOT granted"
                " AND relation = 'outbox.key_checks'::regclass"
            )

            async def claim_waits() -> bool:
                return bool((await query(database_url, waiting))[0][0])

            await until_async(claim_waits, message="the claim waiting")
            assert await store.rescue() == 1
            holder.rollback()
        assert (await in_flight).messages == ()  # it began from the cursor, not the find
        (late,) = (await store.claim(model.Ask(10, 30, 10))).messages
        assert late.routing_key == "late"
    finally:
        await store.close()
