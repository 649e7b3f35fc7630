"""Where a relay's windows start and what happens to the rows they give up on (migration 0022,
docs/decisions/0004): lane_start and the straggler sweep against real PostgreSQL, with a clock
the test moves for the window's waits."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from relay import app
from relay.core import model
from relay.ops import upkeep
from relay.postgres import window
from relay.postgres.store import PgStore
from relay.postgres.window import STRAGGLER_WAIT, SWEEP_AFTER
from tests.support import amqp
from tests.support.inprocess import query, settings_for, wait_for_count

pytestmark = pytest.mark.asyncio


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def store(url: str, clock: Clock, name: str = "b") -> AsyncIterator[PgStore]:
    opened = await PgStore.open(url, "outbox", name, clock=clock)
    try:
        await opened.use_fast_lane()
        yield opened
    finally:
        await opened.close()


async def commit(url: str, n: int, exchange: str = "x") -> list[uuid.UUID]:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        ids = []
        for _ in range(n):
            cur = await conn.execute("SELECT outbox.enqueue(%s, 'k', 'm')", [exchange])
            row = await cur.fetchone()
            assert row is not None
            ids.append(uuid.UUID(str(row[0])))
        await conn.commit()
    return ids


async def claim_held(url: str) -> psycopg.AsyncConnection[Any]:
    """Another relay's claim of every ready row, in a transaction left open (a relay stalled
    mid-claim): its rows are locked and their claims rows not yet committed."""
    conn = await psycopg.AsyncConnection.connect(url)
    await conn.execute(
        "SELECT * FROM outbox.claim_batch(100, 1000000, gen_random_uuid(), 'a', 30,"
        " '1:1:', NULL, '0', 0, true, false)"
    )
    return conn


async def pass_over_held_rows(b: PgStore, clock: Clock, expect: int = 0) -> None:
    """b's claims skip the held rows, go back to them, and after STRAGGLER_WAIT give up: its
    window closes over them."""
    assert len((await b.claim(10, 30)).messages) == expect
    for _ in range(3):
        clock.now += STRAGGLER_WAIT
        assert (await b.claim(10, 30)).messages == ()


async def test_a_row_whose_claim_rolled_back_after_the_window_gave_up_is_moved_and_sent(
    database_url: str,
) -> None:
    clock = Clock()
    async with store(database_url, clock) as b:
        ids = await commit(database_url, 2)
        holder = await claim_held(database_url)
        await pass_over_held_rows(b, clock)
        await holder.rollback()  # a's connection broke: nothing of its claim remains
        await holder.close()
        assert (await b.claim(10, 30)).messages == ()  # behind b's window now
        assert await b.sweep_stragglers() == 0  # not yet: the windows passed them too recently
        clock.now += SWEEP_AFTER
        assert await b.sweep_stragglers() == 2
        assert await b.sweep_stragglers() == 0  # moved once
        claim = await b.claim(10, 30)
        assert sorted(m.message_id for m in claim.messages) == sorted(ids)
        assert {m.attempts for m in claim.messages} == {1}  # the sweep counted no attempt
        rows = await query(
            database_url, "SELECT attempts, last_error, ambiguous FROM outbox.messages"
        )
        assert rows == [(1, None, 0), (1, None, 0)]
        await b.settle(
            claim.claim_id, model.Settlement(archive=tuple(m.id for m in claim.messages))
        )
        assert await query(database_url, "SELECT count(*) FROM outbox.archive") == [(2,)]
        open_rows = (
            "SELECT count(*) FROM outbox.ready r"
            " WHERE NOT EXISTS (SELECT 1 FROM outbox.done d WHERE d.id = r.id)"
        )
        assert await query(database_url, open_rows) == [(0,)]  # nothing keeps its segment


async def test_the_sweep_leaves_a_row_whose_claim_is_still_in_progress_and_then_commits(
    database_url: str,
) -> None:
    clock = Clock()
    async with store(database_url, clock) as b:
        await commit(database_url, 2)
        holder = await claim_held(database_url)
        await pass_over_held_rows(b, clock)
        clock.now += SWEEP_AFTER
        assert await b.sweep_stragglers() == 0  # still held: skipped, not waited for
        await holder.commit()  # a's claim goes through after all: the rows are a's
        await holder.close()
        assert await b.sweep_stragglers() == 0
        assert (await b.claim(10, 30)).messages == ()
        assert await query(database_url, "SELECT count(*) FROM outbox.messages") == [(0,)]
        claimed = await query(database_url, "SELECT claimed_by FROM outbox.claims")
        assert claimed == [("a",), ("a",)]


async def test_the_sweep_never_moves_rows_the_windows_have_not_passed(database_url: str) -> None:
    # A backlog committed after b's windows last closed: unclaimed for now, and b's to claim from
    # the ready lane, however long they wait.
    clock = Clock()
    async with store(database_url, clock) as b:
        assert (await b.claim(10, 30)).messages == ()  # the first window: nothing there
        ids = await commit(database_url, 5)
        clock.now += 10 * SWEEP_AFTER
        assert await b.sweep_stragglers() == 0
        claim = await b.claim(10, 30)
        assert sorted(m.message_id for m in claim.messages) == sorted(ids)
        assert await query(database_url, "SELECT count(*) FROM outbox.messages") == [(0,)]


async def test_a_first_window_starts_at_the_first_row_with_no_claim(database_url: str) -> None:
    # A ring of claimed rows, then a few unclaimed: a new relay's first claim takes the unclaimed
    # ones, including a transaction that was still open when it looked where to start.
    clock = Clock()
    async with store(database_url, clock, "a") as a:
        for _ in range(3):
            await commit(database_url, 50)
            while (await a.claim(100, 30)).messages:
                pass
        waiting = await commit(database_url, 3)
        async with await psycopg.AsyncConnection.connect(database_url) as open_tx:
            cur = await open_tx.execute("SELECT outbox.enqueue('x', 'k', 'late')")
            row = await cur.fetchone()
            assert row is not None
            late = uuid.UUID(str(row[0]))
            later = await commit(database_url, 1)  # a younger transaction commits first
            async with store(database_url, clock, "b") as b:
                got = [m.message_id for m in (await b.claim(100, 30)).messages]
                assert sorted(got) == sorted(waiting + later)
                await open_tx.commit()
                assert [m.message_id for m in (await b.claim(100, 30)).messages] == [late]


async def test_lane_start_and_the_sweep_refuse_bad_input(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for args, match in [
            ((None, 10), "a snapshot and a positive limit"),
            (("5:5:", 0), "a snapshot and a positive limit"),
            (("not a snapshot", 10), "invalid input syntax for type pg_snapshot"),
            (("999999999:999999999:", 10), "ahead of the server"),
        ]:
            with pytest.raises(psycopg.Error, match=match):
                await conn.execute("SELECT * FROM outbox.sweep_stragglers(%s, %s)", args)
        cur = await conn.execute("SELECT snapshot, xid, id FROM outbox.lane_start()")
        assert await cur.fetchone() is not None


async def test_a_running_relay_sweeps_and_sends_a_row_it_gave_up_on(
    database_url: str,
    amqp_url: str,
    broker: amqp.Broker,
    free_tcp_port: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # End to end, on a relay's own chores (shortened): another relay stalls mid-claim over a
    # message and then dies; the running relay's window gives up on the row after STRAGGLER_WAIT,
    # its sweep moves it, and it is delivered.
    monkeypatch.setattr(upkeep, "SWEEP_INTERVAL", 0.2)
    monkeypatch.setattr(window, "SWEEP_AFTER", 0.5)
    monkeypatch.setattr(window, "VERIFY_EVERY", 0.1)
    monkeypatch.setattr(window, "STRAGGLER_WAIT", 0.3)
    await broker.declare()
    await query(database_url, "SELECT outbox.use_fast_lane()")  # as a relay that ran before
    (stalled,) = await commit(database_url, 1, broker.exchange)
    holder = await claim_held(database_url)
    stop = asyncio.Event()
    settings = settings_for(database_url, amqp_url, metrics_port=free_tcp_port)
    relay = asyncio.create_task(app.run(settings, stop=stop))  # the relay with its chores
    try:
        # The stall lasts many times the relay's wait on a held row (it claims every 0.2 s, and
        # at once on each new message): its first window stays on the row, then gives up on it.
        for _ in range(6):  # 3 s: ten times the wait, four times what giving up takes
            await commit(database_url, 1, broker.exchange)
            await asyncio.sleep(0.5)
        await holder.close()  # the stalled relay dies: its claim rolls back
        await wait_for_count(database_url, "archive", 7)
    finally:
        stop.set()
        await asyncio.wait_for(relay, 30)
    swept = "SELECT r.message_id FROM outbox.claims c JOIN outbox.ready r USING (seg, id)"
    assert await query(database_url, swept + " WHERE c.claimed_by = 'straggler sweep'") == [
        (stalled,)
    ]
    got = [m.message_id for m in await broker.collect(7, settle=0.3)]
    assert sorted(got) == sorted(set(got))  # each once
    assert str(stalled) in got
