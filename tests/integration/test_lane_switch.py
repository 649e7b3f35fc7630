"""The ready lane's switch (migration 0018, `outbox-relay lane`): turned off, it stays off whatever
relays start, and `lane off` returns only once nothing can still be in the lane — including a
REPEATABLE READ producer whose snapshot is older than the switch and still writes to it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from relay.core import model
from relay.postgres import admin, locks
from relay.postgres.doorbell import Doorbell
from tests.integration.test_ready_lane import enqueue, store
from tests.support.processes import assert_one_line_error, clean_env, run_cli

pytestmark = pytest.mark.asyncio


async def lane_of(conn: psycopg.AsyncConnection[Any], message_id: uuid.UUID) -> str:
    row = await (
        await conn.execute("SELECT lane FROM outbox.waiting WHERE message_id = %s", [message_id])
    ).fetchone()
    assert row is not None, f"{message_id} is not waiting"
    return str(row[0])


async def drain(url: str) -> int:
    """What a relay of this version does: claim what is due and archive it; how many."""
    settled = 0
    async with store(url, lane=False) as s:
        while (claim := await s.claim(500, 30.0)).messages:
            ids = tuple(m.id for m in claim.messages)
            settled += (await s.settle(claim.claim_id, model.Settlement(archive=ids))).archived
    return settled


async def test_lane_off_waits_for_older_snapshots_and_the_lane_then_stays_off(
    database_url: str,
) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=database_url)
    async with store(database_url):  # a relay of this version started: the lane is on
        pass
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as rc:
        first = await enqueue(rc)
        assert await lane_of(rc, first) == "ready"
        old = await psycopg.AsyncConnection.connect(database_url)
        await old.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        await old.execute("SELECT 1 FROM outbox.settings")  # its snapshot: the lane is on
        try:
            waited = run_cli("lane", "off", "--timeout", "1", env=env)
            assert_one_line_error(waited, 1, "1 message(s) in the lane", "gave up")
            later = await enqueue(rc)
            assert await lane_of(rc, later) == "messages"
            assert await drain(database_url) == 2
            # The lane is empty, but a transaction older than the switch is open: not done yet.
            waited = run_cli("lane", "off", "--timeout", "2", env=env)
            assert_one_line_error(
                waited, 1, "1 transaction(s) open since the switch, 0 message(s) in the lane"
            )
            straggler = await enqueue(old)  # its snapshot still says on
            assert await lane_of(old, straggler) == "ready"
            await old.commit()
        finally:
            await old.close()
        assert await drain(database_url) == 1
        done = run_cli("lane", "off", "--timeout", "30", env=env)
        assert done.returncode == 0, done.stderr
        assert "the ready lane is empty" in done.stdout
        async with store(database_url):  # a relay of this version starting again
            pass
        after = await enqueue(rc)
        assert await lane_of(rc, after) == "messages"
        assert "ready lane off (turned off" in run_cli("lane", "status", env=env).stdout
        on = run_cli("lane", "on", env=env)
        assert on.returncode == 0, on.stderr
        assert "ready lane on;" in on.stdout
        assert await lane_of(rc, await enqueue(rc)) == "ready"


@pytest.fixture
def blind_role(database_url: str) -> Iterator[str]:
    """A login that may flip the switch but not see other roles' sessions."""
    name = f"lane_{uuid.uuid4().hex[:8]}"
    role = sql.Identifier(name)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
        for grant in (
            "GRANT USAGE ON SCHEMA outbox TO {}",
            "GRANT EXECUTE ON FUNCTION outbox.set_fast_lane(boolean) TO {}",
            "GRANT SELECT, UPDATE ON outbox.settings TO {}",
            "GRANT SELECT ON outbox.waiting TO {}",
        ):
            conn.execute(sql.SQL(grant).format(role))
    try:
        url = urlsplit(database_url)
        yield urlunsplit(url._replace(netloc=f"{name}@{url.hostname}:{url.port or 5432}"))
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(role))
            conn.execute(sql.SQL("DROP ROLE {}").format(role))


async def test_lane_off_refuses_to_vouch_for_sessions_it_cannot_see(
    database_url: str, blind_role: str
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as other:
        await other.execute("SELECT 1")  # another role's session, in a transaction
        result = run_cli("lane", "off", env=clean_env(OUTBOX_DATABASE_URL=blind_role))
    assert_one_line_error(result, 2, "cannot see the transactions", "pg_read_all_stats")
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        row = await (await conn.execute("SELECT fast_lane FROM outbox.settings")).fetchone()
    assert row == (False,)  # it did turn the lane off, and says it stays off


async def test_lane_off_refuses_to_vouch_for_a_session_that_hides_its_transactions(
    database_url: str,
) -> None:
    # track_activities off: PostgreSQL shows the session, but not whether it is in a transaction.
    hidden = await psycopg.AsyncConnection.connect(database_url, options="-c track_activities=off")
    async with hidden:
        await hidden.execute("SELECT 1")
        result = run_cli("lane", "off", env=clean_env(OUTBOX_DATABASE_URL=database_url))
    assert_one_line_error(result, 2, "cannot see the transactions of 1 session(s)")


async def test_lane_off_does_not_wait_for_a_lock_holder_but_for_a_producer(
    database_url: str,
) -> None:
    # A pruner's lock sits in a transaction for the whole run, and an idle relay's doorbell for as
    # long as it sleeps, with no xid and no snapshot: neither has written anything, and each would
    # see the switch; a producer that began before it must be waited for.
    since = datetime.now(UTC)
    bell = Doorbell(database_url, "outbox")
    ringing = asyncio.create_task(bell.run())
    bell.arm()
    await asyncio.wait_for(bell.armed.wait(), 10)
    with (
        locks.exclusive(database_url, "outbox", "prune", wait=False) as held,
        admin.Admin.connect(database_url) as ops,
    ):
        assert held
        assert ops.transactions_since(since + timedelta(seconds=5))[0] == 0
        with psycopg.connect(database_url) as producer:
            producer.execute("SELECT 1")  # a transaction open from before the switch
            assert ops.transactions_since(since + timedelta(seconds=5))[0] == 1
    assert bell.armed.is_set()  # held all along
    ringing.cancel()
    await asyncio.gather(ringing, return_exceptions=True)
