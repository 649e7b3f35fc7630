"""The doorbell (migration 0023): producers notify only while a relay holds it, and a relay that
arms it waits for every producer that did not notify."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

import relay
from relay.core import model
from relay.postgres.doorbell import Doorbell
from relay.postgres.store import PgStore
from tests.support.amqp import Broker
from tests.support.inprocess import running, settings_for
from tests.support.wait import until_async

SENTINEL = "sentinel"


@pytest.fixture
async def bell(database_url: str) -> AsyncIterator[Doorbell]:
    """A doorbell being served (which turns settings.doorbell on once it connects)."""
    doorbell = Doorbell(database_url, "outbox")
    task = asyncio.create_task(doorbell.run())
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:

        async def on() -> bool:
            row = await (await conn.execute("SELECT doorbell FROM outbox.settings")).fetchone()
            return bool(row and row[0])

        await until_async(on, timeout=10, message="the doorbell to connect")
    yield doorbell
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def ears(database_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A connection listening on the relays' channel."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute("LISTEN outbox_new")
        yield conn


async def heard(ears: psycopg.AsyncConnection[Any], url: str) -> list[str]:
    """Every notification on the channel up to a sentinel sent now: notifications arrive in
    commit order, so one a producer's commit sent before this call is among them."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SELECT pg_notify('outbox_new', %s)", [SENTINEL])
    payloads: list[str] = []
    async for notify in ears.notifies(timeout=10):
        if notify.payload == SENTINEL:
            return payloads
        payloads.append(notify.payload)
    raise AssertionError("the sentinel never arrived")


async def producer(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url)


async def lock_waiters(url: str) -> int:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        row = await (
            await conn.execute(
                "SELECT count(*) FROM pg_locks"
                " WHERE relation = 'outbox.doorbell'::regclass AND NOT granted"
            )
        ).fetchone()
        assert row is not None
        return int(row[0])


