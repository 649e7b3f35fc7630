"""The ready lane (migration 0015, docs/decisions/0004) against real PostgreSQL: which messages take
it, how claims find them whatever order their transactions commit in, and how a lane row ends —
archived, dead, retried, taken over as an orphan, or reclaimed with its segment."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from relay.core import model
from relay.postgres.store import PgStore
from relay.postgres.window import STRAGGLER_WAIT
from tests.support.inprocess import query

pytestmark = pytest.mark.asyncio

SEGMENT = 131072


@contextlib.asynccontextmanager
async def store(url: str, name: str = "relay-a", lane: bool = True) -> AsyncIterator[PgStore]:
    """A relay's store; `lane`: as a relay's start-up does, let producers use the ready lane."""
    opened = await PgStore.open(url, "outbox", name)
    try:
        if lane:
            await opened.use_fast_lane()
        yield opened
    finally:
        await opened.close()


async def enqueue(conn: psycopg.AsyncConnection[Any], body: bytes = b"m", **kw: Any) -> uuid.UUID:
    args = ", ".join(f"{k} => %({k})s" for k in kw)
    row = await (
        await conn.execute(
            f"SELECT outbox.enqueue('x', 'k', %(body)s{', ' + args if args else ''})",
            {"body": body, **kw},
        )
    ).fetchone()
    assert row is not None
    return uuid.UUID(str(row[0]))


async def producer(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url)


def archive(ids: list[int]) -> model.Settlement:
    return model.Settlement(archive=tuple(ids))


async def test_only_unkeyed_due_messages_with_generated_ids_take_the_ready_lane(
    database_url: str,
) -> None:
    async with store(database_url), await producer(database_url) as conn:
        await enqueue(conn)
        await enqueue(conn, ordering_key="a")
        await enqueue(conn, message_id=uuid.uuid4())
        await enqueue(conn, available_at="2999-01-01T00:00:00Z")
        await conn.commit()
    assert await query(database_url, "SELECT count(*) FROM outbox.ready") == [(1,)]
    assert await query(database_url, "SELECT count(*) FROM outbox.messages") == [(3,)]


async def test_producers_keep_the_old_table_until_a_relay_of_this_version_starts(
    database_url: str,
) -> None:
    async with store(database_url, lane=False) as relay_store:
        async with await producer(database_url) as conn:
            await enqueue(conn)
            await conn.commit()
            assert await query(database_url, "SELECT count(*) FROM outbox.ready") == [(0,)]
            await relay_store.use_fast_lane()
            await enqueue(conn)
            await conn.commit()
        assert await query(database_url, "SELECT count(*) FROM outbox.ready") == [(1,)]
        claim = await relay_store.claim(10, 30)
    assert len(claim.messages) == 2


async def test_a_message_committed_after_later_ones_is_claimed_next(database_url: str) -> None:
    async with (
        store(database_url) as relay_store,
        await producer(database_url) as early,
        await producer(database_url) as late,
    ):
        first = await enqueue(early, b"first")  # its transaction started first, commits last
        second = await enqueue(late, b"second")
        await late.commit()
        claim = await relay_store.claim(10, 30)
        assert [m.message_id for m in claim.messages] == [second]
        await relay_store.settle(claim.claim_id, archive([m.id for m in claim.messages]))
        assert (await relay_store.claim(10, 30)).messages == ()
        await early.commit()
        claim = await relay_store.claim(10, 30)
        assert [m.message_id for m in claim.messages] == [first]


async def test_rows_skipped_while_another_relays_claim_held_them_are_claimed_after_it_rolls_back(
    database_url: str,
) -> None:
    async with store(database_url, "a") as a, store(database_url, "b") as b:
        async with await producer(database_url) as conn:
            ids = [await enqueue(conn) for _ in range(3)]
            await conn.commit()
        # Relay a's claim statement has locked the rows and not committed (its connection will
        # roll back): b's claim skips them and must not close its window over them.
        async with await psycopg.AsyncConnection.connect(database_url) as holder:
            await holder.execute("SELECT id FROM outbox.ready FOR UPDATE")
            assert (await b.claim(10, 30)).messages == ()
            await holder.rollback()
        claim = await b.claim(10, 30)
        assert sorted(m.message_id for m in claim.messages) == sorted(ids)
        assert (await a.claim(10, 30)).messages == ()


async def test_a_claim_held_open_keeps_no_relays_window_open_past_the_straggler_wait(
    database_url: str,
) -> None:
    # Another relay's claim statement locked a row and its transaction stays open (a relay
    # stalled mid-claim). b skips the row, verifies its window, finds it unclaimed and goes back
    # to it on every claim after: that must not keep b's window open, and so every row committed
    # since unclaimed, for as long as the stalled claim lasts.
    async with store(database_url, "b") as b, await producer(database_url) as conn:
        held, other = await enqueue(conn), await enqueue(conn)
        await conn.commit()
        async with await psycopg.AsyncConnection.connect(database_url) as holder:
            await holder.execute(
                "SELECT id FROM outbox.ready WHERE message_id = %s FOR UPDATE", [held]
            )
            assert [m.message_id for m in (await b.claim(10, 30)).messages] == [other]
            later = await enqueue(conn)
            await conn.commit()
            deadline = time.monotonic() + 4 * STRAGGLER_WAIT
            got: list[uuid.UUID] = []
            while not got and time.monotonic() < deadline:
                got = [m.message_id for m in (await b.claim(10, 30)).messages]
                if not got:
                    await asyncio.sleep(0.05)
            assert got == [later]
            await holder.rollback()
    # The held row is found by the next pass over the whole lane (a relay's first, here).
    async with store(database_url, "c") as c:
        assert [m.message_id for m in (await c.claim(10, 30)).messages] == [held]


async def test_a_segment_is_never_reclaimed_outside_read_committed(database_url: str) -> None:
    # Under one snapshot for the whole transaction, a row committed after reclaim_segment's first
    # check would be invisible to its check under the lock too, and truncated.
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(psycopg.errors.InvalidTransactionState):
            await conn.execute("SELECT outbox.reclaim_segment(2)")


async def test_two_relays_never_claim_the_same_ready_row(database_url: str) -> None:
    async with store(database_url, "a") as a, store(database_url, "b") as b:
        async with await producer(database_url) as conn:
            for _ in range(400):
                await enqueue(conn)
            await conn.commit()
        seen: list[int] = []
        while True:
            claims = await asyncio.gather(a.claim(37, 30), b.claim(37, 30))
            got = [m.id for c in claims for m in c.messages]
            if not got:
                break
            seen.extend(got)
        assert len(seen) == len(set(seen)) == 400


async def test_a_ready_row_ends_once_archived_dead_or_retried(database_url: str) -> None:
    async with store(database_url) as relay_store, await producer(database_url) as conn:
        for _ in range(3):
            await enqueue(conn)
        await conn.commit()
        claim = await relay_store.claim(10, 30)
        ok, bad, again = (m.id for m in claim.messages)
        counts = await relay_store.settle(
            claim.claim_id,
            model.Settlement(
                archive=(ok,),
                dead=(model.DeadLetter(bad, model.DeadReason.UNROUTABLE, "no queue"),),
                retry=(model.Retry(again, 60.0, "nacked", ambiguous=True),),
            ),
        )
        assert (counts.archived, counts.dead, counts.retried, counts.fenced) == (1, 1, 1, 0)
        # Settling the same claim again does nothing: each row ended once.
        again_counts = await relay_store.settle(claim.claim_id, archive([ok]))
        assert again_counts.archived == 0
    assert await query(database_url, "SELECT attempts FROM outbox.archive") == [(1,)]
    assert await query(database_url, "SELECT attempts, reason FROM outbox.dead") == [
        (1, "unroutable")
    ]
    assert await query(
        database_url,
        "SELECT attempts, ambiguous, last_error, available_at > now() + interval '50 s'"
        " FROM outbox.messages",
    ) == [(1, 1, "nacked", True)]
    assert await query(
        database_url,
        "SELECT count(*) FROM outbox.ready r"
        " WHERE NOT EXISTS (SELECT 1 FROM outbox.done d WHERE d.seg = r.seg AND d.id = r.id)",
    ) == [(0,)]


async def test_an_orphan_is_taken_over_and_its_old_claim_fenced(database_url: str) -> None:
    async with store(database_url, "a") as a, store(database_url, "b") as b:
        async with await producer(database_url) as conn:
            message_id = await enqueue(conn)
            await conn.commit()
        stale = await a.claim(10, 0.2)
        (row,) = stale.messages
        await asyncio.sleep(0.3)  # the lease runs out: relay a died, as far as anyone knows
        assert await b.release_orphans(0.2) == 1
        orphan = await b.claim_orphans(1, 30, max_attempts=5)
        assert [(m.message_id, m.attempts) for m in orphan.messages] == [(message_id, 2)]
        # Relay a comes back: its renewal and its settle do nothing.
        assert await a.extend(stale.claim_id, [row.id], 30) == frozenset()
        assert (await a.settle(stale.claim_id, archive([row.id]))).fenced == 1
        settled = await b.settle(orphan.claim_id, archive([m.id for m in orphan.messages]))
        assert settled.archived == 1
    assert await query(database_url, "SELECT message_id, attempts FROM outbox.archive") == [
        (message_id, 2)
    ]


async def test_an_orphan_settled_by_its_own_relay_first_is_not_moved(database_url: str) -> None:
    async with store(database_url, "a") as a, store(database_url, "b") as b:
        async with await producer(database_url) as conn:
            await enqueue(conn)
            await conn.commit()
        claim = await a.claim(10, 0.2)
        await asyncio.sleep(0.3)
        assert (await a.settle(claim.claim_id, archive([claim.messages[0].id]))).archived == 1
        assert await b.release_orphans(0.2) == 0
    assert await query(database_url, "SELECT count(*) FROM outbox.messages") == [(0,)]


async def test_a_renewed_claim_is_not_an_orphan(database_url: str) -> None:
    async with store(database_url, "a") as a, store(database_url, "b") as b:
        async with await producer(database_url) as conn:
            await enqueue(conn)
            await conn.commit()
        claim = await a.claim(10, 0.2)
        ids = [m.id for m in claim.messages]
        assert await a.extend(claim.claim_id, ids, 30) == frozenset(ids)
        await asyncio.sleep(0.3)
        assert await b.release_orphans(0.2) == 0


async def test_a_caller_passing_a_waiting_ready_messages_id_again_is_refused(
    database_url: str,
) -> None:
    async with store(database_url), await producer(database_url) as conn:
        first = await enqueue(conn)
        await conn.commit()
        with pytest.raises(psycopg.errors.UniqueViolation, match="already in the outbox"):
            await enqueue(conn, message_id=first)


async def test_a_done_segment_is_reclaimed_and_a_late_row_in_it_still_found(
    database_url: str,
) -> None:
    async with store(database_url) as relay_store, await producer(database_url) as conn:
        await enqueue(conn)
        await conn.commit()
        claim = await relay_store.claim(10, 30)
        await relay_store.settle(claim.claim_id, archive([m.id for m in claim.messages]))
        assert await relay_store.reclaim() == 0  # segment 0 is the one being written
        await conn.execute("SELECT setval('outbox.messages_id_seq', %s)", [2 * SEGMENT])
        await conn.commit()
        assert await relay_store.reclaim() == 1
        assert await query(database_url, "SELECT count(*) FROM outbox.ready") == [(0,)]
        # A producer whose id fell in segment 0 before it was reclaimed commits afterwards.
        await conn.execute("SELECT setval('outbox.messages_id_seq', 10)")
        late = await enqueue(conn)
        await conn.commit()
        claim = await relay_store.claim(10, 30)
        assert [m.message_id for m in claim.messages] == [late]


async def test_a_reader_holding_a_segment_only_postpones_its_reclaim(database_url: str) -> None:
    async with store(database_url) as relay_store, await producer(database_url) as conn:
        await enqueue(conn)
        await conn.commit()
        claim = await relay_store.claim(10, 30)
        await relay_store.settle(claim.claim_id, archive([m.id for m in claim.messages]))
        await conn.execute("SELECT setval('outbox.messages_id_seq', %s)", [2 * SEGMENT])
        await conn.commit()
        async with await psycopg.AsyncConnection.connect(database_url) as reader:
            await reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            await reader.execute("SELECT count(*) FROM outbox.ready")
            assert await relay_store.reclaim() == 0
            fresh = await enqueue(conn)
            await conn.commit()
            claim = await relay_store.claim(10, 30)  # claims go on meanwhile
            assert [m.message_id for m in claim.messages] == [fresh]
        assert await relay_store.reclaim() == 1


async def test_the_gauges_count_the_lane_by_index_past_the_newest_claim(database_url: str) -> None:
    # lane_gauges (migration 0019): due = rows past the newest claim, in flight = leases not run
    # out and not ended; neither counts the ring (which holds the settled rows until reclaimed).
    async with store(database_url) as s:
        async with await producer(database_url) as p:
            for _ in range(3):
                await enqueue(p)
            await p.commit()
        seen = await s.observe()
        assert (seen.due, seen.in_flight, seen.oldest_due_seconds is not None) == (3, 0, True)
        claim = await s.claim(2, 30.0)
        assert len(claim.messages) == 2
        seen = await s.observe()
        assert (seen.due, seen.in_flight) == (1, 2)
        await s.settle(claim.claim_id, archive([claim.messages[0].id]))
        assert (await s.observe()).in_flight == 1
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await c.execute("UPDATE outbox.claims SET until = now() - interval '1 s'")
        assert (await s.observe()).in_flight == 0  # an orphan now: the next look moves it
        stats = await s.stats()
        assert (stats.pending, stats.in_flight) == (1, 0)