async def test_no_producer_notifies_while_no_relay_holds_it(
    bell: Doorbell, ears: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    async with await producer(database_url) as conn:
        await relay.enqueue_async(conn, "x", "k", b"fast lane")
        await relay.enqueue_async(conn, "x", "k", b"slow lane", ordering_key="a")
        await conn.commit()
    assert await heard(ears, database_url) == []


async def test_every_producer_notifies_before_the_first_relay_of_this_version_runs(
    ears: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    # No doorbell has connected: settings.doorbell is off, as right after the migration.
    async with await producer(database_url) as conn:
        await relay.enqueue_async(conn, "x", "k", b"")
        await conn.commit()
    assert await heard(ears, database_url) == [""]


async def test_producers_notify_while_a_relay_holds_it_and_not_after(
    bell: Doorbell, ears: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    bell.arm()
    await asyncio.wait_for(bell.armed.wait(), 10)
    async with await producer(database_url) as conn:
        for n in range(3):
            await relay.enqueue_async(conn, "x", "k", str(n).encode())
        await conn.commit()
        assert await heard(ears, database_url) == [""]  # one, folded, for the transaction
        await relay.enqueue_async(conn, "x", "k", b"keyed", ordering_key="a")
        await conn.commit()
        assert await heard(ears, database_url) == [""]  # the key gate's release rings too
        bell.disarm()
        await until_async(
            lambda: _no_lock(database_url), timeout=10, message="the doorbell to be let go"
        )
        await relay.enqueue_async(conn, "x", "k", b"")
        await conn.commit()
    assert await heard(ears, database_url) == []


async def _no_lock(url: str) -> bool:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        row = await (
            await conn.execute(
                "SELECT count(*) FROM pg_locks WHERE relation = 'outbox.doorbell'::regclass"
            )
        ).fetchone()
        return row is not None and row[0] == 0


async def test_arming_waits_for_a_producer_that_did_not_notify_and_the_look_after_sees_its_row(
    bell: Doorbell, ears: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    """The order of events the doorbell exists for: a producer enqueues while no relay sleeps
    (so it will not notify), the relay finds nothing and arms, and only then does the producer
    commit. The relay must not sleep past that row."""
    store = await PgStore.open(database_url, "outbox", "test-relay")
    try:
        assert not (await store.claim(model.Ask(10, 30, 10))).messages
        early = await producer(database_url)
        await relay.enqueue_async(early, "x", "k", b"early")  # no relay armed: no NOTIFY
        bell.arm()
        await until_async(
            lambda: _waiting_for_lock(database_url), timeout=10, message="the arm to wait"
        )
        assert not bell.armed.is_set()
        # Meanwhile, a producer that starts now notifies: the relay is about to sleep.
        async with await producer(database_url) as late:
            await relay.enqueue_async(late, "x", "k", b"late")
            await late.commit()
        assert await heard(ears, database_url) == [""]
        await early.commit()
        await asyncio.wait_for(bell.armed.wait(), 10)
        claim = await store.claim(model.Ask(10, 30, 10))
        assert sorted(m.body for m in claim.messages) == [b"early", b"late"]
        await early.close()
    finally:
        await store.close()


async def _waiting_for_lock(url: str) -> bool:
    return await lock_waiters(url) == 1


async def test_disarming_while_the_arm_waits_withdraws_it(
    bell: Doorbell, ears: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    early = await producer(database_url)
    await relay.enqueue_async(early, "x", "k", b"")
    bell.arm()
    await until_async(lambda: _waiting_for_lock(database_url), timeout=10, message="the wait")
    bell.disarm()
    await until_async(
        lambda: _no_waiter(database_url), timeout=10, message="the wait to be withdrawn"
    )
    await early.commit()
    assert not bell.armed.is_set()
    assert bell.arms == 0
    await early.close()
    async with await producer(database_url) as conn:  # nobody holds it: no NOTIFY
        await relay.enqueue_async(conn, "x", "k", b"")
        await conn.commit()
    assert await heard(ears, database_url) == []  # the early one took it: it never rang


async def _no_waiter(url: str) -> bool:
    return await lock_waiters(url) == 0


async def test_a_held_doorbell_pins_nothing(bell: Doorbell, database_url: str) -> None:
    for _ in range(7):  # past psycopg's prepare threshold: a prepared arm would keep a snapshot
        bell.arm()
        await asyncio.wait_for(bell.armed.wait(), 10)
        bell.disarm()
        await until_async(lambda: _no_lock(database_url), timeout=10, message="the let-go")
    bell.arm()
    await asyncio.wait_for(bell.armed.wait(), 10)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        row = await (
            await conn.execute(
                "SELECT a.state, a.backend_xid, a.backend_xmin FROM pg_stat_activity a"
                " JOIN pg_locks l ON l.pid = a.pid"
                " WHERE l.relation = 'outbox.doorbell'::regclass AND l.granted"
            )
        ).fetchone()
    assert row == ("idle in transaction", None, None)


async def test_the_doorbell_comes_back_after_its_backend_is_terminated(
    bell: Doorbell, database_url: str
) -> None:
    bell.arm()
    await asyncio.wait_for(bell.armed.wait(), 10)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_locks"
            " WHERE relation = 'outbox.doorbell'::regclass AND granted"
        )
    # The loop still wants it: the doorbell reconnects and takes it again.
    await until_async(lambda: _armed_again(bell), timeout=15, message="the doorbell to return")


async def _armed_again(bell: Doorbell) -> bool:
    return bell.arms == 2 and bell.armed.is_set()


async def test_arming_needs_read_committed(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        with pytest.raises(psycopg.errors.InvalidTransactionState, match="READ COMMITTED"):
            await conn.execute("SELECT outbox.arm_doorbell()")


async def test_an_idle_relay_is_woken_through_its_doorbell(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    # A poll of a minute: each message arriving within seconds was woken for.
    settings = settings_for(database_url, amqp_url, poll_interval=60.0, doorbell=True)
    async with running(settings) as parts:
        assert parts.doorbell is not None
        await asyncio.wait_for(parts.doorbell.armed.wait(), 10)  # idle: it holds the doorbell
        async with await producer(database_url) as conn:
            for i in range(5):
                collecting = asyncio.create_task(broker.collect(1, timeout=30))
                await relay.enqueue_async(conn, broker.exchange, "k", str(i).encode())
                await conn.commit()
                committed = time.monotonic()
                (got,) = await collecting
                assert got.body == str(i).encode()
                assert time.monotonic() - committed < 20  # far below the poll
                await asyncio.wait_for(parts.doorbell.armed.wait(), 10)


async def test_a_held_doorbell_does_not_hold_up_vacuum_or_analyze(
    bell: Doorbell, database_url: str
) -> None:
    bell.arm()
    await asyncio.wait_for(bell.armed.wait(), 10)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute("SET lock_timeout = '5s'")
        await conn.execute("VACUUM")  # the whole database, as vacuumdb does
        await conn.execute("ANALYZE")
    assert bell.armed.is_set()
